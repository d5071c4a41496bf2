"""Planning a run: every input of a run resolved and checked once, before anything is written (a fresh run,
a resume that must agree with the saved one, or a start from other weights).

    plan = plan_run(RunRequest({"preset": "cpu-char", "data": "shk"}, out=Path("checkpoints/shk"))); print(plan.notes)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from nanogpt_cli.config import (
    Dtype,
    GPTConfig,
    Resume,
    TrainConfig,
    build_configs,
    flag,
    parse_value,
    preset_values,
    show_value,
    split_values,
)
from nanogpt_cli.data import load_meta
from nanogpt_cli.device import resolve_device
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.loading import is_converted, load_model
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import read_metadata
from nanogpt_cli.runs.rundir import RunDir, resolve_weights
from nanogpt_cli.tokenizer import describe_difference, same_tokenizer
from nanogpt_cli.training.auto import AUTO, AutoChoice, Probed, plan_auto, wants_auto
from nanogpt_cli.training.clock import EVAL_SHARE
from nanogpt_cli.training.distributed import check_world, launched_size
from nanogpt_cli.training.request import RunRequest

# --seq-len's default for a converted model (hf:NAME, a Hugging Face folder, a GGUF file, or a run started from one)
# whose context is longer: such contexts are long (SmolLM2's 8,192 tokens), a batch of them costs that many tokens a
# row, and fine-tuning data rarely needs them (TRL's SFT also trains at 1,024 by default)
CONVERTED_SEQ_LEN = 1024
# A converted model fine-tuned on a CPU (a laptop's): TrainConfig's --batch-size 12 and --eval-iters 20 make an update
# of 12 sequences and an evaluation of 480, which for SmolLM2-135M on 2 busy cores took 193 s an update, over 8
# minutes for the first evaluation, and 12.7 GB. There an update works through about CPU_UPDATE_TOKENS tokens of a 135M
# model (rows of --seq-len tokens, so a larger model gets fewer rows, never fewer than one), and an evaluation
# scores CPU_EVAL_ITERS batches of them per split: a few updates' time, and memory a few times the weights'.
CPU_UPDATE_TOKENS = 1024
CPU_EVAL_ITERS = 2
CPU_REFERENCE_WEIGHTS = 135_000_000  # the model whose update CPU_UPDATE_TOKENS tokens make (SmolLM2-135M's size)


@dataclass
class RunPlan:
    """What a run needs, resolved and checked before anything is written."""

    model: GPTConfig
    train: TrainConfig
    run_dir: RunDir
    dataset: dict[str, Any]  # the prepared dataset's meta.json
    init_weights: Path | None = None  # --init-from: the weights file to start from
    init_model: GPT | None = None  # --init-from a Hugging Face model: its weights, converted once while planning
    init_model_used: bool = False  # a run copied init_model and let it go: another run of this plan must refuse
    resume: bool = False
    force: bool = False
    step: int = 0  # where the run starts: 0, or the step a resumed run stopped at
    notes: list[str] = field(default_factory=list)  # things the user should know before it starts (warnings)
    time_spent: float | None = None  # a resumed run that --max-time ended: the --max-time it ended under
    # a fine-tuning run (finetune.py): what config.json records under "finetune"; its "weights" entries go into
    # the weights files' metadata (a LoRA run: its adapter config and its base)
    finetune: dict[str, Any] | None = None
    changes: list[Change] = field(default_factory=list)  # training values a resume changes, from its step on
    hf_family: str | None = None  # --init-from a Hugging Face model or GGUF file: its family, which exports write back
    # --init-from as config.json records it, {"source", "last", "path"}: a resume given it again checks it is the same
    init_from: dict[str, Any] | None = None
    threads: int | None = None  # a resumed CPU run: the threads it last trained with (None: not known)
    auto: AutoChoice | None = None  # --preset auto: what it chose and why (training/auto.py)
    # --max-time with no --eval-iters given: the seconds one evaluation may take (the trainer keeps the batches that
    # fit); None: every evaluation scores all of --eval-iters
    eval_limit_s: float | None = None

    @property
    def seq_len(self) -> int:
        """The tokens of each training sequence: --seq-len, else the model's context."""
        return self.train.seq_len or self.model.block_size

    @property
    def length_flag(self) -> str:
        """The flag that shortens the training sequences: --block-size for a new model without --seq-len, else
        --seq-len (a resumed or started-from model keeps its context)."""
        new_model = (
            not self.resume and self.init_weights is None and self.init_model is None and not self.init_model_used
        )
        return "--block-size" if new_model and self.train.seq_len is None else "--seq-len"

    @property
    def complete(self) -> bool:
        """A resumed run that has already done its --max-iters, or spent a --max-time not raised since."""
        return self.resume and (self.step >= self.train.max_iters or self.time_over)

    @property
    def time_over(self) -> bool:
        return self.time_spent is not None and (self.train.max_time or 0) <= self.time_spent


