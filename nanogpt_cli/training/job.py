"""What a `train` invocation asks for -> a planned job: the launch checks, a LoRA run resumed on its base, and a
full fine-tune recorded as one. The CLI and the Python API share it; it prints nothing.

    job = plan_train(RunRequest({"data": "shk", "preset": "tiny"}, out=Path("checkpoints/tiny")), launch_of(2))
    job.launch   # None: this process trains; a Launch: --nproc processes do
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.training.launch import Launch
from nanogpt_cli.training.plan import RunPlan, plan_run
from nanogpt_cli.training.request import RunRequest


@dataclass
class TrainJob:
    plan: RunPlan
    trainable: Any = None  # a LoRA run's hook (None: every parameter trains)
    launch: Launch | None = None  # --nproc: the processes to start; None: train here


def complete_reason(plan: RunPlan, flags: bool = True) -> str:
    """Why a resumed run trains no further, and what to raise (named as a flag, or as the config field)."""
    max_time, max_iters = ("--max-time", "--max-iters") if flags else ("max_time", "max_iters")
    if plan.time_over:
        return (
            f"{plan.run_dir} is already complete: its {max_time} {plan.time_spent:g} s was spent at step "
            f"{plan.step:,}; raise {max_time} to train it further"
        )
    return (
        f"{plan.run_dir} is already complete: step {plan.step:,} of {max_iters} {plan.train.max_iters:,}; "
        f"raise {max_iters} to train it further"
    )


def launch_of(nproc: int | None, nnodes: int = 1, rdzv_endpoint: str | None = None) -> Launch | None:
    """--nproc, --nnodes and --rdzv-endpoint as a Launch (None: this process trains), checked."""
    if nproc is None and (nnodes != 1 or rdzv_endpoint):
        raise NanoGPTError("--nnodes and --rdzv-endpoint go with --nproc N: the processes on each machine")
    if nproc is not None and os.environ.get("WORLD_SIZE"):
        raise NanoGPTError("--nproc launches the processes itself; under torchrun drop it")
    return Launch(nproc, nnodes, rdzv_endpoint) if nproc is not None else None


def plan_train(request: RunRequest, launch: Launch | None = None, on_probe: Any = None) -> TrainJob:
    """Check the invocation, then plan the run it names: a fresh run, a resumed one (a LoRA run resumes on its
    base, with its adapters), or one from other weights (on a chat dataset, recorded as a full fine-tune).
    launch: the processes that will train it (None: this one); on_probe: --preset auto's (training.auto.Probed)."""
    from nanogpt_cli.training.finetune import is_finetune_run, plan_finetune, record_full_finetune

    r = request
    if r.last and r.init_from is None:
        raise NanoGPTError("--last picks the weights of --init-from RUN; give --init-from or drop --last")
    if r.resume and r.out is not None and is_finetune_run(r.out):
        job = plan_finetune(r, world_size=launch.world_size if launch else None)
        objective = job.plan.finetune.get("objective")
        if objective is not None:  # its loss (a teacher's, DPO's, GRPO's) is finetune's to set up, not train's
            flags = " ".join(launch.flags()) + " " if launch and objective == "distill" else ""  # DPO, GRPO: one
            raise NanoGPTError(
                f"{r.out} is a --method {objective} run; resume it with `nanogpt finetune {flags}--method "
                f"{objective} --out {r.out} --resume`"
            )
        return TrainJob(job.plan, job.trainable, launch=launch)
    plan = plan_run(r, world_size=launch.world_size if launch else None, on_probe=on_probe)
    if r.init_from is not None and plan.dataset.get("masks"):  # the same run as `finetune` without --lora
        record_full_finetune(plan, r.init_from)
        plan.notes.append("fine-tuning on a chat dataset: `nanogpt finetune` does the same, and LoRA with --lora")
    return TrainJob(plan, launch=launch)
