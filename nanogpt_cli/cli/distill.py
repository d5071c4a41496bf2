"""finetune --method distill and prepare --teacher: the options, which reach api.plan_finetuning and
api.label_with_teacher.

nanogpt finetune --method distill --teacher smol.gguf --data shk-smol --preset cpu --out checkpoints/draft
"""

from __future__ import annotations

import functools
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
    typer.Option(
        help="Distillation: the temperature of the teacher's and the student's softmax.  [default: 1]",
        show_default=False,
    ),
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


OPTIONS = {
    "teacher": Teacher,
    "distill_top_k": TopK,
    "distill_temperature": DistillTemperature,
    "distill_alpha": DistillAlpha,
    "on_policy_fraction": OnPolicy,
}


def _extended(command, extra: dict, call):
    """`command` with the options `extra` (name -> (Annotated type, default)) added to its own, as config_options
    adds the config fields: run as call(command, given, kwargs), `given` holding the added options' values."""
    import inspect
    import typing

    hints = typing.get_type_hints(command, include_extras=True)
    parameters = inspect.signature(command).parameters.values()
    own = [p.replace(annotation=hints[p.name]) for p in parameters if p.name != "distill"]
    keyword = inspect.Parameter.KEYWORD_ONLY
    added = [inspect.Parameter(n, keyword, default=d, annotation=kind) for n, (kind, d) in extra.items()]

    @functools.wraps(command)
    def run(**kwargs):
        return call(command, {n: kwargs.pop(n) for n in extra}, kwargs)

    params = own + added
    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def settings_of(given: dict) -> dict:
    """The distillation options given, by DistillSettings' field names (api.plan_finetuning's distill=)."""
    return {n.removeprefix("distill_"): v for n, v in given.items() if n in OPTIONS and v is not None}


def distill_options(command):
    """finetune's own options plus the distillation's, which reach it as one dict, `distill` (the options given,
    by DistillSettings' field names)."""

    def call(command, given: dict, kwargs: dict):
        return command(**kwargs, distill=settings_of(given))

    return _extended(command, {n: (kind, None) for n, kind in OPTIONS.items()}, call)


def teacher_options(command):
    """prepare's own options plus --teacher, --distill-top-k, --distill-temperature and --teacher-context: once
    the dataset is prepared, the teacher labels its train split (label_with_teacher)."""
    from nanogpt_cli.errors import NanoGPTError

    def call(command, given: dict, kwargs: dict):
        settings = settings_of(given)
        if settings.get("teacher") is not None and (kwargs.get("name") is None or kwargs.get("compare")):
            raise NanoGPTError("--teacher labels the dataset prepared: give --name, without --compare")
        done = command(**kwargs)
        label_with_teacher(kwargs["data_dir"], kwargs["name"], settings, given["teacher_context"])
        return done

    extra = {n: (OPTIONS[n], None) for n in ("teacher", "distill_top_k", "distill_temperature")}
    return _extended(command, {**extra, "teacher_context": (TeacherContext, 512)}, call)


def label_with_teacher(data_dir, name: str, settings: dict, context: int) -> None:
    """prepare --teacher: the prepared dataset labeled by the teacher (none given: nothing), with its progress and
    what it cost."""
    from nanogpt_cli import api

    def progress(done: int, total: int) -> None:
        if prints():
            print(f"teacher: {done:,} / {total:,} tokens", flush=True)

    if settings.get("teacher") is None:
        return
    teacher = settings["teacher"]
    top_k, temperature = settings.get("top_k"), settings.get("temperature")
    record = api.label_with_teacher(
        name, teacher, data_dir=data_dir, top_k=top_k, temperature=temperature, context=context, progress=progress
    )
    print(
        f"labeled the train split of {name} with {teacher}'s top-{record['top_k']} at temperature "
        f"{record['temperature']:g}: {record['bytes_per_token']} bytes per token beside the tokens, "
        f"{record['seconds']:,.0f} s"
    )
