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

from nanogpt_cli.config import LoadSpec
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.serve import ServeOptions, Started
from nanogpt_cli.training.events import (  # dataclasses only
    EvalProgress,
    Evaluated,
    RunStarted,
    StepLogged,
    TrainResult,
)
from nanogpt_cli.training.launch import launch_flags, record_error  # the standard library's os and json only
from nanogpt_cli.training.request import RunRequest  # a dataclass only: the CLI generates its options
from nanogpt_cli.training.signals import Interrupted, StopSignals  # the standard library's signal only

if TYPE_CHECKING:
    import torch

    from nanogpt_cli.config import GPTConfig, TrainConfig
    from nanogpt_cli.data.chat import ChatPrepareResult
    from nanogpt_cli.data.chat_template import ChatTemplate
    from nanogpt_cli.data.pipeline import PrepareResult
    from nanogpt_cli.data.preference import RowsPrepareResult
    from nanogpt_cli.data.tokenizer_compare import TokenizerComparison
    from nanogpt_cli.data.tokenizer_train import TokenizerTrainResult
    from nanogpt_cli.inference.chat import ChatSession
    from nanogpt_cli.inference.evaluate import EvalResult
    from nanogpt_cli.inference.sample import Piece, SampleResult, SampleSettings
    from nanogpt_cli.inference.speculative import Draft
    from nanogpt_cli.inference.tasks import TaskResults
    from nanogpt_cli.inspect.attention import AttentionMaps
    from nanogpt_cli.inspect.catalog import Info, RunSummary
    from nanogpt_cli.inspect.heads import HeadReport
    from nanogpt_cli.inspect.positions import PositionViews
    from nanogpt_cli.interop.export import ExportResult
    from nanogpt_cli.interop.loading import InferenceModel
    from nanogpt_cli.lora import LoRAConfig
    from nanogpt_cli.model import GPT
    from nanogpt_cli.tokenizer import Tokenizer
    from nanogpt_cli.training.distill import DistillSettings
    from nanogpt_cli.training.events import Display
    from nanogpt_cli.training.launch import Launch
    from nanogpt_cli.training.plan import Change, RunPlan

__all__ = [
    "ChatReply",
    "EvalProgress",
    "Evaluated",
    "Hint",
    "Interrupted",
    "LoadSpec",
    "Model",
    "Note",
    "RunRequest",
    "RunStarted",
    "Saved",
    "ServeOptions",
    "Status",
    "StepLogged",
    "StopSignals",
    "Stream",
    "TrainResult",
    "Training",
    "compare",
    "compare_tokenizers",
    "evaluate_tasks",
    "export",
    "finetune",
    "info",
    "kernel_note",
    "label_with_teacher",
    "launch_flags",
    "list_runs",
    "load",
    "load_spec",
    "plan_finetuning",
    "plan_training",
    "plot",
    "prepare",
    "record_error",
    "report",
    "sample_settings",
    "serve",
    "system_info",
    "train",
    "train_tokenizer",
]


# --- loading and using a model ---


def load(source: str | Path | LoadSpec, **options: Any) -> Model:
    """A model ready to generate, chat and score, from a LoadSpec (what the commands load, config.py) or a source
    and the spec's fields as keywords. source: a run folder (its best weights; its last with last=True) or a run's
    name in checkpoints/, a .safetensors file, a LoRA run (on its base), a Hugging Face folder or hf:NAME, or a
    .gguf file. device: auto, cpu, cuda, cuda:N or mps; dtype: auto, float32, bfloat16, float16 (or a
    torch.dtype); auto picks from the device and the size of the weights. quantize: None, "int8" (one scale per
    output channel) or "int4" (a scale and zero per group_size inputs) for the blocks' weights, on a CPU. backend:
    "cpu" or "torch", how decode steps are computed (default: the first that supports the model). threads: torch's
    CPU threads (None: as they are; "auto": chosen from the load, as the commands do). draft, draft_tokens,
    draft_lookup: a draft model for speculative decoding, loaded after the model as Model.use_draft does."""
    from nanogpt_cli.interop.loading import load_parsed, parse_spec

    spec = load_spec(source, **options)
    parsed = parse_spec(spec)  # the one reading of the source: the loaders dispatch on its type
    loaded = load_parsed(parsed, spec)
    model = Model(loaded, spec.source, spec)
    if spec.draft is not None or spec.draft_lookup:
        model.use_draft(spec.draft, spec.draft_tokens, spec.draft_lookup)
    return model


def load_spec(source: str | Path | LoadSpec, **options: Any) -> LoadSpec:
    """A LoadSpec from a spec (options replace its fields) or a source with the fields as keywords; an unknown
    keyword is refused with the names there are."""
    _check_options(options, [f.name for f in dataclasses.fields(LoadSpec) if f.name != "source"])
    if isinstance(source, LoadSpec):
        return dataclasses.replace(source, **options)
    return LoadSpec(str(source), **options)


