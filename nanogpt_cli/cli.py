"""The `nanogpt` command line: thin typed commands over the library. Nothing imports this module.

    nanogpt prepare examples/tinyshakespeare.txt --name shakespeare-char --tokenizer char
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from nanogpt_cli.config import MODEL_FIELDS, TRAIN_FIELDS, flag
from nanogpt_cli.errors import NanoGPTError

CONFIG_FIELDS = MODEL_FIELDS | TRAIN_FIELDS

app = typer.Typer(
    help="Prepare text, train a small GPT, sample from it and evaluate it.\n\n"
    "Example: nanogpt prepare examples/tinyshakespeare.txt --name shk --tokenizer char",
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish and PowerShell
    pretty_exceptions_enable=False,
    # click's plain help: wraps to the terminal (80 columns included) without cutting flag names or showing
    # <bool> after flags; usage errors become one line in main()
    rich_markup_mode=None,
)
eval_app = typer.Typer(help="Evaluate a trained model.\n\n"
                       "Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char",
                       rich_markup_mode=None)
app.add_typer(eval_app, name="eval")


@eval_app.callback(invoke_without_command=True)
def _eval_root(ctx: typer.Context):
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def fail(message: str) -> typer.Exit:
    """Print one styled error line on stderr and return the exit to raise."""
    from nanogpt_cli.ui import err_console

    from rich.markup import escape

    # escaped: a message may hold brackets that are text, not styles (pip install -e ".[hf]")
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context,
          version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False):
    if version:
        from nanogpt_cli import __version__

        print(f"nanogpt {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def one_line_errors(command):
    """Every command's library errors become one styled line on stderr and exit code 1."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except NanoGPTError as e:
            raise (fail(str(e)) if prints() else typer.Exit(1)) from None

    return run


def prints() -> bool:
    """Whether this process prints: always, except under torchrun, where rank 0 speaks for all (they meet the
    same errors, as they read the same files and agree on losses and stop signals)."""
    return os.environ.get("RANK", "0") == "0"
def show_config_defaults(command):
    """Train's config options default to None ("not given", so a preset or config file can fill them); their
    help shows the value they stand for when nothing sets them."""
    import dataclasses
    import typing

    from nanogpt_cli.config import GPTConfig, TrainConfig

    defaults = {f.name: f.default for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)}
    defaults.pop("vocab_size")  # the dataset's, not the dataclass's
    for name, hint in typing.get_type_hints(command, include_extras=True).items():
        value = defaults.get(name)
        for info in getattr(hint, "__metadata__", ()):
            if value not in (None, "") and hasattr(info, "show_default"):
                info.show_default = (flag(name) if value else f"no-{flag(name)}") if isinstance(value, bool) \
                    else str(value)
                command.__annotations__[name] = hint  # the evaluated hint, so Typer sees this OptionInfo
    return command


# options that several commands share
Checkpoint = Annotated[str, typer.Option(help="Run folder (its best weights), a .safetensors file, or a Hugging "
                                              "Face model folder or hf:NAME.")]
Last = Annotated[bool, typer.Option("--last", help="Use a run's last weights instead of its best.")]
DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps."
DTYPE_HELP = "auto, float32, bfloat16 or float16."
Device = Annotated[str, typer.Option(help=DEVICE_HELP)]
Dtype = Annotated[str, typer.Option(help=DTYPE_HELP)]
DATA_DIR_HELP = "Folder of prepared datasets."
Threads = Annotated[Optional[int], typer.Option(help="CPU threads (default: torch's choice, one per core); fewer "
                                                     "help on a busy machine.", show_default=False)]


def note(message: str) -> None:
    from nanogpt_cli.ui import err_console

    err_console.print(f"note: {message}", highlight=False, soft_wrap=True, markup=False)

# --- commands: thin typed functions over the library, each wrapped by one_line_errors ---


