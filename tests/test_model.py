"""The GPT model: causality, positions, overfitting, Hugging Face parity, config validation."""

import json
import math

import pytest
import torch

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.interop import hf
from nanogpt_cli.model import GPT, activation, apply_rope, rope_tables, sinusoidal_table
from conftest import tiny_config

POS = ["rope", "sinusoidal", "learned"]
# the block options of issue 11, alone and together (zero_init_proj only changes the init: tested on its own)
OPTIONS = [
    {},
    dict(qk_norm=True),
    dict(mlp="relu2"),
    dict(logit_softcap=3.0),
    dict(qk_norm=True, mlp="relu2", logit_softcap=3.0),
]
OPTION_IDS = ["plain", "qk_norm", "relu2", "softcap", "all"]


tiny = tiny_config


@pytest.mark.parametrize("opts", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("pos", POS)
def test_future_tokens_never_change_earlier_logits(pos, opts):
    torch.manual_seed(0)
    model = GPT(tiny(pos_encoding=pos, **opts)).eval()
    idx = torch.randint(0, 61, (1, 16))
    base, _ = model(idx)
    for t in range(15):
        changed = idx.clone()
        changed[0, t + 1 :] = (changed[0, t + 1 :] + 7) % 61
        logits, _ = model(changed)
        assert torch.allclose(logits[0, : t + 1], base[0, : t + 1], atol=1e-6), f"position {t} saw the future"
        assert not torch.allclose(logits[0, t + 1 :], base[0, t + 1 :]), "the change had no effect at all"


def test_block_options_do_what_they_say():
    torch.manual_seed(0)
    x = torch.randint(0, 61, (2, 16))
    capped = GPT(tiny(logit_softcap=2.0)).eval()
    with torch.no_grad():
        capped.lm_head.weight.mul_(1000.0)  # huge raw logits ...
        logits, _ = capped(x)
        raw = capped.lm_head(capped.transformer.ln_f(torch.randn(4, 32)))
    assert raw.abs().max() > 100  # the cap is what holds them
    assert logits.dtype == torch.float32 and logits.abs().max() <= 2.0
    normed = GPT(tiny(qk_norm=True))
    names = {n for n, _ in normed.named_parameters()}
    assert {"transformer.h.0.attn.q_norm.weight", "transformer.h.0.attn.k_norm.weight"} <= names
    assert not any("q_norm" in n for n, _ in GPT(tiny()).named_parameters())  # old checkpoints load unchanged
    h = torch.tensor([-2.0, -0.5, 0.0, 1.5])
    relu2 = GPT(tiny(mlp="relu2")).transformer.h[0].mlp
    assert relu2.c_fc.out_features == 4 * 32
    torch.testing.assert_close(activation(h, "relu2"), torch.tensor([0.0, 0.0, 0.0, 2.25]))


def test_squared_relu_backward_is_autograds():
    """relu2's hand-written backward gives the gradient autograd derives for relu(h).square(), in fp64 to
    gradcheck's finite differences too (h keeps away from 0, where the derivative's kink would fool them)."""
    torch.manual_seed(0)
    h = torch.randn(3, 5, 16, dtype=torch.float64)
    h = (h + h.sign() * 0.1).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: activation(t, "relu2"), (h,))
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    (ours,) = torch.autograd.grad(activation(h, "relu2"), h, g)
    (autograds,) = torch.autograd.grad(torch.relu(h).square(), h, g)
    torch.testing.assert_close(ours, autograds, rtol=0, atol=0)


def composite_attention(attn, x, cos, sin):
    """CausalSelfAttention's output computed from its modules one by one and the definition of attention: the
    norms, apply_rope, softmax(q k^T / sqrt(hs) + causal mask) v, the output projection."""
    B, T, C = x.shape
    qkv = attn.c_attn(x).view(B, T, 3, attn.n_head, attn.head_size)
    qk = torch.stack([attn.q_norm(qkv[:, :, 0]), attn.k_norm(qkv[:, :, 1])], dim=2)
    q, k = apply_rope(qk, cos, sin).unbind(2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, 2].transpose(1, 2)  # (B, nh, T, hs)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(attn.head_size)
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    y = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))