class Model:
    """A loaded model, its tokenizer and its chat template, kept for many calls."""

    def __init__(self, loaded: InferenceModel, source: str, spec: LoadSpec | None = None):
        from nanogpt_cli.inference.sample import Sampler

        self.loaded, self.source = loaded, source
        self.spec = spec or LoadSpec(source)  # how it was loaded: another model loads alike with replace(source=...)
        self.sampler = Sampler(loaded)  # the one generation path the commands use too
        self._template = None

    def use_draft(self, source: str | Path | None, tokens: int | None = None, lookup: bool = False) -> None:
        """Decode with a draft model from then on (speculative decoding; None: without one): a smaller model with
        the same tokenizer, from any source load() takes, loaded as this model was (its spec, the source replaced:
        the same device, dtype, quantization and backend). It proposes `tokens` tokens at a time (None: a number
        adapted to how many are kept) that this model checks in one forward: greedy text stays this model's, and
        sampled text keeps its distribution. lookup: where a row's last tokens occurred before in its text, the
        tokens that followed them there are proposed instead (prompt lookup); with source None, lookup alone.
        load(..., draft=, draft_tokens=, draft_lookup=) does the same."""
        from nanogpt_cli.inference.speculative import load_draft

        spec = dataclasses.replace(self.spec, draft=source, draft_tokens=tokens, draft_lookup=lookup)  # checked first
        self.sampler.draft = load_draft(spec, self.tokenizer, self.dtype)
        self.spec = spec

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

            where = self.loaded.source.location if self.loaded.source is not None else self.source
            self._template = ChatTemplate.for_model(self.meta, self.tokenizer, where)
        return self._template

    @property
    def name(self) -> str:
        """A short name for the model: its run's (or file's, or hub model's), with its training step if known."""
        from nanogpt_cli.inspect import display_name

        return display_name(self.loaded.source.location if self.loaded.source else self.source, self.meta)

    def attention(self, prompt: str, *, layer: int | None = None, head: int | None = None) -> AttentionMaps:
        """Every layer's and head's attention over the prompt's tokens (its last block_size if longer), what `nanogpt
        inspect attention` draws. layer, head: the ones about to be looked at (from 0), checked to exist before
        anything is computed; the maps hold every layer and head all the same."""
        from nanogpt_cli.inspect.attention import attention_maps, check_selection

        check_selection(self.module.config.n_layer, self.module.config.n_head, layer, head)
        return attention_maps(self.loaded, prompt, source=self.source, name=self.name)

    def heads(self, *, length: int | None = None, seed: int = 0, prompt: str | None = None) -> HeadReport:
        """Every head scored on the standard probes and named (previous-token, induction, sink, local, mixed), what
        `nanogpt inspect heads` prints: a repeated random sequence of `length` tokens (default the smaller of 64
        and half the context), drawn with `seed`; prompt: measure previous-token, first-token and distance on it."""
        from nanogpt_cli.inspect import score_heads

        return score_heads(self.loaded, source=self.source, name=self.name, length=length, seed=seed, prompt=prompt)

    def positions(self) -> PositionViews:
        """The model's position scheme (the sinusoidal or learned table, or RoPE's frequencies) as `nanogpt inspect
        positions` draws it."""
        from nanogpt_cli.inspect import position_views

        return position_views(self.module)

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


def evaluate_tasks(
    source: str | Path | LoadSpec,
    tasks: str | list[str],
    *,
    callback: Callable[[Note], None] | None = None,
    batch_size: int | None = None,
    **options: Any,
) -> TaskResults:
    """What `nanogpt eval tasks` does: the tasks and options checked, the model loaded (source: a LoadSpec or a
    source, as for load()), then Model.evaluate_tasks(tasks, **options). callback gets a Note where
    apply_chat_template meets a model without a chat template (its prompts get a plain transcript)."""
    from nanogpt_cli.inference.tasks import check_options

    names = [tasks] if isinstance(tasks, str) else list(tasks)
    _check_options(options, ["limit", "num_fewshot", "include_path", "apply_chat_template", "output_path"])
    check_options(names, options.get("limit"), options.get("num_fewshot"), options.get("include_path"))
    if batch_size is not None and batch_size < 1:
        raise NanoGPTError(f"--batch-size must be at least 1, got {batch_size}")
    model = load(source)
    if options.get("apply_chat_template") and model.template.plain and callback is not None:
        plain = "has no chat template (a base model): its prompts get a plain User:/Assistant: transcript"
        callback(Note(f"{model.source} {plain}"))
    return model.evaluate_tasks(names, batch_size=batch_size, **options)


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


