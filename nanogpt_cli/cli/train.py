"""train and finetune: thin commands over the API's plan_training and plan_finetuning, with the progress display.

nanogpt train --data shakespeare-char --preset cpu-char --out checkpoints/shk
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli import api
from nanogpt_cli.api import RunRequest
from nanogpt_cli.cli.common import Threads, config_options, note, one_line_errors, prints
from nanogpt_cli.cli.distill import distill_options
from nanogpt_cli.cli.rl import (
    KL,
    Beta,
    GroupSize,
    LossType,
    MaxNew,
    Method,
    Reward,
    RPOAlpha,
    Temperature,
    Updates,
    run_policy,
)
from nanogpt_cli.cli.stops import cut_short, resume_command, stop_code, stopped_line, while_planning
from nanogpt_cli.config import PRESETS

# options that train and finetune share (the run's own, --out, --resume, ..., are RunRequest's: config_options)
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final summary.")]
Plot = Annotated[
    bool, typer.Option("--plot/--no-plot", help="Draw loss.png in the run folder at the end (with matplotlib).")
]
EvalTasks = Annotated[
    str | None,
    typer.Option(
        "--eval-tasks",
        help="lm-eval tasks to score at the end (as `nanogpt eval tasks` does), comma-separated; their scores go "
        "into the run's report.md. Needs the eval extra.",
        show_default=False,
    ),
]
Nproc = Annotated[
    int | None,
    typer.Option(
        help="Train in N processes on this machine (one per GPU, or gloo on the CPU), launched by torch's elastic "
        "launcher.",
        show_default=False,
    ),
]
Nnodes = Annotated[int, typer.Option(help="With --nproc: machines taking part, each running this command.")]
RdzvEndpoint = Annotated[
    str | None,
    typer.Option(help="With --nnodes: HOST:PORT where the machines meet (the same on each).", show_default=False),
]
Tracker = Annotated[
    str | None,
    typer.Option(
        "--tracker",
        help="Also log to tensorboard or wandb (offline unless WANDB_MODE=online); needs the track extra.",
        show_default=False,
    ),
]


@config_options
@one_line_errors
def train(
    preset: Annotated[
        str | None,
        typer.Option(
            help=f"Named config: {', '.join(PRESETS)}, or auto: sized to the data, --max-time and this device by a "
            "short probe (the default when --max-time is given without a model shape).",
            show_default=False,
        ),
    ] = None,
    request: RunRequest = None,  # --config, --out, --resume, --force, --init-from, --last (config_options)
    quiet: Quiet = False,
    plot: Plot = True,
    threads: Threads = None,
    tracker: Tracker = None,
    eval_tasks: EvalTasks = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print the whole config at the start.")] = False,
    nproc: Nproc = None,
    nnodes: Nnodes = 1,
    rdzv_endpoint: RdzvEndpoint = None,
):
    """Train a GPT on a prepared dataset, with checkpoints you can resume.

    Example: nanogpt train --data shakespeare-char --preset cpu-char --out checkpoints/shk
    """
    request = request.but(flags={"preset": preset} if preset is not None else {})
    launched = dict(nproc=nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint)
    probe = say_probe if prints() and not quiet else None
    training = while_planning(
        api.plan_training,
        request=request,
        threads=threads,
        tracker=tracker,
        eval_tasks=eval_tasks,
        on_probe=probe,
        **launched,
    )
    if training.launch is not None:
        own = dict(threads=threads, tracker=tracker, eval_tasks=eval_tasks, quiet=quiet, verbose=verbose)
        return run_launched(training, {**own, "no_plot": not plot})
    run_planned(training, quiet, verbose, plot)


def run_launched(training, options: dict) -> None:
    """--nproc: the planned run in its processes (everything was checked here, before any process starts), each
    given the command's own options (by name); their exit code is this one's."""
    if training.plan.complete:
        return say_complete(training)
    code = training.spawn(options)
    if code:
        raise typer.Exit(code)


def run_planned(training, quiet: bool, verbose: bool = False, plot: bool = True) -> None:
    """Train a planned run with the progress display, then report it: train and finetune."""
    from nanogpt_cli.cli.train_ui import TrainDisplay

    plan = training.plan
    if prints() and plan.auto is not None and not quiet:
        from nanogpt_cli.cli.train_ui import auto_table
        from nanogpt_cli.cli.ui import console

        console.print(auto_table(plan.auto))
    if prints():
        for message in plan.notes:
            note(message)
        for change in plan.changes:  # "--learning-rate 0.001 -> 0.0003 from step 723"
            print(change, flush=True)
    if plan.complete:
        if prints():
            say_complete(training)
        return

    def report(result) -> None:  # under torchrun: while every rank waits, so that none ends the others first
        display.close()
        if prints():
            drawn = report_training(training, result, plot)
            write_card(training, result, drawn, quiet)
            say_ending(plan, result)

    with TrainDisplay(quiet or not prints(), verbose) as display, cut_short(plan):
        result = training.run(display, then=report)
    if result.stopped in ("SIGINT", "SIGTERM"):
        from nanogpt_cli import api

        api.record_error(stopped_line(plan, result))  # every rank: torchrun's report of the stop ends with this line
        raise typer.Exit(stop_code(result.stopped))


@config_options
@one_line_errors
@distill_options
def finetune(
    lora: Annotated[
        bool, typer.Option("--lora", help="Train LoRA adapters on the frozen weights (any --lora-* flag implies it).")
    ] = False,
    lora_r: Annotated[int | None, typer.Option(help="LoRA rank.  [default: 8]", show_default=False)] = None,
    lora_alpha: Annotated[
        float | None, typer.Option(help="LoRA scale: the update is times alpha / r.  [default: 16]", show_default=False)
    ] = None,
    lora_dropout: Annotated[
        float | None, typer.Option(help="Dropout on the adapters' input.  [default: 0]", show_default=False)
    ] = None,
    lora_targets: Annotated[
        str | None,
        typer.Option(
            help="Projections to adapt, comma-separated: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, or attn, "
            "mlp, all.  [default: attn.c_attn]",
            show_default=False,
        ),
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="Named training config (the architecture stays the checkpoint's).")
    ] = None,
    request: RunRequest = None,  # --config, --out, --resume, --force, --init-from, --last (config_options)
    quiet: Quiet = False,
    threads: Threads = None,
    tracker: Tracker = None,
    plot: Plot = True,
    eval_tasks: EvalTasks = None,
    method: Method = "sft",
    beta: Beta = None,
    loss_type: LossType = None,
    rpo_alpha: RPOAlpha = None,
    group_size: GroupSize = None,
    kl: KL = None,
    reward: Reward = None,
    max_new_tokens: MaxNew = None,
    temperature: Temperature = None,
    grpo_updates: Updates = None,
    nproc: Nproc = None,
    nnodes: Nnodes = 1,
    rdzv_endpoint: RdzvEndpoint = None,
    distill: dict | None = None,  # --teacher, --distill-top-k, ... given (distill_options)
):
    """Fine-tune trained weights: all of them, or LoRA adapters (--lora). sft trains on a chat dataset's replies
    (keeping its template), dpo on preference pairs, grpo on rewarded completions of its own, distill on a
    --teacher's next-token distributions (without --init-from: into a new model).

    Example: nanogpt finetune --init-from checkpoints/base --data chats --lora --max-iters 300 --out checkpoints/chat
    """
    request = request.but(flags={"preset": preset} if preset is not None else {})
    given = {"r": lora_r, "alpha": lora_alpha, "dropout": lora_dropout, "targets": lora_targets}
    given = {k: v for k, v in given.items() if v is not None}
    settings = dict(beta=beta, loss_type=loss_type, rpo_alpha=rpo_alpha, group_size=group_size, kl=kl, reward=reward)
    settings |= dict(max_new_tokens=max_new_tokens, rollout_temperature=temperature, grpo_updates=grpo_updates)
    training = while_planning(
        api.plan_finetuning,
        request=request,
        method=method,
        lora=given or lora,  # on --resume with --lora alone: the run's own adapters
        settings=settings,
        distill=distill,
        tracker=tracker,
        eval_tasks=eval_tasks,
        threads=threads,
        nproc=nproc,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
    )
    if training.launch is not None:  # sft and distill (DPO and GRPO were refused)
        own = dict(threads=threads, tracker=tracker, eval_tasks=eval_tasks, quiet=quiet)
        return run_launched(training, {**own, "no_plot": not plot})
    if training.policy is None:
        return run_planned(training, quiet, plot=plot)
    from functools import partial

    run_policy(training, method, quiet, write_card=partial(policy_card, plot=plot, quiet=quiet))


def say_probe(event) -> None:
    """A shape --preset auto's probe timed, as it comes."""
    from nanogpt_cli.cli.train_ui import probe_line

    print(probe_line(event), flush=True)


