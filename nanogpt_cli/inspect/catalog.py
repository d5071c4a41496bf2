"""What is in a run folder or a weights file, read without loading the weights: `nanogpt runs` and `nanogpt info`.

    for run in list_runs(Path("checkpoints")): print(run.name, run.status)
    info = inspect_path(Path("checkpoints/shk")); print(info.to_dict())

Nothing here writes; a damaged file is reported (status "damaged", or "loads": false), never raised.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError, first_line
from nanogpt_cli.files import read_jsonl
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import damage, file_step, read_metadata
from nanogpt_cli.runs.rundir import RunDir

STATUSES = {
    "running": "a process is training it now",
    "finished": "step reached --max-iters, or --max-time was spent",
    "resumable": "stopped before --max-iters; `nanogpt train --out RUN --resume` continues it",
    "stopped": "weights but no trainer state: start from it with --init-from",
    "empty": "stopped before its first save: the command that started it starts it again",
    "damaged": "a file it needs cannot be read",
    "export": "a Hugging Face folder (`nanogpt export --format hf`): sample, eval and --init-from read it",
}


@dataclass
class RunSummary:
    """One row of `nanogpt runs`."""

    name: str
    path: str
    dataset: str | None
    params: int | None  # non-embedding parameters
    step: int | None
    max_iters: int | None
    best_val_loss: float | None
    tokens: int | None
    updated: str  # ISO time of the newest file in the folder
    status: str  # one of STATUSES
    problem: str | None = None  # why it is damaged
    description: str | None = None  # what an export folder is, who trains a running run, in words

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_counts(config: GPTConfig) -> tuple[int, int, int]:
    """(all parameters, non-embedding parameters, training FLOPs per token) of a config, from a model built on
    the meta device: shapes only, no memory, so a GPT-2-sized run costs nothing to inspect."""
    with torch.device("meta"):
        model = GPT(config, init=False)  # init on the meta device would still import torch's reference kernels
    return model.num_params(non_embedding=False), model.num_params(), model.flops_per_token()


@dataclass
class HFExport:
    """A Hugging Face model folder, read from its config.json and its weights' header (nothing loaded)."""

    architecture: str
    params: int | None
    origin: dict[str, Any]  # export.ORIGIN_KEY: run, step, dataset of the weights; {} when nanogpt did not write it

    def describe(self) -> str:
        """ "Hugging Face export: GPTNeoXForCausalLM, 0.8M parameters, from run checkpoints/shk step 300"."""
        words = [self.architecture]
        if self.params is not None:
            words.append(f"{_millions(self.params)} parameters")
        if not self.origin:
            return "Hugging Face model: " + ", ".join(words)
        source = f"from run {self.origin.get('run')}"
        if self.origin.get("step") is not None:
            source += f" step {self.origin['step']:,}"
        return "Hugging Face export: " + ", ".join(words + [source])


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def read_hf_folder(path: Path) -> HFExport | None:
    """The folder as a Hugging Face model (an export of ours, or any transformers folder), or None."""
    from safetensors import safe_open

    from nanogpt_cli.interop import hf
    from nanogpt_cli.interop.export import ORIGIN_KEY

    if str(path).startswith("hf:") or not hf.is_hf_source(path):
        return None
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    params = None
    weights = sorted(path.glob("*.safetensors"))
    if weights:
        try:
            params = 0
            for file in weights:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        params += _numel(f.get_slice(key))
        except Exception:  # unreadable weights: the architecture is still known
            params = None
    arch = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    origin = config.get(ORIGIN_KEY) if isinstance(config.get(ORIGIN_KEY), dict) else {}
    return HFExport(arch, params, origin)


def _numel(tensor_slice) -> int:
    n = 1
    for d in tensor_slice.get_shape():
        n *= d
    return n


def summarize_export(path: Path, export: HFExport, updated: str) -> RunSummary:
    return RunSummary(
        name=path.name,
        path=str(path),
        dataset=export.origin.get("dataset"),
        params=export.params,
        step=export.origin.get("step"),
        max_iters=None,
        best_val_loss=None,
        tokens=export.origin.get("tokens"),
        status="export",
        updated=updated,
        description=export.describe(),
    )


