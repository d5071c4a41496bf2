"""Speculative decoding (inference/speculative.py): greedy text is the model's own for every K and batch size, both
caches hold exactly the kept tokens after rejections, sampled tokens follow the model's distribution however far the
draft's is from it (a chi-square test), the server's rows keep different numbers of drafted tokens, and bad input is
one sentence."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import http.client
import json
import threading

import pytest
import torch
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import LoadSpec
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.engine import Engine, SamplingParams, process_logits
from nanogpt_cli.inference.speculative import Costs, Draft, SpeculativeEngine, check_tokenizers, lookup
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.tokenizer import build_tokenizer
from conftest import tiny_config as tiny

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [10]]


def shaken(model: GPT, scale: float, seed: int) -> GPT:
    """The model with noise of this scale added to every weight: a random model's logits are nearly flat, these
    are not, and a shaken copy of a model is a draft that agrees with it often but not always."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


@pytest.fixture(scope="module")
def target() -> GPT:
    torch.manual_seed(0)
    return shaken(GPT(tiny(vocab_size=64, block_size=64)), 0.3, 0)


@pytest.fixture(scope="module")
def near(target) -> GPT:
    """A draft that the target agrees with some of the time."""
    return shaken(copy.deepcopy(target), 0.1, 1)


def decode(engine: Engine, prompts, params=GREEDY, n: int = 40) -> list[list[int]]:
    ids = engine.add_many(prompts, params, n)
    out = {i: [] for i in ids}
    while engine.active:
        for t in engine.step():
            out[t.row].append(t.token)
    return [out[i] for i in ids]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 2, 4, None])
def test_greedy_text_is_the_models_own_for_every_k_and_batch_size(target, near, backend, batch, k):
    prompts = PROMPTS[:batch]
    plain = decode(Engine(target, batch, backend=backend), prompts)
    draft = Draft(near, k)
    assert decode(SpeculativeEngine(target, draft, batch, backend=backend), prompts) == plain
    if k is not None:  # drafted tokens were both kept and refused (an adaptive K soon rests this draft)
        assert 0 < draft.stats.accepted < draft.stats.proposed