@app.command()
@one_line_errors
def prepare(
    source: Annotated[str, typer.Argument(help="A .txt/.md file, a folder or glob of them, a .jsonl/.json/.parquet/"
                                               ".csv file, hf:OWNER/NAME, or shakespeare (downloaded once).")],
    name: Annotated[str, typer.Option(help="Dataset name: the folder DATA_DIR/NAME that training reads.")],
    tokenizer: Annotated[str, typer.Option(help="gpt2, char, byte, or a tiktoken encoding such as cl100k_base.")
                         ] = "gpt2",
    val_fraction: Annotated[float, typer.Option(help="Share held out for validation: the tail of one text, or "
                                                     "every (1/f)-th document.")] = 0.1,
    data_dir: Annotated[Path, typer.Option(help=DATA_DIR_HELP)] = Path("data"),
    text_column: Annotated[str, typer.Option(help="Column with the text in .jsonl/.json/.parquet/.csv and hub "
                                                  "datasets.")] = "text",
    subset: Annotated[Optional[str], typer.Option(help="Hub dataset subset (configuration) name.")] = None,
    split: Annotated[str, typer.Option(help="Hub dataset split to read.")] = "train",
    streaming: Annotated[bool, typer.Option(help="Stream a hub dataset instead of downloading it first.")] = False,
    max_docs: Annotated[Optional[int], typer.Option(help="Keep only the first N documents.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="Stop after N tokens (train and val together).")
                          ] = None,
    val_tokens: Annotated[Optional[int], typer.Option(help="Validate on the first N tokens of the stream instead "
                                                           "of --val-fraction.")] = None,
    shard_tokens: Annotated[int, typer.Option(help="Tokens per shard file.")] = 100_000_000,
    num_proc: Annotated[int, typer.Option(help="Tokenizer worker processes (the output does not depend on it).")
                        ] = 1,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted prepare of --name (or start "
                                                          "one if there is none).")] = False,
):
    """Tokenize text into DATA_DIR/NAME: train-00000.bin, ..., val-00000.bin, ... and meta.json.

    Example: nanogpt prepare shakespeare --name shakespeare-char --tokenizer char
    """
    from nanogpt_cli.data import interrupted_prepare
    from nanogpt_cli.data import prepare as prepare_data
    from nanogpt_cli.files import check_creatable
    from nanogpt_cli.ui import console, err_console, prepare_progress, prepare_table

    check_creatable(data_dir, "--data-dir")
    replacing = (data_dir / name / "meta.json").is_file() and not resume  # --resume continues, not replaces

    try:
        with prepare_progress() as progress:
            result = prepare_data(source, name, tokenizer=tokenizer, val_fraction=val_fraction, data_dir=data_dir,
                                  text_column=text_column, subset=subset, split=split, streaming=streaming,
                                  max_docs=max_docs, num_proc=num_proc, shard_tokens=shard_tokens,
                                  max_tokens=max_tokens, val_tokens=val_tokens, resume=resume, progress=progress)
    except KeyboardInterrupt:  # the partial prepare is kept: say where and how to continue it
        kept = interrupted_prepare(data_dir, name)
        err_console.print(f"interrupted; {kept}" if kept else "interrupted", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    console.print(prepare_table(result))
    if replacing:  # said after the table, where it is seen: runs trained on the old data see the new
        console.print(f"replaced the dataset that was in {result.path}; runs trained on it continue on the new data "
                      "when resumed")


@app.command()
@show_config_defaults
@one_line_errors
def train(
    data: Annotated[Optional[str], typer.Option(help="Dataset name under --data-dir (made by nanogpt prepare).")
                    ] = None,
    data_dir: Annotated[Optional[str], typer.Option(help=DATA_DIR_HELP[:-1] + " (default data).")] = None,
    preset: Annotated[Optional[str], typer.Option(help="Named config: tiny, cpu-char, cpu-fast, shakespeare-char, "
                                                       "gpt2-124m, gpt2-350m.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="TOML file of config keys; flags override it.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Run folder (default checkpoints/DATA-TIMESTAMP).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out where it stopped.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Start over in an --out that holds a run (deletes it).")
                     ] = False,
    init_from: Annotated[Optional[str], typer.Option(help="Start from these weights (run folder, .safetensors, "
                                                          "Hugging Face folder or hf:NAME) with a fresh optimizer.")
                         ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final summary.")] = False,
    last: Annotated[bool, typer.Option("--last", help="With --init-from RUN: its last weights, not its best.")
                    ] = False,
    threads: Threads = None,
    tracker: Annotated[Optional[str], typer.Option(help="Also log to tensorboard or wandb (offline unless "
                                                        "WANDB_MODE=online); needs the track extra.",
                                                   show_default=False)] = None,
    # model
    vocab_size: Annotated[Optional[int], typer.Option(help="Vocabulary (default: the dataset's; larger pads it).",
                                                      rich_help_panel="Model")] = None,
    n_layer: Annotated[Optional[int], typer.Option(help="Transformer blocks.", rich_help_panel="Model")] = None,
    n_head: Annotated[Optional[int], typer.Option(help="Attention heads.", rich_help_panel="Model")] = None,
    n_embd: Annotated[Optional[int], typer.Option(help="Residual width.", rich_help_panel="Model")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="Context length.", rich_help_panel="Model")] = None,
    dropout: Annotated[Optional[float], typer.Option(help="Dropout rate.", rich_help_panel="Model")] = None,
    bias: Annotated[Optional[bool], typer.Option("--bias/--no-bias", help="Biases in linear and norm layers.",
                                                 rich_help_panel="Model")] = None,
    pos_encoding: Annotated[Optional[str], typer.Option(help="rope, sinusoidal or learned.",
                                                        rich_help_panel="Model")] = None,
    rope_theta: Annotated[Optional[float], typer.Option(help="RoPE base.", rich_help_panel="Model")] = None,
    norm: Annotated[Optional[str], typer.Option(help="layernorm or rmsnorm.", rich_help_panel="Model")] = None,
    norm_eps: Annotated[Optional[float], typer.Option(help="Norm epsilon.", rich_help_panel="Model")] = None,
    mlp: Annotated[Optional[str], typer.Option(help="gelu, gelu_tanh, swiglu or relu2 (squared ReLU).",
                                               rich_help_panel="Model")] = None,
    mlp_hidden: Annotated[Optional[int], typer.Option(help="MLP hidden width.", rich_help_panel="Model")] = None,
    tie_embeddings: Annotated[Optional[bool], typer.Option("--tie-embeddings/--no-tie-embeddings",
                                                           help="Share the embedding with the LM head.",
                                                           rich_help_panel="Model")] = None,
    qk_norm: Annotated[Optional[bool], typer.Option("--qk-norm/--no-qk-norm", help="RMSNorm on queries and keys.",
                                                    rich_help_panel="Model")] = None,
    logit_softcap: Annotated[Optional[float], typer.Option(help="Soft-cap the logits at C with tanh.",
                                                           rich_help_panel="Model")] = None,
    zero_init_proj: Annotated[Optional[bool], typer.Option("--zero-init-proj/--no-zero-init-proj",
                                                           help="Start output projections at zero.",
                                                           rich_help_panel="Model")] = None,
    # training
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per micro-batch.",
                                                      rich_help_panel="Training")] = None,
    gradient_accumulation_steps: Annotated[Optional[int], typer.Option(help="Micro-batches per update.",
                                                                       rich_help_panel="Training")] = None,
    max_iters: Annotated[Optional[int], typer.Option(help="Optimizer updates in the run.",
                                                     rich_help_panel="Training")] = None,
    learning_rate: Annotated[Optional[float], typer.Option(help="Peak learning rate.",
                                                           rich_help_panel="Training")] = None,
    min_lr: Annotated[Optional[float], typer.Option(help="Final learning rate.", rich_help_panel="Training")] = None,
    lr_schedule: Annotated[Optional[str], typer.Option(help="cosine, constant or wsd.",
                                                       rich_help_panel="Training")] = None,
    wsd_decay_frac: Annotated[Optional[float], typer.Option(help="wsd: share of the decay iters spent decaying.",
                                                            rich_help_panel="Training")] = None,
    warmup_iters: Annotated[Optional[int], typer.Option(help="Linear warmup updates.",
                                                        rich_help_panel="Training")] = None,
    lr_decay_iters: Annotated[Optional[int], typer.Option(help="Updates until --min-lr (default --max-iters).",
                                                          rich_help_panel="Training")] = None,
    weight_decay: Annotated[Optional[float], typer.Option(help="AdamW weight decay on matrices.",
                                                          rich_help_panel="Training")] = None,
    beta1: Annotated[Optional[float], typer.Option(help="AdamW beta1.", rich_help_panel="Training")] = None,
    beta2: Annotated[Optional[float], typer.Option(help="AdamW beta2.", rich_help_panel="Training")] = None,
    grad_clip: Annotated[Optional[float], typer.Option(help="Clip the gradient norm (0: off).",
                                                       rich_help_panel="Training")] = None,
    optimizer: Annotated[Optional[str], typer.Option(help="adamw, or muon (Muon on the block matrices, AdamW on "
                                                          "the rest).", rich_help_panel="Training")] = None,
    muon_lr: Annotated[Optional[float], typer.Option(help="Muon's peak learning rate.",
                                                     rich_help_panel="Training")] = None,
    muon_momentum: Annotated[Optional[float], typer.Option(help="Muon's momentum.",
                                                           rich_help_panel="Training")] = None,
    muon_momentum_warmup: Annotated[Optional[int], typer.Option(help="Updates to raise Muon's momentum from 0.85.",
                                                                rich_help_panel="Training")] = None,
    eval_interval: Annotated[Optional[int], typer.Option(help="Evaluate and checkpoint every N updates.",
                                                         rich_help_panel="Training")] = None,
    eval_iters: Annotated[Optional[int], typer.Option(help="Batches per split in an evaluation.",
                                                      rich_help_panel="Training")] = None,
    log_interval: Annotated[Optional[int], typer.Option(help="Progress every N updates.",
                                                        rich_help_panel="Training")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Random seed.", rich_help_panel="Training")] = None,
    device: Annotated[Optional[str], typer.Option(help=DEVICE_HELP, rich_help_panel="Training")] = None,
    dtype: Annotated[Optional[str], typer.Option(help=DTYPE_HELP, rich_help_panel="Training")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="torch.compile the model.",
                                                    rich_help_panel="Training")] = None,
    stop_at: Annotated[Optional[int], typer.Option(help="Stop after update K as if interrupted.",
                                                   rich_help_panel="Training")] = None,
    max_time: Annotated[Optional[float], typer.Option(help="End after this many seconds of training; the LR schedule "
                                                           "then follows the time spent.",
                                                      rich_help_panel="Training")] = None,
    parallel: Annotated[Optional[str], typer.Option(help="Under torchrun: ddp (weights on every GPU) or fsdp "
                                                         "(sharded).", rich_help_panel="Training")] = None,
):
    """Train a GPT on a prepared dataset, with checkpoints you can resume.

    Example: nanogpt train --data shakespeare-char --preset cpu-char --out checkpoints/shk
    """
    # every option named like a config field is an override; None means not given
    flags = {k: v for k, v in locals().items() if k in CONFIG_FIELDS and v is not None}
    if preset is not None:
        flags["preset"] = preset
    from nanogpt_cli.config import load_toml
    from nanogpt_cli.train import plan_run, processes
    from nanogpt_cli.train import train as run_training
    from nanogpt_cli.ui import TrainDisplay, console, train_table

    from nanogpt_cli.device import set_threads

    set_threads(threads)
    from nanogpt_cli.trackers import Tee, open_tracker

    sink = open_tracker(tracker) if tracker and prints() else None  # unknown or missing extra: refused first
    if last and init_from is None:
        raise NanoGPTError("--last picks the weights of --init-from RUN; give --init-from or drop --last")
    plan = plan_run(flags, load_toml(config) if config else {}, out=out, resume=resume, force=force,
                    init_from=init_from, init_last=last)
    if prints():
        for message in plan.notes:
            note(message)
    if plan.complete:
        if prints() and plan.time_over:
            console.print(f"{plan.run_dir} is already complete: its --max-time {plan.time_spent:g} s was spent at "
                          f"step {plan.step:,}; raise --max-time to train it further")
        elif prints():
            console.print(f"{plan.run_dir} is already complete: step {plan.step:,} of --max-iters "
                          f"{plan.train.max_iters:,}; raise --max-iters to train it further")
        return
    # under torchrun the process group is left only after rank 0 has printed, so no rank ends (and has
    # torchrun stop the others) before
    with processes(plan.train) as world:
        try:
            with TrainDisplay(quiet or not prints()) as display:
                result = run_training(plan, Tee(display, sink) if sink else display, world)
        finally:
            if sink is not None:
                sink.close()
        if prints():
            console.print(train_table(result))
            if importlib.util.find_spec("matplotlib") is not None:  # the plot extra: a picture of the curves
                from nanogpt_cli.checkpoint import LOSS_PLOT
                from nanogpt_cli.plot import write_png

                write_png([plan.run_dir.path], plan.run_dir / LOSS_PLOT)
            resume_with = f"nanogpt train --out {plan.run_dir} --resume"
            if result.stopped in ("SIGINT", "SIGTERM"):
                fail(f"stopped by {result.stopped} after step {result.step:,}; resume with: {resume_with}")
            if result.stopped == "stop_at":
                console.print(f"stopped at step {result.step:,} (--stop-at); resume with: {resume_with}")
            if result.stopped == "max_time":
                console.print(f"ended at step {result.step:,}: --max-time {plan.train.max_time:g} s was spent")
    if result.stopped in ("SIGINT", "SIGTERM"):
        raise typer.Exit(130 if result.stopped == "SIGINT" else 143)  # the shell's 128 + signal number


