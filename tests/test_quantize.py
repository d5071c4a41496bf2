"""int8 / int4 quantization (inference/backends/quantize.py) and GGUF Q8_0 / Q4_0 blocks loaded as they are
(interop/gguf_blocks.py): the packed kernels against the dequantized weights, logits near the float model's, the
engine's cache and batch against the full forward, and --quantize on the command line."""

import os

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.inference.backends import native
from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step, head_logits
from nanogpt_cli.inference.backends.quantize import QuantizedLinear, quantize_linear, quantize_model
from nanogpt_cli.inference.engine import Engine, KVCache, SamplingParams
from nanogpt_cli.model import GPT
from conftest import kernel_reference, tiny_config

KINDS = ["int8", "int4"]
LLAMA = dict(n_embd=64, norm="rmsnorm", mlp="swiglu", block_size=32)  # 64: whole int4 groups of 32


def model_of(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**{**LLAMA, **kw})).eval()


def quantized(kind: str, **kw) -> GPT:
    return quantize_model(model_of(**kw), kind, 32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 40])  # the kernel for a decode step's rows; dequantized for a prefill's
def test_the_packed_kernel_computes_the_dequantized_weight(kind, rows):
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=True)
    q = quantize_linear(layer, kind, 32)
    assert isinstance(q, QuantizedLinear)
    x = torch.randn(rows, 64)
    expected = torch.nn.functional.linear(x, q.dequantize(torch.float32), q.bias)
    if q.native and rows < 32:  # our kernels: x rounded to int8 in blocks of 32
        expected = kernel_reference(q, x) + q.bias
    torch.testing.assert_close(q(x), expected, atol=1e-5, rtol=0)
    # each weight within half a quantization step: 1/254 of the row's largest (int8), 1/30 of a group's range
    step = layer.weight.abs().amax(1, keepdim=True) / 127 if kind == "int8" else 2 * layer.weight.abs().max() / 15
    assert ((q.dequantize(torch.float32) - layer.weight).abs() <= step / 2 + 1e-6).all()


def test_our_kernels_are_built_here_when_ci_says_so():
    """CI's machine has a compiler and AVX2: the kernels must build there, not fall back quietly."""
    if os.environ.get("CI") != "true":
        pytest.skip("checked on CI only (CI=true): elsewhere torch's kernels are a valid fallback")
    assert native.available(), native.status()


