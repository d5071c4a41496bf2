"""The architecture settings of GPT-NeoX/Pythia, Mistral and Gemma 3 (partial rotary, parallel residual, sliding
window with a pattern and a RoPE base per kind, embedding scale, 1 + w norms, post-norms, GeGLU, QK-norm):
each against a reference written here from its paper's or model card's definition, the KV cache and batched
rows against the full forward, `inspect` against the model, and each trained, resumed, sampled and served."""

import json
import math

import pytest
import torch
from torch.nn import functional as F

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
from nanogpt_cli.inference.engine import Engine, KVCache, SamplingParams
from nanogpt_cli.inspect.attention import attention_forward
from nanogpt_cli.model import GPT, Block, Context, activation, apply_rope, rope_tables
from conftest import check_rows_apart
from conftest import tiny_config as tiny

SETTINGS = {
    "rotary": dict(rotary_dim=4),
    "parallel": dict(parallel_residual=True),
    "window": dict(sliding_window=5),
    "pattern": dict(sliding_window=5, window_pattern="LG", rope_local_theta=100.0),
    "embed_scale": dict(embed_scale=True),
    "norm_offset": dict(norm="rmsnorm", norm_offset=True, qk_norm=True),
    "post_norms": dict(post_norms=True),
    "geglu": dict(mlp="geglu"),
    # the combinations real models have
    "pythia": dict(parallel_residual=True, rotary_dim=4, bias=True, mlp="gelu"),
    "mistral": dict(sliding_window=5, norm="rmsnorm", mlp="swiglu"),
    "gemma3": dict(
        n_layer=6,
        sliding_window=5,
        window_pattern="LLLLLG",
        rope_theta=1000.0,
        rope_local_theta=10.0,
        embed_scale=True,
        norm="rmsnorm",
        norm_offset=True,
        post_norms=True,
        mlp="geglu",
        qk_norm=True,
    ),
}
COMBOS = ["pythia", "mistral", "gemma3"]
GREEDY = SamplingParams(temperature=0.0)


