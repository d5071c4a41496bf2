"""`nanogpt serve` through real clients: the openai package, raw sockets and a headless Chromium, against a live
server on 127.0.0.1 (port 0) run in a thread of the test process. Every wait is bounded."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

openai = pytest.importorskip("openai", reason="the serve tests need the openai package (the dev extra)")
pytest.importorskip("fastapi", reason="nanogpt serve needs the serve extra")

from nanogpt_cli.cli import app  # noqa: E402
from nanogpt_cli.config import GPTConfig, LoadSpec  # noqa: E402
from nanogpt_cli.inference.sample import Sampler, SampleSettings  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs import checkpoint as ckpt  # noqa: E402
from nanogpt_cli.serve import ServeOptions, build_server  # noqa: E402
from nanogpt_cli.serve.chat import DEFAULT_STOP, ChatTemplate  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer  # noqa: E402

KEY = "sk-test-key"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """A random-weights model on the gpt2 tokenizer (its tokens split multi-byte characters), context 64."""
    torch.manual_seed(0)
    tok = build_tokenizer("gpt2")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32))
    path = tmp_path_factory.mktemp("serve") / "tiny.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    return path


class Live:
    """A server running in a thread until stop(); url once listening."""

    def __init__(self, options: ServeOptions):
        ready = threading.Event()
        self.server = build_server(options, on_ready=lambda url: ready.set())
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert ready.wait(60), "the server did not start within 60 s"
        self.url = self.server.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive(), "the server did not stop within 20 s"

    def health(self) -> dict:
        return get_json(self.url, "/health")[1]


def get_json(url: str, path: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def live(model_path):
    server = Live(
        ServeOptions(
            LoadSpec(str(model_path), device="cpu", dtype="float32"),
            port=0,
            max_batch=16,
            api_key=KEY,
            max_tokens=100_000,
            max_n=4,
            max_body=50_000,
        )
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def sampler(model_path) -> Sampler:
    return Sampler.load(model_path, device="cpu", dtype="float32")


def greedy(sampler: Sampler, prompt: str, n: int, stop=()) -> object:
    return sampler.generate(prompt, SampleSettings(max_new_tokens=n, temperature=0.0, stop=list(stop)))


def test_a_streamed_greedy_completion_is_nanogpt_samples_text_with_exact_usage(client, sampler, model_path):
    stream = client.completions.create(
        model="tiny",
        prompt="The café",
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == len(sampler.tokenizer.encode("The café"))
    out = CliRunner().invoke(
        app,
        [
            "sample",
            "--checkpoint",
            str(model_path),
            "--prompt",
            "The café",
            "--temperature",
            "0",
            "--max-new-tokens",
            "24",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ],
    )
    assert out.exit_code == 0, out.output
    assert out.output == "The café" + text + "\n"
    whole = client.completions.create(model="tiny", prompt="The café", max_tokens=24, temperature=0)
    assert whole.choices[0].text == text and whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    assert whole.id.startswith("cmpl-") and whole.model == "tiny" and whole.created > 0


def test_a_stop_text_ends_the_text_before_it(client, sampler):
    free = greedy(sampler, "Once", 40).text
    stop = free[10:13]
    got = client.completions.create(model="tiny", prompt="Once", max_tokens=40, temperature=0, stop=[stop, "@@"])
    assert got.choices[0].text == free[: free.find(stop)] and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == greedy(sampler, "Once", 40, stop=[stop]).tokens


def test_chat_streams_with_the_assistant_role_first_and_uses_the_template(client, sampler, live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    prompt = "System: Be brief.\n\nUser: Hello there\n\nAssistant:"
    assert text == greedy(sampler, prompt, 12, stop=DEFAULT_STOP).text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(sampler.tokenizer.encode(prompt))
    assert client.models.list().data[0].model_extra["chat_template"] == "nanogpt-plain"


def test_a_checkpoint_chat_template_gives_the_token_ids_transformers_gives():
    transformers = pytest.importorskip("transformers")
    from nanogpt_cli.interop import hf

    source = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tok = build_tokenizer("gpt2")
    backend = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf.tokenizers_object(tok.describe())[0], bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    backend.chat_template = source
    messages = [{"role": "system", "content": "Short answers."}, {"role": "user", "content": " Where is the café? "}]
    theirs = backend.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    template = ChatTemplate.for_meta({"chat_template": source}, "<|endoftext|>")
    assert template.name == "checkpoint" and template.stop == []
    text = template.render(messages)
    parts = text.split("<|endoftext|>")
    ours = [i for k, part in enumerate(parts) for i in ([tok.eot_id] if k else []) + tok.encode(part)]
    assert ours == list(theirs)


def test_a_hugging_face_folders_tokenizer_config_template_is_used(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[-1]['content'] }}!"}))
    assert ChatTemplate.for_meta({}, None, tmp_path).render([{"role": "user", "content": "hey"}]) == "hey!"
    assert ChatTemplate.for_meta({}, None, tmp_path / "nothing").name == "nanogpt-plain"


def test_eight_concurrent_streams_each_get_their_solo_greedy_text(live, sampler):
    prompts = ["A", "The king", "naïve café 🙂", "Hello world, this is", "1 2 3", "Why", "Über", "x y"]
    lengths = [30, 12, 25, 40, 8, 33, 20, 50]

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*[one(ac, p, n) for p, n in zip(prompts, lengths)])

    texts = asyncio.run(asyncio.wait_for(all_at_once(), 120))
    for prompt, n, text in zip(prompts, lengths, texts):
        assert text == greedy(sampler, prompt, n).text, prompt


def test_a_seeded_sampled_request_gives_the_same_text_alone_and_under_load(live, client):
    ask = dict(model="tiny", prompt="Seeded", max_tokens=30, temperature=1.0, top_k=50, seed=1234)
    alone = (
        client.completions.create(**{k: v for k, v in ask.items() if k not in ("top_k",)}, extra_body={"top_k": 50})
        .choices[0]
        .text
    )
    other = (
        client.completions.create(
            model="tiny", prompt="Seeded", max_tokens=30, temperature=1.0, seed=99, extra_body={"top_k": 50}
        )
        .choices[0]
        .text
    )
    assert alone != other

    async def loaded():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as ac:
            noise = [
                ac.completions.create(
                    model="tiny",
                    prompt=f"noise {i}",
                    max_tokens=40,
                    temperature=0.9,
                    extra_body={"min_p": 0.05, "repetition_penalty": 1.2},
                )
                for i in range(15)
            ]
            mine = ac.completions.create(
                model="tiny", prompt="Seeded", max_tokens=30, temperature=1.0, seed=1234, extra_body={"top_k": 50}
            )
            results = await asyncio.gather(*noise[:7], mine, *noise[7:])
            return results[7].choices[0].text

    assert asyncio.run(asyncio.wait_for(loaded(), 120)) == alone
    two = client.completions.create(
        model="tiny", prompt="Seeded", max_tokens=30, temperature=1.0, seed=1234, n=2, extra_body={"top_k": 50}
    )
    assert two.choices[0].text == alone and two.choices[1].text != alone  # choice j is seeded seed + j
    assert two.usage.completion_tokens == 60


def test_logprobs_and_echo_score_the_prompt_through_the_api(client, sampler):
    prompt = "The king is dead"
    ids = sampler.tokenizer.encode(prompt)
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    with torch.inference_mode():
        logits, _ = sampler.model(torch.tensor([ids]))
        expected = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None]).view(-1)
    assert lp.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    gen = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    lp = gen.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == gen.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy picks the most likely token
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()), abs=1e-5)


def test_bad_inputs_get_their_status_openais_shape_and_exception_class(live, client):
    status, body = get_json(
        live.url,
        "/v1/completions",
        "POST",
        b"{not json",
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    cases = [
        (dict(prompt="x", max_tokens="many"), "max_tokens"),
        (dict(prompt="x", max_tokens=-1), "max_tokens"),
        (dict(prompt="x", n=5), "n"),  # the limit is 4
        (dict(prompt="x", temperature=-1), "temperature"),
        (dict(prompt="x", bogus=1), "bogus"),
        (dict(prompt="word " * 100), "prompt"),  # 100 tokens > the context of 64
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model="tiny",
                **{k: v for k, v in kw.items() if k in ("prompt", "n")},
                extra_body={k: v for k, v in kw.items() if k not in ("prompt", "n")},
            )
        assert e.value.status_code == 400 and e.value.body["param"] == param, kw
    assert "context of 64 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError, match="no model 'other' here"):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()
    status, body = get_json(live.url, "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="x" * 60_000, max_tokens=1)
    assert e.value.status_code == 413 and "50,000 bytes" in e.value.message
    status, body = get_json(live.url, "/no/such/route")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, body = get_json(live.url, "/v1/chat/completions", "POST", b"[1, 2]", headers)
    assert status == 400 and "detail" not in body  # never FastAPI's own 422 body
    assert live.health()["status"] == "ok" and live.health()["backend"].startswith("cpu (")


def test_a_temperature_that_would_fail_in_the_engine_is_refused_alone(live, client, sampler):
    # logits / 1e-45 overflow in float32: refused before the engine (a row that fails inside it fails alone,
    # test_engine.py), while a good request beside it decodes as usual
    async def both():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as ac:
            bad = ac.completions.create(model="tiny", prompt="Boom", max_tokens=20, temperature=1e-45)
            good = ac.completions.create(model="tiny", prompt="Fine", max_tokens=20, temperature=0)
            return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(asyncio.wait_for(both(), 60))
    assert isinstance(bad, openai.BadRequestError) and bad.body["param"] == "temperature"
    assert good.choices[0].text == greedy(sampler, "Fine", 20).text
    assert live.health()["active_rows"] == 0


def test_raw_stream_is_data_lines_ending_with_done_and_a_disconnect_frees_the_row(live):
    host, port = live.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "Go", "max_tokens": 8, "temperature": 0, "stream": True})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    lines = [line for line in response.read().decode().split("\n") if line]
    conn.close()
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert len(lines) == 9 and json.loads(lines[0][6:])["object"] == "text_completion"

    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    # 100,000 tokens take minutes: a row that leaves within the bounded wait below left because its client did
    long = json.dumps({"model": "tiny", "prompt": "Go", "max_tokens": 100_000, "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body=long, headers=headers)
    response = conn.getresponse()
    response.readline()  # the first event: the row is running
    assert live.health()["active_rows"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    _wait_idle(live)

    whole = json.dumps({"model": "tiny", "prompt": "Go", "max_tokens": 100_000, "temperature": 0})
    sock = socket.create_connection((host, int(port)), timeout=30)  # a whole (not streamed) answer, abandoned
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(whole)}\r\n\r\n{whole}".encode()
    )
    deadline = time.monotonic() + 20
    while live.health()["active_rows"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.health()["active_rows"] == 1
    sock.close()
    _wait_idle(live)


def _wait_idle(live) -> None:
    deadline = time.monotonic() + 20
    while live.health()["active_rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.health()["active_rows"] == 0


def test_a_full_queue_answers_503_and_stopping_ends_open_streams(model_path):
    small = Live(
        ServeOptions(LoadSpec(str(model_path), device="cpu", dtype="float32"), port=0, max_batch=1, max_queue=1)
    )
    c = openai.OpenAI(base_url=small.url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        first = c.completions.create(model="tiny", prompt="a", max_tokens=2000, temperature=0, stream=True)
        next(iter(first))  # running: the one row is taken
        second = threading.Thread(
            target=lambda: _swallow(
                lambda: c.completions.create(model="tiny", prompt="b", max_tokens=5, temperature=0)
            ),
            daemon=True,
        )
        second.start()
        deadline = time.monotonic() + 20
        while small.health()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt="c", max_tokens=5)
        assert e.value.status_code == 503 and "queue is full" in e.value.message
    finally:
        small.stop()  # the open stream is ended, so the server can stop
    rest = list(_swallow(lambda: list(first)) or [])
    assert len(rest) < 2000
    second.join(10)


def _swallow(fn):
    try:
        return fn()
    except (openai.APIError, openai.APIConnectionError):
        return None


@pytest.mark.slow
def test_the_chat_page_in_a_real_browser_shows_the_greedy_reply(live, client, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright (dev extra)")
    chromium = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if chromium is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    expected = (
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi page"}], max_tokens=15, temperature=0
        )
        .choices[0]
        .message.content
    )
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 390, "height": 700})  # a phone's width
            page.add_init_script(f"localStorage.setItem('nanogpt-key', '{KEY}')")
            page.goto(live.url + "/", timeout=30_000)
            assert "tiny" in page.locator("#model").inner_text()
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "15")
            page.fill("#input", "Hi page")
            page.click("#send")
            page.wait_for_selector(".assistant[data-done=true]", timeout=30_000)
            reply = page.locator(".assistant").inner_text()
            out = Path(os.environ.get("NANOGPT_TEST_ARTIFACTS", tmp_path)) / "serve-page.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
        finally:
            browser.close()
    assert reply == expected and out.stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_the_command_prints_its_url_and_a_signal_ends_open_streams_and_exits_0(model_path, sig):
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("NANOGPT_API_KEY", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanogpt_cli",
            "serve",
            str(model_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = _read_line(proc.stdout, 90)
        assert line.startswith("serving tiny at http://127.0.0.1:") and line.rstrip().endswith("(Ctrl-C to stop)")
        assert " with a KV cache of 512 bytes per token " in line  # 2 layers x k and v x 32 wide x 4 bytes
        url = line.split(" at ")[1].split()[0]
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"prompt": "Go", "max_tokens": 3000, "temperature": 0, "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.readline()  # streaming
        proc.send_signal(getattr(signal, sig))
        lines = [x for x in response.read().decode().split("\n") if x]
        assert lines[-1] == "data: [DONE]" and "the server is stopping" in lines[-2]
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _read_line(stream, timeout: float) -> str:
    """One line of a child's output, waiting at most timeout seconds."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert box, f"no output within {timeout} s"
    return box[0]


def test_loopback_hosts_and_the_default_model_name():
    from nanogpt_cli.serve import default_model_name, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.com")
    assert default_model_name("runs/shk/") == "shk" and default_model_name("a/b/model.safetensors") == "model"
    assert default_model_name("hf:gpt2") == "gpt2"


def test_a_non_loopback_host_without_a_key_is_warned_about(tmp_path):
    out = CliRunner().invoke(
        app, ["serve", str(tmp_path / "missing.safetensors"), "--host", "0.0.0.0"], env={"NANOGPT_API_KEY": ""}
    )
    assert out.exit_code == 1
    assert "reachable from other machines and no --api-key is set" in out.output


def test_a_port_in_use_is_one_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = CliRunner().invoke(app, ["serve", str(tmp_path / "missing.safetensors"), "--port", str(port)])
    assert out.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.output and "in use" in out.output
