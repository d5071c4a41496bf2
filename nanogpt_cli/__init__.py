"""nanogpt: prepare text, train a small GPT, sample from it and evaluate it.

nanogpt prepare examples/tinyshakespeare.txt --name shakespeare-char --tokenizer char

From Python (api.py; docs/python.md):

    import nanogpt_cli as nanogpt
    model = nanogpt.load("checkpoints/shk"); print(model.generate("ROMEO:").text)
"""

__version__ = "0.1.0"

# from nanogpt_cli.api, imported on first use (not api.serve: nanogpt_cli.serve is the server's package)
_API = (
    "LoadSpec",
    "ServeOptions",
    "RunRequest",
    "load",
    "train",
    "plan_training",
    "finetune",
    "plan_finetuning",
    "prepare",
    "train_tokenizer",
    "compare_tokenizers",
    "export",
    "evaluate_tasks",
    "info",
    "system_info",
    "list_runs",
    "report",
    "compare",
    "plot",
)

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    """The API's entry points, imported on first use: `nanogpt --help` and `import nanogpt_cli` stay light."""
    if name in _API:
        from nanogpt_cli import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
