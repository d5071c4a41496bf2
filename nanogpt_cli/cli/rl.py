"""finetune --method dpo and --method grpo: their options, and the run with the training display.

nanogpt finetune --method grpo --init-from checkpoints/sft --data count-prompts --group-size 8 --kl 0.02
"""

from __future__ import annotations

from typing import Annotated

import typer

Method = Annotated[
    str,
    typer.Option(
        "--method",
        help="sft (imitate the replies), dpo (prefer chosen over rejected; a --format preference dataset), grpo "
        "(rewarded rollouts; a --format prompts dataset) or distill (learn a --teacher's next-token distributions).",
    ),
]
Beta = Annotated[float | None, typer.Option(help="DPO: strength of the pull to the reference.  [default: 0.1]")]
RPOAlpha = Annotated[
    float | None, typer.Option(help="DPO: weight of the chosen replies' cross-entropy added (RPO).  [default: 0]")
]
LossType = Annotated[str | None, typer.Option(help="DPO loss: sigmoid (DPO's) or ipo.  [default: sigmoid]")]
GroupSize = Annotated[int | None, typer.Option(help="GRPO: completions per prompt.  [default: 8]")]
KL = Annotated[
    float | None, typer.Option("--kl", help="GRPO: weight of the KL penalty to the reference.  [default: 0.02]")
]
Reward = Annotated[
    str | None,
    typer.Option(help="GRPO reward: exact (the row's answer), or module:function(prompt, completion, row) -> float."),
]
MaxNew = Annotated[int | None, typer.Option(help="GRPO: longest completion in tokens.  [default: 32]")]
Temperature = Annotated[
    float | None, typer.Option("--rollout-temperature", help="GRPO: sampling temperature of rollouts.  [default: 1]")
]
Updates = Annotated[
    int | None, typer.Option(help="GRPO: updates per batch of rollouts (the clip acts from 2).  [default: 1]")
]


def sft_planned(plan) -> bool:
    """True when the planned run can train with --method sft; a refusal naming the method it needs otherwise."""
    from nanogpt_cli.errors import NanoGPTError

    objective = (plan.finetune or {}).get("objective")
    if objective is not None:
        raise NanoGPTError(f"{plan.run_dir} is a --method {objective} run; resume it with --method {objective}")
    wanted = {"preference": "dpo", "prompts": "grpo"}.get(plan.dataset.get("format"))
    if wanted:
        raise NanoGPTError(
            f"{plan.train.data} is a {plan.dataset['format']} dataset; train on it with --method {wanted}"
        )
    return True


def run_policy(job, method: str, given: dict, quiet: bool, sink=None) -> None:
    """Train a planned DPO or GRPO run with train's display (start lines, progress, evaluations; unless quiet)
    and a summary table. sink: the --tracker's, which these methods do not feed yet (refused)."""
    from nanogpt_cli.cli.common import note
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.errors import NanoGPTError

    if method not in ("dpo", "grpo"):
        raise NanoGPTError(f"unknown --method {method!r}; use sft, dpo, grpo or distill")
    if sink is not None:
        sink.close()
        raise NanoGPTError(
            f"--tracker does not log --method {method} runs; drop it (the run folder's metrics file has every value)"
        )
    own = ("beta", "loss_type", "rpo_alpha") if method == "dpo" else ("group_size", "kl", "reward", "max_new_tokens")
    own += () if method == "dpo" else ("rollout_temperature", "grpo_updates")
    stray = [k for k, v in given.items() if v is not None and k not in own]
    if stray:
        raise NanoGPTError(f"--{stray[0].replace('_', '-')} has no effect with --method {method}; drop it")
    given = {k: v for k, v in given.items() if v is not None}
    for message in job.plan.notes:
        note(message)
    from nanogpt_cli.cli.stops import cut_short, resume_command, stop_code, stopped_line, while_planning
    from nanogpt_cli.cli.train_ui import TrainDisplay, policy_table

    with TrainDisplay(quiet) as display:
        if method == "dpo":
            from nanogpt_cli.training.dpo import DPO

            run = while_planning(DPO, job, given, display=display)  # reads the pairs
        else:
            from functools import partial

            from nanogpt_cli.api import engine_rollout
            from nanogpt_cli.training.grpo import GRPO

            rollout = partial(engine_rollout, vocab_size=job.plan.dataset.get("vocab_size"))
            run = while_planning(GRPO, job, rollout, given, display=display)  # reads the prompts and the reward
        # `runs` says "running" while it trains; another start there is refused
        with cut_short(job.plan), job.plan.run_dir.hold():
            result = run.fit()
    console.print(policy_table(result, method))
    if result.stopped in ("SIGINT", "SIGTERM"):  # a stop asked for, after a save: a note, not an error
        note(stopped_line(job.plan, result))
        raise typer.Exit(stop_code(result.stopped))
    if result.stopped == "stop_at":
        console.print(f"stopped at step {result.step:,} (--stop-at); resume with: {resume_command(job.plan)}")
