"""Fine-tuning: a run that starts from trained weights, all of them trained (full) or a frozen base with LoRA
adapters. On a chat dataset only the assistant's tokens are in the loss (the trainer reads the masks). The loop
is the trainer's; this module plans the start and hands the trainer its `trainable` hook.

    request = RunRequest({"data": "chats", "max_iters": 200}, out=Path("checkpoints/chat"), init_from="hf:gpt2")
    job = plan_finetune(request, lora=LoRAConfig(r=8))
    Trainer(job.plan, trainable=job.trainable).fit()

A LoRA run saves its adapters only, with a reference to its base: where it came from and the sha256 of its
weights (lora.weights_hash), checked whenever the run is resumed or loaded. config.json records it all under
"finetune", which is how `--resume` finds the base again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogpt_cli.config import OptimizerName, flag, parse_value, show_value
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.loading import is_converted
from nanogpt_cli.lora import LoRAConfig, add_lora, weights_hash
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.rundir import resolve_weights
from nanogpt_cli.training.plan import RunPlan, plan_run
from nanogpt_cli.training.request import RunRequest

# what LoRA trains its adapters with, whatever a preset says, and the refusal of another given value: AdamW at
# --learning-rate, and a frozen token embedding, which no --embedding-lr reaches
LORA_TRAINS_WITH: dict[str, tuple[Any, str]] = {
    "optimizer": (OptimizerName.adamw, "LoRA trains its adapters with --optimizer adamw; drop --optimizer muon"),
    "embedding_lr": (None, "LoRA keeps the token embedding frozen, so --embedding-lr has nothing to train; drop it"),
}


@dataclass
class FinetunePlan:
    plan: RunPlan
    lora: LoRAConfig | None  # None: full fine-tuning
    trainable: Any = None  # the trainer's hook: LoRA's adapters (None: every parameter trains)
    loss: Any = None  # the trainer's loss hook (None: next-token cross-entropy); distillation's (training/distill.py)


class LoRAStart:
    """The trainer's `trainable` hook for a LoRA run: it sees the model with its base weights loaded, records
    (or, on resume, checks) the base's hash, puts the adapters on and returns their parameters."""

    def __init__(self, cfg: LoRAConfig, record: dict[str, Any], expect_hash: str | None):
        self.cfg, self.record, self.expect_hash = cfg, record, expect_hash

    def __call__(self, model: GPT):
        digest = weights_hash(model)
        base = self.record["weights"]["base"]
        if self.expect_hash is not None and digest != self.expect_hash:
            raise NanoGPTError(
                f"the base weights {base['source']} changed since this LoRA run started (sha256 "
                f"{self.expect_hash[:12]}..., now {digest[:12]}...); resume needs the same base"
            )
        base["sha256"] = digest  # config.json and the weights files are written after this, with it
        return add_lora(model, self.cfg)


def base_source(plan: RunPlan, init_from: str, last: bool = False) -> str:
    """Where the base weights are, as a LoRA run records it: the weights file (absolute), or the Hugging Face
    folder (absolute) or hf:NAME."""
    if plan.init_weights is not None:
        return str(Path(plan.init_weights).resolve())
    if not is_converted(init_from):  # a LoRA run of ours, loaded merged: its weights file
        return str(resolve_weights(init_from, last=last).resolve())
    return init_from if init_from.startswith("hf:") else str(Path(init_from).resolve())