def model_with(kw: dict, seed: int = 0) -> GPT:
    """A tiny model whose norm gains and biases are random too, so a misplaced one shows in the logits."""
    torch.manual_seed(seed)
    model = GPT(tiny(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.3 if name.endswith("weight") else 0.1)
    return model


# --- the KV cache, batched rows and inspect against the full forward --------------------------------------


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_kv_cache_and_decode_step_equal_the_full_forward(name):
    model = model_with(SETTINGS[name])
    idx = torch.randint(0, 61, (3, 16))
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model, 3)
        prefill, _ = model(idx[:, :7], cache=cache.view(0, 3))  # longer than the window of 5
        chunk, _ = model(idx[:, 7:10], cache=cache.view(0, 3))  # a chunk that wraps around the window's ring
        plan = decode_plan(model)
        steps = [decode_step(plan, idx[:, t], cache)[:, None] for t in range(10, 16)]
    torch.testing.assert_close(torch.cat([prefill, chunk, *steps], dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rows_at_different_positions_decode_what_they_would_alone(name):
    check_rows_apart(model_with(SETTINGS[name]), steps=6, chunk=(12, 15))


@pytest.mark.parametrize("name", COMBOS + ["window"])
def test_a_batch_with_rows_joining_and_leaving_gives_each_row_its_solo_tokens(name):
    model = model_with(SETTINGS[name])
    torch.manual_seed(1)
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (5, 2, 9, 1, 4)]
    lengths = [6, 11, 12, 9, 14]  # some run past the context of 16: their caches restart

    def alone(prompt, n):
        engine = Engine(model, max_batch=1)
        engine.add(prompt, GREEDY, n)
        return [t.token for t in engine.run()]

    solo = [alone(p, n) for p, n in zip(prompts, lengths)]
    engine, got = Engine(model, max_batch=3), {}
    which = {engine.add(prompts[0], GREEDY, lengths[0]): 0, engine.add(prompts[1], GREEDY, lengths[1]): 1}
    waiting = [2, 3, 4]
    for step in range(60):
        if step >= 2 and waiting and engine.free:  # rows join into freed slots: a moved row keeps its ring
            i = waiting.pop(0)
            which[engine.add(prompts[i], GREEDY, lengths[i])] = i
        for t in engine.step():
            got.setdefault(which[t.row], []).append(t.token)
        if not engine.active and not waiting:
            break
    assert [got[i] for i in range(5)] == solo
    # greedy with the cache equals greedy recomputing every token (no cache), within the context
    plain = Engine(model, max_batch=1, use_cache=False)
    plain.add(prompts[0], GREEDY, lengths[0])
    assert [t.token for t in plain.run()] == solo[0]


@pytest.mark.parametrize("name", COMBOS)
def test_inspects_logits_equal_the_models_and_a_local_layer_attends_within_its_window(name):
    model = model_with(SETTINGS[name])
    idx = torch.randint(0, 61, (2, 16))
    logits, probs = attention_forward(model, idx)  # probs (B, L, nh, T, T)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(idx)[0], atol=1e-5, rtol=0)
    cfg, W = model.config, 5
    p, j = torch.arange(16)[:, None], torch.arange(16)
    for layer in range(cfg.n_layer):
        seen = (j <= p) & (j > p - W) if cfg.is_local(layer) else j <= p
        assert (probs[:, layer][..., ~seen] == 0).all() and (probs[:, layer][..., seen] > 0).all()


# --- each setting against its definition --------------------------------------------------------------


def test_a_token_outside_the_window_has_no_effect_on_a_local_layers_output():
    """Mistral / Gemma: position p attends to j with p - W < j <= p. One local layer: the logits at p ignore
    token p - W and earlier, and depend on token p - W + 1."""
    W, p = 4, 11
    model = model_with(dict(n_layer=1, sliding_window=W))
    idx = torch.randint(0, 61, (1, 16))
    with torch.no_grad():
        base = model(idx)[0][0, p]
        for far in (0, p - W):
            changed = idx.clone()
            changed[0, far] = (idx[0, far] + 1) % 61
            torch.testing.assert_close(model(changed)[0][0, p], base, atol=1e-6, rtol=0)
        near = idx.clone()
        near[0, p - W + 1] = (idx[0, p - W + 1] + 1) % 61
        assert (model(near)[0][0, p] - base).abs().max() > 1e-4
        # a global layer of the same weights sees the whole past
        plain = GPT(tiny(n_layer=1)).eval()
        plain.load_state_dict(model.state_dict())
        far = idx.clone()
        far[0, 0] = (idx[0, 0] + 1) % 61
        assert (plain(far)[0][0, p] - plain(idx)[0][0, p]).abs().max() > 1e-4


def test_partial_rotary_rotates_the_first_dims_as_gpt_neox_does_and_leaves_the_rest_position_free():
    """GPT-NeoX (rotary_pct): q_rot, q_pass = q[..., :rd], q[..., rd:]; q_rot * cos + rotate_half(q_rot) * sin with
    inv_freq = 1 / base^(arange(0, rd, 2) / rd), cos = cat(freqs, freqs).cos(); q_pass unchanged."""
    hs, rd, base = 16, 6, 10000.0
    x = torch.randn(5, hs)
    pos = torch.arange(3, 8)
    cos, sin = rope_tables(pos, rd, base)
    ours = apply_rope(x, cos, sin)
    inv_freq = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    emb = torch.cat([pos[:, None] * inv_freq, pos[:, None] * inv_freq], dim=-1)
    x_rot = x[..., :rd].double()
    rotate_half = torch.cat([-x_rot[..., rd // 2 :], x_rot[..., : rd // 2]], dim=-1)
    reference = torch.cat([(x_rot * emb.cos() + rotate_half * emb.sin()).float(), x[..., rd:]], dim=-1)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)
    assert torch.equal(ours[..., rd:], x[..., rd:])  # the unrotated dims carry no position
    # the model's own tables: the same query at positions 3 and 9 differs in its first 4 dims only
    model = GPT(tiny(rotary_dim=4, n_layer=1))
    q = torch.randn(16)
    at3, at9 = (apply_rope(q, model.rope_cos[p, 0, 0], model.rope_sin[p, 0, 0]) for p in (3, 9))
    assert torch.equal(at3[4:], at9[4:]) and (at3[:4] - at9[:4]).abs().max() > 1e-3


def block_branches(block: Block, x: torch.Tensor, cfg: GPTConfig):
    """A(x) and M of a block, its attention and MLP branches each alone: a plain sequential block of the same
    weights with the other branch's output projection at zero computes y + that branch of y."""

    def branch(zeroed: str):
        plain = Block(tiny(**{**cfg.to_dict(), "parallel_residual": False, "post_norms": False})).eval()
        plain.load_state_dict(block.state_dict(), strict=False)  # the post-norms are not the plain block's
        with torch.no_grad():
            plain.get_submodule(zeroed).weight.zero_()
        return lambda y: plain(y, Context(1, y.size(0))) - y

    attn, mlp = branch("mlp.c_proj"), branch("attn.c_proj")
    with torch.no_grad():
        return attn(x), mlp(x), attn, mlp


def test_the_parallel_residual_is_x_plus_attention_plus_mlp_of_the_same_input():
    """GPT-NeoX / GPT-J: x + attn(ln_1(x)) + mlp(ln_2(x)), against the sequential x' = x + attn(.), x' + mlp(x')."""
    cfg = tiny(parallel_residual=True, pos_encoding="learned")  # no RoPE tables: the block alone
    torch.manual_seed(0)
    block = Block(cfg).eval()
    x = torch.randn(9, 32)
    a, m, _, mlp = block_branches(block, x, cfg)
    with torch.no_grad():
        out = block(x, Context(1, 9))
        torch.testing.assert_close(out, x + a + m, atol=1e-6, rtol=0)
        assert (out - (x + a + mlp(x + a))).abs().max() > 1e-4  # not the sequential block


def test_post_norms_norm_each_branch_before_its_add():
    """Gemma 3: h = x + post_attention_norm(attn(input_norm(x)));
    out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))."""
    cfg = tiny(post_norms=True, norm="rmsnorm", pos_encoding="learned")
    torch.manual_seed(0)
    block = Block(cfg).eval()
    with torch.no_grad():
        block.post_ln_1.weight.normal_(1.0, 0.3)
        block.post_ln_2.weight.normal_(1.0, 0.3)
        x = torch.randn(9, 32)
        a, _, _, mlp = block_branches(block, x, cfg)

        def rms(y, w):
            return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

        h = x + rms(a, block.post_ln_1.weight)
        torch.testing.assert_close(block(x, Context(1, 9)), h + rms(mlp(h), block.post_ln_2.weight), atol=1e-5, rtol=0)


def test_geglu_is_the_tanh_gelu_of_the_gate_times_up():
    """Gemma's MLP: down(gelu_tanh(gate(x)) * up(x)), gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))."""
    gate, up = torch.randn(4, 24), torch.randn(4, 24)
    g = gate.double()
    reference = (0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))).float() * up
    torch.testing.assert_close(activation(torch.cat([gate, up], dim=-1), "geglu"), reference, atol=1e-6, rtol=0)
    cfg = tiny(mlp="geglu")
    model = GPT(cfg)
    assert model.transformer.h[0].mlp.c_fc.out_features == 2 * cfg.hidden_size  # gate and up fused, as SwiGLU


def test_norm_offset_is_rms_norm_times_one_plus_w_and_starts_as_plain_rms_norm():
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), w initialised at 0; QK-norm's too."""
    cfg = tiny(norm="rmsnorm", norm_offset=True, qk_norm=True)
    model = GPT(cfg)
    norms = [model.transformer.ln_f, model.transformer.h[0].ln_1, model.transformer.h[0].attn.q_norm]
    assert all(torch.equal(n.weight, torch.zeros_like(n.weight)) for n in norms)
    x = torch.randn(3, 32)
    w = torch.randn(32)
    with torch.no_grad():
        model.transformer.ln_f.weight.copy_(w)
        reference = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * (1 + w)
        torch.testing.assert_close(model.transformer.ln_f(x), reference, atol=1e-6, rtol=0)
    q = model.transformer.h[0].attn.q_norm
    assert q.normalized_shape == (cfg.head_size,)  # over each head's dims, one gain shared by the heads (Qwen3)