def sample_settings(**settings: Any) -> SampleSettings:
    """SampleSettings (what generate() and chat() take as keywords) checked once, for a loop that reuses them."""
    return _sample_settings(settings)


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
    launch: Launch | None = None  # nproc: the processes that train it (None: this one)
    policy: Any = None  # method "dpo" or "grpo": its run, data read and settings checked (None: the trainer's loop)
    request: RunRequest | None = None  # what was asked, which launched processes are given again
    sink: Any = None  # the tracker's (training.trackers), closed when the run ends
    eval_tasks: list[str] | None = None  # lm-eval tasks that write_report scores
    loss: Any = None  # the trainer's loss hook: distillation's DistillLoss (None: next-token cross-entropy)
    # what launched processes run: the command, and its own options beyond the request's (finetune's method,
    # LoRA and distillation options, by the CLI's names)
    command: str = "train"
    command_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        """What the plan set aside or warns of: the callback gets each as a Note."""
        return self.plan.notes

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir.path

    @property
    def complete_reason(self) -> str | None:
        """Why a resumed run trains no further and what to raise (as flags), or None when it has steps to go."""
        from nanogpt_cli.training.job import complete_reason

        return complete_reason(self.plan) if self.plan.complete else None

    def run(
        self, callback: Callable[[Event], None] | Display | None = None, then: Callable[[Any], None] | None = None
    ) -> TrainResult | Any:
        """Train (or resume) the run in this process, under torchrun in its process group, or with nproc in that
        many processes (None once they end). callback: a function that receives every event (see Event), or a
        Display. then(result): called once it has trained, while the process group is still up (every process
        waits for it). Ctrl-C and SIGTERM stop it after the step under way, with a checkpoint: the result's
        `stopped` says so, and the same call with resume=True continues it. DPO and GRPO runs give their own
        results (training.dpo.DPOResult, training.grpo.GRPOResult)."""
        from nanogpt_cli.training.distributed import open_world
        from nanogpt_cli.training.trackers import Tee
        from nanogpt_cli.training.trainer import Trainer

        if self.launch is not None:
            code = self.spawn()
            if code:
                raise NanoGPTError(f"the training processes ended with exit code {code}")
            return None
        display = self._display(callback)
        display = Tee(display, self.sink) if self.sink is not None else display
        try:
            if self.policy is not None:
                with self.plan.run_dir.hold():  # `runs` says "running" while it trains; another start is refused
                    result = self.policy.fit(display)
                if then is not None:
                    then(result)
                return result
            with open_world(self.plan.train) as world:
                hooks = {"loss": self.loss} if self.loss is not None else {}
                result = Trainer(self.plan, display, world, trainable=self.trainable, **hooks).fit()
                if then is not None:  # before this process leaves the group, so that no rank ends the others first
                    then(result)
            return result
        finally:
            if self.sink is not None:
                self.sink.close()

    def _display(self, callback: Any) -> Any:
        """A Display as it is, or a function wrapped as one (given the plan's notes and changes first)."""
        from nanogpt_cli.training.job import complete_reason

        if callback is None or hasattr(callback, "on_start"):
            return callback
        for text in self.plan.notes + ([complete_reason(self.plan, flags=False)] if self.plan.complete else []):
            callback(Note(text))
        for change in self.plan.changes:
            callback(change)
        return _Callback(callback)

    def spawn(self, options: dict[str, Any] | None = None) -> int:
        """nproc: the planned run in launch.world_size processes, each running `nanogpt train` (or `finetune`)
        with this request (options: more of the command's own options, by name; None or False: not given) and the
        run folder planned here. Their exit code: 0, 130 or 143 after a signal, 1 after an error (which they
        said)."""
        from nanogpt_cli.training.distributed import rank_device
        from nanogpt_cli.training.launch import launch, train_args

        r = self.request
        rank_device(self.plan.train.device, self.launch.nproc - 1)  # cuda:N, or more processes than GPUs: here
        own = dict(config=r.config, init_from=r.init_from, resume=r.resume, force=r.force, last=r.last)
        env = self.plan.auto.launch_env() if self.plan.auto is not None else None  # auto's probe, run once here
        args = train_args(r.flags, {**own, **self.command_options, **(options or {})}, self.plan.run_dir.path)
        return launch(args, self.launch, env=env, command=self.command)

    def draw_plot(self) -> tuple[Path | None, str | None]:
        """loss.png in the run folder (needs the plot extra): its path, or None and why it was not drawn."""
        from nanogpt_cli.inspect.plot import write_png

        try:
            write_png([self.plan.run_dir.path], self.plan.run_dir.loss_plot_path)
        except NanoGPTError as e:
            return None, str(e)
        return self.plan.run_dir.loss_plot_path, None

    def write_report(
        self,
        result: TrainResult,
        plot: Path | None = None,
        plot_note: str | None = None,
        on_status: Callable[[str], None] | None = None,
    ) -> Path | None:
        """The run's report card, report.md (with samples, and the eval_tasks' scores): its path, or None for a
        run stopped before its first save. plot: the loss picture it shows (draw_plot's), or why there is none."""
        from nanogpt_cli.inspect.report import write_report

        run = self.plan.run_dir
        if not run.has_run() or run.is_empty():
            return None
        name = None if plot is None else Path(plot).name
        write_report(run, result, eval_tasks=self.eval_tasks, plot=name, plot_note=plot_note, on_status=on_status)
        return run.report_path


