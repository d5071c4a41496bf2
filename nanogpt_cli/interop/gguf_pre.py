"""llama.cpp's pre-tokenizers (a GGUF's `tokenizer.ggml.pre`): the names it knows and how each cuts text into the
pieces its byte-level BPE then merges, written as a Hugging Face tokenizer.json would cut them. A tokenizer.json
goes out under the name that cuts text exactly as it does; a name read from a GGUF comes back in as that cut.

    llama_pre(json.loads(text), "SmolLM2") -> "smollm";  pre_tokenizer("qwen2") -> (a tokenizers PreTokenizer, False)

llama.cpp (llama-vocab.cpp) gives each name a list of regexes applied one after the other, each cutting the pieces
the one before left, and keeps what no regex matches as pieces too: what a tokenizer.json's Sequence of Split
(isolated), Digits and ByteLevel (GPT-2's regex) pre-tokenizers does. Two tokenizers cut alike when those lists
are the same; llama.cpp rewrites some regexes for its own engine (the case-blind `(?i:'s|...)` as `'[sS]|...`),
and a name is matched on the tokenizer.json spelling it was written for. Several names cut alike and differ only
in settings that do not change the ids (clean_spaces, which llama.cpp applies when detokenizing a whole text):
PRE keeps one of each, and ALIASES maps the others to it, for reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import PATTERNS

PRE_KEY = "tokenizer_pre"  # in a model's metadata: the tokenizer.ggml.pre of the GGUF file it was read from
DIGIT, DIGITS = r"\p{N}", r"\p{N}+"  # Digits(individual_digits=True / False)
GPT2 = PATTERNS["gpt2"]  # ByteLevel(use_regex=True) cuts with GPT-2's regex
LLAMA3 = PATTERNS["gpt4"]  # cl100k_base's; Llama 3's tokenizer.json spells it so
GPT4O = PATTERNS["gpt4o"]  # o200k_base's
QWEN2 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)  # Qwen2, Qwen2.5 and Qwen3: Llama 3's with one digit a piece
QWEN35 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)  # Qwen3.5: Qwen2's with combining marks kept on their letters
TEKKEN = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)  # Mistral's tekken (Mistral NeMo)
# the case-blind contractions as llama.cpp rewrites them, and as tokenizer.json files spell them
_CONTRACTIONS = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)")


@dataclass(frozen=True)
class Pre:
    """How a llama.cpp pre-tokenizer turns text into the pieces BPE merges within."""

    splits: tuple[str, ...]  # regexes, each cutting the pieces the one before left (tokenizer.json spelling)
    ignore_merges: bool = False  # a piece that is a token of the vocabulary is that token, whatever the merges


PRE = {  # llama.cpp's name -> its cut; of names that cut alike, the one nanogpt writes
    "gpt-2": Pre((GPT2,)),  # GPT-2, GPT-NeoX and Pythia, OLMo, Phi-2
    "smollm": Pre((DIGIT, GPT2)),  # SmolLM, SmolLM2, StarCoder: GPT-2's with one digit a piece
    "llama-bpe": Pre((LLAMA3,), ignore_merges=True),  # Llama 3, 3.1, 3.2
    "dbrx": Pre((LLAMA3,)),  # Llama 3's regex, the merges always applied
    "qwen2": Pre((QWEN2,)),
    "qwen35": Pre((QWEN35,)),
    "gpt-4o": Pre((GPT4O,)),
    "tekken": Pre((TEKKEN,), ignore_merges=True),
}
ALIASES = {  # other names llama.cpp cuts as one in PRE (llama-vocab.cpp), and the one they cut as
    **dict.fromkeys(
        ["phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion", "granite-docling"]
        + ["jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "modern-bert"],
        "gpt-2",
    ),
    **dict.fromkeys(["starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], "smollm"),
    **dict.fromkeys(["llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"], "llama-bpe"),
    **dict.fromkeys(["smaug-bpe"], "dbrx"),
    **dict.fromkeys(["deepseek-r1-qwen", "stablelm2", "megrez", "kormo", "grok-2"], "qwen2"),
    **dict.fromkeys(["llama4", "minimax-m2", "kanana2"], "gpt-4o"),
}


def llama_pre(spec: dict[str, Any], name: str, carried: str | None = None) -> str:
    """The llama.cpp pre-tokenizer that cuts text as the byte-level BPE tokenizer.json `spec` does (named `name` in
    a refusal): `carried` (the name a GGUF it came from gave) when that name cuts so, else the first in PRE that
    does; one sentence when none does."""
    cut = hf_cut(spec)
    if carried is not None and cut is not None and PRE.get(ALIASES.get(carried, carried)) == cut:
        return carried
    found = next((n for n, pre in PRE.items() if pre == cut), None)
    if found is not None:
        return found
    raise NanoGPTError(
        f"llama.cpp has no pre-tokenizer that cuts text as the {name} tokenizer's ({describe(spec)}) does, so a "
        "GGUF export would tokenize differently; export it with --format hf instead"
    )


def hf_cut(spec: dict[str, Any]) -> Pre | None:
    """The cut a byte-level BPE tokenizer.json makes before merging, as a Pre; None when it is not one llama.cpp can
    make: a step other than Split (a regex, isolated), Digits and a final ByteLevel without a prefix space, or a
    normalizer llama.cpp does not apply (NFC, which llama.cpp's converter takes for Qwen's and Pythia's, is kept:
    it changes only text not already composed)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre] if pre else []
    if (spec.get("normalizer") or {}).get("type") not in (None, "NFC"):
        return None
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    splits = []
    for step in steps[:-1]:
        kind, pattern = step.get("type"), step.get("pattern") or {}
        if kind == "Digits":
            splits.append(DIGIT if step.get("individual_digits") else DIGITS)
        elif kind == "Split" and "Regex" in pattern and step.get("behavior") == "Isolated" and not step.get("invert"):
            splits.append(pattern["Regex"].replace(*_CONTRACTIONS))
        else:
            return None
    if steps[-1].get("use_regex", True):
        splits.append(GPT2)
    return Pre(tuple(splits), bool((spec.get("model") or {}).get("ignore_merges")))


def describe(spec: dict[str, Any]) -> str:
    """The tokenizer.json's pre-tokenizer steps in a few words ("Digits + ByteLevel"), for a refusal."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre] if pre else []
    words = " + ".join(str(s.get("type")) for s in steps) or "no pre-tokenizer"
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        words += f", a {normalizer} normalizer"
    return words + (", ignore_merges" if (spec.get("model") or {}).get("ignore_merges") else "")


def pre_tokenizer(name: str):
    """(a tokenizers PreTokenizer, ignore_merges) that cut as llama.cpp's pre-tokenizer `name` does, ending in the
    byte-level step; None for a name nanogpt does not know."""
    import tokenizers as tk

    pre = PRE.get(ALIASES.get(name, name))
    if pre is None:
        return None
    steps = []
    regex = pre.splits[-1] == GPT2  # the last cut is GPT-2's regex: ByteLevel's own
    for split in pre.splits[:-1] if regex else pre.splits:
        if split in (DIGIT, DIGITS):
            steps.append(tk.pre_tokenizers.Digits(individual_digits=split == DIGIT))
        else:
            steps.append(tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated"))
    steps.append(tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex))
    return (steps[0] if len(steps) == 1 else tk.pre_tokenizers.Sequence(steps)), pre.ignore_merges
