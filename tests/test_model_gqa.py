"""Grouped-query attention, head_dim, qkv_bias and RoPE scaling: the KV cache and batched rows against the full
forward, inspect's logits, references written here from the papers' definitions (GQA as full attention with each
key/value head repeated; Llama 3.1's frequency formula), transformers' Llama as a reference, and a tiny run that
trains, resumes, samples and serves with --n-kv-head."""

from __future__ import annotations

import http.client
import json
import math
import threading

import pytest
import torch
from torch.nn import functional as F

from nanogpt_cli.config import GPTConfig, build_configs
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
from nanogpt_cli.inference.engine import Engine, KVCache
from nanogpt_cli.inspect.attention import attention_forward
from nanogpt_cli.lora import LoRAConfig, add_lora, merge_lora
from nanogpt_cli.model import GPT, rope_inv_freq, rope_tables
from conftest import check_rows_apart, tiny_config, tiny_plan

LLAMA = dict(norm="rmsnorm", mlp="swiglu")
SETTINGS = {  # each setting alone, then the combinations the small open models use
    "mqa": dict(n_head=4, n_kv_head=1),
    "gqa": dict(n_head=4, n_kv_head=2),
    "head_dim": dict(n_head=4, head_dim=12),
    "qkv_bias": dict(qkv_bias=True),
    "bias-no-qkv": dict(bias=True, qkv_bias=False),
    "linear": dict(rope_scaling="linear", rope_factor=2.0),
    "llama3": dict(rope_scaling="llama3", rope_factor=8.0, rope_original_context=4),
    "yarn": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=4),
    "gqa-learned": dict(n_head=4, n_kv_head=2, pos_encoding="learned"),
    "smollm2": dict(LLAMA, n_head=6, n_embd=48, n_kv_head=2),
    "qwen2.5": dict(LLAMA, n_head=4, n_kv_head=2, qkv_bias=True),
    "qwen3": dict(LLAMA, n_head=4, n_kv_head=2, head_dim=16, qk_norm=True),
    "llama3.2": dict(LLAMA, n_head=4, n_kv_head=1, rope_scaling="llama3", rope_factor=32.0, rope_original_context=8),
}
SWEEP = [pytest.param(kw, id=name) for name, kw in SETTINGS.items()]


def swept(kw: dict, seed: int = 0) -> GPT:
    """A tiny model whose norm gains and biases are random too, so a misplaced one shows."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    return model


@pytest.mark.parametrize("kw", SWEEP)
def test_cached_forward_and_decode_steps_equal_the_full_forward(kw):
    model = swept(kw)
    idx = torch.randint(0, 61, (3, 16))
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model, 3)
        assert cache.k[0].shape == (3, model.config.kv_heads, 16, model.config.head_size)
        prefill, _ = model(idx[:, :5], cache=cache.view(0, 3))
        chunk, _ = model(idx[:, 5:9], cache=cache.view(0, 3))
        plan = decode_plan(model)
        steps = [decode_step(plan, idx[:, t], cache)[:, None] for t in range(9, 16)]
    torch.testing.assert_close(torch.cat([prefill, chunk, *steps], dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw", SWEEP)
def test_rows_at_different_positions_decode_what_they_would_alone(kw):
    check_rows_apart(swept(kw), steps=5)


@pytest.mark.parametrize("kw", SWEEP)
def test_inspect_computes_the_models_logits_with_a_probability_per_query_head(kw):
    model = swept(kw)
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        expected, _ = model(idx)
    logits, probs = attention_forward(model, idx)
    assert probs.shape == (2, 2, model.config.n_head, 16, 16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_grouped_query_attention_is_full_attention_with_each_key_value_head_repeated():
    """Ainslie et al. (2023): query head i reads key/value head i // (nh / nkv). The same weights with each k and v
    head's rows repeated for its group, in a model with one key/value head per query head, compute the same."""
    nh, nkv, hs = 4, 2, 8
    gqa = swept(dict(n_head=nh, n_kv_head=nkv, qk_norm=True))
    full = GPT(tiny_config(n_head=nh, qk_norm=True)).eval()
    state = gqa.state_dict()
    for name, w in list(state.items()):
        if name.endswith("attn.c_attn.weight"):
            q, k, v = w.split([nh * hs, nkv * hs, nkv * hs])
            repeat = lambda t: t.view(nkv, hs, -1).repeat_interleave(nh // nkv, dim=0).reshape(nh * hs, -1)  # noqa: E731
            state[name] = torch.cat([q, repeat(k), repeat(v)])
    full.load_state_dict(state)
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx)[0], full(idx)[0], atol=1e-5, rtol=0)
    assert gqa.transformer.h[0].attn.c_attn.weight.shape == ((nh + 2 * nkv) * hs, 32)