def plan_training(
    config: str | Path | dict[str, Any] | TrainConfig | None = None,
    *,
    model: GPTConfig | None = None,
    request: RunRequest | None = None,
    lora: LoRAConfig | dict[str, Any] | bool | None = None,
    nproc: int | None = None,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    tracker: str | None = None,
    eval_tasks: str | list[str] | None = None,
    threads: int | None = None,
    on_probe: Callable[[Any], None] | None = None,
    **options: Any,
) -> Training:
    """A checked run, as `nanogpt train` plans it, from a config: a preset name ("tiny", "cpu-char", ...), a .toml
    file, a dict of the config fields (the flags' names with underscores; "preset" and "out" among them), or a
    TrainConfig (with model= a GPTConfig; a GPTConfig's vocab_size left at its default becomes the dataset's).
    options: RunRequest's fields (out, resume, force, init_from, last: see training/request.py) and config flags
    that override the config (data="shk", max_iters=100); request: a RunRequest to start from (the CLI's).
    lora: train LoRA adapters on frozen init_from weights, as `finetune --lora` (see plan_finetuning).
    nproc (nnodes, rdzv_endpoint): train in that many processes, as --nproc. tracker: "tensorboard" or "wandb";
    eval_tasks: lm-eval tasks write_report scores; threads: CPU threads; on_probe: --preset auto's shapes."""
    from nanogpt_cli.training.job import launch_of, plan_train

    names = _eval_task_names(eval_tasks)
    if lora:
        more = dict(lora=lora, tracker=tracker, eval_tasks=names, threads=threads, nproc=nproc, nnodes=nnodes)
        more["rdzv_endpoint"] = rdzv_endpoint
        return plan_finetuning(config, model=model, request=request, **more, **options)
    r = _run_request(config, model, request, options)
    _set_threads(threads)
    launch = launch_of(nproc, nnodes, rdzv_endpoint)
    sink = _open_tracker(tracker, launch is None)
    try:
        job = plan_train(r, launch, on_probe)  # a fine-tuning run resumes on its base; a chat dataset is a fine-tune
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    return Training(job.plan, job.trainable, job.launch, request=r, sink=sink, eval_tasks=names)


def plan_finetuning(
    config: str | Path | dict[str, Any] | TrainConfig | None = None,
    *,
    model: GPTConfig | None = None,
    request: RunRequest | None = None,
    method: str = "sft",
    lora: LoRAConfig | dict[str, Any] | bool | None = None,
    settings: dict[str, Any] | None = None,
    distill: DistillSettings | dict[str, Any] | None = None,
    tracker: str | None = None,
    eval_tasks: str | list[str] | None = None,
    threads: int | None = None,
    nproc: int | None = None,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    **options: Any,
) -> Training:
    """A checked fine-tuning run, as `nanogpt finetune` plans it: init_from's weights (required unless resume)
    trained in full, or with lora (True: the default adapters; a LoRAConfig; or a dict of the LoRA values given,
    r, alpha, dropout, targets, which a resume checks against the run's). method: "sft" (the trainer's loop),
    "dpo" (a preference dataset) or "grpo" (a prompts dataset), with settings: METHOD_SETTINGS' names (beta=0.1,
    group_size=8, reward="exact", ...); or "distill" (the trainer's loop on a teacher's distributions), with
    distill: a DistillSettings or a dict of its fields (teacher, top_k, temperature, alpha, on_policy_fraction;
    without init_from the student is a new model of the config's shape). nproc (nnodes, rdzv_endpoint): train
    in that many processes, as plan_training (sft and distill; each process loads its own live teacher). The
    rest as plan_training."""
    from nanogpt_cli.training.distill import plan_distill
    from nanogpt_cli.training.finetune import plan_finetune
    from nanogpt_cli.training.job import launch_of

    names = _eval_task_names(eval_tasks)
    r = _run_request(config, model, request, options)
    _set_threads(threads)
    cfg, lora_flags = _lora_config(lora, r.resume)
    given = {k: v for k, v in (settings or {}).items() if v is not None}
    launch = launch_of(nproc, nnodes, rdzv_endpoint)
    _check_method(method, given, tracker, launch)
    taught = _distill_settings(method, distill)
    sink = _open_tracker(tracker, launch is None)
    world = launch.world_size if launch is not None else None
    try:
        if taught is not None:  # it plans its own start: a new model when init_from is absent
            # with nproc the teacher is only checked here, on the CPU: each process loads its own
            where = "cpu" if launch is not None else None
            job = plan_distill(r, taught, cfg, lora_flags, world_size=world, teacher_device=where)
        else:
            job = plan_finetune(r, lora=cfg, lora_flags=lora_flags, world_size=world)
        policy = _policy(job, method, given)
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    loss = getattr(job, "loss", None) if launch is None else None  # None: the checked teacher freed here
    again = _finetune_options(method, cfg, lora_flags, taught)
    given = dict(policy=policy, request=r, sink=sink, eval_tasks=names, loss=loss)
    return Training(job.plan, job.trainable, launch, **given, command="finetune", command_options=again)


def train(
    config: str | Path | dict[str, Any] | TrainConfig | None = None,
    *,
    callback: Callable[[Event], None] | Display | None = None,
    **options: Any,
) -> TrainResult:
    """Plan a run and train it: plan_training(config, **options).run(callback)."""
    return plan_training(config, **options).run(callback)


