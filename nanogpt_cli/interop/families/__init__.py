"""The Hugging Face families nanogpt converts, one record per file (base.Family): config in and out, tensor
names and transforms, the llama.cpp architecture, what each refuses. A new family is one new file here, its
entry below, and its parameters in tests/test_families.py.

    family = FAMILIES[hf_config.model_type]
"""

from __future__ import annotations

from nanogpt_cli.interop.families import gemma3, gpt2, gpt_neox, llama, mistral, qwen2, qwen3
from nanogpt_cli.interop.families.base import Biases, Family

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (gpt2.FAMILY, llama.FAMILY, gpt_neox.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, gemma3.FAMILY)
}
# llama.cpp's architecture -> the family a file of it reads as (the first that writes it: llama, not Mistral)
GGUF_FAMILIES: dict[str, str] = {}
for _f in FAMILIES.values():
    GGUF_FAMILIES.setdefault(_f.gguf_arch, _f.model_type)

__all__ = ["FAMILIES", "GGUF_FAMILIES", "Biases", "Family"]
