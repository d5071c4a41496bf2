"""`serve BASE --adapter NAME=LORA_RUN`: LoRA runs of the served base, put on its one copy of the weights and
chosen per request by `model`.

    names = load_adapters(loaded.model, ["legal=checkpoints/legal-lora"], base_digest)   # before the engine
"""

from __future__ import annotations

from nanogpt_cli.errors import NanoGPTError


def parse_adapter(spec: str) -> tuple[str, str]:
    """--adapter NAME=LORA_RUN -> (NAME, LORA_RUN)."""
    name, sep, source = spec.partition("=")
    if not sep or not name.strip() or not source.strip():
        raise NanoGPTError(f"--adapter takes NAME=LORA_RUN (a name and a LoRA run), got {spec!r}")
    return name.strip(), source.strip()


def load_adapters(model, specs: list[str], base_digest: str, base_name: str):
    """Read each --adapter's LoRA run, check it was trained on these base weights (base_digest, lora.weights_hash)
    and put them all on the model: returns the lora.RowAdapters the engine selects with (None without any)."""
    import torch
    from safetensors.torch import load_file

    from nanogpt_cli.interop.source import LoRARun, parse_source
    from nanogpt_cli.lora import LoRAConfig, add_row_adapters, is_adapter_key

    named: dict[str, tuple[LoRAConfig, dict[str, torch.Tensor]]] = {}
    for spec in specs:
        name, source = parse_adapter(spec)
        if name in named or name == base_name:
            raise NanoGPTError(f"--adapter {name!r} names the model twice; give each adapter its own name")
        run = parse_source(source)
        if not isinstance(run, LoRARun):
            raise NanoGPTError(f"--adapter {name}={source} is not a LoRA run (nanogpt finetune --lora makes one)")
        meta = run.meta
        if run.base_sha256 != base_digest:
            raise NanoGPTError(
                f"--adapter {name}={source} was trained on other base weights ({meta['base']['source']}) than "
                "the served model's"
            )
        tensors = {k: t for k, t in load_file(str(run.weights)).items() if is_adapter_key(k)}
        named[name] = (LoRAConfig.from_dict(meta["lora"]), tensors)
    return add_row_adapters(model, named) if named else None