@pytest.mark.parametrize("kind, tol", [("int8", 0.02), ("int4", 0.25)])
def test_quantized_logits_stay_close_to_the_float_models(kind, tol):
    idx = torch.randint(0, 61, (2, 16))
    with torch.inference_mode():
        ref, _ = model_of()(idx)
        got, _ = quantized(kind)(idx)
    assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_only_the_blocks_projections_are_quantized_and_bf16_runs():
    model = quantized("int4")
    kinds = {type(m).__name__ for m in model.transformer.h.modules() if isinstance(m, nn.Linear | QuantizedLinear)}
    assert kinds == {"QuantizedLinear"} and type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight  # the tied head stays one tensor
    bf16 = quantize_model(model_of().cast(torch.bfloat16), "int8")
    with torch.inference_mode():
        logits, _ = bf16(torch.randint(0, 61, (1, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.parametrize("kind", KINDS)
def test_cache_and_decode_step_equal_the_full_forward(kind):
    model = quantized(kind, bias=True)
    idx = torch.randint(0, 61, (3, 16))
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model, 3)
        prefill, _ = model(idx[:, :12], cache=cache.view(0, 3))  # 36 rows: the dequantized path
        plan = decode_plan(model)
        steps = [decode_step(plan, idx[:, t], cache)[:, None] for t in range(12, 16)]  # 3 rows: the kernel
        hs = model.hidden_states(idx)  # the full forward's last positions through the decode step's quantized head
        heads = [head_logits(plan, hs[:, t])[:, None] for t in range(12, 16)]
    torch.testing.assert_close(prefill, full[:, :12], atol=1e-4, rtol=0)
    # our kernels round a step's activations to int8 (blocks of 32), the full forward's 48 rows meet the
    # dequantized weight in float32: within 1% of the largest logit; torch's kernels to float32's rounding
    rounded = native.available()
    atol = 0.01 * full.abs().max().item() if rounded else 1e-4
    torch.testing.assert_close(torch.cat(steps, dim=1), torch.cat(heads, dim=1), atol=atol, rtol=0)


@pytest.mark.parametrize("kind, tol", [("int8", 0.02), ("int4", 0.25)])
@pytest.mark.parametrize("vocab", [None, 50])  # 50: not a multiple of 16, int4's padded rows cut off
def test_the_decode_steps_quantized_head_stays_close_to_the_float_head(kind, tol, vocab):
    model = quantized(kind)
    plan = decode_plan(model, vocab)
    assert plan.head_q is not None and plan.head_q.kind == kind
    assert model.lm_head.weight is model.transformer.wte.weight  # the model's own head and embedding stay float
    h = torch.randn(3, 64)
    with torch.inference_mode():
        got = head_logits(plan, h)  # 3 rows: the packed kernel
        ref = torch.nn.functional.linear(h, plan.head)
        many = head_logits(plan, h.repeat(12, 1))  # 36 rows: the float head
    assert got.shape == ref.shape == (3, vocab or 61) and got.is_contiguous()
    assert 0 < (got - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.6
    torch.testing.assert_close(many, ref.repeat(12, 1))


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_gives_each_row_the_tokens_it_gets_alone(kind):
    model = quantized(kind)
    prompts = [[1, 2, 3], [5, 8, 13, 21, 34, 55, 2], [7]]
    greedy = SamplingParams(temperature=0.0)
    alone = []
    for p in prompts:
        engine = Engine(model, max_batch=1)
        engine.add(p, greedy, 10)
        alone.append([t.token for t in engine.run()])
    engine = Engine(model, max_batch=3)
    rows = [engine.add(p, greedy, 10) for p in prompts]
    together = {r: [] for r in rows}
    for t in engine.run():
        together[t.row].append(t.token)
    assert [together[r] for r in rows] == alone


@pytest.mark.parametrize("kind", KINDS)
def test_quantizing_in_slices_of_rows_gives_the_same_values(kind, monkeypatch):
    from nanogpt_cli.inference.backends import quantize

    torch.manual_seed(0)
    w = torch.randn(37, 64).bfloat16()
    run = (lambda w: quantize.quantize_int8(w)) if kind == "int8" else (lambda w: quantize.quantize_int4(w, 32))
    whole = run(w)
    monkeypatch.setattr(quantize, "ROWS_BYTES", 5 * 4 * 64)  # 5 rows at a time: 8 slices, the last of 2
    for a, b in zip(whole, run(w), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_int4_values_packed_in_slices_of_rows_compute_the_dequantized_weight(monkeypatch):
    from nanogpt_cli.inference.backends import quantize

    torch.manual_seed(0)
    layer = nn.Linear(64, 176, bias=False)  # 176 rows: slices of 64, 64 and 48
    whole = quantize_linear(layer, "int4", 32)
    monkeypatch.setattr(quantize, "PACK_ROWS", 64)
    sliced = quantize_linear(layer, "int4", 32)
    assert torch.equal(sliced.weight_q, whole.weight_q)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(x, sliced.dequantize(torch.float32))
    if sliced.native:
        expected = kernel_reference(sliced, x)  # no bias
    torch.testing.assert_close(sliced(x), expected, atol=1e-5, rtol=0)


def test_a_bad_kind_or_group_size_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--quantize"):
        quantize_model(model_of(), "int3")
    with pytest.raises(ValueError, match="--int4-group"):
        quantize_model(model_of(), "int4", 48)
    with pytest.raises(ValueError, match=r"--int4-group \(128\) must divide"):  # 64 wide: whole groups of 64 only
        quantize_model(model_of(), "int4", 128)


# --- GGUF blocks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, quant, tol", [("int4", "q4_0", 1e-5), ("int8", "q8_0", 0.02)])
def test_a_quantized_gguf_loads_into_the_matching_form(kind, quant, tol, tmp_path):
    pytest.importorskip("gguf")
    from nanogpt_cli.interop.export import export_gguf
    from nanogpt_cli.interop.loading import load_model
    from nanogpt_cli.tokenizer import build_tokenizer

    tok = build_tokenizer("char", ["abcdefghijklmnopqrstuvwxyz .,!?\n" * 2])
    torch.manual_seed(0)
    model = GPT(tiny_config(**{**LLAMA, "vocab_size": tok.vocab_size})).eval()
    path = tmp_path / "model.gguf"
    export_gguf(model, tok.describe(), path, quant=quant)
    packed, _ = load_model(path, quantize=kind)
    floats, _ = load_model(path)  # the same file dequantized to float32
    layers = [m for m in packed.transformer.h.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * 2 and all(m.kind == kind for m in layers)
    idx = torch.randint(0, tok.vocab_size, (2, 16))
    with torch.inference_mode():
        got, ref = packed(idx)[0], floats(idx)[0]
    # q4_0: the file's values and scales themselves; q8_0: each row's blocks rescaled to one scale
    assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


# --- the command line -------------------------------------------------------------------------------------


def test_sample_with_quantize_int8_writes_the_float_models_greedy_text(trained_run):
    args = ["sample", "--checkpoint", str(trained_run), "--prompt", "the ", "--max-new-tokens", "12", "--no-stream"]
    runs = {q: CliRunner().invoke(app, [*args, "--temperature", "0", *q]) for q in ((), ("--quantize", "int8"))}
    for result in runs.values():
        assert result.exit_code == 0, result.output
    # stdout: the text alone (a first build of our kernels in this process notes itself on stderr)
    assert runs[()].stdout == runs[("--quantize", "int8")].stdout
    assert runs[()].stdout.startswith("the ") and len(runs[()].stdout) == len("the ") + 12 + 1  # and its newline
    int4 = CliRunner().invoke(app, [*args, "--quantize", "int4", "--int4-group", "32"])
    assert int4.exit_code == 0 and int4.output.startswith("the "), int4.output


def test_sample_refuses_an_unknown_quantize_in_one_line(trained_run):
    result = CliRunner().invoke(app, ["sample", "--checkpoint", str(trained_run), "--quantize", "int3"])
    assert result.exit_code == 1 and "--quantize must be one of int8, int4" in result.output
    args = ["sample", "--checkpoint", str(trained_run), "--quantize", "int4", "--int4-group", "64"]
    result = CliRunner().invoke(app, args)  # the tiny preset's 32-wide projections
    assert result.exit_code == 1 and "--int4-group (64) must divide" in result.output, result.output


def test_a_bf16_quantized_model_decodes_with_a_head_of_its_bits_where_our_kernels_run():
    from nanogpt_cli.inference.backends.decode import packed_form

    h = torch.randn(3, 64, dtype=torch.bfloat16)
    for kind in KINDS:
        model = quantize_model(model_of().cast(torch.bfloat16), kind, 32)
        plan = decode_plan(model)
        packs = packed_form(plan.head) is not None  # oneDNN's bf16 product on this CPU
        # int8 with our kernels reads its head in int8, faster than bf16; torch's int8 kernel is slower than bf16
        assert (plan.head_q is None) == (kind == "int8" and packs and not native.available())
        with torch.inference_mode():
            got, ref = head_logits(plan, h).float(), torch.nn.functional.linear(h, plan.head).float()
        tol = 0.02 if plan.head_q is None else 0.25
        assert got.shape == (3, 61) and (got - ref).abs().max().item() <= tol * ref.abs().max().item()