def test_embed_scale_multiplies_the_embeddings_by_sqrt_width():
    """Gemma: hidden = embed(tokens) * sqrt(hidden_size); the LM head is not scaled."""
    scaled = model_with(dict(embed_scale=True, tie_embeddings=False))
    plain = GPT(tiny(tie_embeddings=False)).eval()
    state = scaled.state_dict()
    plain.load_state_dict({**state, "transformer.wte.weight": state["transformer.wte.weight"] * math.sqrt(32)})
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(scaled(idx)[0], plain(idx)[0], atol=1e-5, rtol=0)


def test_local_layers_turn_at_their_own_rope_base():
    model = model_with(SETTINGS["pattern"])
    cos_local, _ = rope_tables(torch.arange(16), 16, 100.0)
    torch.testing.assert_close(model.rope_local_cos[:, 0, 0], cos_local)
    cos, _ = rope_tables(torch.arange(16), 16, 10000.0)
    torch.testing.assert_close(model.rope_cos[:, 0, 0], cos)
    assert [model.config.is_local(i) for i in range(4)] == [True, False, True, False]


# --- counts, the cache's size, validation --------------------------------------------------------------


def test_flops_count_only_the_windows_keys_and_parameters_include_the_post_norms():
    T, C = 16, 32
    base = GPT(tiny()).flops_per_token()
    assert GPT(tiny(sliding_window=5)).flops_per_token() == base - 2 * 12 * C * (T - 5)
    assert GPT(tiny(sliding_window=5, window_pattern="LG")).flops_per_token() == base - 12 * C * (T - 5)
    assert GPT(tiny(post_norms=True)).num_params() == GPT(tiny()).num_params() + 2 * 2 * C  # two a layer, a gain each
    geglu = GPT(tiny(mlp="geglu"))
    assert geglu.num_params() == GPT(tiny(mlp="swiglu")).num_params()


