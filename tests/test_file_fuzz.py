"""Every file nanogpt reads fails in one sentence: a seeded mutation fuzz of each format (our GGUF exports,
llama.cpp converter-style GGUFs of every tensor type we take, our safetensors weights, run folders, Hugging Face
folders, tokenizer files, prepared shards and their meta.json). Each mutated input either raises NanoGPTError
with one line (the CLI's `error:` line), or loads the model the intact file holds; every case runs under a time
limit and a cap on the address space it may add, so that a size is checked against the file before anything of
that size is allocated. Tiny models; the cases are drawn from a fixed seed."""

from __future__ import annotations

import contextlib
import json
import random
import re
import resource
import shutil
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT

gguf = pytest.importorskip("gguf")

SEED = 0
CASE_SECONDS = 10  # one case's limit (each takes well under a second on a quiet core)
EXTRA_BYTES = 2 * 2**30  # the address space a case may add to what the process maps when it starts
HUGE = (2**63 - 1, 2**64 - 1, 2**40, 2**32 - 1, 100_000)  # absurd counts and sizes; 2**64 - 1 is -1 as int64


class CaseTimeout(Exception):
    pass


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def bounded():
    """The case's limits: CASE_SECONDS of wall time (an alarm) and EXTRA_BYTES more address space (RLIMIT_AS,
    restored after): an allocation sized by a damaged count fails instead of paging the machine to a halt."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + EXTRA_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))

    def alarm(*_):
        raise CaseTimeout(f"a case ran past {CASE_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def outcome(load, path: Path, what: str):
    """("error", message) or ("loaded", result) for one mutated input; anything else fails the test, naming it."""
    try:
        with bounded():
            result = load(path)
    except NanoGPTError as e:
        message = str(e)
        assert message and "\n" not in message.strip() and "Traceback" not in message, f"{what}: {message!r}"
        return "error", message
    except BaseException as e:  # what the fuzz is here to find (a Rust panic is a BaseException)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from None
    return "loaded", result


def same_weights(a: GPT, b: GPT) -> bool:
    """The same tensors, every one of them bit for bit. A flipped bit inside a number of the metadata (a norm's
    epsilon, the RoPE base, the context) is a valid file of another setting, which no reader can tell from the
    intended one; that the weights are all there and all the file's own is what a reader must hold."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)


# --- mutations ---


def flips(data: bytes, rng: random.Random, n: int, region: tuple[int, int]) -> list[tuple[str, bytes]]:
    """n copies of data with one random bit flipped inside region [start, end)."""
    out = []
    for _ in range(n):
        at = rng.randrange(*region)
        bit = rng.randrange(8)
        changed = bytearray(data)
        changed[at] ^= 1 << bit
        out.append((f"bit {bit} of byte {at} flipped", bytes(changed)))
    return out


