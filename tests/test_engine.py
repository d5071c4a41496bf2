"""The inference engine: the per-row KV cache and decode step against the full forward for every kind of block,
a batch against its rows one at a time (different prompt lengths, rows that join and leave mid-generation),
per-row seeds, the restart past the context, logits processing, and non-finite probabilities."""

import itertools

import pytest
import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
from nanogpt_cli.inference.engine import (
    Engine,
    KVCache,
    SamplingParams,
    generate,
    process_logits,
)
from nanogpt_cli.model import GPT
from conftest import check_rows_apart
from conftest import tiny_config as tiny

POS = ["rope", "sinusoidal", "learned"]
OPTIONS = [
    {},
    dict(qk_norm=True),
    dict(mlp="relu2"),
    dict(logit_softcap=3.0),
    dict(qk_norm=True, mlp="relu2", logit_softcap=3.0),
]
OPTION_IDS = ["plain", "qk_norm", "relu2", "softcap", "all"]


def sweep() -> list:
    """Every position scheme x norm x MLP x QK-norm x bias; the soft-cap on in every other one, tanh GELU in place
    of exact GELU in every other GELU one: each block option and each pair of them occurs."""
    norms, mlps, on_off = ("layernorm", "rmsnorm"), ("gelu", "swiglu", "relu2"), (False, True)
    out = []
    for i, (pos, norm, mlp, qk_norm, bias) in enumerate(itertools.product(POS, norms, mlps, on_off, on_off)):
        mlp = "gelu_tanh" if mlp == "gelu" and (i // 4) % 2 else mlp
        kw = dict(pos_encoding=pos, norm=norm, mlp=mlp, qk_norm=qk_norm, bias=bias)
        kw["logit_softcap"] = 3.0 if (i + i // 4) % 2 else None
        name = f"{pos}-{norm}-{mlp}{'-qk_norm' if qk_norm else ''}{'-bias' if bias else ''}"
        out.append(pytest.param(kw, id=name + ("-softcap" if kw["logit_softcap"] else "")))
    return out


SWEEP = sweep()


def model_of(pos="rope", mlp="gelu", norm="layernorm", bias=False, opts=None) -> GPT:
    torch.manual_seed(0)  # opts win over the block's mlp (relu2)
    return GPT(tiny(**{**dict(pos_encoding=pos, mlp=mlp, norm=norm, bias=bias), **(opts or {})})).eval()


def swept(kw: dict) -> GPT:
    torch.manual_seed(0)
    model = GPT(tiny(**kw)).eval()
    with torch.no_grad():  # norm gains and biases away from their init of ones and zeros, so a missing one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


GREEDY = SamplingParams(temperature=0.0)


def run_alone(model, prompt, n, params=GREEDY, seed=None, **kw):
    engine = Engine(model, max_batch=1, **kw)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    engine.add(prompt, params, n, gen)
    return [t.token for t in engine.run()]


@pytest.mark.parametrize("kw", SWEEP)
def test_cached_forward_and_decode_step_equal_the_full_forward(kw):
    model = swept(kw)
    idx = torch.randint(0, 61, (3, 16))
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model, 3)
        prefill, _ = model(idx[:, :5], cache=cache.view(0, 3))
        chunk, _ = model(idx[:, 5:9], cache=cache.view(0, 3))  # a multi-token chunk on a non-empty cache
        assert cache.pos == [9, 9, 9]
        plan = decode_plan(model)
        steps = [decode_step(plan, idx[:, t], cache)[:, None] for t in range(9, 16)]
    torch.testing.assert_close(torch.cat([prefill, chunk, *steps], dim=1), full, atol=1e-5, rtol=0)
    assert cache.pos == [16, 16, 16]


@pytest.mark.parametrize("kw", SWEEP)
def test_rows_at_different_positions_each_decode_what_they_would_alone(kw):
    cache = check_rows_apart(swept(kw), steps=6, chunk=(9, 12))
    assert cache.pos[:3] == [n + 6 + 3 for n in (3, 7, 1)]


@pytest.mark.parametrize("opts", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("pos", POS)
def test_a_bf16_model_decodes_rows_at_different_positions_in_bf16(pos, opts):
    half = model_of(pos, opts=opts).to(torch.bfloat16)
    idx = torch.randint(0, 61, (2, 8))
    with torch.inference_mode():
        cache = KVCache(half, 2)
        half(idx[:1, :4], cache=cache.view(0, 1))
        half(idx[1:2, :2], cache=cache.view(1, 2))
        got = decode_step(decode_plan(half), idx[:2, 4], cache)
        expected_dtype = torch.float32 if opts.get("logit_softcap") else torch.bfloat16  # the cap runs in fp32
        assert got.dtype == expected_dtype
        for r, n in enumerate((4, 2)):
            alone = half(torch.cat([idx[r : r + 1, :n], idx[r : r + 1, 4:5]], dim=1))[0][0, -1]
            torch.testing.assert_close(got[r].float(), alone.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("opts", [{}, dict(qk_norm=True, mlp="relu2", logit_softcap=3.0)], ids=["plain", "all"])
@pytest.mark.parametrize("pos", POS)
def test_a_batch_with_rows_joining_and_leaving_gives_each_row_its_solo_tokens(pos, opts):
    model = model_of(pos, opts=opts)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (5, 2, 9, 1, 4)]
    lengths = [6, 11, 12, 9, 14]  # prompts 2 and 4 run past the context of 16: their caches restart
    greedy = SamplingParams(temperature=0.0)
    solo = [run_alone(model, p, n) for p, n in zip(prompts, lengths)]
    engine = Engine(model, max_batch=3)
    got: dict[int, list[int]] = {}
    which = {engine.add(prompts[0], greedy, lengths[0]): 0, engine.add(prompts[1], greedy, lengths[1]): 1}
    waiting = [2, 3, 4]
    joined_late = 0
    for step in range(40):
        if step >= 2 and waiting and engine.free:  # rows join mid-generation, into freed rows
            i = waiting.pop(0)
            joined_late += 1
            which[engine.add(prompts[i], greedy, lengths[i])] = i
        for t in engine.step():
            got.setdefault(which[t.row], []).append(t.token)
        if not engine.active and not waiting:
            break
    assert [got[i] for i in range(5)] == solo
    assert joined_late == 3
    assert engine.active == 0


def test_a_seeded_sampled_row_draws_the_same_tokens_alone_and_among_others():
    model = model_of()
    params = SamplingParams(temperature=1.0, top_k=20)
    alone = run_alone(model, [1, 2, 3], 30, params, seed=42)
    assert alone != run_alone(model, [1, 2, 3], 30, params, seed=43)
    engine = Engine(model, max_batch=4)
    engine.add([5, 6], SamplingParams(temperature=1.3, top_p=0.9), 30, torch.Generator().manual_seed(1))
    engine.add([7] * 10, SamplingParams(temperature=0.0), 12)
    engine.step()
    mine = engine.add([1, 2, 3], params, 30, torch.Generator().manual_seed(42))
    engine.add(
        [9, 9, 9, 9],
        SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3),
        30,
        torch.Generator().manual_seed(2),
    )
    tokens = [t.token for t in engine.run() if t.row == mine]
    assert tokens == alone


def test_remove_frees_the_row_at_once_and_the_others_carry_on():
    model = model_of()
    greedy = SamplingParams(temperature=0.0)
    engine = Engine(model, max_batch=2)
    a = engine.add([1, 2, 3], greedy, 20)
    b = engine.add([4, 5], greedy, 20)
    engine.step()
    engine.remove(a)
    assert engine.active == 1 and engine.free == 1
    engine.remove(a)  # twice is harmless
    rest = [t.token for t in engine.run()]
    assert [t for t in run_alone(model, [4, 5], 20)][1:] == rest
    assert all(t.row == b for t in engine.step()) and engine.active == 0


def test_the_restart_past_the_context_equals_a_forward_over_the_kept_window():
    model = model_of()  # block_size 16: a full cache restarts from the last 8 tokens
    tokens = run_alone(model, [3], 40)
    seq = torch.tensor([[3] + tokens])
    held = 1
    with torch.inference_mode():
        for t in range(40):  # token t + 1 of seq is the argmax over the window the cache held
            held = held + 1 if held < 16 else 8
            if t == 0:
                held = 1
            logits, _ = model(seq[:, t + 1 - held : t + 1])
            assert logits[0, -1].argmax().item() == seq[0, t + 1].item(), t


@pytest.mark.parametrize("pos", POS)
def test_greedy_with_and_without_the_cache_agree_and_generate_keeps_the_prompt(pos):
    model = model_of(pos)
    prompt = torch.randint(0, 61, (2, 5))
    with_cache = generate(model, prompt, 11, temperature=0.0)  # fills the context exactly
    without = generate(model, prompt, 11, temperature=0.0, use_cache=False)
    assert with_cache.shape == (2, 16) and torch.equal(with_cache, without)
    assert torch.equal(with_cache[:, :5], prompt)
    assert generate(model, prompt[:, :3], 60, temperature=0.0).shape == (2, 63)
    a = generate(model, prompt, 20, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 20, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(1))
    c = generate(model, prompt, 20, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stop_tokens_length_and_a_padded_vocabulary():
    model = model_of()
    free = run_alone(model, [1, 2], 10)
    engine = Engine(model, max_batch=1)
    engine.add([1, 2], SamplingParams(temperature=0.0), 10, stop_ids=[free[3]])
    steps = list(engine.run())
    assert [t.token for t in steps] == free[: free.index(free[3]) + 1] and steps[-1].finish == "stop"
    assert run_alone(model, [1, 2], 10)[-1] == free[-1]
    with torch.no_grad():
        model.lm_head.weight[60] = 100.0  # the last row would win everywhere ...
    small = Engine(model, max_batch=1, vocab_size=60)  # ... but the tokenizer has only 60 tokens
    small.add([1, 2], SamplingParams(temperature=0.0), 10)
    assert all(t.token < 60 for t in small.run())


def test_non_finite_probabilities_raise_one_clear_error_before_sampling():
    model = model_of()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")  # a diverged model
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)):
        engine = Engine(model, max_batch=1)
        engine.add([1, 2], params, 5)
        with pytest.raises(NanoGPTError, match="not finite numbers"):
            engine.step()
    extreme = Engine(model_of(), max_batch=1)
    extreme.add([1, 2], SamplingParams(temperature=1e-45), 5)  # logits / 1e-45 overflow to infinity
    with pytest.raises(NanoGPTError, match="not finite numbers"):
        extreme.step()