def values_from(preset: str | None, auto: AutoChoice | None = None) -> dict[str, Any]:
    """A preset's values; auto's (a resumed auto run: none, its values are saved)."""
    if auto is not None:
        return dict(auto.values)
    if preset == AUTO:
        return {}
    return preset_values(preset) if preset else {}


def default_run_dir(data: str) -> Path:
    return Path("checkpoints") / f"{data}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def padded_vocab_size(meta: dict) -> int:
    """The model's vocabulary for a dataset: GPT-2's 50,257 tokens padded to 50,304, a multiple of 64, so the
    embedding and LM-head matmuls are aligned for tensor cores (as nanoGPT does); the padding rows are never
    sampled, scored or exported. Other vocabularies as they are."""
    if meta["tokenizer"].get("name") == "gpt2":
        return -(-meta["vocab_size"] // 64) * 64
    return meta["vocab_size"]


def plan_run(
    request: RunRequest, world_size: int | None = None, on_probe: Callable[[Probed], None] | None = None
) -> RunPlan:
    """The effective configs of a run. Fresh: preset < config file < flags, with the vocabulary from the dataset.
    Resume: the saved run's configs; the same preset, file and flags may be given again, and each field's
    Resume rule (config.py) says what they may change. --init-from: the checkpoint's architecture (dropout may
    change; best weights unless request.last), training fields as for a fresh run. `preset` and `out` may come from
    the flags or the config file (flags win). world_size: the processes it trains in (default: torchrun's
    WORLD_SIZE, or 1); a preset's (or the default) --gradient-accumulation-steps is raised to a multiple of it.
    --preset auto (the default for a fresh run given --max-time and no model shape) probes the device first,
    telling on_probe of each shape it times."""
    r = request
    world_size = launched_size() if world_size is None else world_size
    values = r.values()
    preset = values.pop("preset", None)
    out = r.out or values.pop("out", None)
    values.pop("out", None)
    if r.resume and out is None:
        raise NanoGPTError("--resume needs --out: the run folder to continue")
    run_dir = RunDir(out or default_run_dir(values.get("data") or "run"))
    run_dir.check(r.resume, r.force)
    split_values(values)  # unknown keys are refused first
    if r.resume:
        if r.init_from is not None:  # the command that started the run, given again: accepted when it is the same
            check_same_start(run_dir, r.init_from, r.last)
        return _plan_resume(run_dir, preset, values, world_size)
    auto = None
    if wants_auto(preset, values, r.init_from, r.resume) and values.get("data"):
        meta = load_meta(Path(parse_value("data_dir", values.get("data_dir", "data"))), values["data"])
        preset, auto = AUTO, plan_auto(meta, values, world_size, on_probe)
    return _plan_fresh(run_dir, preset, values, world_size, r, auto)


def _plan_fresh(
    run_dir: RunDir,
    preset: str | None,
    given: dict[str, Any],
    world_size: int,
    request: RunRequest,
    auto: AutoChoice | None = None,
) -> RunPlan:
    """A new run (from scratch or from --init-from's weights): `given` holds the config file's and the flags'
    values, which win over the preset's (or auto's)."""
    init_from, init_last = request.init_from, request.last
    explicit_model, _ = split_values(given)
    model_values, train_values = split_values({**values_from(preset, auto), **given})
    notes: list[str] = []
    adapted = _adapt_accumulation(train_values, given, world_size, TrainConfig.gradient_accumulation_steps)
    if adapted:
        n_micro, n = adapted
        where = f"--preset {preset}'s" if "gradient_accumulation_steps" in values_from(preset, auto) else "the default"
        notes.append(
            f"--gradient-accumulation-steps {n} instead of {where} {n_micro}: a multiple of the "
            f"{world_size} processes ({n // world_size} micro-batch{'es' if n > world_size else ''} each per update)"
        )
    _, train_cfg = build_configs(train_values)
    if not train_cfg.data:
        raise NanoGPTError("--data is required: the name of a dataset made by `nanogpt prepare`")
    meta = load_meta(Path(train_cfg.data_dir), train_cfg.data)
    init: dict[str, Any] = {}  # init_weights or init_model, for the plan

    if init_from is not None:
        model_values, init, note = _plan_init(init_from, init_last, meta, train_cfg.data, model_values, explicit_model)
        notes.append(note)
    elif "vocab_size" not in model_values:
        model_values["vocab_size"] = padded_vocab_size(meta)
    model_cfg, train_cfg = build_configs({**model_values, **train_values})
    if model_cfg.vocab_size < meta["vocab_size"]:
        raise NanoGPTError(
            f"--vocab-size {model_cfg.vocab_size:,} is smaller than the {meta['vocab_size']:,} tokens "
            f"of dataset '{train_cfg.data}'; drop it to use the dataset's, or give at least that"
        )
    train_cfg = _without_unneeded(train_cfg, model_cfg, given, preset, init_from, notes)
    check_seq_len(train_cfg, model_cfg, meta, init_from)
    converted = init_from is not None and (is_converted(init_from) or "hf_family" in init)
    windows = meta.get("format") not in ("preference", "prompts")  # DPO and GRPO score each sequence whole
    if converted and windows and train_cfg.seq_len is None and model_cfg.block_size > CONVERTED_SEQ_LEN:
        train_cfg = dataclasses.replace(train_cfg, seq_len=CONVERTED_SEQ_LEN)
        notes.append(
            f"--seq-len {CONVERTED_SEQ_LEN}: training sequences of {CONVERTED_SEQ_LEN:,} tokens, the default for a "
            f"converted model; it keeps its context of {model_cfg.block_size:,} (give --seq-len "
            f"{model_cfg.block_size} to train at all of it)"
        )
    if converted and windows and resolve_device(train_cfg.device).type == "cpu":
        train_cfg = _cpu_defaults(train_cfg, model_cfg, {**values_from(preset), **given}, notes)
    check_world(train_cfg, world_size)
    notes += _warnings(model_cfg, train_cfg)
    started = None if init_from is None else start_record(init_from, init_last)
    if auto is not None:
        notes += auto.notes
    force = request.force
    limit = EVAL_SHARE * train_cfg.max_time if train_cfg.max_time is not None and "eval_iters" not in given else None
    return RunPlan(
        model_cfg, train_cfg, run_dir, meta, force=force, notes=notes, init_from=started, auto=auto,
        eval_limit_s=limit, **init,
    )  # fmt: skip


def start_record(init_from: str, last: bool) -> dict[str, Any]:
    """--init-from as config.json records it: as given, and where it pointed then (see check_same_start)."""
    return {"source": init_from, "last": last, "path": _weights_identity(init_from, last)}


def check_same_start(run_dir: RunDir, init_from: str, last: bool) -> None:
    """--resume with --init-from: the command that started the run, given again. Accepted when it names the
    weights the run started from (as given then, or the same file or folder now); the run continues with its own
    weights either way, so anything else is refused rather than silently not used."""
    config = run_dir.read_config()
    record = config.get("init_from")
    if record is None and config.get("finetune", {}).get("init_from"):  # a fine-tune records it there
        finetune = config["finetune"]
        record = {"source": finetune["init_from"], "last": finetune.get("init_last", False)}
    given = f"--init-from {init_from}" + (" --last" if last else "")
    if not record or not record.get("source"):
        raise NanoGPTError(
            f"{run_dir} was not started from other weights, and --resume continues it with its own; drop {given}"
        )
    if bool(record.get("last")) == last:
        if record["source"] == init_from:
            return
        known = record.get("path") or _weights_identity(record["source"], bool(record.get("last")))
        if known is not None and known == _weights_identity(init_from, last):
            return
    started = f"--init-from {record['source']}" + (" --last" if record.get("last") else "")
    raise NanoGPTError(
        f"{given} is not what {run_dir} was started from ({started}); --resume continues the run with its own "
        "weights: drop --init-from, or give the one it was started with"
    )


def _weights_identity(source: str, last: bool) -> str | None:
    """What a --init-from value points at, to compare two spellings of it: hf:NAME, or the weights file or model
    folder resolved to an absolute path; None when it names nothing now."""
    if source.startswith("hf:"):
        return source
    try:
        path = Path(source) if is_converted(source) else resolve_weights(source, last=last)
        return str(path.resolve()) if path.exists() else None
    except (NanoGPTError, OSError):
        return None


def matmul_weights(cfg: GPTConfig) -> int:
    """The weights each token is multiplied by, from the config alone: every block's projections and the head."""
    attention = cfg.n_embd * cfg.head_size * 2 * (cfg.n_head + cfg.kv_heads)
    mlp = (3 if cfg.gated else 2) * cfg.n_embd * cfg.hidden_size
    return cfg.n_layer * (attention + mlp) + cfg.vocab_size * cfg.n_embd


def cpu_rows(cfg: GPTConfig, seq_len: int, most: int) -> int:
    """A converted model's rows per micro-batch on a CPU: about CPU_UPDATE_TOKENS tokens of a
    CPU_REFERENCE_WEIGHTS model's work, from 1 to `most` rows of seq_len tokens."""
    tokens = CPU_UPDATE_TOKENS * CPU_REFERENCE_WEIGHTS // matmul_weights(cfg)
    return max(1, min(most, tokens // seq_len))


def _cpu_defaults(train_cfg: TrainConfig, model_cfg: GPTConfig, said: dict[str, Any], notes: list[str]) -> TrainConfig:
    """A converted model on a CPU: --batch-size (cpu_rows) and --eval-iters (CPU_EVAL_ITERS) where neither the
    command, its config file nor its preset says them, with one note saying what was chosen."""
    seq_len = train_cfg.seq_len or model_cfg.block_size
    chosen = {}
    if "batch_size" not in said:
        chosen["batch_size"] = cpu_rows(model_cfg, seq_len, train_cfg.batch_size)
    if "eval_iters" not in said:
        chosen["eval_iters"] = min(CPU_EVAL_ITERS, train_cfg.eval_iters)
    chosen = {k: v for k, v in chosen.items() if v != getattr(train_cfg, k)}
    if not chosen:
        return train_cfg
    train_cfg = dataclasses.replace(train_cfg, **chosen)
    rows, batches = train_cfg.batch_size, train_cfg.eval_iters
    notes.append(
        ", ".join(f"--{flag(k)} {v}" for k, v in chosen.items())
        + f": a converted model's defaults on a CPU, updates of {rows} row{'s' if rows > 1 else ''} of {seq_len:,} "
        f"tokens and evaluations of {batches} such batch{'es' if batches > 1 else ''} a split (give "
        + " or ".join(f"--{flag(k)}" for k in chosen)
        + " to choose)"
    )
    return train_cfg


def check_seq_len(train_cfg: TrainConfig, model_cfg: GPTConfig, meta: dict[str, Any], source: str | None) -> None:
    """--seq-len: at most the model's context (source: the weights or run whose model it is, None for a new one),
    and only where training reads windows (DPO and GRPO score each sequence whole)."""
    n, context = train_cfg.seq_len, model_cfg.block_size
    if n is None:
        return
    method = {"preference": "dpo", "prompts": "grpo"}.get(meta.get("format"))
    if method is not None:
        raise NanoGPTError(
            f"--seq-len has no effect with --method {method}, which scores each sequence whole (padded to the "
            "longest of its batch); drop it"
        )
    if n > context:
        if source is None:
            raise NanoGPTError(
                f"--seq-len {n} is longer than the model's context (--block-size {context}); give at most {context}, "
                "or a larger --block-size"
            )
        raise NanoGPTError(
            f"--seq-len {n} is longer than the context of {source} (--block-size {context}), which it keeps; give "
            f"--seq-len {context} or less"
        )


def _without_unneeded(
    train_cfg: TrainConfig,
    model_cfg: GPTConfig,
    given: dict[str, Any],
    preset: str | None,
    source: str | None,
    notes: list[str],
) -> TrainConfig:
    """The training values this model has no use for (what their field Needs does not hold): a given one is
    refused (source: the weights whose model it is, or None for a new one), a preset's set aside with a note."""
    for f in dataclasses.fields(TrainConfig):
        needs, value = f.metadata.get("needs"), getattr(train_cfg, f.name)
        if needs is None or value == f.default or needs.holds(model_cfg):
            continue
        if f.name in given:
            raise needs.refuse(value, source)
        notes.append(needs.aside.format(preset=preset, given=show_value(value)))
        train_cfg = dataclasses.replace(train_cfg, **{f.name: f.default})
    return train_cfg


def _adapt_accumulation(
    train_values: dict[str, Any], given: dict[str, Any], world_size: int, default: int | None = None
) -> tuple[int, int] | None:
    """A preset's --gradient-accumulation-steps (or, where train_values has none, `default`) raised in place to
    the next multiple of the processes, so every process runs the same share of each update: (it, the new value),
    or None when it was given (check_world refuses one that does not divide) or needs no change."""
    name = "gradient_accumulation_steps"
    n_micro = train_values.get(name, default)
    if name in given or n_micro is None or world_size <= 1:
        return None
    adapted = -(-n_micro // world_size) * world_size
    if adapted == n_micro:
        return None
    train_values[name] = adapted
    return n_micro, adapted


def _plan_init(
    init_from: str,
    init_last: bool,
    meta: dict[str, Any],
    data: str,
    model_values: dict[str, Any],
    explicit_model: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """--init-from, checked against the dataset's tokenizer: the model values (the checkpoint's, with only
    dropout from the flags), where the weights come from (init_weights or init_model) and a note saying so."""
    if is_converted(init_from):  # a Hugging Face model or a GGUF file
        init_model, weights_meta = load_model(init_from)
        init, source = {"init_model": init_model}, init_from
    else:
        source = resolve_weights(init_from, last=init_last)
        weights_meta = read_metadata(source)
        init = {"init_weights": source}
        if "lora" in weights_meta:  # a LoRA run's file holds adapters: start from its base with them merged in
            init = {"init_model": load_model(source)[0]}
    theirs, ours = (weights_meta.get("tokenizer") or {}).get("name"), meta["tokenizer"]["name"]
    if theirs != ours and not same_tokenizer(weights_meta.get("tokenizer") or {}, meta["tokenizer"]):
        raise NanoGPTError(
            f"--init-from {init_from} uses the {theirs} tokenizer but dataset "
            f"'{data}' was prepared with {ours}; prepare it with --tokenizer {theirs}"
        )
    differ = describe_difference(
        meta["tokenizer"], weights_meta.get("tokenizer") or {}, f"dataset '{data}'", "the checkpoint"
    )
    if differ:
        raise NanoGPTError(
            f"--init-from {init_from} was trained with another tokenizer than dataset "
            f"'{data}' ({differ}); prepare the data with the checkpoint's tokenizer"
        )
    extra = set(explicit_model) - {"dropout"}
    if extra:
        raise NanoGPTError(
            "--init-from takes the architecture from the checkpoint; drop "
            + ", ".join(f"--{flag(k)}" for k in sorted(extra))
        )
    step, val = weights_meta.get("step"), weights_meta.get("val_loss")  # a Hugging Face model has neither
    known = ([f"step {step}"] if step is not None else []) + (
        [f"val loss {val:.4f}"] if isinstance(val, (int, float)) else []
    )
    note = f"--init-from: starting from {source}" + (f" ({', '.join(known)})" if known else "")
    if weights_meta.get("hf_family"):  # an export of the run writes that family back
        init["hf_family"] = weights_meta["hf_family"]
    return {**weights_meta["config"], **{k: v for k, v in model_values.items() if k == "dropout"}}, init, note


def _warnings(model_cfg: GPTConfig, cfg: TrainConfig) -> list[str]:
    notes = []
    if cfg.warmup_iters >= cfg.max_iters:
        notes.append(
            f"--warmup-iters ({cfg.warmup_iters:,}) is not below --max-iters ({cfg.max_iters:,}): the "
            "learning rate never reaches its peak"
        )
    if cfg.dtype == Dtype.float16 and resolve_device(cfg.device).type == "cpu":
        notes.append(
            "--dtype float16 on the CPU runs the GPU's fp16 path (autocast and grad scaler) and is slow "
            "there; use bfloat16 or float32 for speed"
        )
    return notes


def _plan_resume(run_dir: RunDir, preset: str | None, given: dict[str, Any], world_size: int) -> RunPlan:
    """A resume: the saved run's configs, and what the command says (the one that started the run may be given
    again, preset included) applied by each field's Resume rule; its architecture and dataset are the run's."""
    saved = run_dir.read_config()
    state, notes = run_dir.check_resumable()
    model_said, train_said = split_values({**values_from(preset), **given})
    _check_architecture(run_dir, preset, given, saved["model"], model_said)
    model_cfg, _ = build_configs(saved["model"])
    _adapt_accumulation(train_said, given, world_size)  # a preset's adapts to the world, as when the run started
    if (
        saved["train"].get("seq_len") is None
        and parse_value("seq_len", train_said.get("seq_len")) == model_cfg.block_size
    ):
        train_said.pop("seq_len")  # the context, which the run trains at already: not a change
    resuming = _Resuming(run_dir, preset, given, model_cfg, state.step, notes)
    train_values, changes = _resume_training(resuming, saved["train"], train_said)
    _, train_cfg = build_configs(train_values)
    if state.step < train_cfg.max_iters and train_cfg.stop_at is not None and train_cfg.stop_at <= state.step:
        raise NanoGPTError(
            f"--stop-at {train_cfg.stop_at} is not after the run's step {state.step}; drop it (or "
            "raise it) to continue the run"
        )
    meta = _resumed_dataset(run_dir, saved.get("dataset") or {}, train_cfg, notes)
    if "seq_len" in train_said:  # a saved value was checked when the run was planned
        check_seq_len(train_cfg, model_cfg, meta, str(run_dir))
    check_world(train_cfg, world_size)
    notes += _warnings(model_cfg, train_cfg)
    return RunPlan(
        model_cfg,
        train_cfg,
        run_dir,
        meta,
        resume=True,
        step=state.step,
        notes=notes,
        time_spent=state.max_time_spent,
        changes=changes,
        hf_family=saved.get("hf_family"),
        init_from=saved.get("init_from"),
        threads=state.threads,
    )


@dataclass
class _Resuming:
    """What the Resume rules of a resumed run's fields are applied with."""

    run_dir: RunDir
    preset: str | None
    given: dict[str, Any]  # the config file's and the flags' values (a preset's are not given)
    model: GPTConfig  # the run's architecture
    step: int  # where it continues
    notes: list[str]  # the plan's notes, added to


def _check_architecture(
    run_dir: RunDir, preset: str | None, given: dict[str, Any], saved: dict[str, Any], said: dict[str, Any]
) -> None:
    """The architecture's fields (all Resume.FIXED) that the command says, refused in one sentence where they
    differ from the run's."""
    saved_model = {k: parse_value(k, v) for k, v in saved.items()}
    differ = [k for k, v in said.items() if saved_model.get(k) != parse_value(k, v)]
    if differ:

        def where(k):
            return f"--preset {preset} gives" if k not in given else "given"

        raise NanoGPTError(
            f"--resume takes the architecture from {run_dir}; these differ from it: "
            + ", ".join(f"--{flag(k)} (saved {saved.get(k)!r}, {where(k)} {said[k]!r})" for k in sorted(differ))
        )


def _resume_training(r: _Resuming, saved: dict[str, Any], said: dict[str, Any]) -> tuple[dict[str, Any], list[Change]]:
    """The resumed run's training values and what they change: the saved values, with each value the command
    says applied by its field's Resume rule. The fixed ones are checked first, in their declared order; the
    rest go in flag order."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}

    def rule(name: str) -> Resume | None:
        return fields[name].metadata["resume"] if name in fields else None

    defaults = TrainConfig().to_dict()
    # out: older runs kept it here; an invocation's value is its own
    saved = {k: v for k, v in saved.items() if k != "out" and rule(k) is not Resume.INVOCATION}
    for name in [name for name in fields if name in said and rule(name) is Resume.FIXED]:
        before, after = parse_value(name, saved.get(name, defaults[name])), parse_value(name, said[name])
        if before != after:
            text = fields[name].metadata["refusal"]
            raise NanoGPTError(text.format(given=show_value(after), saved=show_value(before), run_dir=r.run_dir))
    values, changes = dict(saved), []
    for name, value in sorted(said.items()):
        kind, after = rule(name), parse_value(name, value)
        if kind is Resume.FIXED:  # checked above
            continue
        if kind in (Resume.LOCAL, Resume.INVOCATION):
            values[name] = after
            continue
        before = parse_value(name, saved.get(name, defaults[name]))
        if kind is Resume.CHANGES_IF_SET and before is None and after is not None:
            _untrained_value(r, fields[name], after)  # refused, or set aside with a note
        elif before != after:
            changes.append(Change(name, before, after, r.step))
            values[name] = after
    return values, changes


def _untrained_value(r: _Resuming, f: dataclasses.Field, value: Any) -> None:
    """A Resume.CHANGES_IF_SET value for a run trained without one: a preset's is set aside with the field's
    note; a given one is refused, by what the field needs of the model where the run's lacks it (Needs)."""
    if f.name not in r.given:
        r.notes.append(f.metadata["aside"].format(preset=r.preset, given=show_value(value), run_dir=r.run_dir))
        return
    needs = f.metadata.get("needs")
    if needs is not None and not needs.holds(r.model):
        raise needs.refuse(value, str(r.run_dir))
    raise NanoGPTError(f.metadata["refusal"].format(given=show_value(value), run_dir=r.run_dir))


def _resumed_dataset(
    run_dir: RunDir, saved_meta: dict[str, Any], train_cfg: TrainConfig, notes: list[str]
) -> dict[str, Any]:
    """The dataset's meta.json, refused where it was prepared again with another tokenizer since the run started;
    prepared again with the same one, it is named in a note."""
    meta = load_meta(Path(train_cfg.data_dir), train_cfg.data)
    differ_tok = describe_difference(
        meta["tokenizer"], saved_meta.get("tokenizer", meta["tokenizer"]), f"dataset '{train_cfg.data}' now", "the run"
    )
    if differ_tok:
        raise NanoGPTError(
            f"dataset '{train_cfg.data}' was prepared again with another tokenizer since {run_dir} "
            f"started ({differ_tok}); prepare it as before, or start a new run"
        )
    if saved_meta.get("created") and meta.get("created") != saved_meta.get("created"):
        notes.append(
            f"dataset '{train_cfg.data}' was prepared again since this run started (then "
            f"{saved_meta['created']}, now {meta.get('created')}); the run continues on the new data"
        )
    return meta


@dataclass(frozen=True)
class Change:
    """A training value a resume changes: applied from `step` on, announced, and kept in the run's history."""

    field: str
    saved: Any
    given: Any
    step: int

    def __str__(self) -> str:
        """ "--learning-rate 0.001 -> 0.0003 from step 723"."""
        return f"--{flag(self.field)} {show_value(self.saved)} -> {show_value(self.given)} from step {self.step:,}"

    def record(self) -> dict[str, Any]:
        return {"flag": f"--{flag(self.field)}", "saved": self.saved, "given": self.given}