def truncations(data: bytes, rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    cuts = {0, 3, 8, len(data) - 1} | {rng.randrange(len(data)) for _ in range(n)}
    return [(f"cut to {cut:,} bytes", data[:cut]) for cut in sorted(cuts)]


def patched(data: bytes, at: int, fmt: str, value) -> bytes:
    changed = bytearray(data)
    struct.pack_into("<" + fmt, changed, at, value)
    return bytes(changed)


def after(data: bytes, marker: bytes) -> int:
    """The offset just past the first occurrence of marker (a key or tensor name in a GGUF header)."""
    at = data.find(marker)
    assert at >= 0, marker
    return at + len(marker)


def gguf_header_end(path: Path) -> int:
    from nanogpt_cli.interop.gguf_header import read_header

    return min(t.data_offset for t in read_header(path).tensors)


def gguf_mutations(data: bytes, rng: random.Random, header_end: int, arch: str, flips_n: int = 12):
    """Truncations, bit flips in the header (counts, metadata, tensor table), absurd counts and sizes in the
    counts, in block_count / head_count / context_length, and zero, huge and negative (as uint64) dimensions."""
    cases = truncations(data, rng, 4) + flips(data, rng, flips_n, (0, header_end))
    cases += [(f"tensor count {v:,}", patched(data, 8, "Q", v)) for v in HUGE[:3]]
    cases += [(f"metadata count {v:,}", patched(data, 16, "Q", v)) for v in HUGE[:3]]
    cases += [("magic broken", b"GGUx" + data[4:]), ("version 7", patched(data, 4, "I", 7))]
    for key, values in (
        ("block_count", (100_000, 0, 3)),
        ("attention.head_count", (0, 2**31)),
        ("context_length", (2**31,)),
    ):
        at = after(data, f"{arch}.{key}".encode()) + 4  # past the value's type
        cases += [(f"{key} {v:,}", patched(data, at, "I", v)) for v in values]
    name = b"blk.0.attn_q.weight"
    dims = after(data, name) + 4  # past the dimension count
    cases += [(f"{name.decode()} dimension 0 = {v:,}", patched(data, dims, "Q", v)) for v in (0, 2**40, 2**64 - 1)]
    cases += [(f"{name.decode()} dimension 1 = 0", patched(data, dims + 8, "Q", 0))]
    cases += [(f"{name.decode()} with 9 dimensions", patched(data, dims - 4, "I", 9))]
    cases += [(f"{name.decode()} of type 99", patched(data, dims + 16, "I", 99))]
    cases += [(f"{name.decode()} at offset 2**40", patched(data, dims + 20, "Q", 2**40))]
    return cases


def run_cases(tmp: Path, suffix: str, cases, load, intact, what: str, same=same_weights) -> dict[str, int]:
    """Each case written to a file and loaded; returns how many ended in one line and how many loaded the intact
    model (a case that loads something else fails the test)."""
    counts = {"inputs": 0, "one line": 0, "same model": 0}
    for i, (label, data) in enumerate(cases):
        path = tmp / f"case{i}{suffix}"
        path.write_bytes(data)
        kind, result = outcome(load, path, f"{what}, {label}")
        counts["inputs"] += 1
        if kind == "error":
            counts["one line"] += 1
        else:
            assert same(result, intact), f"{what}, {label}: loaded a model other than the intact one"
            counts["same model"] += 1
        path.unlink()
    assert counts["one line"] + counts["same model"] == counts["inputs"]
    return counts


def fixed(path: Path) -> None:
    """A JSON file with its times of day set to one value, so that the seeded flips land on the same bytes in
    every run."""
    value = json.loads(path.read_text(encoding="utf-8"))
    for key in ("created", "updated", "started"):
        if key in value:
            value[key] = "2026-01-01T00:00:00+00:00"
    path.write_text(json.dumps(value, indent=2), encoding="utf-8")


# --- tiny models ---


def llama_config(**changes) -> GPTConfig:
    base = dict(vocab_size=258, block_size=32, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, pos_encoding="rope")
    base |= dict(norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=True, dropout=0.0)
    return GPTConfig(**(base | changes))


def tiny(config: GPTConfig) -> GPT:
    torch.manual_seed(SEED)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def load_gguf(path: Path) -> GPT:
    from nanogpt_cli.interop.loading import load_model

    return load_model(path)[0].eval()


# the byte offsets of the fp16 scales in one block of each type gguf dequantizes but cannot quantize
BLOCK_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
BLOCK_SCALES |= {"IQ4_NL": (0,), "IQ4_XS": (0,), "TQ2_0": (64,)}


def write_converter_gguf(model: GPT, path: Path, qtype_name: str) -> None:
    """model as llama.cpp's converter writes a Llama (no nanogpt keys): its layout's names, keys and row order,
    a byte-level vocabulary, the matrices in qtype_name (gguf's quantizer, or random blocks of the K and IQ types,
    which gguf only dequantizes)."""
    from nanogpt_cli.hf_tokenizer import HF_FILE  # noqa: F401 (the hf extra is there)
    from nanogpt_cli.interop.families import FAMILIES
    from nanogpt_cli.interop.gguf_file import gguf_tensors
    from nanogpt_cli.interop.hf import byte_alphabet

    layout = FAMILIES["llama"].gguf
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    layout.keys_out(w, c)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(byte_alphabet() + ["Ġt", "<|endoftext|>"])
    w.add_token_types([1] * 257 + [3])
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(257)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(SEED)
    for name, t in gguf_tensors(model, layout).items():
        if name == "output.weight" and c.tie_embeddings:
            continue
        if t.ndim == 1 or qtype_name == "F32" or t.shape[1] % block:
            w.add_tensor(name, t)
        elif qtype_name == "F16":
            w.add_tensor(name, t.astype(np.float16))
        elif qtype_name in ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:  # random blocks with small finite fp16 scales at each block's start
            blocks = rng.integers(0, 256, (t.shape[0], t.shape[1] // block, size), dtype=np.uint8)
            for at in BLOCK_SCALES[qtype_name]:
                blocks[..., at : at + 2] = (
                    rng.uniform(1e-4, 1e-3, blocks.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
                )
            w.add_tensor(
                name, blocks.reshape(t.shape[0], -1), raw_shape=blocks.reshape(t.shape[0], -1).shape, raw_dtype=qtype
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


RESULTS: dict[str, dict[str, int]] = {}  # format -> counts, printed by the last test (-s shows the table)


def record(fmt: str, counts: dict[str, int]) -> None:
    total = RESULTS.setdefault(fmt, {"inputs": 0, "one line": 0, "same model": 0})
    for k, v in counts.items():
        total[k] += v


# --- GGUF ---


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_0"])
def test_a_mutated_gguf_export_of_ours_fails_in_one_line_or_loads_the_same_model(quant, tmp_path):
    from nanogpt_cli.interop.gguf_file import CONFIG_KEY, write_gguf

    model = tiny(llama_config())
    path = tmp_path / "ours.gguf"
    write_gguf(model, {"name": "byte", "vocab_size": 256}, path, quant=quant)
    intact = load_gguf(path)
    data = path.read_bytes()
    rng = random.Random(f"{SEED}-ours-{quant}")
    cases = gguf_mutations(data, rng, gguf_header_end(path), "llama")
    config = after(data, CONFIG_KEY.encode()) + 4 + 8  # the JSON text, past its type and length
    text = data[config : data.index(b"}", config) + 1]
    for old, new in (
        (b'"n_layer": 2', b'"n_layer": 9'),
        (b'"n_layer": 2', b'"n_layer": 0'),
        (b'"n_head": 4', b'"n_head": 0'),
    ):
        cases.append((f"config {new.decode()}", data.replace(text, text.replace(old, new), 1)))
    cases += [
        ("config not JSON", data[:config] + b"[" + data[config + 1 :]),
        ("config a list", data[:config] + b"[" + text[1:-1] + b"]" + data[config + len(text) :]),
    ]
    record(f"GGUF export of ours ({quant})", run_cases(tmp_path, ".gguf", cases, load_gguf, intact, f"ours {quant}"))


QUANTS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ2_0"]


def converter_case(quant: str, tmp_path: Path, flips_n: int) -> None:
    wide = quant in K_QUANTS  # rows of whole 256-value blocks
    config = llama_config(n_embd=256, n_layer=1, mlp_hidden=256) if wide else llama_config()
    model = tiny(config)
    path = tmp_path / "converter.gguf"
    write_converter_gguf(model, path, quant)
    intact = load_gguf(path)
    data = path.read_bytes()
    rng = random.Random(f"{SEED}-converter-{quant}")
    cases = gguf_mutations(data, rng, gguf_header_end(path), "llama", flips_n)
    counts = run_cases(tmp_path, ".gguf", cases, load_gguf, intact, f"converter {quant}")
    record(f"llama.cpp converter GGUF ({quant})", counts)


@pytest.mark.parametrize("quant", QUANTS)
def test_a_mutated_converter_gguf_fails_in_one_line_or_loads_the_same_model(quant, tmp_path):
    converter_case(quant, tmp_path, flips_n=6)


@pytest.mark.slow
@pytest.mark.parametrize("quant", K_QUANTS)
def test_a_mutated_converter_gguf_of_k_and_iq_blocks_fails_in_one_line(quant, tmp_path):
    converter_case(quant, tmp_path, flips_n=6)


def test_gguf_is_named_by_its_magic_not_by_the_reader_that_failed_last(tmp_path):
    from nanogpt_cli.interop.loading import load_model
    from nanogpt_cli.runs.checkpoint import save_model

    model = tiny(llama_config())
    path = tmp_path / "m.gguf"
    from nanogpt_cli.interop.gguf_file import write_gguf

    write_gguf(model, {"name": "byte", "vocab_size": 256}, path)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUx" + path.read_bytes()[4:])
    with pytest.raises(
        NanoGPTError, match=r"broken\.gguf is not a GGUF file \(it does not begin with the bytes GGUF\)"
    ):
        load_model(broken)
    renamed = tmp_path / "weights.bin"  # a GGUF under another name is read as one
    renamed.write_bytes(path.read_bytes())
    assert same_weights(load_model(renamed)[0].eval(), load_gguf(path))
    save_model(tmp_path / "w.safetensors", model, {"tokenizer": {"name": "byte", "vocab_size": 256}})
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:9] + b"!" + data[10:])
    with pytest.raises(NanoGPTError, match="safetensors"):
        load_model(tmp_path / "w.safetensors")


# --- safetensors weights and run folders ---


def load_weights_file(path: Path) -> GPT:
    from nanogpt_cli.interop.loading import load_model

    return load_model(path)[0].eval()


def load_lazily(path: Path) -> GPT:
    from nanogpt_cli.interop.loading import load_for_inference

    return load_for_inference(path, device="cpu", dtype="float32").model


def safetensors_cases(data: bytes, rng: random.Random, flips_n: int):
    n = int.from_bytes(data[:8], "little")
    cases = truncations(data, rng, 4) + flips(data, rng, flips_n, (0, 8 + n))
    cases += [(f"header length {v:,}", patched(data, 0, "Q", v)) for v in HUGE]
    header = json.loads(data[8 : 8 + n])
    meta = header["__metadata__"]
    name = "transformer.h.0.attn.c_attn.weight"

    def config(field: str, value: str):
        return lambda h: meta.update(config=re.sub(rf'"{field}": [^,}}]+', f'"{field}": {value}', meta["config"]))

    edits = {
        "shape of 2**40": lambda h: h[name].update(shape=[2**40, h[name]["shape"][1]]),
        "negative shape": lambda h: h[name].update(shape=[-1, h[name]["shape"][1]]),
        "zero shape": lambda h: h[name].update(shape=[0, h[name]["shape"][1]]),
        "offsets past the end": lambda h: h[name].update(data_offsets=[0, 2**40]),
        "unknown dtype": lambda h: h[name].update(dtype="F128"),
        "a tensor missing": lambda h: h.pop("transformer.h.0.ln_2.weight"),
        "config not JSON": lambda h: meta.update(config="{n_layer: 2"),
        "config n_layer 100000": config("n_layer", "100000"),
        "config n_layer 3": config("n_layer", "3"),
        "config n_embd 2**30": config("n_embd", "1073741824"),
        "config n_head 0": config("n_head", "0"),
        "config n_head a string": config("n_head", '"4"'),
        "config block_size 2**40": config("block_size", "1099511627776"),
    }
    for label, edit in edits.items():
        h = json.loads(data[8 : 8 + n])
        meta = h["__metadata__"]
        edit(h)
        text = json.dumps(h).encode()
        cases.append((label, len(text).to_bytes(8, "little") + text + data[8 + n :]))
    return cases


@pytest.mark.parametrize("loader", [load_weights_file, load_lazily])
def test_a_mutated_weights_file_fails_in_one_line_or_loads_the_same_model(loader, tmp_path):
    from nanogpt_cli.runs.checkpoint import save_model

    model = tiny(llama_config(tie_embeddings=False))
    path = tmp_path / "w.safetensors"
    save_model(path, model, {"tokenizer": {"name": "byte", "vocab_size": 256}, "step": 3})
    intact = loader(path)
    assert same_weights(intact, model)
    rng = random.Random(f"{SEED}-safetensors-{loader.__name__}")
    cases = safetensors_cases(path.read_bytes(), rng, 12)
    record("safetensors weights", run_cases(tmp_path, ".safetensors", cases, loader, intact, "safetensors"))


@pytest.mark.slow
def test_a_mutated_run_folder_fails_in_one_line_or_loads_the_same_model(tmp_path):
    """A real run (train for two steps): its weights and config.json mutated; loaded as a model and shown by `info`."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app
    from nanogpt_cli.inspect.catalog import inspect_path

    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 60, encoding="utf-8")
    runner = CliRunner()
    args = ["prepare", str(tmp_path / "t.txt"), "--name", "t", "--tokenizer", "char", "--data-dir", str(tmp_path / "d")]
    assert runner.invoke(app, args).exit_code == 0
    run = tmp_path / "run"
    args = ["train", "--data", "t", "--data-dir", str(tmp_path / "d"), "--out", str(run), "--n-layer", "1"]
    args += ["--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "2", "--max-iters", "2"]
    args += ["--eval-interval", "2", "--eval-iters", "1", "--device", "cpu"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    intact = load_weights_file(run)
    rng = random.Random(f"{SEED}-run")
    counts = {"inputs": 0, "one line": 0, "same model": 0}
    weights = sorted(run.glob("*.safetensors"))[0]
    original = weights.read_bytes()
    for label, data in safetensors_cases(original, rng, 8):
        weights.write_bytes(data)
        for load in (load_weights_file, inspect_path):
            kind, result = outcome(load, run, f"run folder, {weights.name} {label}")
            counts["inputs"] += 1
            counts["one line" if kind == "error" else "same model"] += 1
            if kind == "loaded" and load is load_weights_file:
                assert same_weights(result, intact), f"run folder, {label}"
    weights.write_bytes(original)
    config = run / "config.json"
    fixed(config)
    text = config.read_bytes()
    settings = json.loads(text)
    edits = [
        (f"model {k} {v:,}", json.dumps(settings | {"model": settings["model"] | {k: v}}).encode())
        for k, v in (("n_layer", 100_000), ("n_embd", 2**30), ("n_head", 0), ("block_size", 2**40))
    ]
    for label, data in edits + truncations(text, rng, 4) + flips(text, rng, 8, (0, len(text))):
        config.write_bytes(data)
        for load in (load_weights_file, inspect_path):
            kind, result = outcome(load, run, f"run folder, config.json {label}")
            counts["inputs"] += 1
            counts["one line" if kind == "error" else "same model"] += 1
            if kind == "loaded" and load is load_weights_file:
                assert same_weights(result, intact), f"run folder, config.json {label}"
    record("run folder", counts)


# --- Hugging Face folders ---


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from nanogpt_cli.interop.export import export
    from nanogpt_cli.runs.checkpoint import save_model

    folder = tmp_path_factory.mktemp("hf")
    model = tiny(llama_config(tie_embeddings=False))
    save_model(folder / "w.safetensors", model, {"tokenizer": {"name": "byte", "vocab_size": 256}})
    export(folder / "w.safetensors", "hf", folder / "out")
    return folder / "out"


def load_hf(folder: Path) -> GPT:
    from nanogpt_cli.interop.loading import load_model

    return load_model(folder)[0].eval()


CONFIG_EDITS = {  # config.json sizes that disagree with the weights, absurd values, wrong types
    "num_hidden_layers 1": {"num_hidden_layers": 1},
    "num_hidden_layers 3": {"num_hidden_layers": 3},
    "num_hidden_layers 100000": {"num_hidden_layers": 100_000},
    "hidden_size 128": {"hidden_size": 128},
    "intermediate_size 48": {"intermediate_size": 48},
    "num_attention_heads 0": {"num_attention_heads": 0},
    "num_attention_heads 8": {"num_attention_heads": 8},
    "num_key_value_heads 4": {"num_key_value_heads": 4},
    "vocab_size 300": {"vocab_size": 300},
    "vocab_size -1": {"vocab_size": -1},
    "tie_word_embeddings": {"tie_word_embeddings": True},
    "hidden_size a string": {"hidden_size": "64"},
    "max_position_embeddings 2**40": {"max_position_embeddings": 2**40},
}


@pytest.mark.slow
def test_a_hugging_face_folder_whose_config_disagrees_with_its_weights_is_refused_naming_the_tensor(
    hf_folder, tmp_path
):
    folder = tmp_path / "m"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
    with pytest.raises(NanoGPTError, match=r"holds model\.layers\.1\.\S+, and the config has 1 block"):
        load_hf(folder)
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(NanoGPTError, match=r"has no tensors of block 2"):
        load_hf(folder)
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    with pytest.raises(NanoGPTError, match=r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\), and the config implies"):
        load_hf(folder)


@pytest.mark.slow
def test_a_mutated_hugging_face_folder_fails_in_one_line_or_loads_the_same_model(hf_folder, tmp_path):
    intact = load_hf(hf_folder)
    rng = random.Random(f"{SEED}-hf")
    counts = {"inputs": 0, "one line": 0, "same model": 0}
    config = json.loads((hf_folder / "config.json").read_text())
    cases = [(label, "config.json", json.dumps(config | edit).encode()) for label, edit in CONFIG_EDITS.items()]
    text = (hf_folder / "config.json").read_bytes()
    cases += [
        (f"config.json {label}", "config.json", d)
        for label, d in truncations(text, rng, 2) + flips(text, rng, 6, (0, len(text)))
    ]
    weights = (hf_folder / "model.safetensors").read_bytes()
    n = int.from_bytes(weights[:8], "little")
    cases += [
        (f"weights {label}", "model.safetensors", d)
        for label, d in truncations(weights, rng, 2) + flips(weights, rng, 6, (0, 8 + n))
    ]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        text = (hf_folder / name).read_bytes()
        cases += [
            (f"{name} {label}", name, d) for label, d in truncations(text, rng, 2) + flips(text, rng, 4, (0, len(text)))
        ]
    for i, (label, name, data) in enumerate(cases):
        folder = tmp_path / f"case{i}"
        shutil.copytree(hf_folder, folder)
        (folder / name).write_bytes(data)
        kind, result = outcome(load_hf, folder, f"hf folder, {label}")
        counts["inputs"] += 1
        if kind == "error":
            counts["one line"] += 1
        else:
            assert same_weights(result, intact), f"hf folder, {label}: loaded another model"
            counts["same model"] += 1
        shutil.rmtree(folder)
    record("Hugging Face folder", counts)


# --- tokenizer files ---


def test_a_mutated_tokenizer_file_fails_in_one_line_or_reads_the_same_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from nanogpt_cli.hf_tokenizer import read_hf_tokenizer
    from nanogpt_cli.interop.hf import tokenizers_object
    from nanogpt_cli.tokenizer import BPETokenizer, train_bpe

    tok, _ = tokenizers_object({"name": "byte", "vocab_size": 256})
    (tmp_path / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    intact = read_hf_tokenizer(str(tmp_path / "tokenizer.json"))
    text = (tmp_path / "tokenizer.json").read_bytes()
    rng = random.Random(f"{SEED}-tokenizer")
    probe = "Hello, world 123 café"

    def same(a, b):  # a flipped character of a token's text is another valid tokenizer: it must work whole
        return isinstance(a.decode(a.encode(probe)), str)

    cases = truncations(text, rng, 6) + flips(text, rng, 16, (0, len(text)))
    record(
        "tokenizer.json",
        run_cases(tmp_path, ".json", cases, lambda p: read_hf_tokenizer(str(p)), intact, "tokenizer.json", same),
    )

    bpe = train_bpe(["the quick brown fox jumps over the lazy dog " * 20], 300, "t", "gpt2")
    folder = tmp_path / "bpe"
    folder.mkdir()
    bpe.save(folder)
    intact = BPETokenizer.load(folder)
    counts = {"inputs": 0, "one line": 0, "same model": 0}
    for file in sorted(folder.iterdir()):
        original = file.read_bytes()
        for label, data in truncations(original, rng, 3) + flips(original, rng, 8, (0, len(original))):
            file.write_bytes(data)
            kind, result = outcome(BPETokenizer.load, folder, f"trained tokenizer, {file.name} {label}")
            counts["inputs"] += 1
            counts["one line" if kind == "error" else "same model"] += 1
        file.write_bytes(original)
    record("trained tokenizer folder", counts)


# --- prepared shards and meta.json ---


def test_a_mutated_dataset_fails_in_one_line_or_reads_the_same_tokens(tmp_path):
    from nanogpt_cli.data import open_split
    from nanogpt_cli.data.pipeline import prepare

    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40, encoding="utf-8")
    prepare(str(tmp_path / "t.txt"), "t", tokenizer="char", data_dir=tmp_path / "d")
    folder = tmp_path / "d" / "t"
    fixed(folder / "meta.json")

    def read_all(_):
        out = []
        for split in ("train", "val"):
            shards = open_split(tmp_path / "d", "t", split)
            out.append(shards.read([(i, 0) for i in range(len(shards.counts))], min(shards.counts)))
        return out

    intact = read_all(None)
    rng = random.Random(f"{SEED}-data")
    counts = {"inputs": 0, "one line": 0, "same model": 0}
    meta = json.loads((folder / "meta.json").read_text())
    edits = {
        "dtype float64": {"dtype": "float64"},
        "dtype object": {"dtype": "object"},
        "vocab_size 2": {"vocab_size": 2},
        "shards a list": {"shards": []},
        "shard outside the folder": {"shards": {**meta["shards"], "train": [{"file": "../../t.txt", "tokens": 10}]}},
        "shard of 2**40 tokens": {
            "shards": {**meta["shards"], "train": [{**meta["shards"]["train"][0], "tokens": 2**40}]}
        },
        "shard of -1 tokens": {"shards": {**meta["shards"], "train": [{**meta["shards"]["train"][0], "tokens": -1}]}},
    }
    cases = [(label, "meta.json", json.dumps(meta | e).encode()) for label, e in edits.items()]
    text = (folder / "meta.json").read_bytes()
    cases += [
        (f"meta.json {label}", "meta.json", d)
        for label, d in truncations(text, rng, 4) + flips(text, rng, 12, (0, len(text)))
    ]
    shard = meta["shards"]["train"][0]["file"]
    tokens = (folder / shard).read_bytes()
    cases += [(f"{shard} {label}", shard, d) for label, d in truncations(tokens, rng, 3)]
    cases += [(f"{shard} byte {at} = 255", shard, tokens[:at] + b"\xff" + tokens[at + 1 :]) for at in (1, 3)]
    for label, name, data in cases:
        original = (folder / name).read_bytes()
        (folder / name).write_bytes(data)
        kind, result = outcome(read_all, folder, f"dataset, {label}")
        counts["inputs"] += 1
        if kind == "error":
            counts["one line"] += 1
        else:
            assert all(np.array_equal(a, b) for a, b in zip(result, intact)), f"dataset, {label}: other tokens"
            counts["same model"] += 1
        (folder / name).write_bytes(original)
    record("prepared dataset (shards, meta.json)", counts)


# --- through the CLI ---


@pytest.mark.slow
def test_damaged_files_through_the_cli_end_in_one_error_line_and_exit_1(tmp_path):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    model = tiny(llama_config())
    path = tmp_path / "m.gguf"
    write_converter_gguf(model, path, "Q8_0")
    data = path.read_bytes()
    at = after(data, b"llama.block_count") + 4
    (tmp_path / "blocks.gguf").write_bytes(patched(data, at, "I", 100_000))
    (tmp_path / "magic.gguf").write_bytes(b"GGUx" + data[4:])
    (tmp_path / "count.gguf").write_bytes(patched(data, 8, "Q", 2**63 - 1))
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    runner = CliRunner()
    for name in ("blocks", "magic", "count", "cut"):
        for command in (
            ["info", str(tmp_path / f"{name}.gguf")],
            ["sample", "--checkpoint", str(tmp_path / f"{name}.gguf"), "--max-new-tokens", "2"],
        ):
            t0 = time.perf_counter()
            result = runner.invoke(app, command)
            lines = [line for line in result.output.splitlines() if line.strip()]
            assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), (
                command,
                result.output,
            )
            assert time.perf_counter() - t0 < CASE_SECONDS, command


def test_zz_report(pytestconfig):
    """Every format fuzzed met damage it refused, and every case ended one of the two ways; the table of what was
    tried is shown with pytest -s."""
    for fmt, c in RESULTS.items():
        assert c["one line"] > 0 and c["one line"] + c["same model"] == c["inputs"], (fmt, c)
        if pytestconfig.getoption("capture") == "no":
            print(f"\n{fmt:45} {c['inputs']:4} inputs  {c['one line']:4} one line  {c['same model']:4} same model")
