"""finetune --method dpo and --method grpo: their options, and the run with the training display (api.py plans it).

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


def run_policy(training, method: str, quiet: bool, write_card=None) -> None:
    """Train a planned DPO or GRPO run (api.plan_finetuning's) with train's display (start lines, progress,
    evaluations; unless quiet), a summary table and the report card (write_card(training, result): train's)."""
    from nanogpt_cli.cli.common import note
    from nanogpt_cli.cli.stops import cut_short, resume_command, stop_code, stopped_line
    from nanogpt_cli.cli.train_ui import TrainDisplay, policy_table
    from nanogpt_cli.cli.ui import console

    plan = training.plan
    for message in plan.notes:
        note(message)
    with TrainDisplay(quiet) as display, cut_short(plan):
        result = training.run(display)
    console.print(policy_table(result, method))
    if write_card is not None:
        write_card(training, result)
    if result.stopped in ("SIGINT", "SIGTERM"):  # a stop asked for, after a save: a note, not an error
        note(stopped_line(plan, result))
        raise typer.Exit(stop_code(result.stopped))
    if result.stopped == "stop_at":
        console.print(f"stopped at step {result.step:,} (--stop-at); resume with: {resume_command(plan)}")
    if result.stopped == "max_time":
        console.print(f"ended at step {result.step:,}: --max-time {plan.train.max_time:g} s was spent")