def test_llama3_rope_frequencies_follow_the_published_formula():
    """Meta's apply_scaling (llama-models, Llama 3.1): wavelengths under context / high_freq_factor kept, over
    context / low_freq_factor divided by the factor, a smooth blend between."""
    hs, theta, factor, low, high, context = 64, 500000.0, 32.0, 1.0, 4.0, 8192
    cfg = GPTConfig(
        n_head=1,
        n_embd=hs,
        block_size=16,
        rope_theta=theta,
        rope_scaling="llama3",
        rope_factor=factor,
        rope_low_freq_factor=low,
        rope_high_freq_factor=high,
        rope_original_context=context,
    )
    expected = []
    for i in range(0, hs, 2):
        freq = 1.0 / theta ** (i / hs)
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            expected.append(freq)
        elif wavelen > context / low:
            expected.append(freq / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            expected.append((1 - smooth) * freq / factor + smooth * freq)
    got = rope_inv_freq(hs, theta, cfg)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=0, rtol=1e-12)
    kept, divided = got[0] == expected[0], got[-1] * factor == pytest.approx(1.0 / theta ** ((hs - 2) / hs))
    assert kept and divided  # both ends of the ramp occur


def test_linear_scaling_divides_positions_and_yarn_scales_the_tables():
    cfg = tiny_config(rope_scaling="linear", rope_factor=4.0)
    pos = torch.arange(8)
    cos, sin = rope_tables(pos, 16, 10000.0, cfg)
    plain_cos, _ = rope_tables(pos.double() / 4.0, 16, 10000.0)
    torch.testing.assert_close(cos, plain_cos)
    yarn = tiny_config(rope_scaling="yarn", rope_factor=4.0)
    cos, sin = rope_tables(pos, 16, 10000.0, yarn)
    mscale = 0.1 * math.log(4.0) + 1.0  # YaRN's sqrt(1/t) for s = 4
    torch.testing.assert_close(cos.square() + sin.square(), torch.full_like(cos, mscale**2))


def test_counts_include_the_grouped_heads_and_the_head_size():
    c = dict(vocab_size=61, block_size=16, n_layer=2, n_embd=32, n_head=4, n_kv_head=1, head_dim=16, bias=False)
    model = GPT(GPTConfig(**c))
    attn = 32 * (4 + 2 * 1) * 16 + 4 * 16 * 32  # c_attn and c_proj
    mlp = 2 * 32 * 128
    assert model.num_params() == 2 * (attn + mlp + 2 * 32) + 32
    matmul = 2 * (attn + mlp) + 61 * 32
    assert model.flops_per_token() == 6 * matmul + 12 * 2 * 4 * 16 * 16
    assert GPTConfig(**c).kv_values_per_token == 2 * 2 * 1 * 16
    assert Engine(model.eval(), max_batch=2).cache_bytes_per_token == 2 * 2 * 1 * 16 * 4


def test_an_older_config_without_the_fields_builds_the_same_model():
    old = {k: v for k, v in tiny_config().to_dict().items() if k not in ("n_kv_head", "head_dim", "qkv_bias")}
    old = {k: v for k, v in old.items() if not k.startswith("rope_") or k == "rope_theta"}
    config = GPTConfig.from_dict(old)
    assert config == tiny_config() and config.kv_heads == 2 and config.attn_bias is False
    assert GPT(config).transformer.h[0].attn.c_attn.weight.shape == (96, 32)


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(n_head=9, n_embd=36, n_kv_head=2), r"--n-head \(9\) must be a multiple of --n-kv-head \(2\)"),
        (dict(n_kv_head=0), "--n-kv-head must be a positive integer"),
        (dict(head_dim=7), "RoPE needs an even head size, got 7"),
        (dict(n_head=5), r"--n-embd \(32\) must be divisible by --n-head \(5\), or --head-dim given"),
        (dict(rope_factor=8.0), "--rope-factor applies to --rope-scaling linear or llama3 or yarn"),
        (dict(rope_scaling="linear", rope_beta_fast=16.0), "--rope-beta-fast applies to --rope-scaling yarn"),
        (dict(rope_scaling="linear", pos_encoding="learned"), "--rope-scaling linear needs --pos-encoding rope"),
        (dict(rope_scaling="llama3", rope_low_freq_factor=4.0), "--rope-low-freq-factor .* must be positive and below"),
    ],
)
def test_bad_settings_are_one_sentence_naming_the_flag(flags, message):
    values = {"vocab_size": 61, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, **flags}
    with pytest.raises(NanoGPTError, match=message):
        build_configs(values)