def test_lookup_proposes_what_followed_the_longest_earlier_match_and_a_loop_goes_on():
    assert lookup([1, 2, 3, 4, 5, 9, 2, 3, 4], 3) == [5, 9, 2]  # what followed 2, 3, 4 before
    assert lookup([7, 2, 3, 4, 8, 1, 2, 3, 4, 6, 1, 2, 3, 4], 2) == [6, 1]  # 1, 2, 3, 4 matches further back
    assert lookup([5, 6, 7, 5, 6, 7], 5) == [5, 6, 7, 5, 6]  # a loop of 3 taken to go on
    assert lookup([1, 2, 3, 4, 5, 6], 2) == [] and lookup([1, 2], 2) == []  # never before, or too short


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [2, None])
def test_lookup_rounds_keep_the_models_greedy_text(target, near, batch, k):
    """A random model's greedy text soon loops: lookup rounds propose its own earlier tokens, kept and refused."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], *PROMPTS[1:batch]]
    plain = decode(Engine(target, batch), prompts, n=50)
    draft = Draft(near, k, lookup=True)
    assert decode(SpeculativeEngine(target, draft, batch), prompts, n=50) == plain
    assert draft.lookup.stats.rounds > 0 and draft.lookup.stats.accepted > 0
    assert draft.stats.proposed > draft.lookup.stats.proposed  # the draft model proposed in the other rounds


@pytest.mark.parametrize("batch", [1, 3])
def test_lookup_alone_keeps_the_models_greedy_text_and_rows_without_a_match_take_plain_steps(target, batch):
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], *PROMPTS[1:batch]]
    plain = decode(Engine(target, batch), prompts, n=50)
    draft = Draft(None, None, lookup=True)
    engine = SpeculativeEngine(target, draft, batch)
    assert decode(engine, prompts, n=50) == plain
    assert 0 < draft.stats.accepted < draft.stats.proposed == draft.lookup.stats.proposed
    with pytest.raises(NanoGPTError, match="lookup alone"):
        Draft(None, 2)


LLAMA = dict(vocab_size=64, block_size=64, norm="rmsnorm", mlp="swiglu", n_kv_head=1)
# Gemma 3's blocks: local layers of a window of 8 (their caches keep every position in a speculative engine)
GEMMA3 = dict(LLAMA, mlp="geglu", qk_norm=True, post_norms=True, sliding_window=8, window_pattern="LG")


@pytest.mark.parametrize("arch", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_shaped_model_checks_through_its_fused_step_and_keeps_its_greedy_text(dtype, arch):
    """RMSNorm, SwiGLU and RoPE (and Gemma 3's sliding windows, past them): the cpu backend checks the drafted
    tokens in one call of its fused step where our kernels are built (each row's tokens as rows sharing its cache
    row), else through the decoding form."""
    torch.manual_seed(0)
    model = shaken(GPT(tiny(**arch)), 0.3, 0).to(dtype)
    draft = Draft(shaken(copy.deepcopy(model).float(), 0.1, 1).to(dtype), 3)
    plain = decode(Engine(model, 3, backend="cpu"), PROMPTS)
    assert decode(SpeculativeEngine(model, draft, 3, backend="cpu"), PROMPTS) == plain
    assert 0 < draft.stats.accepted < draft.stats.proposed


def test_past_either_models_context_the_caches_restart_and_the_text_stays_the_models(target):
    """A draft of 8 tokens of context, and a model of 16, each restarting its cache from the last half of its
    window (the model as the plain engine does: the same text)."""
    torch.manual_seed(3)
    small = shaken(GPT(tiny(vocab_size=64, block_size=8, n_layer=1)), 0.3, 3)
    plain = decode(Engine(target, 3), PROMPTS, n=50)
    assert decode(SpeculativeEngine(target, Draft(small, 3), 3), PROMPTS, n=50) == plain
    short = shaken(GPT(tiny(vocab_size=64, block_size=16)), 0.3, 0)
    near = shaken(copy.deepcopy(short), 0.1, 1)
    plain = decode(Engine(short, 3), PROMPTS, n=40)
    draft = Draft(near, 3)
    assert decode(SpeculativeEngine(short, draft, 3), PROMPTS, n=40) == plain
    assert 0 < draft.stats.accepted < draft.stats.proposed


def test_after_rejections_both_caches_hold_what_a_fresh_prefill_of_the_kept_tokens_gives(target, near):
    engine = SpeculativeEngine(target, Draft(near, 4), 3)
    engine.add_many(PROMPTS, GREEDY, 60)
    for _ in range(6):
        engine.step()
    assert engine.draft.stats.accepted < engine.draft.stats.proposed  # there were rejections to roll back
    rows = [list(r.tokens) for r in engine.rows]
    with torch.inference_mode():
        draft_logits, _ = engine._catch_up(1)  # the draft's next-token logits from its cache
        type(engine).__mro__[1].advance(engine)  # the model's: its pending tokens fed through its cache
        for slot, tokens in enumerate(rows):
            fresh, _ = target(torch.tensor([tokens]))
            torch.testing.assert_close(engine.logits[slot], fresh[0, -1], atol=1e-5, rtol=1e-5)
            fresh, _ = near(torch.tensor([tokens[engine.offset[slot] :]]))
            torch.testing.assert_close(draft_logits[slot], fresh[0, -1, :64], atol=1e-5, rtol=1e-5)


def expected_marginals(model: GPT, prompt: list[int], params: SamplingParams, steps: int) -> list[torch.Tensor]:
    """The exact distribution of each of the first `steps` sampled tokens after prompt under the model's filtered
    probabilities, summed over every earlier continuation."""
    V = model.config.vocab_size
    paths, weights, out = [prompt], torch.ones(1), []
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = model(torch.tensor(paths))
            filtered = process_logits(logits[:, -1], params.temperature, params.top_k, params.top_p)
            joint = weights[:, None] * filtered.softmax(dim=-1)  # (paths, V)
            out.append(joint.sum(dim=0))
            paths = [p + [t] for p in paths for t in range(V)]
            weights = joint.reshape(-1)
    return out


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)], ids=["t1", "t0.7-topk5"]
)
def test_sampled_tokens_follow_the_models_distribution_not_the_drafts(params):
    """Each of the first three tokens of 3,000 seeded rows against the model's exact marginal (chi-square): the
    first comes from the prefill's logits, the second through a check (kept or redrawn), the third also from the
    bonus draw after a kept token. The draft's distribution is far from the model's."""
    torch.manual_seed(0)
    model = shaken(GPT(tiny(vocab_size=8, block_size=8)), 0.2, 0)  # top probabilities of 0.35 to 0.55
    draft = shaken(GPT(tiny(vocab_size=8, block_size=8)), 0.4, 1)  # sum(min(p, q)) of 0.35 to 0.6
    prompt, n = [1, 2], 3000
    engine = SpeculativeEngine(model, Draft(draft, 1), n)
    engine.add_many([prompt] * n, params, 3, [torch.Generator().manual_seed(0)] * n)
    tokens = {}
    while engine.active:
        for t in engine.step():
            tokens.setdefault(t.row, []).append(t.token)
    assert 0.1 < engine.draft.stats.rate < 0.9
    for step, p in enumerate(expected_marginals(model, prompt, params, 3)):
        counts = torch.bincount(torch.tensor([tokens[r][step] for r in tokens]), minlength=8).double()
        assert (counts[p == 0] == 0).all()
        expected = p[p > 0].double() * n
        stat = ((counts[p > 0] - expected) ** 2 / expected).sum()
        p_value = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2.0), stat / 2)
        assert p_value > 1e-3, (step, counts.tolist(), expected.tolist())


# a prompt after which some rows' last 3 tokens occurred before (those rows look up, the rest draft), and one after
# which every row's did: 2, 3 and then each token of the vocabulary (rounds of lookups alone)
LOOKED_UP = {"some rows": [1, 2, 3, 1, 2, 3], "every row": [x for t in range(8) for x in (2, 3, t)] + [2, 3]}


@pytest.mark.parametrize("prompt", LOOKED_UP.values(), ids=LOOKED_UP.keys())
def test_sampled_tokens_after_a_lookup_follow_the_models_distribution(prompt):
    """As above, with lookups' proposals (drawn with probability 1): a kept token is one the model drew, a refused
    one is redrawn from p without it."""
    torch.manual_seed(0)
    model = shaken(GPT(tiny(vocab_size=8, block_size=64)), 0.2, 0)
    n, params = 3000, SamplingParams(temperature=1.0)
    draft = Draft(model, 2, lookup=True)
    engine = SpeculativeEngine(model, draft, n)
    engine.add_many([prompt] * n, params, 3, [torch.Generator().manual_seed(0)] * n)
    tokens = {}
    while engine.active:
        for t in engine.step():
            tokens.setdefault(t.row, []).append(t.token)
    assert 0 < draft.lookup.stats.accepted < draft.lookup.stats.proposed  # lookups both kept and refused
    for step, p in enumerate(expected_marginals(model, prompt, params, 3)):
        counts = torch.bincount(torch.tensor([tokens[r][step] for r in tokens]), minlength=8).double()
        expected = p[p > 0].double() * n
        stat = ((counts[p > 0] - expected) ** 2 / expected).sum()
        p_value = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2.0), stat / 2)
        assert p_value > 1e-3, (step, counts.tolist(), expected.tolist())


def test_an_adaptive_k_grows_while_all_are_kept_and_a_useless_draft_rests(target):
    draft = Draft(target, None, costs=Costs(timed=False))  # the priors' costs: a draft of a tenth of the model
    assert draft.k == 1  # the prior's acceptance of 2/3: one token at a time
    decode(SpeculativeEngine(target, draft, 1), PROMPTS[:1], n=60)  # a draft that is the model: all kept
    assert draft.k >= 4 and draft.stats.rate == 1.0
    engine = SpeculativeEngine(target, Draft(shaken(GPT(tiny(vocab_size=64, block_size=64)), 0.3, 5), None), 1)
    decode(engine, PROMPTS[:1], n=60)  # a draft of its own that the model seldom agrees with
    assert engine.draft.stats.rate < 0.1 and engine.draft.stats.rounds < 30  # it rested between probes
    for _ in range(60):  # nothing kept from now on
        draft.adapt([0], draft.k)
    assert draft.k == 1 and draft.rest > 0


def padded(model: GPT, extra: int) -> GPT:
    """The model with `extra` blocks after its own whose outputs are zero: the same logits, at a higher cost."""
    bigger = GPT(dataclasses.replace(model.config, n_layer=model.config.n_layer + extra))
    bigger.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for block in bigger.transformer.h[model.config.n_layer :]:
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
    return bigger.eval()


def test_the_adaptive_k_weighs_the_costs_it_timed():
    """A draft that agrees with the model on every token but costs several of its steps: with the costs timed it
    rests between probes; with the priors' (a draft of a tenth of the model, checks at a quarter step a token) its
    K grows."""
    torch.manual_seed(0)
    model = shaken(GPT(tiny(vocab_size=64, block_size=128, n_layer=1)), 0.3, 0)
    slow = padded(model, 23)
    prompt = [[1, 2, 3]]
    assert decode(Engine(slow, 1), prompt, n=60) == decode(Engine(model, 1), prompt, n=60)  # the same model
    timed, priors = Draft(slow, None), Draft(slow, None, costs=Costs(timed=False))
    for draft in (timed, priors):
        decode(SpeculativeEngine(model, draft, 1), prompt, n=60)
        assert draft.stats.rate == 1.0
    # timed, a drafted token costs about a plain step or more (the draft's steps, a tiny model's check): it rested
    assert "step" in timed.costs.times and "check" in timed.costs.times and timed.stats.proposed < 20
    assert priors.costs.of("draft") == 0.15 and priors.k >= 4 and priors.stats.proposed > 40


def test_sampling_rows_plan_with_the_priors_so_a_seed_repeats_its_text(target, near):
    """K decides how many random numbers a round draws: rows that sample plan their K with the priors' costs, never
    the times taken, so the same seed gives the same text however the timings went."""
    params = SamplingParams(temperature=1.0)

    def sampled(draft: Draft) -> list[int]:
        engine = SpeculativeEngine(target, draft, 1)
        generator = torch.Generator().manual_seed(3)
        row = engine.add([1, 2, 3], params, 60, generator)
        out = []
        while engine.active:
            out += [t.token for t in engine.step() if t.row == row]
        return out

    skewed = Draft(near, None)  # timings that would make every check free and the draft dear
    for _ in range(3):
        skewed.costs.step(1, 1.0)
    for what, seconds in (("check", 0.0), ("draft", 10.0)):
        for _ in range(3):
            skewed.costs.note(what, seconds)
    assert skewed.best(timed=True) != skewed.best(timed=False)
    assert sampled(skewed) == sampled(Draft(near, None))


# --- through the commands and the server ----------------------------------------------------------------------


def save(model: GPT, path, tokenizer: str = "byte"):
    ckpt.save_model(path, model, {"tokenizer": build_tokenizer(tokenizer).describe(), "step": 0})
    return path


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    """A model and a near draft on the byte tokenizer, as weights files."""
    torch.manual_seed(0)
    model = shaken(GPT(tiny(vocab_size=256, block_size=64)), 0.3, 0)
    folder = tmp_path_factory.mktemp("spec")
    return save(model, folder / "model.safetensors"), save(shaken(model, 0.1, 1), folder / "draft.safetensors")


def test_sample_json_reports_the_acceptance_and_the_greedy_text_is_the_models(byte_models):
    model, draft = byte_models
    args = ["sample", "--checkpoint", str(model), "--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "30"]
    args += ["--json", "--device", "cpu", "--dtype", "float32"]
    plain = CliRunner().invoke(app, args)
    with_draft = CliRunner().invoke(app, [*args, "--draft", str(draft), "--draft-tokens", "3"])
    assert plain.exit_code == 0 and with_draft.exit_code == 0, with_draft.output
    a, b = json.loads(plain.stdout), json.loads(with_draft.stdout)
    assert a["text"] == b["text"] and "draft_acceptance" not in a
    assert 0 < b["draft_acceptance"] < 1
    for extra in (["--draft", str(draft), "--draft-lookup"], ["--draft-lookup"]):  # lookup beside a draft, alone
        looked = CliRunner().invoke(app, [*args, *extra])
        assert looked.exit_code == 0 and json.loads(looked.stdout)["text"] == a["text"], looked.output
        assert "draft_acceptance" in json.loads(looked.stdout)
    from nanogpt_cli import api

    loaded = api.load(str(model), device="cpu", dtype="float32", draft=str(draft), draft_lookup=True)
    assert loaded.draft.lookup is not None and loaded.generate("Hi", temperature=0, max_new_tokens=30).text == a["text"]


def test_bad_drafts_are_one_sentence(byte_models, tmp_path):

    model, draft = byte_models
    torch.manual_seed(0)
    other = save(GPT(tiny(vocab_size=50257)), tmp_path / "gpt2.safetensors", "gpt2")
    base = ["sample", "--checkpoint", str(model), "--max-new-tokens", "3", "--device", "cpu"]
    cases = {
        ("--draft", str(other)): "a draft must share the model's tokenizer",
        ("--draft", str(draft), "--draft-tokens", "0"): "--draft-tokens must be at least 1",
        ("--draft-tokens", "2"): "give --draft or --draft-lookup",
        ("--draft", str(draft), "--no-cache"): "drop --no-cache",
    }
    for extra, words in cases.items():
        out = CliRunner().invoke(app, [*base, *extra])
        assert out.exit_code == 1 and words in out.output and "Traceback" not in out.output, (extra, out.output)
    with pytest.raises(NanoGPTError, match="must share the model's tokenizer"):
        check_tokenizers(build_tokenizer("byte"), build_tokenizer("gpt2"))
    for k in (0, 2.5):  # a Draft built in Python gets the flag's one check
        with pytest.raises(NanoGPTError, match="--draft-tokens must be at least 1"):
            Draft(GPT(tiny(vocab_size=64)), k)


def test_server_rows_keep_different_numbers_of_drafted_tokens_and_the_greedy_text_is_the_models(byte_models):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from nanogpt_cli.inference.sample import Sampler, SampleSettings
    from nanogpt_cli.serve import ServeOptions, build_server

    model, draft = byte_models
    # a fixed K: an adaptive one would soon rest this draft
    spec = LoadSpec(str(model), device="cpu", dtype="float32", draft=str(draft), draft_tokens=2)
    options = ServeOptions(spec, port=0, max_batch=4)
    ready = threading.Event()
    server = build_server(options, on_ready=lambda started: ready.set())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the server did not start within 60 s"
        prompts = ["The king", "abc", "Hello world"]

        async def all_at_once():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
                calls = [c.completions.create(model="model", prompt=p, max_tokens=40, temperature=0) for p in prompts]
                return [r.choices[0].text for r in await asyncio.gather(*calls)]

        texts = asyncio.run(asyncio.wait_for(all_at_once(), 60))
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
        rates = [s.rate for s in server.state.scheduler.engine.row_stats.values()]
    finally:
        server.should_exit = True
        thread.join(20)
    sampler = Sampler.load(model, device="cpu", dtype="float32")
    for prompt, text in zip(prompts, texts):
        assert text == sampler.generate(prompt, SampleSettings(max_new_tokens=40, temperature=0)).text, prompt
    assert len(rates) == 3 and len(set(rates)) > 1, rates
    assert "nanogpt_draft_accepted_tokens_total" in metrics and "nanogpt_draft_acceptance_rate" in metrics


def test_the_draft_loads_as_the_model_does_through_the_models_spec(byte_models):
    """api.load's draft= goes through the model's loader with the model's spec, its source replaced: the draft's
    blocks are quantized as the model's are, on the backend it names, in the model's dtype as cast."""
    from nanogpt_cli import api
    from nanogpt_cli.inference.backends.quantize import QuantizedLinear

    model, draft = byte_models
    loaded = api.load(model, device="cpu", quantize="int8", backend="torch", draft=draft, draft_tokens=2)
    assert loaded.spec.draft == str(draft) and loaded.draft.tokens == 2
    d = loaded.draft.model
    assert isinstance(d.transformer.h[0].attn.c_attn, QuantizedLinear)
    assert d.decode_backend == "torch" and d.transformer.wte.weight.dtype == loaded.dtype
    loaded.use_draft(None)  # off again, and the spec says so
    assert loaded.draft is None and loaded.spec.draft is None