def finetune(
    config: str | Path | dict[str, Any] | TrainConfig | None = None,
    *,
    callback: Callable[[Event], None] | Display | None = None,
    **options: Any,
) -> Any:
    """Plan a fine-tuning run and train it: plan_finetuning(config, **options).run(callback)."""
    return plan_finetuning(config, **options).run(callback)


# finetune's methods beyond sft, each with the settings it takes (the CLI's options of the same names); distill
# takes its own, plan_finetuning's distill= (DistillSettings)
METHOD_SETTINGS = {
    "dpo": ("beta", "loss_type", "rpo_alpha"),
    "grpo": ("group_size", "kl", "reward", "max_new_tokens", "rollout_temperature", "grpo_updates"),
    "distill": (),
}
TRAINER_METHODS = ("sft", "distill")  # trained by the trainer's loop (and logged by a tracker)


def _check_method(method: str, given: dict[str, Any], tracker: str | None, launch: Launch | None = None) -> None:
    """The method known, its settings its own, no tracker where it logs nothing, and one process where its loop
    runs in one only (DPO's and GRPO's)."""
    from nanogpt_cli.training.distributed import launched_size

    if method != "sft" and method not in METHOD_SETTINGS:
        raise NanoGPTError(f"unknown --method {method!r}; use sft, {', '.join(METHOD_SETTINGS)}")
    if method not in TRAINER_METHODS and (launch is not None or launched_size() > 1):
        how = "drop --nproc" if launch is not None else "start it without torchrun"
        raise NanoGPTError(f"--method {method} trains in one process only; {how}")
    stray = [k for k in given if k not in METHOD_SETTINGS.get(method, ())]
    if stray:
        raise NanoGPTError(f"--{stray[0].replace('_', '-')} has no effect with --method {method}; drop it")
    if method not in TRAINER_METHODS and tracker:
        raise NanoGPTError(
            f"--tracker does not log --method {method} runs; drop it (the run folder's metrics file has every value)"
        )


def _policy(job: Any, method: str, given: dict[str, Any]) -> Any:
    """method's run over the planned job (its data read and its settings checked), or None for sft, whose plan
    is checked to be one sft can train."""
    if method == "distill":  # the trainer's loop, with plan_distill's loss hook
        return None
    if method == "sft":
        objective = (job.plan.finetune or {}).get("objective")
        if objective is not None:
            raise NanoGPTError(f"{job.plan.run_dir} is a --method {objective} run; resume it with --method {objective}")
        wanted = {"preference": "dpo", "prompts": "grpo"}.get(job.plan.dataset.get("format"))
        if wanted:
            raise NanoGPTError(
                f"{job.plan.train.data} is a {job.plan.dataset['format']} dataset; train on it with --method {wanted}"
            )
        return None
    if method == "dpo":
        from nanogpt_cli.training.dpo import DPO

        return DPO(job, given)
    from functools import partial

    from nanogpt_cli.training.grpo import GRPO

    return GRPO(job, partial(engine_rollout, vocab_size=job.plan.dataset.get("vocab_size")), given)


def _distill_settings(method: str, distill: Any) -> DistillSettings | None:
    """method "distill"'s settings (a dict given: its values checked), or None for another method, which takes
    none of them."""
    from nanogpt_cli.training.distill import FLAGS, DistillSettings

    if isinstance(distill, dict):
        unknown = sorted(set(distill) - set(FLAGS))
        if unknown:
            raise NanoGPTError(f"distill takes {', '.join(FLAGS)}, got {', '.join(unknown)}")
        distill = DistillSettings(**{k: v for k, v in distill.items() if v is not None})
    if distill is not None and isinstance(distill.teacher, Path):  # recorded in the run's config.json as text
        distill = dataclasses.replace(distill, teacher=str(distill.teacher))
    elif distill is not None and not isinstance(distill, DistillSettings):
        raise NanoGPTError(f"distill must be a DistillSettings or a dict of its values, got {distill!r}")
    if method == "distill":
        return distill or DistillSettings()
    if distill is not None and distill.given():
        raise NanoGPTError(f"{', '.join(FLAGS[k] for k in distill.given())} go with --method distill")
    return None


def _finetune_options(method: str, lora: Any, lora_flags: set[str] | None, taught: Any) -> dict[str, Any]:
    """finetune's own options that give each launched process the same run (by the CLI's names): the method,
    the LoRA values given and the distillation's."""
    from nanogpt_cli.training.distill import FLAGS

    options: dict[str, Any] = {"method": None if method == "sft" else method}
    if lora is not None:
        values = {k: v for k, v in lora.to_dict().items() if lora_flags is None or k in lora_flags}
        options |= {f"lora_{k}": ",".join(v) if k == "targets" else v for k, v in values.items()}
    options["lora"] = lora is not None
    for name, value in (taught.given() if taught is not None else {}).items():
        options[FLAGS[name].removeprefix("--").replace("-", "_")] = value
    return options