def test_head_dim_lets_the_width_not_divide_by_the_heads():
    model = swept(dict(n_head=3, head_dim=16, n_kv_head=1))
    assert model.transformer.h[0].attn.c_proj.weight.shape == (32, 48)
    with torch.no_grad():
        assert model(torch.randint(0, 61, (1, 8)))[0].shape == (1, 8, 61)


def test_lora_on_the_grouped_projections_trains_and_merges_to_the_same_function():
    model = swept(dict(n_head=4, n_kv_head=1, qkv_bias=True))
    params = add_lora(model, LoRAConfig(r=4, alpha=8, targets=("attn.c_attn", "attn.c_proj")))
    idx = torch.randint(0, 61, (2, 16))
    opt = torch.optim.SGD(params, lr=0.5)
    model.train()
    for _ in range(3):
        loss = model(idx, idx)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        before = model(idx)[0]
        after = merge_lora(model)(idx)[0]
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


# --- training, resume, sample and serve ---


RUNS = {  # a setting trains, resumes exactly, samples and serves: each of this file's settings in one of them
    "mqa-qkv-bias-llama3": dict(
        n_kv_head=1, qkv_bias=True, rope_scaling="llama3", rope_factor=4.0, rope_original_context=8
    ),
    "gqa-head-dim-yarn": dict(n_kv_head=2, head_dim=6, rope_scaling="yarn", rope_factor=2.0, rope_original_context=8),
    "linear": dict(n_kv_head=1, rope_scaling="linear", rope_factor=2.0),
}


@pytest.mark.parametrize("run", RUNS)
def test_a_grouped_query_run_resumes_exactly_samples_and_serves(run, char_data, tmp_path):
    from nanogpt_cli.inference.sample import Sampler, SampleSettings
    from nanogpt_cli.interop.loading import load_model
    from nanogpt_cli.training.plan import plan_run
    from nanogpt_cli.training.request import RunRequest
    from nanogpt_cli.training.trainer import train

    data_dir, name = char_data
    over = dict(max_iters=12, eval_interval=6, n_head=4, **RUNS[run])
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(tiny_plan(data_dir, name, whole, **over))
    assert train(tiny_plan(data_dir, name, parts, stop_at=7, **over)).step == 7
    with pytest.raises(NanoGPTError, match="n-kv-head"):  # the architecture is the run's
        plan_run(RunRequest({"n_kv_head": 4}, out=parts, resume=True))
    assert train(plan_run(RunRequest({}, out=parts, resume=True))).step == 12
    a, _ = load_model(whole, last=True)
    b, _ = load_model(parts, last=True)
    assert b.config.kv_heads == RUNS[run]["n_kv_head"] and b.config.rope_scaling == RUNS[run]["rope_scaling"]
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n

    sampler = Sampler.load(parts, device="cpu", dtype="float32")
    text = sampler.generate("the", SampleSettings(max_new_tokens=12, temperature=0)).text
    again = sampler.generate("the", SampleSettings(max_new_tokens=12, temperature=0)).text
    assert text == again and len(text) > 0

    pytest.importorskip("fastapi")
    from nanogpt_cli.config import LoadSpec
    from nanogpt_cli.serve import ServeOptions, build_server

    ready = threading.Event()
    started = []
    server = build_server(
        ServeOptions(LoadSpec(str(parts), device="cpu", dtype="float32"), port=0),
        on_ready=lambda s: (started.append(s), ready.set()),
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert ready.wait(60)
        cfg = b.config  # layers x (k, v) x key/value heads x head size x fp32
        assert started[0].cache_bytes_per_token == cfg.n_layer * 2 * cfg.kv_heads * cfg.head_size * 4
        host, port = started[0].url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"prompt": "the", "max_tokens": 12, "temperature": 0})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        assert reply["choices"][0]["text"] == text[len("the") :] or reply["choices"][0]["text"] in text
    finally:
        server.should_exit = True
        thread.join(20)


# --- transformers as the reference ---