def test_bad_rows_are_refused():
    engine = Engine(model_of(), max_batch=1)
    with pytest.raises(NanoGPTError, match="1 to 16 tokens"):
        engine.add(list(range(17)), SamplingParams(), 5)
    with pytest.raises(NanoGPTError, match="1 to 16 tokens"):
        engine.add([], SamplingParams(), 5)
    engine.add([1], SamplingParams(), 5)
    with pytest.raises(NanoGPTError, match="0 of 1 are free"):
        engine.add([1], SamplingParams(), 5)


def test_process_logits_filters_in_documented_order():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    # top-p 0.7: 0.5 alone is below 0.7, 0.5 + 0.25 reaches it -> exactly two survive
    assert process_logits(logits, top_p=0.7).isfinite().tolist() == [[True, True, False, False]]
    assert process_logits(logits, top_p=0.75).isfinite().tolist() == [[True, True, False, False]]
    assert process_logits(logits, top_p=0.76).isfinite().tolist() == [[True, True, True, False]]
    # min-p 0.3: drops tokens below 0.3 * 0.5 = 0.15 (0.15 itself stays)
    assert process_logits(logits, min_p=0.3).isfinite().tolist() == [[True, True, True, False]]
    assert process_logits(logits, top_k=1).isfinite().tolist() == [[True, False, False, False]]
    # the repetition penalty divides positive logits and multiplies negative ones of seen tokens
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert process_logits(raw, repetition_penalty=2.0, seen=seen).tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_sampling_draws_from_the_processed_distribution_and_never_a_filtered_token():
    from nanogpt_cli.inference.engine import sample_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0]])).repeat(20_000, 1)  # two tokens at -inf
    tokens = torch.tensor(sample_tokens(logits, 1.0, [torch.Generator().manual_seed(0)]))
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.02, rtol=0)
    assert freq[3:].sum() == 0
    one = [torch.Generator().manual_seed(7) for _ in range(3)]  # each row its own generator, same seed
    assert len(set(sample_tokens(logits[:3], 1.0, one))) == 1
    # a vocabulary of several search blocks (1,024 tokens each, the last one part padding), the probability on
    # both sides of a block boundary and in the last token
    wide = torch.full((20_000, 3000), float("-inf"))
    picked = [1023, 1024, 2047, 2999]
    wide[:, picked] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    tokens = torch.tensor(sample_tokens(wide, 1.0, [torch.Generator().manual_seed(1)]))
    freq = torch.bincount(tokens, minlength=3000).float() / len(tokens)
    torch.testing.assert_close(freq[picked], torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.02, rtol=0)
    assert freq[picked].sum() == 1