def say_complete(training) -> None:
    """A run that has nothing left to train: why, and what to raise."""
    from nanogpt_cli.cli.ui import console

    console.print(training.complete_reason)


def report_training(training, result, plot: bool = True) -> tuple[Path | None, str | None]:
    """The summary table and the loss curves' picture (with the plot extra); returns the picture (None: not
    drawn) and why not."""
    from nanogpt_cli.cli.train_ui import train_table
    from nanogpt_cli.cli.ui import console

    console.print(train_table(result))
    return draw_loss(training, plot)


def draw_loss(training, plot: bool = True) -> tuple[Path | None, str | None]:
    """loss.png beside the report (the plot extra): its path (None: not drawn) and why not."""
    if not plot:
        return None, "--no-plot was given"
    drawn, why = training.draw_plot()  # the plot extra (importing matplotlib and drawing take a moment: --no-plot)
    if drawn is None:  # said once, here at the end, where it is seen
        note(f"{training.plan.run_dir.loss_plot_path.name} not drawn: {why}")
    return drawn, why


def say_ending(plan, result) -> None:
    """How the run ended, last: a stop's resume command, --stop-at's, or the clock's end."""
    from nanogpt_cli.cli.ui import console

    if result.stopped in ("SIGINT", "SIGTERM"):  # a stop the user asked for, after a save: a note, not an error
        note(stopped_line(plan, result))
    if result.stopped == "stop_at":
        console.print(f"stopped at step {result.step:,} (--stop-at); resume with: {resume_command(plan)}")
    if result.stopped == "max_time":
        console.print(f"ended at step {result.step:,}: --max-time {plan.train.max_time:g} s was spent")


def policy_card(training, result, plot: bool, quiet: bool) -> None:
    """A DPO or GRPO run's loss.png and report card."""
    write_card(training, result, draw_loss(training, plot), quiet)


def write_card(training, result, drawn: tuple[Path | None, str | None], quiet: bool) -> None:
    """The run's report card, report.md (with its samples and the --eval-tasks scores), and where it is."""
    from nanogpt_cli.cli.ui import err_console

    status = None if quiet else (lambda text: err_console.print(text, style="dim", highlight=False))
    written = training.write_report(result, plot=drawn[0], plot_note=drawn[1], on_status=status)
    if written is not None:  # None: stopped before its first save, nothing to report
        print(f"report: {written} (nanogpt report {training.plan.run_dir})", flush=True)