def _lora_config(lora: Any, resume: bool) -> tuple[LoRAConfig | None, set[str] | None]:
    """(the LoRA config, the fields given) from plan_finetuning's lora; on a resume, True is the run's own."""
    from nanogpt_cli.lora import DEFAULT_TARGETS, LoRAConfig

    if not lora:
        return None, None
    if lora is True:
        return (None if resume else LoRAConfig()), None
    if isinstance(lora, LoRAConfig):
        return lora, None
    if not isinstance(lora, dict):
        raise NanoGPTError(f"lora must be True, a LoRAConfig or a dict of its values, got {lora!r}")
    values = dict(lora)
    targets = values.pop("targets", None)
    targets = DEFAULT_TARGETS if targets is None else ((targets,) if isinstance(targets, str) else tuple(targets))
    try:
        return LoRAConfig(**values, targets=targets), set(lora)
    except TypeError:
        raise NanoGPTError(f"lora takes r, alpha, dropout and targets, got {', '.join(sorted(lora))}") from None


def _run_request(config: Any, model: Any, request: RunRequest | None, options: dict[str, Any]) -> RunRequest:
    """The RunRequest of a call: request (or an empty one) with the config's values and the options' flags
    merged into its flags, and the options that are its own fields set."""
    from nanogpt_cli.training.request import OPTIONS

    values, config_file = _config_values(config, model)
    own = {f.name: options.pop(f.name) for f in OPTIONS if f.name in options}
    if own.get("out") is not None:
        own["out"] = Path(own["out"])
    if own.get("init_from") is not None:
        own["init_from"] = str(own["init_from"])
    if config_file is not None:
        own["config"] = config_file
    return (request or RunRequest()).but(flags={**values, **options}, **own)


def _eval_task_names(eval_tasks: str | list[str] | None) -> list[str] | None:
    """eval_tasks' names, checked before anything trains (and lm-eval installed)."""
    if eval_tasks is None:
        return None
    from nanogpt_cli.errors import require
    from nanogpt_cli.inference.tasks import check_options

    names = check_options([eval_tasks] if isinstance(eval_tasks, str) else list(eval_tasks), None, None, None)
    require("lm_eval", "eval", "scoring lm-eval tasks", package="lm-eval")
    return names


def _set_threads(threads: int | None) -> None:
    from nanogpt_cli.device import set_threads

    set_threads(threads)


def _open_tracker(tracker: str | None, here: bool) -> Any:
    """The tracker's sink where this process trains and speaks for the run (rank 0); elsewhere only checked, so
    that an unknown one or a missing extra is refused before anything starts. here: this process trains."""
    import os

    from nanogpt_cli.training.trackers import open_tracker

    if not tracker:
        return None
    if os.environ.get("RANK", "0") != "0":
        return None
    sink = open_tracker(tracker)
    if here:
        return sink
    sink.close()
    return None


def _config_values(config: Any, model: Any) -> tuple[dict[str, Any], Path | None]:
    """(flags, the config file) from what plan_training was given as its config."""
    from nanogpt_cli.config import GPTConfig, TrainConfig

    values: dict[str, Any] = {}
    config_file = None
    if isinstance(config, Path) or (isinstance(config, str) and config.endswith(".toml")):
        config_file = Path(config)
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
    return values, config_file


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
) -> PrepareResult | ChatPrepareResult | RowsPrepareResult:
    """Tokenize a source into DATA_DIR/NAME, as `nanogpt prepare` does -> PrepareResult. source: a text file,
    folder or glob, .jsonl/.json/.parquet/.csv, hf:OWNER/NAME or "shakespeare"; tokenizer: gpt2, char, byte, a
    tiktoken name or a trained tokenizer's NAME (in tokenizers_dir). options: PrepareOptions' fields
    (val_fraction, max_docs, max_tokens, num_proc, resume, ...); progress(PrepareProgress) now and then.
    format="chat": a .jsonl of conversations with loss masks -> ChatPrepareResult (options: val_fraction,
    chat_template, strict, shard_tokens); "preference" (prompt/chosen/rejected rows, for DPO) or "prompts" (prompt
    rows with an answer, for GRPO) -> RowsPrepareResult (options: val_fraction, chat_template, strict). Ctrl-C
    during a text prepare raises PrepareStopped, whose `kept` says what was kept and how to continue it."""
    from nanogpt_cli.files import check_creatable
    from nanogpt_cli.tokenizer import trained_or_named

    check_creatable(data_dir, "--data-dir")
    tokenizer = trained_or_named(tokenizer, Path(tokenizers_dir))  # a trained tokenizer's NAME is its folder
    if format in ("chat", "preference", "prompts"):
        if progress is not None:
            raise NanoGPTError('progress is reported for format="text" only')
        if options.get("chat_template") is not None:
            options["chat_template"] = str(options["chat_template"])
    if format == "chat":
        from nanogpt_cli.data.chat import prepare_chat

        _check_options(options, [p for p in inspect.signature(prepare_chat).parameters if p not in ("source", "name")])
        return prepare_chat(str(source), name, tokenizer=tokenizer, data_dir=str(data_dir), **options)
    if format in ("preference", "prompts"):
        from nanogpt_cli.data.preference import prepare_rows

        known = [p for p in inspect.signature(prepare_rows).parameters if p not in ("source", "name", "kind")]
        _check_options(options, known)
        return prepare_rows(str(source), name, kind=format, tokenizer=tokenizer, data_dir=str(data_dir), **options)
    if format != "text":
        raise NanoGPTError(f"unknown --format {format!r}; use text, chat, preference or prompts")
    from nanogpt_cli.data.pipeline import PrepareOptions, interrupted_prepare
    from nanogpt_cli.data.pipeline import prepare as prepare_data

    _check_options(options, [f.name for f in dataclasses.fields(PrepareOptions) if f.name not in ("source", "name")])
    try:
        return prepare_data(
            str(source), name, tokenizer=tokenizer, data_dir=Path(data_dir), progress=progress, **options
        )
    except KeyboardInterrupt:  # the partial prepare is kept: say where and how to continue it
        raise PrepareStopped(interrupted_prepare(Path(data_dir), name)) from None