def graph_nodes(y: torch.Tensor) -> str:
    """The names of every autograd node behind y, joined."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [n for n, _ in node.next_functions]
    return " ".join(type(n).__name__ for n in seen)


def test_the_fused_qk_norm_and_rope_computes_the_modules_values_and_gradients():
    """Attention with QK-norm and RoPE runs one Function (NormRopeQKV) for the norms, the rotation and the
    layout: its backward passes gradcheck in fp64, and a layer gives the output and every weight's gradient
    that its modules give one by one; under CPU bf16 autocast it stays within bf16's precision of them."""
    from nanogpt_cli.model import Context, NormRopeQKV, attention

    torch.manual_seed(0)
    B, T, nh, hs = 2, 6, 3, 8
    qkv = torch.randn(B, T, 3, nh, hs, dtype=torch.float64, requires_grad=True)
    gains = [(1 + 0.3 * torch.randn(hs, dtype=torch.float64)).requires_grad_() for _ in range(2)]
    cos, sin = (t[:, None, None, :].double() for t in rope_tables(torch.arange(T), hs, 10000.0))
    fused = lambda a, gq, gk: NormRopeQKV.apply(a, gq, gk, cos, sin, 1e-5, torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(fused, (qkv, *gains))

    model = GPT(tiny(qk_norm=True))
    attn = model.transformer.h[0].attn
    with torch.no_grad():  # gains away from their init of ones, so that a gain mixed up would show
        attn.q_norm.weight.normal_(1.0, 0.3)
        attn.k_norm.weight.normal_(1.0, 0.3)
    x = torch.randn(2, 16, 32)
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]

    def layer():  # the model's own attention, which picks the fused kernel here
        return attn.c_proj(attention(attn.ops(), x.view(32, 32), Context(2, 16, cos, sin), 0)).view(2, 16, 32)

    assert "NormRopeQKV" in graph_nodes(layer())  # the kernel this test is about is the one that ran
    names = [n for n, p in attn.named_parameters()]
    grads = {}
    for name, fn in (("fused", layer), ("modules", lambda: composite_attention(attn, x, cos, sin))):
        y = fn()
        grads[name] = (y, torch.autograd.grad(y.square().sum(), list(attn.parameters())))
    torch.testing.assert_close(grads["fused"][0], grads["modules"][0], atol=1e-6, rtol=1e-5)
    for name, a, b in zip(names, grads["fused"][1], grads["modules"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
        assert a.abs().sum() > 0, name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = layer()
    torch.testing.assert_close(low.float(), grads["modules"][0], atol=3e-2, rtol=3e-2)


def test_zero_init_projections_start_each_block_as_the_identity_and_still_train():
    torch.manual_seed(0)
    model = GPT(tiny(zero_init_proj=True))
    projections = [b.attn.c_proj.weight for b in model.transformer.h] + [
        b.mlp.c_proj.weight for b in model.transformer.h
    ]
    assert all(p.abs().sum() == 0 for p in projections)
    x = torch.randint(0, 61, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        _, loss = model(x, torch.roll(x, -1, dims=1))
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.abs().sum() > 0 for p in projections) and loss.item() < first - 1.0


def test_loss_at_init_is_near_ln_vocab_and_a_batch_overfits():
    torch.manual_seed(0)
    model = GPT(tiny(dropout=0.0))
    x = torch.randint(0, 61, (4, 16))
    y = torch.roll(x, -1, dims=1)
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(61)) < 0.3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_ignore_index_skips_targets():
    torch.manual_seed(0)
    model = GPT(tiny())
    x = torch.randint(0, 61, (2, 8))
    y = torch.randint(0, 61, (2, 8))
    _, full = model(x, y)
    y_masked = y.clone()
    y_masked[:, 4:] = -1
    logits, masked = model(x, y_masked)
    expected = torch.nn.functional.cross_entropy(logits[:, :4].reshape(-1, 61), y[:, :4].reshape(-1))
    torch.testing.assert_close(masked, expected)
    assert not torch.isclose(masked, full)


def lora_loss_and_grads(model, x, y, keep_logits, dtype=torch.float32):
    """(logits, loss, the trainable parameters' gradients) of one backward, under autocast to dtype."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
        logits, loss = model(x, y, keep_logits=keep_logits)
    (loss * 0.5).backward()  # as a loss shared by two micro-batches: the chunks' gradient takes the factor
    return logits, loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("tied", [True, False])
def test_a_frozen_heads_loss_in_chunks_is_the_whole_batch_loss(tied, monkeypatch):
    from nanogpt_cli.lora import LoRAConfig, adapters, add_lora, hold_frozen
    from nanogpt_cli.model.gpt import HeadCrossEntropy

    monkeypatch.setattr(HeadCrossEntropy, "CHUNK_ELEMENTS", 61 * 5)  # 5 rows a chunk: 32 rows in 7 chunks
    torch.manual_seed(0)
    model = GPT(tiny(tie_embeddings=tied, dropout=0.0))
    add_lora(model, LoRAConfig(r=2, targets=("all",)))
    with torch.no_grad():
        for layer in adapters(model).values():
            layer.lora_B.normal_(0, 0.1)
    x, y = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    y[0, :5] = -1  # targets that do not count
    logits, whole, expected = lora_loss_and_grads(model, x, y, keep_logits=True)
    dropped, chunked, grads = lora_loss_and_grads(model, x, y, keep_logits=False)
    assert logits is not None and dropped is None
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    _, none, zeros = lora_loss_and_grads(model, x, torch.full_like(y, -1), keep_logits=False)
    assert none.item() == 0.0 and not any(g.any() for g in zeros)  # no target: 0, not 0/0, and no gradient
    with torch.no_grad():  # evaluation: the whole batch's logits and loss, as before
        logits, loss = model(x, y, keep_logits=False)
    assert logits is not None and torch.equal(loss, whole)
    hold_frozen(model, torch.bfloat16)  # bf16 autocast, as a LoRA run trains: the same up to bf16's rounding
    _, whole, expected = lora_loss_and_grads(model, x, y, True, torch.bfloat16)
    _, chunked, grads = lora_loss_and_grads(model, x, y, False, torch.bfloat16)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    for a, b in zip(grads, expected, strict=True):
        assert (a - b).abs().max() <= 0.02 * b.abs().max()


def test_a_trained_head_keeps_the_whole_batch_loss():
    torch.manual_seed(0)
    model = GPT(tiny())
    x = torch.randint(0, 61, (2, 8))
    logits, loss = model(x, x, keep_logits=False)  # the head trains: its gradient comes from the whole loss
    assert logits is not None and torch.equal(loss, model(x, x)[1])


def test_sinusoidal_table_matches_its_closed_form():
    pe = sinusoidal_table(50, 16)
    for p in (0, 1, 7, 49):
        for i in range(8):
            angle = p / 10000 ** (2 * i / 16)
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_rope_preserves_norms_and_depends_only_on_relative_offset():
    torch.manual_seed(0)
    hs = 16
    q, k = torch.randn(hs), torch.randn(hs)
    cos, sin = rope_tables(torch.arange(40), hs, 10000.0)

    def rot(x, p):
        return apply_rope(x[None], cos[p : p + 1], sin[p : p + 1])[0]

    for p in (0, 5, 39):
        assert rot(q, p).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)
    dots = [rot(q, m) @ rot(k, m - 3) for m in (3, 10, 25, 39)]
    for d in dots[1:]:
        assert d.item() == pytest.approx(dots[0].item(), abs=1e-4)
    assert (rot(q, 10) @ rot(k, 3)).item() != pytest.approx((rot(q, 10) @ rot(k, 5)).item(), abs=1e-4)


def test_tied_embeddings_share_one_tensor_and_param_counts():
    model = GPT(tiny())
    assert model.lm_head.weight is model.transformer.wte.weight
    n_all = model.num_params(non_embedding=False)
    assert n_all == sum(p.numel() for p in model.parameters())
    assert model.num_params() == n_all - 61 * 32
    untied = GPT(tiny(tie_embeddings=False))
    assert untied.num_params(non_embedding=False) == n_all + 61 * 32


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, block_size=8, n_layer=8, n_head=4, n_embd=256))
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_flops_per_token_counts_matmuls_and_attention():
    cfg = tiny()
    model = GPT(cfg)
    per_layer = 12 * 32 * 32  # qkv 3C^2 + proj C^2 + mlp 8C^2
    expected = 6 * (2 * per_layer + 61 * 32) + 12 * 2 * 32 * 16
    assert model.flops_per_token() == expected


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(n_embd=30, n_head=4), "--n-embd (30) must be divisible by --n-head (4)"),
        (dict(n_embd=30, n_head=6), "RoPE needs an even head size"),
        (dict(n_layer=0), "--n-layer must be a positive integer"),
        (dict(pos_encoding="alibi"), "--pos-encoding must be one of rope, sinusoidal, learned"),
        (dict(norm="batchnorm"), "--norm must be one of"),
        (dict(mlp="relu"), "--mlp must be one of"),
        (dict(logit_softcap=0.0), "--logit-softcap must be positive"),
        (dict(dropout=1.5), "--dropout must be in [0, 1)"),
    ],
)
def test_invalid_configs_fail_with_their_message(kw, message):
    with pytest.raises(ValueError) as e:
        tiny(**kw)
    assert message in str(e.value)


def test_config_round_trips_through_json():
    cfg = tiny(pos_encoding="sinusoidal", mlp="swiglu", norm="rmsnorm", mlp_hidden=48, tie_embeddings=False)
    assert GPTConfig.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["mlp_hidden"] == 48
    assert tiny(mlp="swiglu").hidden_size == 128  # 8/3 * 32 = 85 -> rounded up to 64s


# --- Hugging Face parity (random weights; nothing is downloaded) ---


def hf_reference(kind: str):
    """A random-weights transformers model: GPT-2 (learned positions, LayerNorm, tanh GELU, biases) or Llama
    (RoPE with theta 500, RMSNorm, SwiGLU, no biases, tied embeddings)."""
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        rope_theta=500.0,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_from_hf_matches_reference_logits_and_round_trips(kind):
    torch.manual_seed(0)
    ref = hf_reference(kind)
    ours = hf.from_hf(ref).eval()
    assert ours.lm_head.weight is ours.transformer.wte.weight
    if kind == "llama":
        assert ours.config.rope_theta == 500.0 and ours.config.norm == "rmsnorm" and ours.config.mlp == "swiglu"
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], ref(idx).logits, atol=1e-4, rtol=0)
        back = hf.to_hf(ours)
        torch.testing.assert_close(back(idx).logits, ref(idx).logits, atol=1e-5, rtol=0)


LLAMA_SHAPE = dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(norm="rmsnorm"),
        dict(LLAMA_SHAPE, logit_softcap=30.0),
        dict(LLAMA_SHAPE, mlp="relu2"),
    ],
    ids=["rmsnorm-gelu", "softcap", "relu2"],
)
def test_to_hf_refuses_a_model_with_no_counterpart(cfg):
    from nanogpt_cli.errors import NanoGPTError

    with pytest.raises(NanoGPTError, match="no stock Hugging Face architecture"):
        hf.to_hf(GPT(tiny(**cfg)))
