"""Planning a run: every input of a run resolved and checked once, before anything is written (a fresh run,
a resume that must agree with the saved one, or a start from other weights).

    plan = plan_run({"preset": "cpu-char", "data": "shk"}, out="checkpoints/shk"); print(plan.notes)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from nanogpt_cli.config import (
    Dtype,
    GPTConfig,
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
from nanogpt_cli.interop import hf
from nanogpt_cli.interop.loading import load_model
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import read_metadata
from nanogpt_cli.runs.rundir import RunDir, resolve_weights
from nanogpt_cli.tokenizer import describe_difference
from nanogpt_cli.training.distributed import check_world, launched_size


@dataclass
class RunPlan:
    """What a run needs, resolved and checked before anything is written."""

    model: GPTConfig
    train: TrainConfig
    run_dir: RunDir
    dataset: dict[str, Any]  # the prepared dataset's meta.json
    init_weights: Path | None = None  # --init-from: the weights file to start from
    init_model: GPT | None = None  # --init-from a Hugging Face model: its weights, converted once while planning
    resume: bool = False
    force: bool = False
    step: int = 0  # where the run starts: 0, or the step a resumed run stopped at
    notes: list[str] = field(default_factory=list)  # things the user should know before it starts (warnings)
    time_spent: float | None = None  # a resumed run that --max-time ended: the --max-time it ended under
    # a fine-tuning run (finetune.py): what config.json records under "finetune"; its "weights" entries go into
    # the weights files' metadata (a LoRA run: its adapter config and its base)
    finetune: dict[str, Any] | None = None
    changes: list[Change] = field(default_factory=list)  # training values a resume changes, from its step on

    @property
    def complete(self) -> bool:
        """A resumed run that has already done its --max-iters, or spent a --max-time not raised since."""
        return self.resume and (self.step >= self.train.max_iters or self.time_over)

    @property
    def time_over(self) -> bool:
        return self.time_spent is not None and (self.train.max_time or 0) <= self.time_spent


def values_from(preset: str | None) -> dict[str, Any]:
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
    flags: dict[str, Any],
    file_values: dict[str, Any] | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    init_from: str | None = None,
    init_last: bool = False,
    world_size: int | None = None,
) -> RunPlan:
    """The effective configs of a run. Fresh: preset < config file < flags, with the vocabulary from the dataset.
    Resume: the saved run's configs; the same preset, file and flags may be given again (values equal to the
    saved architecture are accepted, differing ones refused), and training fields they give apply.
    --init-from: the checkpoint's architecture (dropout may change; best weights unless init_last), training
    fields as for a fresh run. `preset` and `out` may come from the flags or the config file (flags win).
    world_size: the processes it trains in (default: torchrun's WORLD_SIZE, or 1); a preset's (or the default)
    --gradient-accumulation-steps is raised to a multiple of it, said in a note."""
    world_size = launched_size() if world_size is None else world_size
    values = {**(file_values or {}), **flags}
    preset = values.pop("preset", None)
    out = out or values.pop("out", None)
    values.pop("out", None)
    if resume and out is None:
        raise NanoGPTError("--resume needs --out: the run folder to continue")
    run_dir = RunDir(out or default_run_dir(values.get("data") or "run"))
    run_dir.check(resume, force)
    split_values(values)  # unknown keys are refused first
    if resume:
        if init_from is not None:
            raise NanoGPTError("--resume continues a run with its own weights; drop --init-from")
        return _plan_resume(run_dir, preset, values, world_size)
    explicit_model, _ = split_values(values)
    given = set(values)
    accumulation_given = "gradient_accumulation_steps" in values
    values = {**(preset_values(preset) if preset else {}), **values}
    model_values, train_values = split_values(values)
    notes: list[str] = []
    if not accumulation_given and world_size > 1:
        n_micro = train_values.get("gradient_accumulation_steps", TrainConfig.gradient_accumulation_steps)
        adapted = _adapted_accumulation(n_micro, world_size)
        if adapted != n_micro:
            train_values["gradient_accumulation_steps"] = adapted
            where = f"--preset {preset}'s" if "gradient_accumulation_steps" in values_from(preset) else "the default"
            notes.append(
                f"--gradient-accumulation-steps {adapted} instead of {where} {n_micro}: a multiple of the "
                f"{world_size} processes ({adapted // world_size} micro-batch{'es' if adapted > world_size else ''} "
                "each per update)"
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
    if train_cfg.embedding_lr is not None and model_cfg.tie_embeddings:
        if "embedding_lr" in given:
            raise tied_embedding_lr(train_cfg.embedding_lr, init_from)
        notes.append(
            f"--preset {preset}'s --embedding-lr {train_cfg.embedding_lr:g} is for an untied embedding; this "
            "model's is tied to the LM head, so it trains at --learning-rate"
        )
        train_cfg = dataclasses.replace(train_cfg, embedding_lr=None)
    check_world(train_cfg, world_size)
    notes += _warnings(model_cfg, train_cfg)
    return RunPlan(model_cfg, train_cfg, run_dir, meta, force=force, notes=notes, **init)


def tied_embedding_lr(value: float, source: str | None) -> NanoGPTError:
    """The refusal of --embedding-lr for a tied embedding; source: the run or weights whose architecture it is, or
    None for a fresh model, which can be untied."""
    if source is None:
        return NanoGPTError(
            f"--embedding-lr {value:g} is for an untied token embedding, and this model ties it to the LM head; "
            "add --no-tie-embeddings, or drop --embedding-lr"
        )
    return NanoGPTError(
        f"--embedding-lr {value:g} is for an untied token embedding, and {source} ties it to the LM head; "
        "drop --embedding-lr"
    )


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
    if hf.is_hf_source(init_from):
        init_model, weights_meta = load_model(init_from)
        init, source = {"init_model": init_model}, init_from
    else:
        source = resolve_weights(init_from, last=init_last)
        weights_meta = read_metadata(source)
        init = {"init_weights": source}
        if "lora" in weights_meta:  # a LoRA run's file holds adapters: start from its base with them merged in
            init = {"init_model": load_model(source)[0]}
    theirs, ours = (weights_meta.get("tokenizer") or {}).get("name"), meta["tokenizer"]["name"]
    if theirs != ours:
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
    saved = run_dir.read_config()
    state, notes = run_dir.check_resumable()
    # the command that started the run may be given again, preset included: its architecture and dataset must be
    # the saved run's; a training value it changes applies from the resumed step, and is announced and recorded
    from_preset = preset_values(preset) if preset else {}
    said = {**from_preset, **given}
    model_said, train_said = split_values(said)
    saved_model = {k: parse_value(k, v) for k, v in saved["model"].items()}
    differ = [k for k, v in model_said.items() if saved_model.get(k) != parse_value(k, v)]
    if differ:

        def where(k):
            return f"--preset {preset} gives" if k not in given else "given"

        raise NanoGPTError(
            f"--resume takes the architecture from {run_dir}; these differ from it: "
            + ", ".join(
                f"--{flag(k)} (saved {saved['model'].get(k)!r}, {where(k)} {model_said[k]!r})" for k in sorted(differ)
            )
        )
    saved_train = {k: v for k, v in saved["train"].items() if k not in ("stop_at", "out")}  # out: older runs
    if "data" in train_said and train_said["data"] != saved_train.get("data"):
        raise NanoGPTError(
            f"--data {train_said['data']} is a different dataset from the one {run_dir} trains on "
            f"({saved_train.get('data')!r}); resume without --data, or train on it in a new run: "
            f"nanogpt train --init-from {run_dir} --data {train_said['data']} --out NEW_FOLDER"
        )
    saved_optimizer = saved_train.get("optimizer", "adamw")
    if train_said.get("optimizer", saved_optimizer) != saved_optimizer:
        raise NanoGPTError(
            f"--resume continues the run's --optimizer {saved_optimizer}; it cannot change to "
            f"{train_said['optimizer']} (start a new run with --init-from instead)"
        )
    defaults = TrainConfig().to_dict()
    changes = []
    for k, v in sorted(train_said.items()):
        if k in ("data", "data_dir", "stop_at"):  # where the data is, and when this invocation stops: not the run's
            continue
        if k == "embedding_lr" and saved_train.get(k) is None:
            # the run trains its embedding at --learning-rate (tied, or untied without one): its optimizer has no
            # group for the embedding to take a rate of its own
            if k not in given:
                notes.append(
                    f"--preset {preset}'s --embedding-lr {show_value(parse_value(k, v))} is set aside: {run_dir} "
                    "trains its embedding at --learning-rate"
                )
                continue
            if saved_model.get("tie_embeddings", True):
                raise tied_embedding_lr(parse_value(k, v), str(run_dir))
            raise NanoGPTError(
                f"--embedding-lr {show_value(parse_value(k, v))} would give the embedding an optimizer group of "
                f"its own, which {run_dir} was not trained with; resume without it, or start a new run from these "
                f"weights with --init-from {run_dir}"
            )
        before = parse_value(k, saved_train.get(k, defaults[k]))
        after = parse_value(k, v)
        if k == "gradient_accumulation_steps" and k not in given:  # a preset's adapts to the world, as when started
            after = _adapted_accumulation(after, world_size)
        if before != after:
            changes.append(Change(k, before, after, state.step))
    model_cfg, train_cfg = build_configs({**saved["model"], **saved_train, **{c.field: c.given for c in changes}})
    train_cfg = dataclasses.replace(train_cfg, **{k: v for k, v in train_said.items() if k in ("data_dir", "stop_at")})
    plan_step = state.step
    if state.step < train_cfg.max_iters and train_cfg.stop_at is not None and train_cfg.stop_at <= state.step:
        raise NanoGPTError(
            f"--stop-at {train_cfg.stop_at} is not after the run's step {state.step}; drop it (or "
            "raise it) to continue the run"
        )
    meta = load_meta(Path(train_cfg.data_dir), train_cfg.data)
    saved_meta = saved.get("dataset") or {}
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
    check_world(train_cfg, world_size)
    notes += _warnings(model_cfg, train_cfg)
    return RunPlan(
        model_cfg,
        train_cfg,
        run_dir,
        meta,
        resume=True,
        step=plan_step,
        notes=notes,
        time_spent=state.max_time_spent,
        changes=changes,
    )


def _adapted_accumulation(n_micro: int, world_size: int) -> int:
    """--gradient-accumulation-steps from a preset (or the default) raised to the next multiple of the number of
    processes, so every process runs the same share of each update."""
    return -(-n_micro // world_size) * world_size


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