def label_with_teacher(
    name: str,
    teacher: str | Path,
    *,
    data_dir: str | Path = "data",
    top_k: int | None = None,
    temperature: float | None = None,
    context: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """What `prepare --teacher` does once the dataset is prepared: the teacher (any source load() takes, sharing
    the dataset's tokenizer) reads the train split in chunks of `context` tokens and its top_k next-token
    probabilities at temperature (default 32 and 1) are written beside the shards, which finetune's
    method="distill" then reads without a live teacher. Returns what meta.json records (top_k, temperature,
    bytes_per_token, seconds, ...); progress(tokens done, tokens in all) now and then."""
    from nanogpt_cli.training.distill import DEFAULTS, DistillSettings, label_dataset

    DistillSettings(top_k=top_k, temperature=temperature)  # checked as finetune checks them
    top_k = DEFAULTS["top_k"] if top_k is None else top_k
    temperature = DEFAULTS["temperature"] if temperature is None else temperature
    return label_dataset(Path(data_dir), name, str(teacher), top_k, temperature, context, on_progress=progress)


class PrepareStopped(KeyboardInterrupt):
    """Ctrl-C stopped a prepare; `kept` says what it kept and how to continue it (None: nothing was kept)."""

    def __init__(self, kept: str | None):
        super().__init__(kept or "interrupted")
        self.kept = kept


def train_tokenizer(
    source: str | Path,
    name: str,
    *,
    vocab_size: int = 8192,
    pattern: str = "gpt4",
    special_tokens: list[str] | None = None,
    max_chars: int | None = None,
    tokenizers_dir: str | Path = "tokenizers",
    text_column: str = "text",
    subset: str | None = None,
    split: str = "train",
    streaming: bool = False,
    force: bool = False,
    progress: Callable[[Any], None] | None = None,
) -> TokenizerTrainResult:
    """Train a byte-level BPE tokenizer on a source into TOKENIZERS_DIR/NAME, as `nanogpt tokenizer train` does;
    prepare(..., tokenizer=NAME) then encodes with it. pattern: the pre-tokenization regex (gpt2, gpt4, gpt4o,
    nanochat); special_tokens: more besides <|endoftext|>, which always comes first; max_chars: train on the first
    N characters only; progress(PrepareProgress) now and then. The result's vocabulary may be smaller than
    vocab_size where the text runs out of pairs to merge (its requested_vocab_size says what was asked)."""
    from nanogpt_cli.data.tokenizer_train import train_tokenizer as train
    from nanogpt_cli.tokenizer import EOT

    specials = [EOT] + [s for s in (special_tokens or []) if s != EOT]
    return train(
        str(source),
        name,
        vocab_size,
        pattern,
        specials,
        max_chars,
        Path(tokenizers_dir),
        text_column=text_column,
        subset=subset,
        split=split,
        streaming=streaming,
        force=force,
        progress=progress,
    )


def compare_tokenizers(
    source: str | Path,
    *,
    sizes: tuple[int, ...] | None = None,
    sample_chars: int | None = None,
    text_column: str = "text",
    encoding: str = "utf-8",
) -> TokenizerComparison:
    """How many tokens each tokenizer makes of a local source, as `nanogpt prepare SOURCE --compare` says: char,
    byte, gpt2 and BPEs of `sizes` tokens (default 1024, 4096 and 16384), counted on its first `sample_chars`
    characters (default a million; each BPE is trained on the sample's first half and counted on its second) and
    scaled to the whole. Its rows: name, vocab_size, tokens, bytes_per_token."""
    from nanogpt_cli.data.tokenizer_compare import BPE_SIZES, SAMPLE_CHARS
    from nanogpt_cli.data.tokenizer_compare import compare_tokenizers as count

    sizes = BPE_SIZES if sizes is None else tuple(sizes)
    sample_chars = SAMPLE_CHARS if sample_chars is None else sample_chars
    return count(str(source), sizes, sample_chars, text_column=text_column, encoding=encoding)


def _check_options(options: dict[str, Any], known: list[str]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise NanoGPTError(f"unknown option(s) {', '.join(unknown)}; these exist: {', '.join(known)}")


def export(
    source: str | Path | LoadSpec,
    out: str | Path,
    format: str = "hf",
    *,
    last: bool = False,
    force: bool = False,
    quant: str | None = None,
    merge: bool = False,
    base: str | Path | None = None,
) -> ExportResult:
    """Write a run (or weights file, or Hugging Face model; a LoadSpec's source and last) as a Hugging Face folder
    (format="hf"), one GGUF file (format="gguf", quant: f32, f16, bf16, q8_0, ...) or a LoRA run's PEFT adapter
    (format="peft", for `base`), as `nanogpt export` does."""
    from nanogpt_cli.interop.export import export as export_run

    spec = load_spec(source, **({"last": True} if last else {}))
    return export_run(spec.source, format, out, last=spec.last, force=force, quant=quant, merge=merge, base=base)


# --- serving, describing, inspecting ---


def serve(options: ServeOptions, on_ready: Callable[[Started], None] | None = None) -> None:
    """What `nanogpt serve` does: the OpenAI-compatible server for options.load's model (a LoadSpec) until Ctrl-C or
    SIGTERM; on_ready(Started) once it listens (its URL, the KV cache's bytes per token). Needs the `serve` extra.

        nanogpt.serve(ServeOptions(LoadSpec("checkpoints/shk", device="cpu"), port=0), on_ready=print)
    """
    from nanogpt_cli.serve import serve as run_server

    run_server(options, on_ready)


def info(source: str | Path) -> Info:
    """What `nanogpt info SOURCE` shows: a run folder (or a run's name in checkpoints/), a weights file, a GGUF file
    or a Hugging Face folder described: config, parameters, FLOPs per token, tokenizer, losses, files. A run whose
    weights are damaged or not written yet is described too (that is what info is for), so the source is not
    loaded."""
    from nanogpt_cli.inspect.catalog import inspect_path
    from nanogpt_cli.runs.rundir import find_run, missing_source

    path = Path(find_run(source))
    if not path.exists():
        raise NanoGPTError(missing_source(path))
    return inspect_path(path)


def system_info() -> dict[str, Any]:
    """What `nanogpt info --system` shows: torch, the threads, the CPU and its features, our decode kernels (built
    here if they were not) and where they are kept, and the devices."""
    from nanogpt_cli.inspect.catalog import system_info as describe

    return describe()


def kernel_note(model: Model | None = None) -> str | None:
    """Our decode kernels' build in one sentence, once per process, where this process built them (its time and
    instruction set) or failed to (the compiler's last error); None where it built nothing or the note was taken.
    model: one about to decode; where its backend is our kernels' (`cpu`), they are built now (the first decode
    would anyway), so that the note can come before its output. A model on `backend="torch"` builds nothing."""
    import sys

    if model is not None and model.backend == "cpu":
        from nanogpt_cli.inference.backends import native

        native.available()
    native = sys.modules.get("nanogpt_cli.inference.backends.native")
    return native.take_note() if native is not None else None


# --- looking at runs ---


def list_runs(folder: str | Path = "checkpoints") -> list[RunSummary]:
    """The runs in a folder (or the one run it is), newest first, as `nanogpt runs` lists them: each a RunSummary
    (name, dataset, size, progress, best val loss, last update, status; to_dict() for JSON)."""
    from nanogpt_cli.inspect.catalog import list_runs as listed

    return listed(Path(folder))


def report(run: str | Path) -> str:
    """A run's report card as Markdown, as `nanogpt report RUN` prints it: the one written at its end (report.md),
    or one made now from its folder (without samples) for a run that has none yet."""
    from nanogpt_cli.inspect.report import report_of
    from nanogpt_cli.runs.rundir import RunDir

    return report_of(RunDir(run))[0]


def plot(
    runs: str | Path | list[str | Path],
    out: str | Path | None = None,
    *,
    width: int | None = None,
    height: int | None = None,
    color: bool = True,
) -> Path | str:
    """The train and val loss curves of one run or several (folders, or run names in checkpoints/), as `nanogpt
    plot` draws them: into `out` (.png, .svg or .pdf, with matplotlib) -> its path, or without `out` as text for
    a terminal (with plotext; width and height in characters) -> the text. Both need the `plot` extra."""
    from nanogpt_cli.files import check_creatable
    from nanogpt_cli.inspect.plot import terminal_plot, write_png
    from nanogpt_cli.runs.rundir import find_run

    folders = [Path(find_run(r)) for r in ([runs] if isinstance(runs, (str, Path)) else runs)]
    if out is None:
        return terminal_plot(folders, width=width, height=height, color=color)
    out = Path(out)
    check_creatable(out.parent if str(out.parent) else Path("."), "the folder of --out")
    return write_png(folders, out)


@dataclass
class Comparison:
    """Runs side by side, as `nanogpt report A B` prints them."""

    names: list[str]  # the runs' folder names, one column each
    rows: list[tuple[str, list[str]]]  # (a figure's label, its value for each run)


def compare(runs: list[str | Path]) -> Comparison:
    """Several runs' report cards side by side: one row per figure, one column per run."""
    from nanogpt_cli.inspect.report import compare as compare_runs
    from nanogpt_cli.runs.rundir import RunDir

    return Comparison(*compare_runs([RunDir(r) for r in runs]))


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