def test_a_sliding_window_layer_keeps_only_its_window_and_bytes_per_token_say_so():
    full = KVCache(GPT(tiny(block_size=32)), 2)
    ring = KVCache(GPT(tiny(block_size=32, sliding_window=8, window_pattern="LG")), 2)
    assert ring.k[0].shape[2] == 8 and ring.k[1].shape[2] == 32
    per_layer = 2 * 32 * 4  # k and v, n_head * head_size values of 4 bytes
    assert full.bytes_per_token() == 2 * per_layer
    assert ring.bytes_per_token() == per_layer + per_layer * 8 / 32


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(rotary_dim=5), r"--rotary-dim must be an even number from 2 to the head size \(16\), got 5"),
        (dict(rotary_dim=18), r"--rotary-dim must be an even number from 2 to the head size \(16\), got 18"),
        (dict(rotary_dim=4, pos_encoding="learned"), "--rotary-dim is for --pos-encoding rope"),
        (dict(sliding_window=0), "--sliding-window must be a positive integer, got 0"),
        (dict(window_pattern="LG"), "--window-pattern needs --sliding-window"),
        (dict(sliding_window=4, window_pattern="LXG"), "--window-pattern must be letters L .* got 'LXG'"),
        (dict(rope_local_theta=10.0), "--rope-local-theta needs --sliding-window"),
        (dict(sliding_window=4, rope_local_theta=-1.0), "--rope-local-theta must be positive"),
        (dict(norm_offset=True), "--norm-offset is a gain of RMSNorm: add --norm rmsnorm"),
        (dict(mlp="glu"), "--mlp must be one of .*geglu"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


def test_defaults_leave_an_older_checkpoints_config_as_it_was():
    old = {k: v for k, v in tiny().to_dict().items() if k not in SETTINGS["gemma3"] and k != "rotary_dim"}
    old.pop("parallel_residual", None)
    cfg = GPTConfig.from_dict(old)
    assert cfg.rotary_size == cfg.head_size and not cfg.is_local(0) and cfg.extras() == []
    torch.manual_seed(0)
    model = GPT(cfg)
    assert [n for n, _ in model.named_parameters() if "post_ln" in n] == []


def test_info_names_the_settings():
    words = tiny(**SETTINGS["gemma3"]).extras()
    assert words == [
        "window 5 on 5 of 6 layers, RoPE base 10",
        "embeddings x sqrt(width)",
        "1 + w norms",
        "post-norms",
        "QK-norm",
    ]
    assert tiny(**SETTINGS["pythia"]).extras() == ["RoPE on 4 of 16 head dims", "parallel residual"]


# --- training and LoRA -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_trains_from_scratch(name):
    """A few AdamW steps on one batch bring the loss down: every new weight gets a gradient."""
    torch.manual_seed(0)
    model = GPT(tiny(**SETTINGS[name]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 61, (4, 16))
    losses = []
    for _ in range(15):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("rotary_dim", [None, 6])
def test_the_fused_training_kernel_and_the_composite_path_agree(rotary_dim):
    """NormRopeQKV runs for RoPE with QK-norm without a cache (local tables, 1 + w gains and partial rotary
    included); through a cache the composite ops run. Both give the gradients of one function."""
    kw = dict(SETTINGS["gemma3"], n_layer=2, window_pattern="LG", rotary_dim=rotary_dim)
    model = model_with(kw).train()
    x = torch.randint(0, 61, (2, 16))
    grads = []
    for fused in (True, False):
        model.zero_grad()
        loss = model(x[:, :-1], x[:, 1:])[1] if fused else composite_loss(model, x)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def composite_loss(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """The loss through the modules' composite path: a cache that holds everything, so no fused kernel runs."""

    class Whole:
        pos = 0

        def update(self, layer, k, v):
            return k, v

        def window_keys(self, T, device):
            return torch.arange(T, device=device)

    logits, _ = model(x[:, :-1], cache=Whole())
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


@pytest.mark.parametrize("name", COMBOS)
def test_lora_on_every_projection_trains_and_decodes_as_its_forward(name):
    from nanogpt_cli.lora import LoRAConfig, adapters, add_lora, merge_lora

    model = model_with(SETTINGS[name])
    params = add_lora(model, LoRAConfig(r=2, targets=("all",)))
    opt = torch.optim.AdamW(params, lr=1e-2)
    x = torch.randint(0, 61, (2, 16))
    model.train()
    for _ in range(3):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(layer.lora_B.abs().sum() > 0 for layer in adapters(model).values())
    model.eval()
    engine = Engine(model, max_batch=1)
    engine.add(x[0, :6].tolist(), GREEDY, 8)
    unmerged = [t.token for t in engine.run()]
    merged = merge_lora(model)
    engine = Engine(merged, max_batch=1, use_cache=False)
    engine.add(x[0, :6].tolist(), GREEDY, 8)
    assert [t.token for t in engine.run()] == unmerged


# --- Hugging Face: GPT-NeoX with the parallel residual and partial rotary (Pythia) ------------------------


@pytest.mark.slow  # transformers takes seconds to import
def test_a_pythia_shaped_gpt_neox_loads_with_its_logits_and_exports_back():
    transformers = pytest.importorskip("transformers")
    from nanogpt_cli.interop import hf

    torch.manual_seed(0)
    ref = transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            rotary_pct=0.25,
            use_parallel_residual=True,
            hidden_act="gelu",
            tie_word_embeddings=False,
        )
    ).eval()
    ours = hf.from_hf(ref).eval()
    assert ours.config.parallel_residual and ours.config.rotary_dim == 4
    idx = torch.randint(0, 61, (2, 20))
    with torch.no_grad():
        assert (ours(idx)[0] - ref(idx).logits).abs().max().item() <= 1e-5
        back = hf.to_hf(ours).eval()
        partial = (getattr(back.config, "rope_parameters", None) or {}).get("partial_rotary_factor")
        assert back.config.use_parallel_residual and int(16 * (partial or back.config.rotary_pct)) == 4
        assert (back(idx).logits - ref(idx).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(sliding_window=8), "closest, MistralForCausalLM, which has --sliding-window 8, needs --norm rmsnorm"),
        (dict(norm="rmsnorm", norm_offset=True, post_norms=True), "Gemma3ForCausalLM, which has .*--post-norms, needs"),
        (dict(mlp="geglu"), "closest, Gemma3ForCausalLM, which has --mlp geglu, needs --norm rmsnorm, --qk-norm"),
        (dict(parallel_residual=True, norm="rmsnorm", mlp="swiglu"), "LlamaForCausalLM, .* needs --no-parallel-resid"),
    ],
)
def test_what_export_cannot_express_is_one_sentence_naming_the_setting(kw, message):
    from nanogpt_cli.errors import NanoGPTError
    from nanogpt_cli.interop import gguf_file, hf

    with pytest.raises(NanoGPTError, match=message):
        hf.hf_kind(tiny(**kw))
    assert hf.hf_kind(tiny(parallel_residual=True, rotary_dim=4)) == "gpt_neox"
    assert gguf_file.gguf_arch(tiny(parallel_residual=True, mlp="gelu_tanh")) == "gptneox"  # llama.cpp's Pythia
    with pytest.raises(NanoGPTError, match="llama.cpp computes GELU with the tanh approximation"):
        gguf_file.gguf_arch(tiny(parallel_residual=True, mlp="gelu"))


