"""Export a run for other tools: a Hugging Face folder (transformers, pipelines, lm-eval) or one GGUF file
(llama.cpp, ollama, LM Studio).

    export("checkpoints/shk", "hf", Path("exports/shk"))  # then AutoModelForCausalLM.from_pretrained("exports/shk")

A Hugging Face folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with the run's chat template, when it was fine-tuned on chats); gguf_file.py writes the
GGUF file. A LoRA run exports merged (--merge: the adapters folded into its base), or as a PEFT adapter folder
(adapter_config.json, adapter_model.safetensors) for the Hugging Face export of its base.

Which stock architecture a run becomes is decided in `hf.hf_kind`; a config that no stock architecture computes
exactly is refused, never approximated. Everything is built in a temporary folder (or file) beside the target
and renamed into place, so a refusal or a crash leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogpt_cli.errors import NanoGPTError, first_line
from nanogpt_cli.interop import hf
from nanogpt_cli.interop.gguf_pre import PRE_KEY
from nanogpt_cli.interop.loading import build_model, tokenizer_of
from nanogpt_cli.interop.source import LoRARun, Source, parse_source
from nanogpt_cli.model import GPT

FORMATS = ("hf", "gguf", "peft")
ORIGIN_KEY = "nanogpt_origin"  # in an exported config.json: the run, step and dataset the weights came from


@dataclass
class ExportResult:
    path: Path  # the folder (hf) or file (gguf) written
    format: str  # hf | gguf
    architecture: str  # the transformers class, or the GGUF architecture
    tokenizer: str  # gpt2 | char | byte | a trained tokenizer's name
    quant: str = "f32"  # gguf: the type of its matrices
    bytes: int = 0  # gguf: the file's size
    f32_bytes: int = 0  # gguf: the size the same file has in float32


def export(
    source: str | Path | Source,
    fmt: str,
    out: str | Path,
    last: bool = False,
    force: bool = False,
    quant: str | None = None,
    merge: bool = False,
    base: str | Path | None = None,
) -> ExportResult:
    """Export a run folder or .safetensors checkpoint (or a Hugging Face folder / hf:NAME) to `out`. quant: the
    GGUF type of the matrices (gguf_file.QUANTS; default f32). A LoRA run: `merge` for hf and gguf; `base` (its
    base: hf:NAME, or a Hugging Face folder such as the base's export) for peft."""
    if fmt not in FORMATS:
        raise NanoGPTError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if quant is not None and fmt != "gguf":
        raise NanoGPTError("--quant applies to --format gguf only")
    if base is not None and fmt != "peft":
        raise NanoGPTError("--base applies to --format peft only")
    source = parse_source(source, last)  # a bare run name: the run under checkpoints/, which the origin names
    lora = source if isinstance(source, LoRARun) else None
    if fmt == "peft":
        if lora is None:
            raise NanoGPTError(f"{source.location} is not a LoRA run; --format peft writes a LoRA run's adapters")
        if merge:
            raise NanoGPTError("--merge folds the adapters in, and --format peft writes them apart; give one")
        if base is None:
            raise NanoGPTError(f"--format peft needs --base: {_base_hint(lora.meta['base']['source'])}")
        return export_peft(lora, str(base), Path(out), force)
    if lora is not None and not merge:
        raise NanoGPTError(
            f"{source.location} is a LoRA run (adapters on {lora.meta['base']['source']}); export it with --merge "
            "(the adapters folded into the base) or as an adapter with --format peft --base BASE"
        )
    if lora is None and merge:
        raise NanoGPTError(f"--merge folds a LoRA run's adapters into its base; {source.location} holds whole weights")
    model, meta = load_source(source)
    template = meta.get("chat_template") if isinstance(meta.get("chat_template"), str) else None
    # a Hugging Face tokenizer is its tokenizer.json, which came with the source: the export gets a copy
    tokenizer = tokenizer_of(meta, source) if meta["tokenizer"].get("kind") == "hf" else None
    if fmt == "hf":
        origin = origin_of(source, meta)
        family = meta.get(hf.FAMILY_KEY)
        return export_hf(model, meta["tokenizer"], Path(out), force, origin, template, tokenizer, family)
    family, pre = meta.get(hf.FAMILY_KEY), meta.get(PRE_KEY)  # a GGUF source's own pre-tokenizer name goes out again
    return export_gguf(model, meta["tokenizer"], Path(out), force, quant or "f32", template, tokenizer, family, pre)


def load_source(source: Source) -> tuple[GPT, dict[str, Any]]:
    """Our model and its metadata (the tokenizer's description in it) from one of our checkpoints or a Hugging
    Face model; a LoRA run comes merged."""
    model, meta = build_model(source)
    if "tokenizer" not in meta:
        raise NanoGPTError(f"{source} has no tokenizer in its metadata, so it cannot be exported with one")
    return model, meta


def origin_of(source: Source, meta: dict[str, Any]) -> dict[str, Any]:
    """Where exported weights came from (ORIGIN_KEY's value): the run, the source named, step, tokens, dataset."""
    from nanogpt_cli import __version__

    path = Path(source.location)  # a run's name: its folder under checkpoints/
    run = path if path.is_dir() else path.parent  # a weights file names its run folder
    origin = {"run": str(run), "source": str(path), "version": __version__}
    origin.update({k: meta[k] for k in ("step", "tokens", "dataset", "val_loss") if meta.get(k) is not None})
    return origin


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise NanoGPTError(f"{out} already exists; pass --force to replace it")


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished tmp into out, with the modes of files the user makes (safetensors writes 0600); an
    existing out (--force) is set aside first and removed after."""
    from nanogpt_cli.files import usual_modes

    usual_modes(tmp)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink(missing_ok=True)


def _staging(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


# --- Hugging Face ---------------------------------------------------------------------------------------


def export_hf(
    model: GPT,
    desc: dict[str, Any],
    out: Path,
    force: bool = False,
    origin: dict[str, Any] | None = None,
    chat_template: str | None = None,
    tokenizer=None,
    family: str | None = None,
) -> ExportResult:
    """Write a folder that AutoModelForCausalLM, AutoTokenizer and pipeline("text-generation") load offline.
    origin: where the weights came from (run, step, ...), kept under ORIGIN_KEY in config.json for `info`. With
    a chat template, `apply_chat_template` renders conversations as the run was trained on them, and generation
    stops where the template ends a reply. tokenizer: the HFTokenizer a Hugging Face description needs; its
    tokenizer.json is copied as it is, and its BOS/EOS settings and end-of-turn ids are written back. family: the
    Hugging Face family the model was imported from, written back when it holds the config (hf.hf_kind)."""
    transformers = hf.require("transformers")
    kind = hf.hf_kind(model.config, family)  # refusals first: nothing is written before every check has passed
    if desc.get("kind") == "hf":
        tok, eot = hf.require("tokenizers").Tokenizer.from_str(tokenizer.text), tokenizer.settings["eos_token"]
    else:
        tok, eot = hf.tokenizers_object(desc)
    if desc["vocab_size"] > model.config.vocab_size:
        raise NanoGPTError(
            f"the tokenizer has {desc['vocab_size']:,} tokens but the model only {model.config.vocab_size:,}"
        )
    _check_target(out, force)
    eot_id = tok.token_to_id(eot) if eot is not None else None
    special = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": None}
    if tokenizer is not None:
        special = _hf_special(tokenizer)
    hf_model = hf.to_hf(model, special, kind)  # float32 on the CPU, whatever the model's dtype and device
    _, extra = hf.hf_config_for(model.config, kind, special)

    tmp = _staging(out)
    try:
        with hf.quiet_transformers():
            hf_model.save_pretrained(tmp)
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config.update(extra)
        if origin:  # transformers keeps unknown keys as config attributes; `info` and `runs` read this one
            config[ORIGIN_KEY] = origin
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # a padded head (vocab_size above the tokenizer's) never picks a token the tokenizer lacks, as in ours
        padding = list(range(desc["vocab_size"], model.config.vocab_size))
        stops = _reply_stops(chat_template, tok, eot_id) if chat_template else {}
        generation = transformers.GenerationConfig(
            **{**special, **stops}, **({"suppress_tokens": padding} if padding else {})
        )
        generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_files(tmp)  # the file itself, byte for byte
        else:
            tok.save(str(tmp / "tokenizer.json"))
        # written here, not by save_pretrained: transformers 5 names its own backend class, which 4.x cannot load
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model.config.block_size,
            "clean_up_tokenization_spaces": False,
        }
        if tokenizer is not None:
            tokenizer_config.update(_hf_tokenizer_config(tokenizer))
        elif eot is not None:
            tokenizer_config.update(bos_token=eot, eos_token=eot, unk_token=eot)
        if chat_template:
            tokenizer_config["chat_template"] = chat_template
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(out, "hf", hf.ARCHS[kind][3], desc["name"])


def _hf_special(tokenizer) -> dict[str, Any]:
    """config.json's and generation_config.json's BOS, EOS and pad ids for a Hugging Face tokenizer: EOS is the list
    of ids that end a reply (its end-of-turn ids with EOS) when there are several, as the model's own files say."""
    stops = list(tokenizer.stop_ids)
    eos = stops if len(stops) > 1 else (stops[0] if stops else None)
    s = tokenizer.settings
    return {
        "bos_token_id": tokenizer.token_id(s["bos_token"]),
        "eos_token_id": eos,
        "pad_token_id": tokenizer.token_id(s["pad_token"]),
    }


def _hf_tokenizer_config(tokenizer) -> dict[str, Any]:
    """tokenizer_config.json's special tokens and add_bos_token / add_eos_token, as they were read."""
    s = tokenizer.settings
    config = {k: s[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if s[k]}
    config.update({k: s[k] for k in ("add_bos_token", "add_eos_token") if s[k] is not None})
    return config


def _reply_stops(template: str, tok, eot_id: int | None) -> dict[str, Any]:
    """generation_config entries that end a reply where the template ends an assistant turn: its end token among
    the stop ids, or, when that text is several tokens (char and byte vocabularies), a stop string."""
    from nanogpt_cli.data.chat import turn_end

    end = turn_end(template)
    if not end.strip():
        return {}
    ids = tok.encode(end, add_special_tokens=False).ids
    if len(ids) == 1:
        return {"eos_token_id": sorted({ids[0]} | ({eot_id} if eot_id is not None else set()))}
    return {"stop_strings": [end.strip()]}


# --- PEFT -----------------------------------------------------------------------------------------------


def export_peft(lora: LoRARun, base: str, out: Path, force: bool = False) -> ExportResult:
    """Write a LoRA run's adapters as a PEFT adapter folder for `base`: hf:NAME (the hub model the run started
    from, from the cache or the hub) or a Hugging Face folder such as the run base's export (checked: its weights
    must be that base's). `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(NAME or base), out)`
    computes what the run computes."""
    from safetensors.torch import save_file

    from nanogpt_cli.interop.loading import load_lora
    from nanogpt_cli.lora import adapters

    transformers = hf.require("transformers")
    model, plain = load_lora(lora, merge=False)
    meta = lora.meta
    family = meta.get(hf.FAMILY_KEY)  # a run started from a Qwen2 folder compares with a Qwen2, not a Llama
    kind = hf.hf_kind(model.config, family)
    theirs = _base_weights(transformers, base)
    ours = hf.to_hf(plain, prefer=family).state_dict()
    if any(k not in theirs or not _same(theirs[k], t) for k, t in ours.items()):
        raise NanoGPTError(
            f"--base {base} does not hold this run's base weights ({meta['base']['source']}); give "
            + _base_hint(meta["base"]["source"])
        )
    _check_target(out, force)
    cfg = meta["lora"]
    layers = {name: (m.lora_A.detach(), m.lora_B.detach()) for name, m in adapters(model).items()}
    tensors, targets = hf.peft_tensors(model.config, kind, layers)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.removeprefix("hf:"),  # what from_pretrained takes: a hub name or folder
        "r": cfg["r"],
        "lora_alpha": cfg["alpha"],
        "lora_dropout": cfg["dropout"],
        "target_modules": targets,  # exact module paths: a suffix such as c_proj would match more than ours
        "fan_in_fan_out": hf.FAMILIES[kind].conv1d,  # a Conv1D stores its weights (in, out)
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    tmp = _staging(out)
    try:
        tmp.mkdir()
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n", encoding="utf-8")
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(out, "peft", hf.ARCHS[kind][3], meta["tokenizer"]["name"])


def _base_hint(source: str) -> str:
    """What --base should be for a run whose base is `source`: that hf:NAME, or the base's Hugging Face export."""
    if source.startswith("hf:"):
        return f"--base {source}, the model the run started from"
    return f"the Hugging Face export of the run's base (`nanogpt export {source} --format hf --out DIR`)"


def _base_weights(transformers, base: str) -> dict[str, Any]:
    """The state dict of --base: hf:NAME through from_pretrained (the cache, or the hub), or a local folder."""
    hub = base.startswith("hf:")
    if not hub and not hf.is_hf_source(base):
        raise NanoGPTError(
            f"--base {base} is neither hf:NAME nor a Hugging Face model folder; export the base with --format hf"
        )
    name = base.removeprefix("hf:")
    try:
        with hf.quiet_transformers():
            model = transformers.AutoModelForCausalLM.from_pretrained(name, local_files_only=not hub)
    except (OSError, ValueError) as e:
        from nanogpt_cli.hf_tokenizer import offline_miss

        raise NanoGPTError(
            (offline_miss(base) if hub else None) or f"could not load the weights of --base {base} ({first_line(e)})"
        ) from None
    return model.state_dict()


def _same(a, b) -> bool:
    return a.shape == b.shape and bool((a.float() == b.float()).all())


# --- GGUF ---------------------------------------------------------------------------------------------


def export_gguf(
    model: GPT,
    desc: dict[str, Any],
    out: Path,
    force: bool = False,
    quant: str = "f32",
    chat_template: str | None = None,
    tokenizer=None,
    family: str | None = None,
    pre: str | None = None,
) -> ExportResult:
    """Write one GGUF file (see gguf_file.py) with float32, float16 or quantized matrices, and the run's chat
    template as tokenizer.chat_template; tokenizer: the HFTokenizer a Hugging Face description needs; family: the
    Hugging Face family the model came from, whose llama.cpp architecture it keeps; pre: the llama.cpp
    pre-tokenizer the GGUF it came from named, kept when it cuts text as the tokenizer does."""
    from nanogpt_cli.interop import gguf_file

    hf.require("gguf")
    if quant not in gguf_file.QUANTS:
        raise NanoGPTError(f"--quant must be one of {', '.join(gguf_file.QUANTS)}, got {quant!r}")
    # refusals first: nothing is written before every check has passed
    arch, layout = gguf_file.gguf_target(model.config, family)
    gguf_file.gguf_vocabulary(desc, model.config.vocab_size, hf.require("gguf"), tokenizer, pre)
    if out.suffix != ".gguf":
        raise NanoGPTError(f"--out for --format gguf is a file ending in .gguf, got {out}")
    _check_target(out, force)
    tmp = _staging(out)
    try:
        gguf_file.write_gguf(model, desc, tmp, quant, chat_template, tokenizer, family, pre)
        size = tmp.stat().st_size
        _replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    # the size of the same file in float32: its size less the tensors as written plus the tensors at 4 bytes a value
    gguf = hf.require("gguf")
    tensors = gguf_file.gguf_tensors(model, layout)

    def padded(n: int) -> int:  # each tensor starts on a 32-byte boundary
        return gguf.GGUFWriter.ggml_pad(n, gguf.GGUF_DEFAULT_ALIGNMENT)

    written = sum(padded(gguf_file._quantize(t, quant, gguf)[0].nbytes) for t in tensors.values())
    f32 = size - written + sum(padded(t.nbytes) for t in tensors.values())
    return ExportResult(out, "gguf", arch, desc["name"], quant=quant, bytes=size, f32_bytes=f32)