ORIGINAL = {"original_max_position_embeddings": 8}
LLAMA_REFS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        **ORIGINAL,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, **ORIGINAL},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def random_llama(rope: dict, bias: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        rope_parameters={"rope_theta": 10000.0, **rope},
        attention_bias=bias,
        tie_word_embeddings=False,
    )
    hf_model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            if name.endswith("o_proj.bias"):
                p.zero_()  # Qwen2's biases: q, k and v only
    return hf_model


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LLAMA_REFS))
def test_a_grouped_query_llama_with_scaled_rope_loads_and_exports_with_its_logits(kind, tmp_path):
    from nanogpt_cli.interop import hf
    from nanogpt_cli.interop.export import export_hf
    from nanogpt_cli.tokenizer import build_tokenizer

    transformers = pytest.importorskip("transformers")
    ref = random_llama(LLAMA_REFS[kind], bias=kind == "llama3")
    ours = hf.from_hf(ref).eval()
    c = ours.config
    context = 32 if kind == "linear" else 8  # linear scaling has no original context; the others count from it
    assert (c.n_head, c.kv_heads, c.head_size, c.rope_scaling, c.rope_context) == (4, 2, 16, kind, context)
    assert c.attn_bias == (kind == "llama3") and not c.bias
    idx = torch.randint(0, 61, (2, 32))
    with torch.no_grad():
        expected = ref(idx).logits
        assert (ours(idx)[0] - expected).abs().max().item() <= 1e-5

    tok = build_tokenizer("char", ["".join(chr(97 + i % 26) for i in range(61))])
    export_hf(ours, tok.describe(), tmp_path / "e")  # a head wider than the tokenizer's vocabulary: padded
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "e").eval()
    assert back.config.num_key_value_heads == 2 and back.config.head_dim == 16
    with torch.no_grad():
        assert (back(idx).logits - expected).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_gguf_writes_llama_cpps_grouped_heads_and_rope_scaling_and_reads_back(tmp_path):
    gguf = pytest.importorskip("gguf")
    from nanogpt_cli.interop.export import export_gguf
    from nanogpt_cli.interop.gguf_file import read_gguf
    from nanogpt_cli.tokenizer import build_tokenizer

    tok = build_tokenizer("byte")
    flags = dict(LLAMA, n_head=4, n_kv_head=1, head_dim=16, qkv_bias=True, rope_scaling="llama3", rope_factor=8.0)
    torch.manual_seed(0)
    model = swept({**flags, "vocab_size": tok.vocab_size, "rope_original_context": 8})
    path = tmp_path / "m.gguf"
    export_gguf(model, tok.describe(), path)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["llama.attention.head_count_kv"].contents() == 1
    assert reader.fields["llama.attention.key_length"].contents() == 16
    tensors = {t.name: t for t in reader.tensors}
    assert tuple(tensors["blk.0.attn_k.weight"].shape) == (32, 16)  # gguf lists (in, out)
    assert "blk.0.attn_q.bias" in tensors
    factors = torch.tensor(tensors["rope_freqs.weight"].data.copy())
    plain, scaled = rope_inv_freq(16, 10000.0), rope_inv_freq(16, 10000.0, model.config)
    torch.testing.assert_close(factors.double(), plain / scaled, rtol=1e-6, atol=0)
    back, _ = read_gguf(path)
    idx = torch.randint(0, tok.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(idx)[0], model(idx)[0], atol=1e-5, rtol=0)

    yarn = swept(
        {**LLAMA, "vocab_size": tok.vocab_size, "n_head": 4, "n_kv_head": 2, "rope_scaling": "yarn", "rope_factor": 2.0}
    )
    export_gguf(yarn, tok.describe(), tmp_path / "y.gguf")
    fields = gguf.GGUFReader(str(tmp_path / "y.gguf")).fields
    assert fields["llama.rope.scaling.type"].contents() == "yarn"
    assert fields["llama.rope.scaling.original_context_length"].contents() == 16


def test_a_peft_adapter_on_grouped_heads_gives_q_k_and_v_their_own_rows():
    from nanogpt_cli.interop.hf import peft_tensors

    config = tiny_config(**LLAMA, n_head=4, n_kv_head=1)  # q: 4 heads of 8, k and v: 1 head of 8 each
    a, b = torch.randn(2, 32), torch.randn(48, 2)
    tensors, targets = peft_tensors(config, "llama", {"transformer.h.0.attn.c_attn": (a, b)})
    rows = {t.rsplit(".", 1)[1]: tensors[f"base_model.model.{t}.lora_B.weight"] for t in targets}
    assert {k: tuple(v.shape) for k, v in rows.items()} == {"q_proj": (32, 2), "k_proj": (8, 2), "v_proj": (8, 2)}
    torch.testing.assert_close(torch.cat([rows["q_proj"], rows["k_proj"], rows["v_proj"]]), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nkv", [1, 3, 6])
def test_decode_attention_is_the_kernel_with_groups_and_a_row_mask(nkv, dtype):
    from nanogpt_cli.model.attention import causal_mask, decode_attention

    torch.manual_seed(0)
    B, nh, S, hs = 3, 6, 20, 16
    q = torch.randn(B, nh, 1, hs, dtype=dtype)
    k, v = torch.randn(B, nkv, S, hs, dtype=dtype), torch.randn(B, nkv, S, hs, dtype=dtype)
    mask = causal_mask(torch.tensor([[4], [19], [11]]), S)  # (B, 1, 1, S): each row at its own position
    for m in (None, mask):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, enable_gqa=nkv != nh)
        got = decode_attention(q, k, v, m)
        assert got.shape == (B, nh, 1, hs) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