GEMMA = dict(norm="rmsnorm", mlp="geglu", qk_norm=True, embed_scale=True, norm_offset=True, post_norms=True)
GEMMA_GGUF = dict(GEMMA, n_layer=6, sliding_window=4, window_pattern="LLLLLG", rope_local_theta=10000.0)


@pytest.mark.parametrize(
    "kw,message",
    [
        (
            dict(norm="rmsnorm", mlp="swiglu", bias=True),
            "llama.cpp's llama does not compute --bias: it needs --no-bias",
        ),
        (
            dict(norm="rmsnorm", mlp="swiglu", qk_norm=True, qkv_bias=True),
            "llama.cpp's qwen3 does not compute --qkv-bias: it needs --no-qkv-bias",
        ),
        (
            dict(GEMMA_GGUF, logit_softcap=30.0),
            "llama.cpp's gemma3 does not compute --logit-softcap 30: it needs --logit-softcap none",
        ),
        (
            dict(GEMMA_GGUF, rope_local_theta=10.0),
            "llama.cpp's gemma3 does not compute --window-pattern LLLLLG with --rope-local-theta 10: it needs "
            "--window-pattern LLLLLG and --rope-local-theta 10000 (llama.cpp's gemma3 makes every sixth layer global "
            "and turns the others at RoPE base 10000)",
        ),
    ],
)
def test_gguf_export_refuses_what_llama_cpps_architecture_does_not_compute_by_its_declaration(kw, message):
    """Each llama.cpp architecture declares what it computes (the family's declaration, narrowed): one sentence
    naming the flag; the same config narrowed to what it takes exports."""
    from nanogpt_cli.errors import NanoGPTError
    from nanogpt_cli.interop import gguf_file

    with pytest.raises(NanoGPTError) as e:
        gguf_file.gguf_arch(tiny(**kw))
    assert str(e.value) == message
    assert gguf_file.gguf_arch(tiny(norm="rmsnorm", mlp="swiglu", qkv_bias=True)) == "llama"  # q, k, v biases only
    assert gguf_file.gguf_arch(tiny(**GEMMA_GGUF)) == "gemma3"


