"""finetune --method dpo and --method grpo: their options, and the run with one progress line per log.

nanogpt finetune --method grpo --init-from checkpoints/sft --data count-prompts --group-size 8 --kl 0.02
"""

from __future__ import annotations

from typing import Annotated

import typer

Method = Annotated[
    str,
    typer.Option(
        "--method",
        help="sft (imitate the replies), dpo (prefer chosen over rejected; a --format preference dataset) or grpo "
        "(rewarded rollouts; a --format prompts dataset).",
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
    """Train a planned DPO or GRPO run, printing its metrics lines (unless quiet) and a summary. sink: the
    --tracker's, which these methods do not feed yet (refused)."""
    from nanogpt_cli.cli.common import note
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.errors import NanoGPTError

    if method not in ("dpo", "grpo"):
        raise NanoGPTError(f"unknown --method {method!r}; use sft, dpo or grpo")
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

    def show(record: dict) -> None:
        if not quiet:
            values = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items())
            console.print(values, highlight=False, soft_wrap=True)

    if method == "dpo":
        from nanogpt_cli.training.dpo import DPO

        with job.plan.run_dir.hold():  # `runs` says "running" while it trains; another start there is refused
            result = DPO(job, given, show).fit()
        console.print(
            f"dpo: {result.step:,} updates in {result.run_dir}; val loss {result.val_loss:.4f}, "
            f"preference accuracy {result.val_accuracy:.1%}",
            highlight=False,
        )
        return
    from functools import partial

    from nanogpt_cli.api import engine_rollout
    from nanogpt_cli.training.grpo import GRPO

    vocab = job.plan.dataset.get("vocab_size")
    with job.plan.run_dir.hold():
        result = GRPO(job, partial(engine_rollout, vocab_size=vocab), given, show).fit()
    console.print(f"grpo: {result.step:,} updates in {result.run_dir}; val reward {result.val_reward:.4f}")
