"""train and finetune: thin commands over training/ (planning, the loop, --nproc), with the progress display.

nanogpt train --data shakespeare-char --preset cpu-char --out checkpoints/shk
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli.cli.common import Threads, config_options, note, one_line_errors, prints
from nanogpt_cli.cli.distill import distill_options, is_distill
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
    sft_planned,
)
from nanogpt_cli.cli.stops import cut_short, resume_command, stop_code, stopped_line, while_planning
from nanogpt_cli.config import PRESETS
from nanogpt_cli.errors import NanoGPTError

# options that train and finetune share, declared once
RunConfig = Annotated[Path | None, typer.Option("--config", help="TOML file of config keys; flags override it.")]
RunOut = Annotated[Path | None, typer.Option("--out", help="Run folder (default checkpoints/DATA-TIMESTAMP).")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the run in --out where it stopped.")]
Force = Annotated[bool, typer.Option("--force", help="Start over in an --out that holds a run (deletes it).")]
InitFrom = Annotated[
    str | None,
    typer.Option(
        help="The weights to start from, with a fresh optimizer: a run folder or a run's name in checkpoints/ (a "
        "LoRA run merged on its base), a .safetensors file, a .gguf file (ours or llama.cpp's), a Hugging Face "
        "folder or hf:NAME (not needed with --resume).",
        show_default=False,
    ),
]
InitLast = Annotated[bool, typer.Option("--last", help="With --init-from RUN: its last weights, not its best.")]
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
    config: RunConfig = None,
    out: RunOut = None,
    resume: Resume = False,
    force: Force = False,
    init_from: InitFrom = None,
    quiet: Quiet = False,
    plot: Plot = True,
    last: InitLast = False,
    threads: Threads = None,
    tracker: Tracker = None,
    eval_tasks: EvalTasks = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print the whole config at the start.")] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            help="Train in N processes on this machine (one per GPU, or gloo on the CPU), launched by torch's "
            "elastic launcher.",
            show_default=False,
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option(help="With --nproc: machines taking part, each running this command.")] = 1,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(help="With --nnodes: HOST:PORT where the machines meet (the same on each).", show_default=False),
    ] = None,
    flags: dict | None = None,  # the config options given (config_options)
):
    """Train a GPT on a prepared dataset, with checkpoints you can resume.

    Example: nanogpt train --data shakespeare-char --preset cpu-char --out checkpoints/shk
    """
    from nanogpt_cli.config import load_toml
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.training.job import TrainRequest, plan_train
    from nanogpt_cli.training.trackers import open_tracker

    given = dict(flags or {})
    tasks = check_eval_tasks(eval_tasks)
    set_threads(threads)
    if nproc is not None and tracker:  # the processes open it; an unknown one or a missing extra is refused here
        open_tracker(tracker).close()
    sink = open_tracker(tracker) if tracker and prints() and nproc is None else None  # refused first, too
    request = TrainRequest(
        flags=dict(given, **({"preset": preset} if preset is not None else {})),
        file_values=load_toml(config) if config else {},
        out=out,
        resume=resume,
        force=force,
        init_from=init_from,
        init_last=last,
        nproc=nproc,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        on_probe=say_probe if prints() and not quiet else None,
    )
    job = while_planning(plan_train, request)
    if job.launch is not None:  # everything was checked here, before any process starts
        options = dict(preset=preset, config=config, init_from=init_from, threads=threads, tracker=tracker)
        switches = dict(resume=resume, force=force, quiet=quiet, last=last, verbose=verbose, no_plot=not plot)
        return launch_training(job.plan, job.launch, given, {**options, **switches})
    run_planned(job.plan, quiet, sink, job.trainable, verbose, plot, tasks)


def check_eval_tasks(eval_tasks: str | None) -> list[str] | None:
    """--eval-tasks: the names, checked before anything trains (and lm-eval installed)."""
    if eval_tasks is None:
        return None
    from nanogpt_cli.errors import require
    from nanogpt_cli.inference.tasks import check_options

    names = check_options([eval_tasks], None, None, None)
    require("lm_eval", "eval", "scoring lm-eval tasks", package="lm-eval")
    return names


def run_planned(
    plan, quiet: bool, sink, trainable=None, verbose: bool = False, plot: bool = True, eval_tasks=None, loss=None
) -> None:
    """Train a planned run with the progress display (and a tracker's sink), then report it: train and finetune."""
    from nanogpt_cli.cli.train_ui import TrainDisplay
    from nanogpt_cli.training.distributed import open_world
    from nanogpt_cli.training.trackers import Tee
    from nanogpt_cli.training.trainer import Trainer

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
            say_complete(plan)
        return
    # under torchrun the process group is left only after rank 0 has printed, so no rank ends (and has
    # torchrun stop the others) before
    with open_world(plan.train) as world:
        try:
            with TrainDisplay(quiet or not prints(), verbose) as display, cut_short(plan):
                hooks = dict(trainable=trainable, **({"loss": loss} if loss is not None else {}))  # loss: distill's
                result = Trainer(plan, Tee(display, sink) if sink else display, world, **hooks).fit()
        finally:
            if sink is not None:
                sink.close()
        if prints():
            drawn = report_training(plan, result, plot)
            write_card(plan, result, drawn, eval_tasks, quiet)
            say_ending(plan, result)
    if result.stopped in ("SIGINT", "SIGTERM"):
        from nanogpt_cli.training.launch import record_error

        record_error(stopped_line(plan, result))  # every rank: torchrun's report of the stop ends with this line
        raise typer.Exit(stop_code(result.stopped))


@config_options
@one_line_errors
@distill_options
def finetune(
    init_from: InitFrom = None,
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
    config: RunConfig = None,
    out: RunOut = None,
    resume: Resume = False,
    force: Force = False,
    last: InitLast = False,
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
    distill=None,  # the distillation options (distill_options)
    flags: dict | None = None,  # the config options given (config_options)
):
    """Fine-tune trained weights: all of them, or LoRA adapters (--lora). sft trains on a chat dataset's replies
    (keeping its template), dpo on preference pairs, grpo on rewarded completions of its own.

    Example: nanogpt finetune --init-from checkpoints/base --data chats --lora --max-iters 300 --out checkpoints/chat
    """
    from nanogpt_cli.config import load_toml
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.lora import DEFAULT_TARGETS, LoRAConfig
    from nanogpt_cli.training.finetune import plan_finetune
    from nanogpt_cli.training.trackers import open_tracker

    flags = dict(flags or {}, **({"preset": preset} if preset is not None else {}))
    tasks = check_eval_tasks(eval_tasks)
    set_threads(threads)
    sink = open_tracker(tracker) if tracker and prints() else None
    given = {"r": lora_r, "alpha": lora_alpha, "dropout": lora_dropout, "targets": lora_targets}
    given = {k: v for k, v in given.items() if v is not None}
    lora_cfg = None  # on --resume without --lora-* values: the run's own
    if given or (lora and not resume):
        targets = given.pop("targets", None)
        lora_cfg = LoRAConfig(**given, targets=(targets,) if targets is not None else DEFAULT_TARGETS)
    where = dict(out=out, resume=resume, force=force, init_from=init_from, init_last=last)
    lora_flags = set(given) | ({"targets"} if lora_targets is not None else set())
    file_values = load_toml(config) if config else {}
    if is_distill(method, distill):  # it plans its own start: a new model when --init-from is absent
        return run_distill(flags, file_values, distill, where, lora_cfg, lora_flags, quiet, sink, plot, tasks)
    job = while_planning(plan_finetune, flags, file_values, **where, lora=lora_cfg, lora_flags=lora_flags)
    if method == "sft" and sft_planned(job.plan):
        return run_planned(job.plan, quiet, sink, job.trainable, plot=plot, eval_tasks=tasks)
    settings = dict(beta=beta, loss_type=loss_type, rpo_alpha=rpo_alpha, group_size=group_size, kl=kl, reward=reward)
    settings |= dict(max_new_tokens=max_new_tokens, rollout_temperature=temperature, grpo_updates=grpo_updates)
    run_policy(job, method, settings, quiet, sink)


def run_distill(flags, file_values, settings, where: dict, lora, lora_flags, quiet, sink, plot, tasks) -> None:
    """finetune --method distill: planned by training/distill.py, trained by train's loop with its loss."""
    from nanogpt_cli.training.distill import plan_distill

    job = while_planning(plan_distill, flags, file_values, settings, **where, lora=lora, lora_flags=lora_flags)
    run_planned(job.plan, quiet, sink, job.trainable, plot=plot, eval_tasks=tasks, loss=job.loss)


def launch_training(plan, how, given: dict, options: dict) -> None:
    """train --nproc: the planned run (its refusals already said) in how.world_size processes, each running this
    command without the launch flags (given: the config options given; options: train's own) and with the run
    folder planned here."""
    from nanogpt_cli.training.distributed import rank_device
    from nanogpt_cli.training.launch import launch, train_args

    if plan.complete:
        return say_complete(plan)
    rank_device(plan.train.device, how.nproc - 1)  # --device cuda:N, or more processes than GPUs: one line here
    code = launch(train_args(given, options, plan.run_dir.path), how)
    if code:
        raise typer.Exit(code)


def say_probe(event) -> None:
    """A shape --preset auto's probe timed, as it comes."""
    from nanogpt_cli.cli.train_ui import probe_line

    print(probe_line(event), flush=True)


def say_complete(plan) -> None:
    """A run that has nothing left to train: why, and what to raise."""
    from nanogpt_cli.cli.ui import console
    from nanogpt_cli.training.job import complete_reason

    console.print(complete_reason(plan))


def report_training(plan, result, plot: bool = True) -> tuple[str | None, str | None]:
    """The summary table and the loss curves' picture (with the plot extra); returns the picture's file name
    (None: not drawn) and why not."""
    from nanogpt_cli.cli.train_ui import train_table
    from nanogpt_cli.cli.ui import console

    console.print(train_table(result))
    drawn: tuple[str | None, str | None] = (None, "--no-plot was given")
    if plot:  # the plot extra: a picture of the curves (importing matplotlib and drawing take a moment: --no-plot)
        from nanogpt_cli.inspect.plot import write_png

        try:
            write_png([plan.run_dir.path], plan.run_dir.loss_plot_path)
            drawn = (plan.run_dir.loss_plot_path.name, None)
        except NanoGPTError as e:  # said once, here at the end, where it is seen
            note(f"{plan.run_dir.loss_plot_path.name} not drawn: {e}")
            drawn = (None, str(e))
    return drawn


def say_ending(plan, result) -> None:
    """How the run ended, last: a stop's resume command, --stop-at's, or the clock's end."""
    from nanogpt_cli.cli.ui import console

    if result.stopped in ("SIGINT", "SIGTERM"):  # a stop the user asked for, after a save: a note, not an error
        note(stopped_line(plan, result))
    if result.stopped == "stop_at":
        console.print(f"stopped at step {result.step:,} (--stop-at); resume with: {resume_command(plan)}")
    if result.stopped == "max_time":
        console.print(f"ended at step {result.step:,}: --max-time {plan.train.max_time:g} s was spent")


def write_card(plan, result, drawn: tuple[str | None, str | None], eval_tasks: list[str] | None, quiet: bool) -> None:
    """The run's report card, report.md (with its samples and the --eval-tasks scores), and where it is."""
    from nanogpt_cli.cli.ui import err_console
    from nanogpt_cli.inspect.report import write_report

    if not plan.run_dir.has_run() or plan.run_dir.is_empty():  # stopped before its first save: nothing to report
        return
    status = None if quiet else (lambda text: err_console.print(text, style="dim", highlight=False))
    write_report(plan.run_dir, result, eval_tasks=eval_tasks, plot=drawn[0], plot_note=drawn[1], on_status=status)
    print(f"report: {plan.run_dir.report_path} (nanogpt report {plan.run_dir})", flush=True)