# --- end to end: train, resume, sample, serve ---------------------------------------------------------

FLAGS = {
    "pythia": ["--parallel-residual", "--rotary-dim", "4", "--bias", "--mlp", "gelu"],
    "mistral": ["--sliding-window", "5", "--norm", "rmsnorm", "--mlp", "swiglu"],
    "gemma3": [
        *("--n-layer", "6", "--sliding-window", "5", "--window-pattern", "LLLLLG", "--rope-theta", "1000"),
        *("--rope-local-theta", "10", "--embed-scale", "--norm", "rmsnorm", "--norm-offset", "--post-norms"),
        *("--mlp", "geglu", "--qk-norm"),
    ],
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app
    from conftest import make_text

    root = tmp_path_factory.mktemp("arch")
    text = root / "play.txt"
    text.write_text(make_text(lines=300, seed=5), encoding="utf-8")
    result = CliRunner().invoke(
        app, ["prepare", str(text), "--name", "play", "--tokenizer", "char", "--data-dir", str(root / "data")]
    )
    assert result.exit_code == 0, result.output
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", COMBOS)
def test_each_setting_trains_resumes_exactly_samples_and_serves(name, dataset, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app
    from nanogpt_cli.inference.sample import Sampler, SampleSettings

    monkeypatch.delenv("NANOGPT_API_KEY", raising=False)
    runner = CliRunner()

    def ok(*args):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result.output

    common = ["--data", "play", "--data-dir", dataset / "data", "--preset", "tiny", "--max-iters", "6"]
    common += ["--eval-interval", "3", "--eval-iters", "1", "--dtype", "float32", "--device", "cpu", *FLAGS[name]]
    ok("train", *common, "--out", tmp_path / "once")
    ok("train", *common, "--out", tmp_path / "twice", "--stop-at", "3")
    assert "resuming at step 3" in ok("train", "--out", tmp_path / "twice", "--resume")
    once, twice = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("once", "twice"))
    assert once.keys() == twice.keys() and all(torch.equal(once[k], twice[k]) for k in once)
    saved = json.loads((tmp_path / "once" / "config.json").read_text())["model"]
    assert {k: saved[k] for k in ("sliding_window", "parallel_residual", "rotary_dim")} == {
        k: tiny(**SETTINGS[name]).to_dict()[k] for k in ("sliding_window", "parallel_residual", "rotary_dim")
    }
    out = ok("sample", "--checkpoint", tmp_path / "once", "--prompt", "THE KING:", "--max-new-tokens", "40")
    assert out.startswith("THE KING:") and len(out) > 30
    info = ok("info", tmp_path / "once")
    assert "attention, blocks" in info

    sampler = Sampler.load(tmp_path / "once", device="cpu", dtype="float32")
    greedy = sampler.generate("THE KING:", SampleSettings(max_new_tokens=24, temperature=0.0)).text
    assert serve_completion(tmp_path / "once", "THE KING:", 24) == greedy


def serve_completion(run, prompt: str, n: int) -> str:
    """A greedy completion from `nanogpt serve`'s server, run in a thread of this process."""
    import http.client
    import threading

    from nanogpt_cli.config import LoadSpec
    from nanogpt_cli.serve import ServeOptions, build_server

    ready = threading.Event()
    server = build_server(
        ServeOptions(LoadSpec(str(run), device="cpu", dtype="float32"), port=0), on_ready=lambda u: ready.set()
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert ready.wait(60)
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        return json.loads(response.read())["choices"][0]["text"]
    finally:
        server.should_exit = True
        thread.join(20)


@pytest.mark.parametrize("name", ["window", "gemma3"])
def test_scored_continuations_of_a_windowed_model_equal_its_full_forward(name):
    """eval tasks' two-pass scoring keeps every layer's keys in full: the window is the mask's."""
    from nanogpt_cli.inference.loglikelihood import score_continuations

    model = model_with(SETTINGS[name])
    torch.manual_seed(2)
    context, choices = torch.randint(0, 61, (9,)).tolist(), [torch.randint(0, 61, (n,)).tolist() for n in (1, 4)]
    got = score_continuations(model, [(context, c) for c in choices])
    for (logprob, _), choice in zip(got, choices):
        ids = torch.tensor([context + choice])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0][0].float(), dim=-1)
        expected = sum(logp[len(context) - 1 + i, t].item() for i, t in enumerate(choice))
        assert logprob == pytest.approx(expected, abs=1e-4)
