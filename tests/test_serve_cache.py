"""`nanogpt serve`'s prompt cache, /metrics and adapters through the openai client against live servers on
127.0.0.1 (port 0) in threads of the test process; the engine's prefix cache and per-row adapters directly.
Every wait is bounded."""

from __future__ import annotations

import json
import threading

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serve tests need the openai package (the dev extra)")
pytest.importorskip("fastapi", reason="nanogpt serve needs the serve extra")
parser = pytest.importorskip("prometheus_client.parser", reason="/metrics needs the serve extra")

from test_serve import Live, get_json  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from nanogpt_cli.cli import app  # noqa: E402
from nanogpt_cli.config import GPTConfig, LoadSpec  # noqa: E402
from nanogpt_cli.errors import NanoGPTError  # noqa: E402
from nanogpt_cli.inference.engine import Engine, SamplingParams  # noqa: E402
from nanogpt_cli.inference.prefix import PrefixCache  # noqa: E402
from nanogpt_cli.interop.loading import load_model  # noqa: E402
from nanogpt_cli.lora import LoRAConfig, add_row_adapters  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs import checkpoint as ckpt  # noqa: E402
from nanogpt_cli.serve import ServeOptions, build_server  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer  # noqa: E402
from nanogpt_cli.training.finetune import plan_finetune  # noqa: E402
from nanogpt_cli.training.request import RunRequest  # noqa: E402
from nanogpt_cli.training.trainer import Trainer  # noqa: E402
from conftest import tiny_plan  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name and labels, parsed with prometheus_client's own parser."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
        text = response.read().decode()
    finally:
        conn.close()
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name] = s.value
    return out


def serve(source, **flags) -> Live:
    return Live(ServeOptions(LoadSpec(str(source), device="cpu", dtype="float32"), port=0, max_tokens=1000, **flags))


# --- the prompt cache -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A random-weights model on the gpt2 tokenizer, context 256."""
    torch.manual_seed(0)
    tok = build_tokenizer("gpt2")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=2, n_head=2, n_embd=32))
    path = tmp_path_factory.mktemp("cache") / "tiny.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    return path


def conversation(client, turns: int, **extra) -> list[str]:
    """A greedy chat of `turns` turns, each turn's prompt the whole conversation so far."""
    messages, replies = [{"role": "system", "content": "Be brief."}], []
    for k in range(turns):
        messages.append({"role": "user", "content": f"Question {k}: what comes next?"})
        got = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=extra or None
        )
        replies.append(got.choices[0].message.content)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_greedy_text_is_the_same_with_and_without_the_prompt_cache_and_hits_show(model_path):
    cached, plain = serve(model_path), serve(model_path, prompt_cache_mb=0)
    try:
        clients = [
            openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60) for s in (cached, plain)
        ]
        with_cache = conversation(clients[0], 4)
        assert with_cache == conversation(clients[1], 4)
        seen = metrics(cached.url)
        assert seen["nanogpt_prefix_cache_hits_total"] >= 3  # turns 2 to 4 start from the turn before
        assert seen["nanogpt_prefix_cache_hit_tokens_total"] > 30
        assert "nanogpt_prefix_cache_hits_total" not in metrics(plain.url)  # two servers, two registries
        # a request may opt out: it neither reads nor counts as a hit
        assert conversation(clients[0], 2, cache_prompt=False) == with_cache[:2]
        assert metrics(cached.url)["nanogpt_prefix_cache_hits_total"] == seen["nanogpt_prefix_cache_hits_total"]
    finally:
        cached.stop()
        plain.stop()