@app.command()
@one_line_errors
def sample(
    checkpoint: Checkpoint,
    prompt: Annotated[Optional[str], typer.Option(help="Text to continue (empty: start a new text).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="Read the prompt from this file.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per sample.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy; lower is more conservative.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Keep only the K most likely tokens (0: off).")] = 200,
    top_p: Annotated[float, typer.Option(help="Keep the fewest tokens whose probability reaches P (1: off).")] = 1.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below P x the top token's probability (0: off).")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option(help="Above 1 discourages tokens already present.")] = 1.0,
    num_samples: Annotated[int, typer.Option(help="How many samples (decoded together as one batch).")] = 1,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed gives the same text.")] = 1337,
    stop: Annotated[Optional[list[str]], typer.Option(help="End a sample at this text (repeatable).",
                                                      metavar="<text>")] = None,
    ignore_eot: Annotated[bool, typer.Option("--ignore-eot", help="Keep going past the end-of-text token.")] = False,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Print text as it is generated.")] = True,
    last: Last = False,
    interactive: Annotated[bool, typer.Option("--interactive", "-i", help="Ask for prompts in a loop (--prompt "
                                                                           "is the first).")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute the whole context every token.")] = False,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
):
    """Generate text from a trained model, streamed as it is written.

    Example: nanogpt sample --checkpoint checkpoints/shk --prompt "ROMEO:" --max-new-tokens 200
    """
    from nanogpt_cli.sample import Sampler, SampleSettings
    from nanogpt_cli.ui import console, err_console

    if prompt is not None and prompt_file is not None:
        raise NanoGPTError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        from nanogpt_cli.files import read_text_file

        prompt = read_text_file(prompt_file, "--prompt-file")
    from nanogpt_cli.device import set_threads

    set_threads(threads)
    settings = SampleSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k or None,
                              top_p=top_p,
                              min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop or [],
                              ignore_eot=ignore_eot, use_cache=not no_cache)
    sampler = Sampler.load(checkpoint, last=last, device=device, dtype=dtype)

    def run(text: str) -> None:
        ids, cut = sampler.encode_prompt(text)
        if cut:
            err_console.print(f"note: the prompt is {len(ids) + cut:,} tokens; its first {cut:,} are cut to fit "
                              f"the context of {sampler.block_size:,}", soft_wrap=True)
        for i, pieces in enumerate(sampler.samples(text, settings, num_samples)):
            if num_samples > 1:
                console.rule(f"sample {i + 1} of {num_samples}")
            sys.stdout.write(text)
            for piece in pieces:
                sys.stdout.write(piece)
                if stream:
                    sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()

    if not interactive:
        return run(prompt or "")
    first = prompt  # --prompt (or --prompt-file) with --interactive is the first prompt
    while True:
        if first is not None:
            text, first = first, None
            print(f"prompt> {text}")
        else:
            try:
                text = input("prompt> ")
            except EOFError:
                break
        try:
            run(text)
        except NanoGPTError as e:  # a bad prompt should not end the session
            fail(str(e))


@app.command()
@one_line_errors
def serve(
    source: Annotated[str, typer.Argument(help="Run folder, .safetensors file, Hugging Face folder or hf:NAME.")],
    host: Annotated[str, typer.Option(help="Address to listen on; anything but loopback wants --api-key.")]
        = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: a free one, printed).")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Rows decoded together (requests and their choices).")] = 8,
    model_name: Annotated[Optional[str], typer.Option(help="The name /v1/models reports (default: the run's).",
                                                      show_default=False)] = None,
    api_key: Annotated[Optional[str], typer.Option(help="Require 'Authorization: Bearer KEY'.",
                                                   envvar="NANOGPT_API_KEY", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens one request may ask for, per choice.")] = 4096,
    max_n: Annotated[int, typer.Option(help="Most choices (n) per request.")] = 8,
    max_queue: Annotated[int, typer.Option(help="Most rows waiting for a free row; beyond it, 503.")] = 64,
    max_body: Annotated[int, typer.Option(help="Most bytes in a request body; beyond it, 413.")] = 1_000_000,
    no_ui: Annotated[bool, typer.Option("--no-ui", help="Do not serve the chat page at /.")] = False,
    last: Last = False,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
):
    """Serve a model over the OpenAI API (completions, chat, streaming) with a chat page at /.

    Example: nanogpt serve checkpoints/shk --port 8000
    """
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.serve import ServeOptions, default_model_name, is_loopback
    from nanogpt_cli.serve import serve as run_server

    options = ServeOptions(source=source, host=host, port=port, max_batch=max_batch, model_name=model_name,
                           api_key=api_key, device=device, dtype=dtype, last=last, ui=not no_ui, max_body=max_body,
                           max_tokens=max_tokens, max_n=max_n, max_queue=max_queue)
    set_threads(threads)
    if not is_loopback(host) and options.api_key is None:
        note(f"--host {host} is reachable from other machines and no --api-key is set: anyone who can reach it "
             "can use the model")
    name = options.model_name or default_model_name(source)
    run_server(options, on_ready=lambda url: print(f"serving {name} at {url} (Ctrl-C to stop)", flush=True))


@eval_app.command()
@one_line_errors
def perplexity(
    checkpoint: Checkpoint,
    data: Annotated[Optional[str], typer.Option(help="A prepared dataset to score.")] = None,
    data_dir: Annotated[Path, typer.Option(help=DATA_DIR_HELP)] = Path("data"),
    split: Annotated[str, typer.Option(help="train or val.")] = "val",
    input: Annotated[Optional[list[Path]], typer.Option(help="Text file(s) to score instead (repeatable).",
                                                        metavar="<path>")] = None,
    stride: Annotated[Optional[int], typer.Option(help="Tokens between window starts (default half the context).")
                      ] = None,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass.")] = 32,
    last: Last = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    device: Device = "auto",
    dtype: Dtype = "float32",
    threads: Threads = None,
):
    """Score every token of a dataset split or text files once: loss, perplexity, bits per byte.

    Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char --split val
    """
    from nanogpt_cli.checkpoint import load_for_inference
    from nanogpt_cli.evaluate import perplexity_of_files, perplexity_of_split
    from nanogpt_cli.ui import console, eval_table

    if (data is None) == (not input):
        raise NanoGPTError("give either --data NAME (with --split) or --input FILE")
    if split not in ("train", "val"):
        raise NanoGPTError(f"--split must be train or val, got {split!r}")
    if batch_size < 1:
        raise NanoGPTError(f"--batch-size must be at least 1, got {batch_size}")
    from nanogpt_cli.device import set_threads

    set_threads(threads)
    loaded = load_for_inference(checkpoint, last=last, device=device, dtype=dtype)
    from nanogpt_cli.ui import eval_progress

    with eval_progress() as progress:  # a bar on a terminal: tokens scored, rate, time left
        if data is not None:
            result = perplexity_of_split(loaded.model, loaded.tokenizer, data_dir, data, split, stride, batch_size,
                                         progress)
        else:
            result = perplexity_of_files(loaded.model, loaded.tokenizer, input, stride, batch_size, progress)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        console.print(eval_table(result))


@app.command()
@one_line_errors
def export(
    run: Annotated[str, typer.Argument(help="Run folder (its best weights), a .safetensors file, a Hugging Face "
                                            "folder or hf:NAME.")],
    out: Annotated[Path, typer.Option(help="Folder to write (hf) or FILE.gguf (gguf).")],
    format: Annotated[str, typer.Option("--format", help="hf (transformers folder) or gguf (llama.cpp file).")
                      ] = "hf",
    last: Last = False,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
):
    """Write a run as a Hugging Face folder or a GGUF file that other tools load.

    Example: nanogpt export checkpoints/shk --format hf --out exports/shk
    """
    from nanogpt_cli.export import export as export_run
    from nanogpt_cli.ui import console

    result = export_run(run, format, out, last=last, force=force)
    if result.format == "hf":
        console.print(f"wrote {result.path} ({result.architecture}, {result.tokenizer} tokenizer); load it with "
                      f"AutoModelForCausalLM.from_pretrained({str(result.path)!r})", soft_wrap=True, highlight=False)
    else:
        console.print(f"wrote {result.path} (GGUF, {result.architecture}, {result.tokenizer} tokenizer, float32)",
                      soft_wrap=True, highlight=False)


@app.command()
@one_line_errors
def runs(
    folder: Annotated[Path, typer.Argument(help="A folder of run folders (or one run).")] = Path("checkpoints"),
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object per run instead of a table.")
                        ] = False,
):
    """List the runs in a folder: dataset, size, progress, best val loss, last update, status.

    Example: nanogpt runs checkpoints
    """
    from nanogpt_cli.runs import list_runs
    from nanogpt_cli.ui import console, runs_table

    found = list_runs(folder)
    if json_out:
        for run in found:
            print(json.dumps(run.to_dict()))
    elif not found:
        console.print(f"no runs in {folder}")
    else:
        console.print(runs_table(found, folder))
        for run in found:
            if run.problem:
                console.print(f"{run.name}: {run.problem}", markup=False)


