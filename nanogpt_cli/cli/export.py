"""export: a run as a Hugging Face folder, a GGUF file or a PEFT adapter (library: interop/export.py).

nanogpt export checkpoints/shk --format hf --out exports/shk
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli.cli.common import load_options, one_line_errors
from nanogpt_cli.config import RUNNING_FIELDS, LoadSpec

# an export writes the weights as they are stored: read in float32 on the CPU, neither cast nor quantized for a run
AS_STORED = "an export writes the weights as stored (float32, on the CPU); --quant sets a GGUF file's types"
EXPORTS = dict.fromkeys(RUNNING_FIELDS, AS_STORED)


@one_line_errors
@load_options(leaves=EXPORTS)
def export(
    out: Annotated[Path, typer.Option(help="Folder to write (hf, peft) or FILE.gguf (gguf).")],
    format: Annotated[
        str,
        typer.Option(
            "--format", help="hf (transformers folder), gguf (llama.cpp file) or peft (a LoRA run's adapter folder)."
        ),
    ] = "hf",
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    quant: Annotated[
        str | None,
        typer.Option(
            help="gguf: the type of the weight matrices: f32 (default), f16, bf16, q8_0, q5_1, q5_0, q4_1 or q4_0."
        ),
    ] = None,
    merge: Annotated[
        bool, typer.Option("--merge", help="A LoRA run: fold its adapters into its base weights (hf, gguf).")
    ] = False,
    base: Annotated[
        str | None,
        typer.Option(
            help="peft: the LoRA run's base, which the adapter is for: hf:NAME, or a Hugging Face folder (the "
            "base's export)."
        ),
    ] = None,
    *,
    spec: LoadSpec,  # the run or model to write (load_options)
):
    """Write a run as a Hugging Face folder or a GGUF file that other tools load.

    Example: nanogpt export checkpoints/shk --format hf --out exports/shk
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console

    result = api.export(spec, out, format, force=force, quant=quant, merge=merge, base=base)
    if result.format == "peft":
        console.print(
            f"wrote {result.path} (PEFT LoRA adapter for the {result.architecture} in {base}); load it with "
            f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base.removeprefix('hf:')!r}), "
            f"{str(result.path)!r})",
            soft_wrap=True,
            highlight=False,
        )
    elif result.format == "hf":
        console.print(
            f"wrote {result.path} ({result.architecture}, {result.tokenizer} tokenizer); load it with "
            f"AutoModelForCausalLM.from_pretrained({str(result.path)!r})",
            soft_wrap=True,
            highlight=False,
        )
    else:
        size = f"{result.bytes / 1e6:,.2f} MB"
        if result.quant != "f32":
            ratio = result.f32_bytes / max(result.bytes, 1)
            size += f", {ratio:.1f}x smaller than float32 ({result.f32_bytes / 1e6:,.2f} MB)"
        console.print(
            f"wrote {result.path} (GGUF, {result.architecture}, {result.tokenizer} tokenizer, {result.quant}: {size})",
            soft_wrap=True,
            highlight=False,
        )