def summarize_run(path: Path) -> RunSummary:
    run = RunDir(path)
    files = [p for p in path.iterdir() if p.is_file()]
    updated = max((p.stat().st_mtime for p in files), default=path.stat().st_mtime)
    stamp = datetime.fromtimestamp(updated, timezone.utc).isoformat(timespec="seconds")
    export = read_hf_folder(path)
    if export is not None:
        return summarize_export(path, export, stamp)
    summary = RunSummary(
        name=path.name,
        path=str(path),
        dataset=None,
        params=None,
        step=None,
        max_iters=None,
        best_val_loss=None,
        tokens=None,
        status="damaged",
        updated=stamp,
    )
    owner = run.running()
    try:
        config = run.read_config()
        summary.dataset = config["train"].get("data")
        summary.max_iters = config["train"].get("max_iters")
        if _blocks_agree(run, config["model"]):
            summary.params = model_counts(GPTConfig.from_dict(config["model"]))[1]
    except (NanoGPTError, TypeError, ValueError, RuntimeError) as e:  # RuntimeError: sizes past torch's
        if owner is not None:  # config.json not written yet, or being replaced
            summary.status, summary.description = "running", _trained_by(owner)
            return summary
        summary.problem = str(e)
        return summary
    if owner is not None:  # its files are being written: what they hold now, as far as it can be read
        summary.status, summary.description = "running", _trained_by(owner)
        with contextlib.suppress(NanoGPTError):
            state = run.read_trainer()
            summary.step, summary.tokens, summary.best_val_loss = state.step, state.tokens, state.best_val_loss
        return summary
    if run.is_empty():
        summary.status = "empty"
        summary.description = "stopped before its first save: the command that started it starts it again"
        return summary
    if not run.has_trainer_state():
        meta = _weights_meta(run.last_path)
        if meta is None:
            summary.problem = f"{run.last_path} is {damage(run.last_path)}"
            return summary
        summary.step, summary.tokens, summary.status = meta.get("step"), meta.get("tokens"), "stopped"
        return summary
    try:
        state, _ = run.check_resumable()
    except NanoGPTError as e:
        summary.problem = str(e)
        return summary
    summary.step, summary.tokens, summary.best_val_loss = state.step, state.tokens, state.best_val_loss
    finished = (summary.max_iters is not None and state.step >= summary.max_iters) or state.max_time_spent is not None
    summary.status = "finished" if finished else "resumable"
    return summary


def _trained_by(owner: dict[str, Any]) -> str:
    """Who trains a running run, from its lock's record."""
    if not owner.get("pid"):
        return "being trained now"
    return f"being trained by process {owner['pid']}" + (f" since {owner['started']}" if owner.get("started") else "")


def list_runs(root: Path) -> list[RunSummary]:
    """Every run folder directly under root (or root itself when it is one), newest first."""
    root = Path(root)
    if not root.is_dir():
        raise NanoGPTError(f"{root} is not a folder of runs")

    def listed(p: Path) -> bool:  # a run, an export, or a run being started (its lock held, no config.json yet)
        return RunDir(p).has_run() or read_hf_folder(p) is not None or RunDir(p).running() is not None

    folders = (
        [root]
        if listed(root)
        else sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and listed(p))
    )
    return sorted((summarize_run(p) for p in folders), key=lambda r: r.updated, reverse=True)


# --- info ---


@dataclass
class FileInfo:
    name: str
    bytes: int
    loads: bool
    note: str = ""  # the step it holds, its record count, or why it does not load


