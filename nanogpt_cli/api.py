"""The Python API: what the commands do, as calls that return typed results and print nothing.

    import nanogpt_cli as nanogpt
    nanogpt.prepare("examples/tinyshakespeare.txt", "shk", tokenizer="char")      # -> PrepareResult
    result = nanogpt.train("tiny", data="shk", out="checkpoints/shk", callback=print)   # -> TrainResult
    model = nanogpt.load("checkpoints/shk", device="cpu")
    model.generate("ROMEO:", max_new_tokens=50, temperature=0)                       # -> SampleResult
    model.chat([{"role": "user", "content": "Hello"}])                               # -> ChatReply
    model.score(["To be, or not to be"])                                             # -> EvalResult
    model.evaluate_tasks(["hellaswag"], limit=100)                                   # -> TaskResults (lm-eval)

Each call is a thin layer over the library: loading is interop.loading's, sampling inference.sample's, chat
rendering data.chat_template's, scoring inference.evaluate's (on lm-eval tasks inference.tasks'), planning and
training training/'s, preparing data/'s. Errors are NanoGPTError with one sentence. Only this module's own names
load at import; torch and the rest load on the first call that needs them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.training.events import (  # dataclasses only
    EvalProgress,
    Evaluated,
    RunStarted,
    StepLogged,
    TrainResult,
)

if TYPE_CHECKING:
    import torch

    from nanogpt_cli.config import GPTConfig, TrainConfig
    from nanogpt_cli.data.chat import ChatPrepareResult
    from nanogpt_cli.data.chat_template import ChatTemplate
    from nanogpt_cli.data.pipeline import PrepareResult
    from nanogpt_cli.inference.chat import ChatSession
    from nanogpt_cli.inference.evaluate import EvalResult
    from nanogpt_cli.inference.sample import Piece, SampleResult, SampleSettings
    from nanogpt_cli.inference.speculative import Draft
    from nanogpt_cli.inference.tasks import TaskResults
    from nanogpt_cli.interop.export import ExportResult
    from nanogpt_cli.interop.loading import InferenceModel
    from nanogpt_cli.lora import LoRAConfig
    from nanogpt_cli.model import GPT
    from nanogpt_cli.tokenizer import Tokenizer
    from nanogpt_cli.training.events import Display
    from nanogpt_cli.training.plan import Change, RunPlan

__all__ = [
    "ChatReply",
    "EvalProgress",
    "Evaluated",
    "Hint",
    "Model",
    "Note",
    "RunStarted",
    "Saved",
    "Status",
    "StepLogged",
    "Stream",
    "TrainResult",
    "Training",
    "export",
    "load",
    "plan_training",
    "prepare",
    "train",
]


# --- loading and using a model ---


def load(
    source: str | Path,
    *,
    last: bool = False,
    device: str = "auto",
    dtype: Any = "auto",
    quantize: str | None = None,
    group_size: int = 32,
    backend: str | None = None,
    draft: str | Path | None = None,
    draft_tokens: int | None = None,
) -> Model:
    """A model ready to generate, chat and score, from any source the commands load: a run folder (its best
    weights; its last with last=True), a .safetensors file, a Hugging Face folder or hf:NAME, or a .gguf file
    that `export` wrote. device: auto, cpu, cuda, cuda:N or mps; dtype: auto, float32, bfloat16, float16 (or a
    torch.dtype); auto picks from the device and the size of the weights. quantize: None, "int8" (one scale per
    output channel) or "int4" (a scale and zero per group_size inputs) for the blocks' weights, on a CPU. backend:
    "cpu" or "torch", how decode steps are computed (default: the first that supports the model). draft,
    draft_tokens: Model.use_draft's."""
    from nanogpt_cli.interop.loading import load_for_inference

    check_draft_options(draft, draft_tokens)  # before the model's weights are read

    loaded = load_for_inference(
        source, last=last, device=device, dtype=_dtype(dtype), quantize=quantize, group_size=group_size, backend=backend
    )
    model = Model(loaded, str(source))
    if draft is not None:
        model.use_draft(draft, draft_tokens)
    return model


def check_draft_options(draft: str | Path | None, draft_tokens: int | None) -> None:
    if draft is None and draft_tokens is not None:
        raise NanoGPTError("--draft-tokens sets how many tokens a draft model proposes: give --draft too")
    from nanogpt_cli.inference.speculative import check_draft_tokens

    check_draft_tokens(draft_tokens)


