"""What a `train` invocation asks for -> a planned job: the launch checks, a LoRA run resumed on its base, and a
full fine-tune recorded as one. The CLI and the Python API share it; it prints nothing.

    job = plan_train(TrainRequest(flags={"data": "shk", "preset": "tiny"}, out=Path("checkpoints/tiny")))
    job.launch   # None: this process trains; a Launch: --nproc processes do
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.training.launch import Launch
from nanogpt_cli.training.plan import RunPlan, plan_run


@dataclass
class TrainRequest:
    """One `train` invocation's choices, as given (nothing filled in yet)."""

    flags: dict[str, Any] = field(default_factory=dict)  # config fields given (the preset too), by field name
    file_values: dict[str, Any] = field(default_factory=dict)  # a config file's keys; flags override them
    out: Path | None = None  # the run folder (None: checkpoints/DATA-TIMESTAMP)
    resume: bool = False  # continue the run in out
    force: bool = False  # start over in an out that holds a run
    init_from: str | None = None  # weights to start from, with a fresh optimizer
    init_last: bool = False  # init_from RUN's last weights, not its best
    nproc: int | None = None  # processes on this machine (None: this one trains)
    nnodes: int = 1  # machines taking part, each running the same command
    rdzv_endpoint: str | None = None  # HOST:PORT where the machines meet
    on_probe: Any = None  # --preset auto: called with each shape its probe times (training.auto.Probed)


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


def plan_train(request: TrainRequest) -> TrainJob:
    """Check the invocation, then plan the run it names: a fresh run, a resumed one (a LoRA run resumes on its
    base, with its adapters), or one from other weights (on a chat dataset, recorded as a full fine-tune)."""
    from nanogpt_cli.training.finetune import is_finetune_run, plan_finetune, record_full_finetune

    r = request
    if r.init_last and r.init_from is None:
        raise NanoGPTError("--last picks the weights of --init-from RUN; give --init-from or drop --last")
    if r.nproc is None and (r.nnodes != 1 or r.rdzv_endpoint):
        raise NanoGPTError("--nnodes and --rdzv-endpoint go with --nproc N: the processes on each machine")
    launch = Launch(r.nproc, r.nnodes, r.rdzv_endpoint) if r.nproc is not None else None
    if launch is not None and os.environ.get("WORLD_SIZE"):
        raise NanoGPTError("--nproc launches the processes itself; under torchrun drop it")
    if r.resume and r.out is not None and is_finetune_run(r.out):
        if launch is not None:
            raise NanoGPTError(
                f"{r.out} is a LoRA run, which --nproc does not launch; resume it in one process, or with "
                "torchrun --nproc-per-node N -m nanogpt_cli finetune --out RUN --resume"
            )
        job = plan_finetune(
            r.flags, r.file_values, out=r.out, resume=True, force=r.force, init_from=r.init_from, init_last=r.init_last
        )
        return TrainJob(job.plan, job.trainable)
    plan = plan_run(
        r.flags,
        r.file_values,
        out=r.out,
        resume=r.resume,
        force=r.force,
        init_from=r.init_from,
        init_last=r.init_last,
        world_size=launch.world_size if launch else None,
        on_probe=r.on_probe,
    )
    if r.init_from is not None and plan.dataset.get("masks"):  # the same run as `finetune` without --lora
        record_full_finetune(plan, r.init_from)
        plan.notes.append("fine-tuning on a chat dataset: `nanogpt finetune` does the same, and LoRA with --lora")
    return TrainJob(plan, launch=launch)
