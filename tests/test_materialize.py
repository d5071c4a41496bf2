"""Loading for inference tensor by tensor into a model built on the meta device (interop/materialize.py): the
same model as building it in float32, loading the file, casting and quantizing after, to the bit; each block
quantized before the next is read; files that do not match their config refused in one sentence."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.backends.quantize import QuantizedLinear, quantize_model
from nanogpt_cli.interop.loading import lazy_model, load_for_inference
from nanogpt_cli.interop.materialize import materialize
from nanogpt_cli.interop.source import parse_source
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.tokenizer import build_tokenizer
from conftest import tiny_config

LLAMA = dict(vocab_size=256, n_embd=64, norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=1, block_size=32)


def saved(tmp_path, **kw):
    torch.manual_seed(0)
    model = GPT(tiny_config(**{**LLAMA, **kw}))
    path = tmp_path / "model.safetensors"
    ckpt.save_model(path, model, {"tokenizer": build_tokenizer("byte").describe(), "step": 0})
    return path


def whole_route(path, dtype: torch.dtype, quantize: str | None) -> GPT:
    """The float32 model built first, the file loaded into it, then cast and quantized."""
    model = GPT(GPTConfig.from_dict(ckpt.read_metadata(path)["config"]))
    ckpt.load_weights(model, path)
    model = model.cast(dtype).eval()
    return quantize_model(model, quantize, 32) if quantize else model


def assert_same(got: GPT, ref: GPT) -> None:
    a, b = got.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    idx = torch.randint(0, got.config.vocab_size, (2, 12))
    with torch.inference_mode():
        assert torch.equal(got(idx)[0], ref(idx)[0])


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_load_equals_building_in_float32_then_casting_and_quantizing(tmp_path, dtype, quantize):
    path = saved(tmp_path)
    loaded = load_for_inference(path, device="cpu", dtype=dtype, quantize=quantize)
    assert_same(loaded.model, whole_route(path, loaded.dtype, quantize))
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight  # still one tensor
    assert getattr(loaded.model, "quantized", None) == quantize


@pytest.mark.parametrize(
    "kw",
    [
        dict(tie_embeddings=False, bias=True, norm="layernorm", mlp="gelu_tanh", n_kv_head=None),
        dict(pos_encoding="learned"),
        dict(pos_encoding="sinusoidal"),  # its table is a buffer no file holds, made again
        dict(rope_local_theta=10000.0, sliding_window=8, window_pattern="LG"),
    ],
)
def test_other_architectures_load_the_same_too(tmp_path, kw):
    path = saved(tmp_path, **kw)
    for dtype, quantize in (("float32", None), ("bfloat16", "int8")):
        loaded = load_for_inference(path, device="cpu", dtype=dtype, quantize=quantize)
        assert_same(loaded.model, whole_route(path, loaded.dtype, quantize))


def test_each_block_is_quantized_before_the_next_one_is_read(tmp_path):
    lazy = lazy_model(parse_source(saved(tmp_path, n_layer=3)), "int8", 32)
    read, floats_seen = lazy.read, []

    def watch(name, dtype):  # how many float projections the model holds at each read
        floats_seen.append(sum(type(m) is nn.Linear and not m.weight.is_meta for m in lazy.model.modules()))
        return read(name, dtype)

    lazy.read = watch
    model = materialize(lazy, torch.bfloat16, "int8", 32)
    assert max(floats_seen) <= 4  # one block's projections (q/k/v, out, fc, proj) at most, never the model's 12
    assert all(isinstance(m, QuantizedLinear) for m in model.transformer.h.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("kind, quant", [("int4", "q4_0"), ("int8", "q8_0")])
def test_a_quantized_gguf_loads_in_bf16_as_when_cast_after(tmp_path, kind, quant):
    pytest.importorskip("gguf")
    from nanogpt_cli.interop.export import export
    from nanogpt_cli.interop.loading import load_model

    gguf_path = tmp_path / f"model-{quant}.gguf"
    export(saved(tmp_path), "gguf", gguf_path, force=True, quant=quant)
    loaded = load_for_inference(gguf_path, device="cpu", dtype="bfloat16", quantize=kind)
    whole, _ = load_model(gguf_path, quantize=kind)  # float32 with the file's blocks, cast after
    assert_same(loaded.model, quantize_model(whole.cast(torch.bfloat16), kind, 32))
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.model.modules()) == 2 * 4


def test_the_plain_reader_gives_what_safetensors_reads(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).bfloat16(),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(6).view(2, 3),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"))
    file, ref = ckpt.TensorFile(tmp_path / "t.safetensors"), load_file(str(tmp_path / "t.safetensors"))
    assert file.keys() == set(ref)
    for name, t in ref.items():
        assert file.get(name).dtype == t.dtype and torch.equal(file.get(name), t)
        if t.is_floating_point():  # converted a slice of rows at a time, by way of float32
            assert torch.equal(file.get(name, torch.float16), t.float().half())


def test_a_large_tensor_is_converted_in_slices_of_rows_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "CONVERT_BYTES", 3 * 4 * 5)  # 3 rows of 5 float32 at a time: slices of 3, 3 and 1
    t = torch.randn(7, 5, dtype=torch.float64)
    save_file({"w": t}, str(tmp_path / "t.safetensors"))
    got = ckpt.TensorFile(tmp_path / "t.safetensors").get("w", torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, t.float().bfloat16())


def test_a_file_that_does_not_match_its_config_is_refused_in_one_sentence(tmp_path):
    torch.manual_seed(0)
    tensors, metadata = ckpt.model_tensors(GPT(tiny_config(**LLAMA)), {"tokenizer": build_tokenizer("byte").describe()})
    missing = {k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_proj.weight"}
    ckpt.write_tensors(tmp_path / "missing.safetensors", missing, metadata)
    with pytest.raises(NanoGPTError, match=r"does not match its config: it has no transformer.h.1.mlp.c_proj.weight"):
        load_for_inference(tmp_path / "missing.safetensors", device="cpu", quantize="int8")
    wrong = {**tensors, "transformer.h.0.mlp.c_proj.weight": torch.zeros(64, 3)}
    ckpt.write_tensors(tmp_path / "wrong.safetensors", wrong, metadata)
    with pytest.raises(NanoGPTError, match=r"transformer.h.0.mlp.c_proj.weight has shape \(64, 3\), and the config"):
        load_for_inference(tmp_path / "wrong.safetensors", device="cpu")
