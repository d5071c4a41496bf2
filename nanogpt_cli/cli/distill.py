"""finetune --method distill and prepare --teacher: the options, and the thin commands over training/distill.py.

nanogpt finetune --method distill --teacher smol.gguf --data shk-smol --preset cpu --out checkpoints/draft
"""

from __future__ import annotations

from typing import Annotated

import typer

from nanogpt_cli.cli.common import prints

Teacher = Annotated[
    str | None,
    typer.Option(
        help="Distillation's teacher, any source --init-from takes (a run, .safetensors, .gguf, Hugging Face folder "
        "or hf:NAME); it must share the data's tokenizer.",
        show_default=False,
    ),
]
TopK = Annotated[
    int | None,
    typer.Option(
        help="Distillation: the teacher's most likely tokens kept per position, the rest as one bucket; 0: the full "
        "vocabulary (a live teacher only).  [default: 32]",
        show_default=False,
    ),
]
DistillTemperature = Annotated[
    float | None,
    typer.Option(help="Distillation: the temperature of the teacher's and the student's softmax.  [default: 1]"),
]
DistillAlpha = Annotated[
    float | None,
    typer.Option(
        help="Distillation: the weight of the KL to the teacher; the data's cross-entropy gets 1 - alpha.  "
        "[default: 0.5]",
        show_default=False,
    ),
]
OnPolicy = Annotated[
    float | None,
    typer.Option(
        help="Distillation: the share of rows the student writes itself (the second half of each, sampled) and the "
        "live teacher scores (GKD).  [default: 0]",
        show_default=False,
    ),
]
TeacherContext = Annotated[
    int, typer.Option(help="prepare --teacher: the tokens of each chunk the teacher reads (its context).")
]


def distill_settings(method: str, teacher, top_k, temperature, alpha, on_policy):
    """The distillation's settings (None: a flag not given), or a refusal of distillation flags on another method."""
    from nanogpt_cli.errors import NanoGPTError
    from nanogpt_cli.training.distill import FLAGS, DistillSettings

    settings = DistillSettings(teacher, top_k, temperature, alpha, on_policy)
    if method != "distill" and settings.given():
        raise NanoGPTError(f"{', '.join(FLAGS[k] for k in settings.given())} go with --method distill")
    return settings


def run_distill(flags, file_values, settings, where: dict, lora, lora_flags, quiet: bool, sink, plot, tasks) -> None:
    """finetune --method distill: the planned run through train's loop and display, with the distillation's loss."""
    from nanogpt_cli.cli.stops import while_planning
    from nanogpt_cli.cli.train import run_planned
    from nanogpt_cli.training.distill import plan_distill

    job = while_planning(plan_distill, flags, file_values, settings, **where, lora=lora, lora_flags=lora_flags)
    run_planned(job.plan, quiet, sink, job.trainable, plot=plot, eval_tasks=tasks, loss=job.loss)


def label_with_teacher(data_dir, name: str, teacher: str, top_k: int | None, temperature: float | None, context: int):
    """prepare --teacher: the prepared dataset labeled by the teacher, with its progress and what it cost."""
    from nanogpt_cli.training.distill import DEFAULTS, label_dataset

    def progress(done: int, total: int) -> None:
        if prints():
            print(f"teacher: {done:,} / {total:,} tokens", flush=True)

    top_k = DEFAULTS["top_k"] if top_k is None else top_k
    temperature = DEFAULTS["temperature"] if temperature is None else temperature
    record = label_dataset(data_dir, name, teacher, top_k, temperature, context, on_progress=progress)
    print(
        f"labeled the train split of {name} with {teacher}'s top-{record['top_k']} at temperature "
        f"{record['temperature']:g}: {record['bytes_per_token']} bytes per token beside the tokens, "
        f"{record['seconds']:,.0f} s"
    )