class Model:
    """A loaded model, its tokenizer and its chat template, kept for many calls."""

    def __init__(self, loaded: InferenceModel, source: str):
        from nanogpt_cli.inference.sample import Sampler

        self.loaded, self.source = loaded, source
        self.sampler = Sampler(loaded)  # the one generation path the commands use too
        self._template = None

    def use_draft(self, source: str | Path | None, tokens: int | None = None) -> None:
        """Decode with a draft model from then on (speculative decoding; None: without one): a smaller model with
        the same tokenizer, from any source load() takes, loaded with this model's device, dtype, quantization and
        backend. It proposes `tokens` tokens at a time (None: a number adapted to how many are kept) that this model
        checks in one forward: greedy text stays this model's, and sampled text keeps its distribution."""
        check_draft_options(source, tokens)
        if source is None:
            self.sampler.draft = None
            return
        from nanogpt_cli.inference.speculative import load_draft

        m = self.module
        options = dict(device=str(self.device), dtype=_dtype(self.dtype), quantize=getattr(m, "quantized", None))
        options.update(group_size=getattr(m, "quant_group_size", 32), backend=getattr(m, "decode_backend", None))
        self.sampler.draft = load_draft(source, self.tokenizer, tokens, **options)

    @property
    def draft(self) -> Draft | None:
        """The draft model and its accepted-token counts (draft.stats), or None."""
        return self.sampler.draft

    @property
    def module(self) -> GPT:
        """The torch module (in eval mode, on `device`, cast to `dtype`)."""
        return self.loaded.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def meta(self) -> dict[str, Any]:
        """The weights file's metadata: config, tokenizer, step, dataset, chat template, ..."""
        return self.loaded.meta

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def backend(self) -> str:
        """The decode backend its engines use: "cpu" (our kernels) or "torch" (the model's own forward)."""
        from nanogpt_cli.inference.backends import choose

        return choose(self.module, getattr(self.module, "decode_backend", None)).name

    @property
    def dtype(self) -> torch.dtype:
        return self.loaded.dtype

    @property
    def block_size(self) -> int:
        """The context length in tokens."""
        return self.loaded.block_size

    @property
    def template(self) -> ChatTemplate:
        """The chat template that chat() renders with: the model's own, or the plain transcript of a base model."""
        if self._template is None:
            from nanogpt_cli.data.chat_template import ChatTemplate

            self._template = ChatTemplate.for_model(self.meta, self.tokenizer, self.source)
        return self._template

    def __repr__(self) -> str:
        cfg = self.module.config
        return (
            f"Model({self.source!r}: {cfg.n_layer} layers, {cfg.n_embd} wide, {self.block_size} tokens of context, "
            f"{self.tokenizer.describe().get('name')} tokenizer, {self.device} {str(self.dtype).replace('torch.', '')})"
        )

    def generate(
        self, prompt: str | list[str], *, stream: bool = False, **settings: Any
    ) -> SampleResult | list[SampleResult] | Stream | Iterator[Piece]:
        """Continue a prompt (-> SampleResult) or a list of prompts, decoded together as one batch (-> a list of
        SampleResult, in order). stream=True: for one prompt a Stream of text pieces (its `result` set once it is
        read to the end); for a list, an iterator of Piece(row, text, result). settings: SampleSettings' fields
        (max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, ignore_eot,
        use_cache); row r of a batch samples with seed + r, so the first row is the single prompt's sample."""
        chosen = _sample_settings(settings)
        if isinstance(prompt, str):
            if stream:
                return Stream(self._pieces(prompt, chosen))
            return self.sampler.generate(prompt, chosen)
        prompts = _prompt_list(prompt)
        return self.sampler.stream_many(prompts, chosen) if stream else self.sampler.generate_many(prompts, chosen)

    def _pieces(self, prompt: str | list[int], settings: SampleSettings) -> Generator[str, None, SampleResult]:
        result = None
        for piece in self.sampler.stream_many([prompt], settings):
            if piece.text:
                yield piece.text
            result = piece.result or result
        return result

    def chat(self, messages: list[dict[str, str]], *, stream: bool = False, **settings: Any) -> ChatReply | Stream:
        """The assistant's reply to a conversation ([{"role": "user", "content": ...}, ...]; system, user and
        assistant turns), rendered with the model's chat template and ended by its end of turn -> ChatReply, or
        with stream=True a Stream of the reply's text (its `result` the ChatReply). max_new_tokens: the most
        tokens of the reply (default: up to the end of the context, where a reply always ends); the other
        settings as for generate(). A conversation longer than the context is refused, not cut."""
        ids, chosen = self._chat_prompt(messages, settings)
        replies = Stream(self._reply(ids, chosen))
        if stream:
            return replies
        for _ in replies:
            pass
        return replies.result

    def _chat_prompt(
        self, messages: list[dict[str, str]], settings: dict[str, Any]
    ) -> tuple[list[int], SampleSettings]:
        """The rendered conversation's token ids and the reply's settings (the template's stop texts added)."""
        _check_messages(messages)
        if "ignore_eot" in settings:
            raise NanoGPTError("chat ends a reply at the end of text; ignore_eot is for generate()")
        max_new_tokens = settings.pop("max_new_tokens", None)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise NanoGPTError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        chosen = _sample_settings(settings)
        ids = self.template.tokens(messages, self.tokenizer)
        if len(ids) >= self.block_size:
            raise NanoGPTError(
                f"the conversation takes {len(ids):,} tokens with the chat template, and the model's context is "
                f"{self.block_size:,}: leave out its oldest turns"
            )
        room = self.block_size - len(ids)
        limit = room if max_new_tokens is None else min(max_new_tokens, room)
        return ids, dataclasses.replace(chosen, max_new_tokens=limit, stop=chosen.stop + self.template.stop)

    def _reply(self, ids: list[int], settings: SampleSettings) -> Generator[str, None, ChatReply]:
        """The reply's text as it comes, without the space the template leaves after the assistant's role and
        without trailing whitespace (held until more text follows), so the pieces join to ChatReply.text."""
        text, pending, result = "", "", None
        for piece in self.sampler.stream_many([ids], settings):
            result = piece.result or result
            body = (pending + piece.text) if text else piece.text.lstrip()
            shown = body.rstrip()
            pending = body[len(shown) :]
            if shown:
                text += shown
                yield shown
        return ChatReply(text, result.stop_reason, result.tokens, len(ids), result.elapsed_s)

    def conversation(
        self, system: str | None = None, max_new_tokens: int | None = None, **settings: Any
    ) -> ChatSession:
        """A conversation that keeps its history: session.ask(text) streams each reply and cuts the oldest turns
        when the context is full (what `nanogpt chat` runs). Settings as for generate()."""
        from nanogpt_cli.inference.chat import ChatSession

        return ChatSession(
            self.loaded, self.template, _sample_settings(settings), system, max_new_tokens, draft=self.draft
        )

    def score(
        self,
        texts: str | list[str] | None = None,
        *,
        files: list[str | Path] | None = None,
        data: str | None = None,
        split: str = "val",
        data_dir: str | Path = "data",
        stride: int | None = None,
        batch_size: int = 8,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> EvalResult:
        """Loss (nats/token), perplexity and bits per byte of texts, text files, or a prepared dataset's split
        (data=NAME, split="val" or "train"), every token scored once with a sliding window of the context (each
        window `stride` tokens after the last; default half the context). Each text and file is scored on its
        own and the sums pooled. progress(what, targets scored, all targets) is called after each batch."""
        from nanogpt_cli.inference import evaluate

        if sum(x is not None for x in (texts, files, data)) != 1:
            raise NanoGPTError("give one of texts, files=[...] or data=NAME to score")
        if batch_size < 1:
            raise NanoGPTError(f"batch_size must be at least 1, got {batch_size}")
        model, tokenizer = self.module, self.tokenizer
        if data is not None:
            return evaluate.perplexity_of_split(
                model, tokenizer, Path(data_dir), data, split, stride, batch_size, progress
            )
        if files is not None:
            paths = [Path(f) for f in ([files] if isinstance(files, (str, Path)) else files)]
            return evaluate.perplexity_of_files(model, tokenizer, paths, stride, batch_size, progress)
        return evaluate.perplexity_of_texts(model, tokenizer, _prompt_list(texts), stride, batch_size, progress)

    def evaluate_tasks(
        self,
        tasks: str | list[str],
        *,
        limit: int | None = None,
        num_fewshot: int | None = None,
        batch_size: int | None = None,
        include_path: str | Path | None = None,
        apply_chat_template: bool = False,
        output_path: str | Path | None = None,
    ) -> TaskResults:
        """Scores on lm-evaluation-harness tasks (needs the `eval` extra), what `nanogpt eval tasks` prints: tasks
        are lm-eval task, group or tag names, glob patterns or YAML files (a list, or one comma-separated string);
        limit: the first N documents of each; num_fewshot: examples before each question (default: the task's);
        include_path: a folder of task YAMLs of your own; output_path: where lm-eval writes its results JSON and
        per-sample logs; batch_size: rows per forward (None: as many as about 2 GB holds, up to 32). The result
        holds the scores as rows, lm-eval's results object and each document's sample."""
        from nanogpt_cli.inference.tasks import check_options, evaluate_tasks

        names = [tasks] if isinstance(tasks, str) else list(tasks)
        check_options(names, limit, num_fewshot, include_path)
        from nanogpt_cli.inference.lm_eval_model import NanoGPTLM

        lm = NanoGPTLM(self.loaded, batch_size=batch_size, source=self.source)
        return evaluate_tasks(
            lm,
            names,
            limit=limit,
            num_fewshot=num_fewshot,
            include_path=include_path,
            apply_chat_template=apply_chat_template,
            output_path=output_path,
        )


@dataclass
class ChatReply:
    """The assistant's reply to a conversation."""

    text: str  # without the template's leading space and trailing whitespace
    stop_reason: str  # "stop" (the template's end of turn, or a stop text), "eot" or "length"
    tokens: int  # tokens generated, the end of turn included
    prompt_tokens: int  # the rendered conversation's tokens
    elapsed_s: float

    @property
    def message(self) -> dict[str, str]:
        """The reply as the next turn of the conversation."""
        return {"role": "assistant", "content": self.text}


class Stream:
    """Text pieces as they are generated; `result` is set once the stream has been read to its end."""

    def __init__(self, pieces: Generator[str, None, Any]):
        self._pieces = pieces
        self.result: Any = None  # SampleResult (generate) or ChatReply (chat)

    def __iter__(self) -> Iterator[str]:
        result = yield from self._pieces  # None when read a second time: the first reading's result stays
        self.result = result if result is not None else self.result


def _sample_settings(settings: dict[str, Any]) -> SampleSettings:
    """SampleSettings from keyword arguments; an unknown one is refused with the names there are. A single stop
    text may be given as a string."""
    from nanogpt_cli.inference.sample import SampleSettings

    known = [f.name for f in dataclasses.fields(SampleSettings)]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise NanoGPTError(f"unknown sampling setting(s) {', '.join(unknown)}; these exist: {', '.join(known)}")
    if isinstance(settings.get("stop"), str):
        settings = {**settings, "stop": [settings["stop"]]}
    return SampleSettings(**settings)


def _prompt_list(prompts: Any) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise NanoGPTError("give a text or a list of texts")
    return list(prompts)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise NanoGPTError('messages must be a non-empty list of {"role": ..., "content": ...}')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise NanoGPTError(f'message {i} must be {{"role": str, "content": str}}, got {m!r}')


def _dtype(value: Any):
    from nanogpt_cli.config import Dtype

    name = str(value).removeprefix("torch.")
    if name not in [d.value for d in Dtype]:
        raise NanoGPTError(f"dtype must be one of {', '.join(d.value for d in Dtype)}, got {value!r}")
    return Dtype(name)


# --- training ---


@dataclass
class Note:
    """What the plan says before the run starts: a value set aside, a warning."""

    text: str


@dataclass
class Status:
    """What the trainer is doing before its first step: "loading the data", "building the model", ..."""

    text: str


@dataclass
class Hint:
    """Advice while the run goes (a busy machine), given at most once each."""

    text: str


@dataclass
class Saved:
    """A stopped run's final checkpoint (of this step) is complete on disk."""

    step: int


if TYPE_CHECKING:
    # what a training callback receives, in this order: Note and Change (a resume's changed values) from the
    # plan, Status while it sets up, RunStarted, then StepLogged and Evaluated as the run goes (Evaluated.saved:
    # a checkpoint followed; it comes once that is on disk, maybe after StepLogged of later steps; EvalProgress
    # before it while a slow one goes), Saved for the final checkpoint of a stopped run, and Hint when there is
    # advice
    Event = Note | Change | Status | RunStarted | StepLogged | EvalProgress | Evaluated | Saved | Hint


class _Callback:
    """The trainer's Display, handing every event to one function as a typed object."""

    def __init__(self, fn: Callable[[Event], None]):
        self.fn = fn

    def on_start(self, event: RunStarted) -> None:
        self.fn(event)

    def on_step(self, event: StepLogged) -> None:
        self.fn(event)

    def on_eval(self, event: Evaluated) -> None:
        self.fn(event)

    def on_scored(self, event) -> None:  # DPO's and GRPO's evaluations (events.Scored)
        self.fn(event)

    def on_eval_progress(self, event: EvalProgress) -> None:
        self.fn(event)

    def on_save(self, step: int) -> None:
        self.fn(Saved(step))

    def on_status(self, text: str) -> None:
        self.fn(Status(text))

    def on_hint(self, text: str) -> None:
        self.fn(Hint(text))


@dataclass
class Training:
    """A run planned and checked, not started yet; nothing is written until run()."""

    plan: RunPlan  # the configs, the run folder, the dataset, where the weights start from
    trainable: Any = None  # LoRA's hook for the trainer (None: every parameter trains)

    @property
    def notes(self) -> list[str]:
        """What the plan set aside or warns of: the callback gets each as a Note."""
        return self.plan.notes

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir.path

    def run(self, callback: Callable[[Event], None] | Display | None = None) -> TrainResult:
        """Train (or resume) the run in this process, or under torchrun in its process group. callback: a function
        that receives every event (see Event), or a Display. Ctrl-C and SIGTERM stop it after the step under way,
        with a checkpoint: TrainResult.stopped says so, and the same call with resume=True continues it."""
        from nanogpt_cli.training.distributed import open_world
        from nanogpt_cli.training.job import complete_reason
        from nanogpt_cli.training.trainer import Trainer

        display = callback
        if callback is not None and not hasattr(callback, "on_start"):
            display = _Callback(callback)
            for text in self.plan.notes + ([complete_reason(self.plan, flags=False)] if self.plan.complete else []):
                callback(Note(text))
            for change in self.plan.changes:
                callback(change)
        with open_world(self.plan.train) as world:
            return Trainer(self.plan, display, world, trainable=self.trainable).fit()


def plan_training(
    config: str | Path | dict[str, Any] | TrainConfig | None = None,
    *,
    model: GPTConfig | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    init_from: str | Path | None = None,
    last: bool = False,
    lora: LoRAConfig | bool | None = None,
    **flags: Any,
) -> Training:
    """A checked run from a config: a preset name ("tiny", "cpu-char", ...), a .toml file, a dict of the config
    fields (the flags' names with underscores; "preset" and "out" among them), or a TrainConfig (with model=
    a GPTConfig; a GPTConfig's vocab_size left at its default becomes the dataset's). Keyword flags override
    it (data="shk", max_iters=100). resume: continue the run in `out` (a fine-tuning run, on its base);
    init_from: start from these weights (last: its last), as `train --init-from`; lora: train LoRA adapters
    on frozen init_from weights (True: the default adapters), as `finetune --lora`."""
    from nanogpt_cli.training import finetune
    from nanogpt_cli.training.job import TrainRequest, plan_train

    if last and init_from is None:
        raise NanoGPTError("last=True picks the last weights of init_from; give init_from or drop last")
    values, file_values = _config_values(config, model)
    values.update(flags)
    init = None if init_from is None else str(init_from)
    if lora:
        from nanogpt_cli.lora import LoRAConfig

        cfg = LoRAConfig() if lora is True else lora
        job = finetune.plan_finetune(
            values, file_values, out=out, resume=resume, force=force, init_from=init, init_last=last, lora=cfg
        )
        return Training(job.plan, job.trainable)
    request = TrainRequest(
        flags=values,
        file_values=file_values,
        out=None if out is None else Path(out),
        resume=resume,
        force=force,
        init_from=init,
        init_last=last,
    )
    job = plan_train(request)  # a fine-tuning run resumes on its base; a chat dataset records a full fine-tune
    return Training(job.plan, job.trainable)


def train(
    config: str | Path | dict[str, Any] | TrainConfig | None = None,
    *,
    callback: Callable[[Event], None] | Display | None = None,
    **options: Any,
) -> TrainResult:
    """Plan a run and train it: plan_training(config, **options).run(callback)."""
    return plan_training(config, **options).run(callback)


def _config_values(config: Any, model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(flags, config-file values) from what plan_training was given as its config."""
    from nanogpt_cli.config import GPTConfig, TrainConfig, load_toml

    values: dict[str, Any] = {}
    file_values: dict[str, Any] = {}
    if isinstance(config, Path) or (isinstance(config, str) and config.endswith(".toml")):
        file_values = load_toml(Path(config))
    elif isinstance(config, str):
        values["preset"] = config
    elif isinstance(config, dict):
        values.update(config)
    elif isinstance(config, TrainConfig):
        values.update(config.to_dict())
    elif config is not None:
        raise NanoGPTError(f"config must be a preset name, a .toml file, a dict or a TrainConfig, got {config!r}")
    if model is not None:
        if not isinstance(model, GPTConfig):
            raise NanoGPTError(f"model must be a GPTConfig, got {model!r}")
        given = model.to_dict()
        if given["vocab_size"] == GPTConfig.vocab_size:  # the default: the dataset's vocabulary, as for a flag
            del given["vocab_size"]
        values.update(given)
    return values, file_values


# --- data and export ---


def prepare(
    source: str | Path,
    name: str,
    *,
    tokenizer: str = "gpt2",
    data_dir: str | Path = "data",
    tokenizers_dir: str | Path = "tokenizers",
    format: str = "text",
    progress: Callable[[Any], None] | None = None,
    **options: Any,
) -> PrepareResult | ChatPrepareResult:
    """Tokenize a source into DATA_DIR/NAME, as `nanogpt prepare` does -> PrepareResult. source: a text file,
    folder or glob, .jsonl/.json/.parquet/.csv, hf:OWNER/NAME or "shakespeare"; tokenizer: gpt2, char, byte, a
    tiktoken name or a trained tokenizer's NAME (in tokenizers_dir). options: PrepareOptions' fields
    (val_fraction, max_docs, max_tokens, num_proc, resume, ...); progress(PrepareProgress) now and then.
    format="chat": a .jsonl of conversations with loss masks -> ChatPrepareResult (options: val_fraction,
    chat_template, strict, shard_tokens)."""
    from nanogpt_cli.files import check_creatable
    from nanogpt_cli.tokenizer import trained_or_named

    check_creatable(data_dir, "--data-dir")
    tokenizer = trained_or_named(tokenizer, Path(tokenizers_dir))  # a trained tokenizer's NAME is its folder
    if format == "chat":
        from nanogpt_cli.data.chat import prepare_chat

        if progress is not None:
            raise NanoGPTError('progress is reported for format="text" only')
        _check_options(options, [p for p in inspect.signature(prepare_chat).parameters if p not in ("source", "name")])
        if options.get("chat_template") is not None:
            options["chat_template"] = str(options["chat_template"])
        return prepare_chat(str(source), name, tokenizer=tokenizer, data_dir=str(data_dir), **options)
    if format != "text":
        raise NanoGPTError(f"unknown format {format!r}; use text or chat")
    from nanogpt_cli.data.pipeline import PrepareOptions
    from nanogpt_cli.data.pipeline import prepare as prepare_data

    _check_options(options, [f.name for f in dataclasses.fields(PrepareOptions) if f.name not in ("source", "name")])
    return prepare_data(str(source), name, tokenizer=tokenizer, data_dir=Path(data_dir), progress=progress, **options)


def _check_options(options: dict[str, Any], known: list[str]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise NanoGPTError(f"unknown option(s) {', '.join(unknown)}; these exist: {', '.join(known)}")


def export(
    source: str | Path,
    out: str | Path,
    format: str = "hf",
    *,
    last: bool = False,
    force: bool = False,
    quant: str | None = None,
    merge: bool = False,
    base: str | Path | None = None,
) -> ExportResult:
    """Write a run (or weights file, or Hugging Face model) as a Hugging Face folder (format="hf"), one GGUF file
    (format="gguf", quant: f32, f16, bf16, q8_0, ...) or a LoRA run's PEFT adapter (format="peft", for `base`),
    as `nanogpt export` does."""
    from nanogpt_cli.interop.export import export as export_run

    return export_run(source, format, out, last=last, force=force, quant=quant, merge=merge, base=base)


# --- rollouts for reinforcement learning ---


def engine_rollout(
    model, prompts, max_new_tokens: int, temperature: float, generator, stop_ids=(), vocab_size: int | None = None
) -> list[list[int]]:
    """GRPO's rollout (training.grpo.Rollout): every prompt continued by up to max_new_tokens tokens, decoded
    together by the engine (one batch, one KV cache), all rows drawing from `generator`; temperature 0 is
    greedy. A row ends at a stop id (which it keeps) or at the limit; vocab_size: the tokenizer's (never a
    padding token)."""
    from nanogpt_cli.inference.engine import Engine, SamplingParams

    engine = Engine(model, max_batch=len(prompts), vocab_size=vocab_size)
    rows = engine.add_many(
        prompts, SamplingParams(temperature=temperature), max_new_tokens, [generator] * len(prompts), stop_ids
    )
    new: dict[int, list[int]] = {row: [] for row in rows}
    for t in engine.run():
        new[t.row].append(t.token)
    return [new[row] for row in rows]