def test_the_prefix_cache_keeps_its_budget_dropping_the_least_recently_used():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=2, n_embd=16)).eval()
    per_token = 2 * 2 * 16 * 4  # layers x (k, v) x n_embd x float32 bytes
    prefix = PrefixCache(budget_bytes=per_token * 30)
    engine = Engine(model, max_batch=2, prefix_cache=prefix)
    for first in (1, 2, 3):  # three 12-token rows; each leaves 11 tokens' keys, and the budget holds two
        engine.add([first] * 8, GREEDY, max_new_tokens=4)
        list(engine.run())
    assert len(prefix.entries) == 2 and prefix.bytes <= prefix.budget and prefix.stats.evicted == 1
    assert [key[1][0] for key in prefix.entries] == [2, 3]  # the first row's prefix went first
    assert prefix.lookup([1] * 8)[0] == 0 and prefix.lookup([2] * 9)[0] == 8
    with pytest.raises(ValueError, match="at least 0 bytes"):
        PrefixCache(-1)


def test_a_sliding_window_model_reuses_only_prefixes_its_rings_still_hold():
    # window 6 on every layer: a stored row of 19 held tokens has overwritten its first keys, so it serves a
    # prompt that holds all of it (the next turn of a conversation) and not one that shares only its start
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=2, n_embd=16, sliding_window=6)
    model = GPT(config).eval()

    def greedy(engine, prompt):
        engine.add(prompt, GREEDY, max_new_tokens=8)
        return [t.token for t in engine.run()]

    first = list(range(1, 13))
    reply = greedy(Engine(model, max_batch=1), first)
    prompts = [first, first + reply + [40, 41], first[:8] + [30, 31, 32, 33]]
    alone = [greedy(Engine(model, max_batch=1), p) for p in prompts]
    prefix = PrefixCache(1 << 20)
    engine = Engine(model, max_batch=1, prefix_cache=prefix)
    assert [greedy(engine, p) for p in prompts] == alone
    # one hit, on all 19 tokens the first row held (its prompt and 7 of its 8 tokens); the third prompt missed
    assert prefix.stats.hits == 1 and prefix.stats.tokens == len(first) + len(reply) - 1


# --- /metrics and /health ---------------------------------------------------------------------------------


def test_metrics_move_with_requests_and_health_reports_rows_and_queue(model_path):
    live = serve(model_path)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        before = metrics(live.url)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=7, temperature=0)
        streamed = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0, stream=True))
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="nope", prompt="Hi", max_tokens=5)
        after = metrics(live.url)
        ok = 'nanogpt_requests_total{"route": "/v1/completions", "status": "200"}'
        assert after[ok] - before.get(ok, 0) == 2
        assert after['nanogpt_requests_total{"route": "/v1/completions", "status": "400"}'] == 1
        gained = after["nanogpt_generated_tokens_total"] - before["nanogpt_generated_tokens_total"]
        assert gained == done.usage.completion_tokens + 5 and len(streamed) > 1
        assert (
            after["nanogpt_prompt_tokens_total"] - before["nanogpt_prompt_tokens_total"] == done.usage.prompt_tokens + 1
        )
        ttft = after["nanogpt_time_to_first_token_seconds_count"] - before["nanogpt_time_to_first_token_seconds_count"]
        itl = after["nanogpt_inter_token_latency_seconds_count"] - before["nanogpt_inter_token_latency_seconds_count"]
        assert ttft == 2 and itl == gained - 2  # one first token per row, then one gap per token after it
        assert after["nanogpt_queue_depth"] == 0 and after["nanogpt_active_rows"] == 0
        health = live.health()
        assert health["model"] == "tiny" and health["active_rows"] == 0 and health["waiting"] == 0
        assert get_json(live.url, "/nope")[0] == 404
        assert metrics(live.url)['nanogpt_requests_total{"route": "other", "status": "404"}'] == 1
    finally:
        live.stop()


def test_metrics_need_the_api_key_when_the_server_has_one(model_path):
    live = serve(model_path, api_key="sk-k")
    try:
        status, body = get_json(live.url, "/metrics")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    finally:
        live.stop()