def test_a_large_vocabulary_head_decodes_as_the_forward_does():
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=600, tie_embeddings=False)).eval()  # V >= 8 C: the plan keeps the head transposed
    plan = decode_plan(model)
    assert plan.head_t is not None and plan.head_t.shape == (32, 600)
    for B in (2, 5):  # the two forms of the head's matmul
        idx = torch.randint(0, 600, (B, 8))
        with torch.inference_mode():
            cache = KVCache(model, B)
            model(idx[:, :7], cache=cache.view(0, B))
            got = decode_step(plan, idx[:, 7], cache)
            torch.testing.assert_close(got, model(idx)[0][:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("opts", [{}, dict(logit_softcap=3.0)], ids=["plain", "softcap"])
def test_a_prefill_gives_the_full_forwards_last_row_for_the_tokenizers_vocabulary(opts):
    model = model_of(opts=opts)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]  # two of one length share a forward
    engine = Engine(model, max_batch=3, vocab_size=50)  # a padded head: its last rows are never picked
    engine.add_many(prompts, GREEDY, 4)
    with torch.inference_mode():
        hidden = model.hidden_states(torch.tensor([prompts[0]]))  # (1, T, C)
        assert hidden.shape == (1, 5, 32)
        for r, prompt in enumerate(prompts):
            full = model(torch.tensor([prompt]))[0][0, -1]  # (V,): the head over every position, the last row
            assert engine.logits.shape == (3, 50)
            torch.testing.assert_close(engine.logits[r], full[:50], atol=1e-5, rtol=0)


def test_pick_then_advance_is_a_step_and_rows_may_join_or_leave_in_between():
    model = model_of()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    solo = [run_alone(model, p, 8) for p in prompts]
    engine = Engine(model, max_batch=3)
    which = {engine.add(prompts[0], GREEDY, 8): 0, engine.add(prompts[1], GREEDY, 8): 1}
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    first = engine.pick()  # the prefill's logits: the first tokens come before any decode step
    assert [t.token for t in first] == [solo[0][0], solo[1][0]] and engine.cache.pos[:2] == [3, 2]
    for t in first:
        got[which[t.row]].append(t.token)
    which[engine.add(prompts[2], GREEDY, 8)] = 2  # joins between pick and advance: the others are fed first
    for _ in range(12):
        for t in engine.pick():
            got[which[t.row]].append(t.token)
            if which[t.row] == 1 and len(got[1]) == 5:
                engine.remove(t.row)  # as a server does for a stop text: no decode step for it
        engine.advance()
        engine.advance()  # a second advance without a pick does nothing
    assert got == {0: solo[0], 1: solo[1][:5], 2: solo[2]} and engine.active == 0


def test_a_model_with_adapters_not_merged_decodes_as_its_forward():
    """The decoding form calls a LoRA layer as the module it is: its adapter counts in every step."""
    from nanogpt_cli.lora import LoRAConfig, add_lora

    model = model_of(opts=dict(qk_norm=True))
    idx = torch.randint(0, 61, (2, 12))
    with torch.inference_mode():
        base, _ = model(idx)
    add_lora(model, LoRAConfig(r=2, targets=("all",)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.2)
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model, 2)
        prefill, _ = model(idx[:, :4], cache=cache.view(0, 2))
        plan = decode_plan(model)
        steps = [decode_step(plan, idx[:, t], cache)[:, None] for t in range(4, 12)]
    assert (full - base).abs().max() > 1e-2  # the adapters change the logits ...
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=0)  # ... in decoding too