@dataclass
class Info:
    """Everything `nanogpt info` shows about a run folder or a weights file."""

    path: str
    kind: str  # "run", "weights", "gguf (ARCH)", "hf export" (a Hugging Face folder we wrote) or "hf model"
    description: str | None = None  # a Hugging Face folder in words: architecture, size, the run it came from
    model: dict[str, Any] | None = None
    params: int | None = None
    params_non_embedding: int | None = None
    flops_per_token: int | None = None  # training FLOPs per token at the full context (6N + attention)
    seq_len: int | None = None  # a run's training sequences (--seq-len), where they are shorter than the context
    kv_cache_bytes_per_token: float | None = None  # the engine's KV cache per token of a row, in float32
    decode: str | None = None  # which decode backend runs it on a CPU, in words (backends.decode_words)
    tokenizer: str | None = None  # name and vocabulary size, in words
    dataset: str | None = None
    step: int | None = None
    max_iters: int | None = None
    tokens: int | None = None
    train_loss: float | None = None  # of the last evaluation
    val_loss: float | None = None
    best_val_loss: float | None = None
    status: str | None = None
    speed: dict[str, Any] | None = None  # the last invocation's speed (events.RunSpeed), from the trainer state
    finetune: str | None = None  # a fine-tune: full or LoRA, and what it started from, in words
    history: list[dict[str, Any]] = field(default_factory=list)  # what resumes changed (config.json's "history")
    files: list[FileInfo] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def inspect_path(path: str | Path) -> Info:
    path = Path(path)
    if path.is_dir():
        return _inspect_run(path)
    if not path.exists():
        raise NanoGPTError(f"{path} does not exist; give a run folder or a .safetensors file")
    from nanogpt_cli.interop.gguf_file import is_gguf

    if is_gguf(path):  # a GGUF file: ours holds our config and tokenizer, llama.cpp's is converted
        from nanogpt_cli.interop.gguf_in import read_any_gguf_meta

        meta = read_any_gguf_meta(path)
        kind = f"gguf ({meta['architecture']})"
        if meta.get("writer") == "llama.cpp":  # tensor types by count, the most common first: its quantization
            types = sorted(meta["tensor_types"].items(), key=lambda kv: -kv[1])
            counts = ", ".join(f"{n} {t}" for t, n in types)
            kind = f"gguf ({meta['architecture']}, llama.cpp's layout; tensors {counts})"
        info = Info(path=str(path), kind=kind)
        _fill_model(info, meta.get("config"), meta.get("tokenizer"))
        info.files = [FileInfo(path.name, path.stat().st_size, True, "GGUF")]
        return info
    meta = read_metadata(path)  # one sentence when it is not a nanogpt weights file
    n_layer = (meta.get("config") or {}).get("n_layer") if isinstance(meta.get("config"), dict) else None
    if isinstance(n_layer, int) and "lora" not in meta:  # blocks counted in the header before a model of them
        from nanogpt_cli.interop.materialize import check_blocks
        from nanogpt_cli.runs.checkpoint import TensorFile

        check_blocks(str(path), n_layer, TensorFile(path).keys())
    info = Info(
        path=str(path),
        kind="weights",
        step=meta.get("step"),
        tokens=meta.get("tokens"),
        val_loss=meta.get("val_loss"),
        dataset=meta.get("dataset") or None,
    )
    _fill_model(info, meta.get("config"), meta.get("tokenizer"))
    info.finetune = finetune_words(meta.get("lora") and {"method": "lora", "weights": meta})
    info.files = [_file_info(path)]
    return info


def finetune_words(record: dict[str, Any] | None) -> str | None:
    """A fine-tune's record (config.json's "finetune") in words: 'LoRA r 8, alpha 16 on attn.c_attn; base ...'."""
    if not record:
        return None
    if record.get("method") != "lora":
        return f"full, from {record.get('init_from')}"
    lora, base = record["weights"]["lora"], record["weights"]["base"]
    digest = (base.get("sha256") or "")[:12]
    return (
        f"LoRA r {lora['r']}, alpha {lora['alpha']:g}, dropout {lora['dropout']:g} on {', '.join(lora['targets'])}; "
        f"adapters only, on the base {base['source']} (sha256 {digest}...)"
    )