def plan_finetune(
    request: RunRequest,
    lora: LoRAConfig | None = None,
    lora_flags: set[str] | None = None,
    world_size: int | None = None,
) -> FinetunePlan:
    """A fine-tuning run's plan. Fresh: --init-from is required, the architecture is its checkpoint's, and
    `lora` (None: full fine-tuning) says what trains. Resume: the run's own record says both; LoRA flags given
    again must agree with it (lora_flags: the fields the user gave, r, alpha, dropout, targets; None: all).
    world_size: the processes that will train it (None: torchrun's, or 1), as plan_run takes it."""
    resume, init_from, init_last = request.resume, request.init_from, request.last
    if not resume and init_from is None:
        raise NanoGPTError(
            "finetune needs --init-from: the weights to start from (a run folder, a .safetensors file, a "
            "Hugging Face folder or hf:NAME)"
        )
    values = request.values()
    for name, (value, refusal) in LORA_TRAINS_WITH.items():
        if lora is not None and name in values and parse_value(name, values[name]) != value:
            raise NanoGPTError(refusal)
    plan = plan_run(request, world_size=world_size)
    if resume:
        return _resume(plan, lora, lora_flags)
    if lora is not None:
        _lora_values(plan)
    record: dict[str, Any] = {"init_from": init_from, "init_last": init_last, "method": "lora" if lora else "full"}
    if lora is None:
        plan.finetune = record
        return FinetunePlan(plan, None)
    record["weights"] = {
        "lora": lora.to_dict(),
        "base": {"source": base_source(plan, init_from, init_last), "last": init_last, "sha256": None},
    }
    plan.finetune = record
    return FinetunePlan(plan, lora, LoRAStart(lora, record, expect_hash=None))


def _lora_values(plan: RunPlan) -> None:
    """A preset's values that LoRA does not train with (LORA_TRAINS_WITH; given ones were refused before
    planning) set aside, with a note."""
    aside = {k: value for k, (value, _) in LORA_TRAINS_WITH.items()}
    said = [
        f"--{flag(k)} {show_value(getattr(plan.train, k))}" for k, v in aside.items() if getattr(plan.train, k) != v
    ]
    if said:
        plan.notes.append(
            f"LoRA trains its adapters with AdamW at --learning-rate: the preset's {' and '.join(said)} set aside"
        )
        plan.train = dataclasses.replace(plan.train, **aside)


def _resume(plan: RunPlan, lora: LoRAConfig | None, lora_flags: set[str] | None) -> FinetunePlan:
    record = plan.run_dir.read_config().get("finetune")
    if record is None:
        raise NanoGPTError(
            f"{plan.run_dir} was not started by `nanogpt finetune`; continue it with `nanogpt train --out "
            f"{plan.run_dir} --resume`"
        )
    plan.finetune = record
    if record.get("method") != "lora":
        if lora is not None:
            raise NanoGPTError(f"{plan.run_dir} is a full fine-tune; drop the --lora-* flags to resume it")
        return FinetunePlan(plan, None)
    saved = LoRAConfig.from_dict(record["weights"]["lora"])
    given = {} if lora is None else {k: v for k, v in lora.to_dict().items() if lora_flags is None or k in lora_flags}
    differ = [
        f"--lora-{k} (saved {saved.to_dict()[k]!r}, given {v!r})" for k, v in given.items() if saved.to_dict()[k] != v
    ]
    if differ:
        raise NanoGPTError(f"--resume continues the run's adapters; these differ from it: {', '.join(differ)}")
    base = record["weights"]["base"]
    from nanogpt_cli.interop.loading import load_model

    if is_converted(base["source"]) or _holds_adapters(base["source"], base.get("last", False)):
        plan.init_model, _ = load_model(base["source"], last=base.get("last", False))
    else:
        plan.init_weights = resolve_weights(base["source"], last=base.get("last", False))
    return FinetunePlan(plan, saved, LoRAStart(saved, record, expect_hash=base["sha256"]))


def _holds_adapters(source: str, last: bool) -> bool:
    """Whether these weights are a LoRA run's (adapters on a base of their own)."""
    from nanogpt_cli.runs.checkpoint import read_metadata

    return "lora" in read_metadata(resolve_weights(source, last=last))


def record_full_finetune(plan: RunPlan, init_from: str) -> None:
    """`train --init-from` on a chat dataset is a full fine-tune: recorded as `finetune` records one, so either
    command resumes it."""
    plan.finetune = {"init_from": init_from, "method": "full"}


def is_finetune_run(out: str | Path) -> bool:
    """Whether the run folder holds a run that `finetune` (or `train --init-from` on a chat dataset) started."""
    from nanogpt_cli.runs.rundir import RunDir

    run = RunDir(out)
    try:
        return run.has_run() and "finetune" in run.read_config()
    except NanoGPTError:
        return False