# --- several adapters on one base -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny byte-level base, two LoRA runs of it (different ranks and targets), and one of another base."""
    from nanogpt_cli.data.chat import prepare_chat

    root = tmp_path_factory.mktemp("adapters")
    chats = [
        {"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]} for w in "abcd"
    ]
    (root / "chats.jsonl").write_text("\n".join(json.dumps(c) for c in chats * 10) + "\n")
    prepare_chat(str(root / "chats.jsonl"), "chats", data_dir=str(root / "data"), tokenizer="byte")
    bases = {}
    for name, seed in (("base", 1), ("other", 2)):
        plan = tiny_plan(
            root / "data", "chats", root / name, max_iters=2, eval_interval=2, eval_iters=1, seed=seed, block_size=64
        )
        Trainer(plan).fit()
        bases[name] = root / name

    def lora(name: str, base: str, cfg: LoRAConfig):
        values = dict(data="chats", data_dir=str(root / "data"), dtype="float32", device="cpu", max_iters=4)
        values.update(eval_interval=4, eval_iters=1, batch_size=4, warmup_iters=0, learning_rate=5e-2)
        job = plan_finetune(RunRequest(values, out=root / name, init_from=str(bases[base])), lora=cfg)
        Trainer(job.plan, trainable=job.trainable).fit()
        return root / name

    return {
        **bases,
        "a": lora("a", "base", LoRAConfig(r=2, targets=("attn",))),
        "b": lora("b", "base", LoRAConfig(r=4, alpha=8, targets=("attn", "mlp"))),
        "stranger": lora("stranger", "other", LoRAConfig(r=2)),
    }


def test_rows_of_different_adapters_in_one_batch_equal_their_merged_models(runs):
    from safetensors.torch import load_file

    base = load_model(runs["base"])[0].eval()
    named = {}
    for name in ("a", "b"):
        meta = ckpt.read_metadata(runs[name] / "model.safetensors")
        named[name] = (LoRAConfig.from_dict(meta["lora"]), load_file(str(runs[name] / "model.safetensors")))
    params = sum(p.numel() for p in base.parameters())
    add_row_adapters(base, named)
    rows = base.transformer.h[0].attn.c_attn.rows
    assert sum(p.numel() for p in base.parameters()) == params  # one copy of the base; the adapters are buffers
    prompts = [[10, 20, 30], [10, 20, 30], [40, 50], [10, 20, 30, 40]]
    which = [0, 1, 2, 1]  # the base, a, b, a: one batch, prefilled and decoded together
    prefix = PrefixCache(1 << 20)
    engine = Engine(base, max_batch=4, adapters=rows, prefix_cache=prefix)
    ids = engine.add_many(prompts, GREEDY, 12, adapters=which)
    got = {i: [] for i in ids}
    for t in engine.run():
        got[t.row].append(t.token)
    again = engine.add_many(prompts, GREEDY, 12, adapters=which)  # now from the prefix cache, each its adapter's
    got_again = {i: [] for i in again}
    for t in engine.run():
        got_again[t.row].append(t.token)
    assert [got_again[i] for i in again] == [got[i] for i in ids] and prefix.stats.hits == 4
    assert prefix.lookup([40, 50, 7], 2)[0] == 2 and prefix.lookup([40, 50, 7], 1)[0] == 0  # by adapter only
    merged = {0: load_model(runs["base"])[0], 1: load_model(runs["a"])[0], 2: load_model(runs["b"])[0]}
    for row, prompt, a in zip(ids, prompts, which):
        alone = Engine(merged[a].eval(), max_batch=1)
        alone.add(prompt, GREEDY, 12)
        assert got[row] == [t.token for t in alone.run()], f"adapter {a}"
    assert len({tuple(got[i]) for i in ids[:2]}) == 2  # the adapter changes the text


def completions(client, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text


def test_serve_with_adapters_lists_them_and_each_answers_as_its_merged_model(runs):
    live = serve(runs["base"], model_name="base", adapters=[f"a={runs['a']}", f"b={runs['b']}"], max_batch=4)
    alone = {name: serve(runs[name], model_name=name) for name in ("a", "b")}
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["base", "a", "b"]
        served = live.server.state.model  # one copy of the base's weights: the adapters add buffers only
        assert sum(p.numel() for p in served.parameters()) == sum(
            p.numel() for p in load_model(runs["base"])[0].parameters()
        )
        prompts = {"base": "Say a.", "a": "Say b.", "b": "Say c."}
        results: dict[str, str] = {}

        def ask(model: str) -> None:  # at once, so that the rows share batches
            results[model] = completions(client, model, prompts[model])

        threads = [threading.Thread(target=ask, args=(m,)) for m in (*prompts, "base", "a")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 3
        for name, server in alone.items():
            single = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
            assert results[name] == completions(single, name, prompts[name])
        reply = client.chat.completions.create(
            model="b", messages=[{"role": "user", "content": "Say d."}], max_tokens=4
        )
        assert reply.model == "b"
        with pytest.raises(openai.BadRequestError, match="no model 'c' here"):
            client.completions.create(model="c", prompt="x", max_tokens=2)
        assert live.health()["models"] == ["base", "a", "b"]
    finally:
        live.stop()
        for server in alone.values():
            server.stop()


def test_an_adapter_of_another_base_or_a_bad_flag_is_one_sentence(runs):
    with pytest.raises(NanoGPTError, match="was trained on other base weights"):
        build_server(
            ServeOptions(LoadSpec(str(runs["base"]), device="cpu"), port=0, adapters=[f"s={runs['stranger']}"])
        )
    with pytest.raises(NanoGPTError, match="is not a LoRA run"):
        build_server(ServeOptions(LoadSpec(str(runs["base"]), device="cpu"), port=0, adapters=[f"s={runs['other']}"]))
    with pytest.raises(NanoGPTError, match="--adapter 'base' names the model twice"):
        build_server(ServeOptions(LoadSpec(str(runs["base"]), device="cpu"), port=0, adapters=[f"base={runs['a']}"]))
    runner = CliRunner()
    for flags, message in (
        (["--adapter", "nameless"], "--adapter takes NAME=LORA_RUN (a name and a LoRA run), got 'nameless'"),
        (["--prompt-cache-mb", "-1"], "--prompt-cache-mb must be at least 0 (0: no prompt cache), got -1"),
    ):
        result = runner.invoke(app, ["serve", str(runs["base"]), "--port", "0", *flags])
        assert result.exit_code == 1 and message in result.output and len(result.output.strip().splitlines()) == 1


def test_a_job_that_cannot_start_fails_alone_and_the_engine_thread_serves_the_next():
    # a seed torch's generator refuses, past the protocol's checks: only its own job fails
    import queue

    from nanogpt_cli.serve.scheduler import Done, Failed, Job, Scheduler

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    scheduler = Scheduler(model, build_tokenizer("byte"), torch.device("cpu"), max_batch=2)
    scheduler.start()
    try:
        events = {"bad": queue.Queue(), "good": queue.Queue()}
        bad = Job([1, 2, 3], GREEDY, 4, [], events["bad"].put, seed=2**70)
        good = Job([1, 2, 3], GREEDY, 4, [], events["good"].put)
        scheduler.submit([bad, good])
        failed = events["bad"].get(timeout=30)
        assert isinstance(failed, Failed) and "could not start" in failed.message
        while not isinstance(event := events["good"].get(timeout=30), (Done, Failed)):
            pass
        assert isinstance(event, Done)
        later = queue.Queue()
        scheduler.submit([Job([4, 5], GREEDY, 3, [], later.put)])
        while not isinstance(event := later.get(timeout=30), (Done, Failed)):
            pass
        assert isinstance(event, Done)
    finally:
        scheduler.stop()