def _inspect_export(path: Path, export: HFExport) -> Info:
    origin = export.origin
    info = Info(
        path=str(path),
        kind="hf export" if export.origin else "hf model",
        description=export.describe(),
        params=export.params,
        dataset=origin.get("dataset"),
        step=origin.get("step"),
        tokens=origin.get("tokens"),
        val_loss=origin.get("val_loss"),
    )
    info.files = [_file_info(p) for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")]
    return info


def _inspect_run(path: Path) -> Info:
    run = RunDir(path)
    export = read_hf_folder(path)
    if export is not None:
        return _inspect_export(path, export)
    if not run.has_run():
        raise NanoGPTError(f"{path} holds no run ({run.no_run_reason()})")
    summary = summarize_run(path)
    info = Info(
        path=str(path),
        kind="run",
        dataset=summary.dataset,
        step=summary.step,
        max_iters=summary.max_iters,
        tokens=summary.tokens,
        best_val_loss=summary.best_val_loss,
        status=summary.status,
    )
    config = None
    try:
        config = run.read_config()
    except NanoGPTError:
        pass
    if config is not None and _blocks_agree(run, config["model"]):
        _fill_model(info, config["model"], (config.get("dataset") or {}).get("tokenizer"))
        info.finetune = finetune_words(config.get("finetune"))
        seq_len = (config.get("train") or {}).get("seq_len")
        if isinstance(seq_len, int) and info.model and seq_len < info.model["block_size"]:
            info.seq_len = seq_len
        info.history = [h for h in config.get("history") or [] if isinstance(h, dict)]
    else:
        meta = next(filter(None, map(_weights_meta, (run.best_path, run.last_path))), None)
        if meta is not None:
            _fill_model(info, meta.get("config"), meta.get("tokenizer"))
    if run.has_trainer_state():
        try:
            info.speed = run.read_trainer().speed
        except NanoGPTError:
            pass  # a damaged trainer state: its file row says so
    records, _ = run.read_metrics()
    evals = [r for r in records if r.get("kind", "eval") == "eval"]
    if evals:
        info.train_loss, info.val_loss = evals[-1].get("train_loss"), evals[-1].get("val_loss")
    info.files = [_file_info(p) for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")]
    return info


def _blocks_agree(run: RunDir, config: Any) -> bool:
    """Whether a run's config.json has as many blocks as its weights (where it has intact weights): a damaged
    config of 100,000 layers is not counted as a model's (that takes minutes)."""
    from nanogpt_cli.runs.checkpoint import TensorFile

    n_layer = config.get("n_layer") if isinstance(config, dict) else None
    for path in (run.best_path, run.last_path):
        if isinstance(n_layer, int) and path.is_file() and damage(path) is None:
            try:
                names = TensorFile(path).keys()
            except NanoGPTError:
                return False
            if any("lora_" in n for n in names):
                return True  # adapters: the base's blocks are elsewhere
            return len({n.split(".")[2] for n in names if n.startswith("transformer.h.")}) == n_layer
    return True


def _fill_model(info: Info, config: dict[str, Any] | None, tokenizer: dict[str, Any] | None) -> None:
    from nanogpt_cli.inference.backends import decode_words

    if config is not None:
        try:
            cfg = GPTConfig.from_dict(config)
            info.model = cfg.to_dict()
            info.params, info.params_non_embedding, info.flops_per_token = model_counts(cfg)
            info.kv_cache_bytes_per_token = cfg.kv_values_per_token * 4
            info.decode = decode_words(cfg)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: sizes past what torch can hold
            pass
    if isinstance(tokenizer, dict):
        info.tokenizer = (
            f"{tokenizer.get('name')} ({tokenizer.get('vocab_size', '?'):,} tokens)"
            if isinstance(tokenizer.get("vocab_size"), int)
            else str(tokenizer.get("name"))
        )


def _weights_meta(path: Path) -> dict[str, Any] | None:
    try:
        return read_metadata(path) if damage(path) is None else None
    except NanoGPTError:
        return None


def _file_info(path: Path) -> FileInfo:
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        problem = damage(path)
        if problem is not None:
            return FileInfo(path.name, size, False, problem)
        step = file_step(path)
        return FileInfo(path.name, size, True, f"step {step}" if step is not None else "")
    if path.suffix == ".jsonl":
        records, bad = read_jsonl(path)
        note = f"{len(records):,} records" + (f", {bad} damaged line(s) skipped" if bad else "")
        return FileInfo(path.name, size, True, note)
    if path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
            return FileInfo(path.name, size, True)
        except (OSError, ValueError) as e:
            return FileInfo(path.name, size, False, f"not valid JSON: {first_line(e)}")
    return FileInfo(path.name, size, True)


# the CPU features that decide our kernels' and torch's paths, in the order `info --system` lists them
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
                "amx_bf16", "amx_int8")  # fmt: skip


def system_info() -> dict:
    """What `nanogpt info --system` shows: torch, the threads, the CPU and its features, our decode kernels (built
    here if they were not: their status is whether they build) and where they are kept, and the devices."""
    import platform

    from nanogpt_cli.device import cpu_cores
    from nanogpt_cli.inference.backends import native

    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
                    .split(":", 1)[1].split())  # fmt: skip
    except (OSError, StopIteration):
        flags = set()
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": cpu_cores(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": f"{platform.machine()}, {native.cpu_name() or platform.processor() or 'unknown model'}",
        "cpu_features": [f for f in CPU_FEATURES if f in flags],
        "kernels": native.status(),
        "kernels_cache": str(native.cache_dir()),
        "kernels_library": str(native.build().path) if native.available() else None,
        "devices": devices,
    }