@app.command()
@one_line_errors
def info(
    path: Annotated[Path, typer.Argument(help="A run folder or a .safetensors weights file.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Describe a run or weights file: config, parameters, FLOPs per token, tokenizer, losses, files.

    Example: nanogpt info checkpoints/shk
    """
    from nanogpt_cli.runs import inspect_path
    from nanogpt_cli.ui import console, info_table

    result = inspect_path(path)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        console.print(info_table(result))


@app.command()
@one_line_errors
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run folders to draw (one or more).")],
    out: Annotated[Optional[Path], typer.Option(help="Write a .png/.svg/.pdf here instead of drawing in the "
                                                     "terminal.")] = None,
):
    """Draw train and val loss against tokens seen, for one or several runs.

    Example: nanogpt plot checkpoints/shk checkpoints/shk-wsd --out loss.png
    """
    from nanogpt_cli.plot import terminal_plot, write_png
    from nanogpt_cli.ui import console

    if out is not None:
        from nanogpt_cli.files import check_creatable

        check_creatable(out.parent if str(out.parent) else Path("."), "the folder of --out")
        console.print(f"wrote {write_png(runs, out)}")
    else:
        print(terminal_plot(runs, width=min(console.width, 100), height=20, color=console.is_terminal))


def main():
    """The console script. Typer runs in click's non-standalone mode so that a usage error (unknown option, bad
    value, missing argument) becomes the same one line and exit code 1 as every other error, not a panel and 2."""
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        raise SystemExit(1)
    except Exception as e:
        if not (callable(getattr(e, "format_message", None)) and hasattr(e, "exit_code")):
            raise  # not a usage error: a bug, shown as a traceback
        ctx = getattr(e, "ctx", None)
        hint = f"; see {ctx.command_path} --help" if ctx is not None else ""
        message = " ".join(e.format_message().split()).rstrip(".")
        fail(f"{message[:1].lower()}{message[1:]}{hint}")
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)
