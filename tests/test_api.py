"""The Python API (api.py): docs/python.md's examples run as written, and each call does what it says."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanogpt_cli import api
from nanogpt_cli.config import GPTConfig, TrainConfig
from nanogpt_cli.data import load_meta
from nanogpt_cli.data.chat_template import ChatTemplate
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.evaluate import perplexity_of_split
from nanogpt_cli.inference.sample import Sampler, SampleSettings
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.tokenizer import build_tokenizer
from nanogpt_cli.training.plan import Change

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "python.md"


def doc_blocks() -> list[tuple[str, bool, list[str]]]:
    """The python code blocks of docs/python.md in order, each with whether an output block follows it and the API
    names it needs (an `<!-- needs: NAME, Model.NAME -->` line above it)."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.finditer(r"(?:<!-- needs: (.*?) -->\n)?```python\n(.*?)```\n(\s*```text\n)?", text, flags=re.S)
    return [(m.group(2), m.group(3) is not None, (m.group(1) or "").replace(",", " ").split()) for m in blocks]


def missing(needs: list[str]) -> list[str]:
    """The names a block needs that the API does not have (yet)."""
    return [n for n in needs if not hasattr(api.Model if n.startswith("Model.") else api, n.removeprefix("Model."))]


def run_doc(folder: Path) -> list[str | None]:
    """Run the doc's blocks one after another in `folder`, in one namespace, as a notebook would: what each
    printed (None: left out, as it needs API names this checkout lacks)."""
    namespace: dict = {"__name__": "__doc__"}
    outputs: list[str | None] = []
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        for code, _, needs in doc_blocks():
            if missing(needs):
                outputs.append(None)
                continue
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, str(DOC), "exec"), namespace)
            outputs.append(out.getvalue())
    finally:
        os.chdir(cwd)
    return outputs


def test_the_python_docs_examples_run_as_written(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    blocks = doc_blocks()
    assert len(blocks) >= 10
    outputs = run_doc(tmp_path)
    for (code, shown, _), printed in zip(blocks, outputs):
        if printed is not None:  # None: a block that needs what this checkout's API lacks
            assert bool(printed.strip()) == shown, f"this block printed {printed!r}, the doc shows otherwise:\n{code}"
    assert all(printed is not None for printed in outputs) or missing(["info", "serve", "Model.attention"])
    runs = tmp_path / "checkpoints"
    assert (runs / "shk" / "best.safetensors").is_file() and (runs / "shk" / "report.md").is_file()
    assert (tmp_path / "exports" / "shk.gguf").is_file()
    assert "lora" in api.load(runs / "shk-lora", device="cpu").meta  # adapters on their base
    for run, method in (("shk-full", "full"), ("chat", "full"), ("dpo", "lora")):  # every method, each as asked
        assert json.loads((runs / run / "config.json").read_text())["finetune"]["method"] == method
    for run, objective in (("dpo", "dpo"), ("grpo", "grpo"), ("student", "distill")):
        assert json.loads((runs / run / "config.json").read_text())["finetune"]["objective"] == objective
    listed = {r.name: r.step for r in api.list_runs(runs)}
    steps = {"shk": 220, "shk-full": 20, "shk-lora": 20, "bytes": 30, "chat": 10, "dpo": 6, "grpo": 4}
    assert listed == {**steps, "student": 10}
    report = next(o for o in outputs if o and "# Report: shk" in o)  # the report card, as `nanogpt report` prints it
    assert "# Report: shk" in report.splitlines() and (tmp_path / "loss.png").stat().st_size > 0
    assert outputs[-1].strip().startswith("unknown sampling setting(s) temprature")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: more threads only wait on each other, badly so on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(trained_run):
    return api.load(trained_run, device="cpu", dtype="float32")


def test_load_takes_a_run_its_last_weights_or_a_file(trained_run, model):
    assert model.dtype == torch.float32 and model.device.type == "cpu" and model.block_size == 32
    last = api.load(trained_run, last=True, device="cpu")
    path = api.load(trained_run / "best.safetensors", device="cpu", dtype=torch.float32)
    assert last.meta["step"] == 60 and path.meta == model.meta
    with pytest.raises(NanoGPTError, match="dtype must be one of auto, float32"):
        api.load(trained_run, dtype="fp8")


def test_attention_checks_the_layer_and_head_asked_for_before_computing(model):
    n_layer, n_head = model.module.config.n_layer, model.module.config.n_head
    maps = model.attention("ROMEO:", layer=n_layer - 1, head=n_head - 1)  # the maps hold every layer all the same
    assert tuple(maps.probs.shape[:2]) == (n_layer, n_head)
    with pytest.raises(NanoGPTError, match=f"--layer must be between 0 and {n_layer - 1}"):
        model.attention("ROMEO:", layer=n_layer)
    with pytest.raises(NanoGPTError, match=f"--head must be between 0 and {n_head - 1}"):
        model.attention("ROMEO:", head=-1)


def test_the_same_seed_gives_the_same_text_and_the_stream_joins_to_it(model):
    one = model.generate("ROMEO:", max_new_tokens=40, seed=5)
    assert one.prompt == "ROMEO:" and one.tokens == 40 and one.stop_reason == "length"
    assert untimed(model.generate("ROMEO:", max_new_tokens=40, seed=5)) == untimed(one)
    assert model.generate("ROMEO:", max_new_tokens=40, seed=6).text != one.text
    stream = model.generate("ROMEO:", max_new_tokens=40, seed=5, stream=True)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == one.text and stream.result.token_ids == one.token_ids
    assert list(stream) == [] and stream.result.token_ids == one.token_ids  # read once; its result stays
    assert model.generate("ROMEO:", max_new_tokens=40, seed=5, stop="e").text == one.text.partition("e")[0]


def untimed(result):
    """The result with its timings zeroed: two runs of the same call must agree on everything else."""
    timings = {f.name: 0 for f in dataclasses.fields(result) if f.name in ("elapsed_s", "tokens_per_s")}
    return dataclasses.replace(result, **timings)


def test_a_batch_of_prompts_gives_each_the_text_it_gets_alone(model):
    prompts = ["ROMEO:", "KING:\nO", "the queen"]
    greedy = model.generate(prompts, max_new_tokens=20, temperature=0)
    assert [r.prompt for r in greedy] == prompts
    assert [r.text for r in greedy] == [model.generate(p, max_new_tokens=20, temperature=0).text for p in prompts]
    seeded = model.generate(prompts, max_new_tokens=20, seed=9)
    assert [r.text for r in seeded] == [
        model.generate(p, max_new_tokens=20, seed=9 + r).text for r, p in enumerate(prompts)
    ]
    pieces = list(model.generate(prompts, max_new_tokens=20, seed=9, stream=True))
    for row, result in enumerate(seeded):
        assert "".join(p.text for p in pieces if p.row == row) == result.text
        assert [p.result.text for p in pieces if p.row == row and p.result] == [result.text]


def letter_model(path: Path, template: str) -> Path:
    """A random byte-level model whose head scores only lowercase letters, so it writes letters only."""
    torch.manual_seed(0)
    tok = build_tokenizer("byte")
    gpt = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=96, n_layer=1, n_head=2, n_embd=16, tie_embeddings=False))
    with torch.no_grad():
        letters = torch.zeros(tok.vocab_size, dtype=torch.bool)
        letters[ord("a") : ord("z") + 1] = True
        gpt.lm_head.weight[~letters] = 0.0
        gpt.lm_head.weight[letters] *= 300.0
    ckpt.save_model(path, gpt, {"tokenizer": tok.describe(), "step": 0, "chat_template": template})
    return path


def letter_template(end: str) -> str:
    """Role lines; the assistant's turn ends with the letter `end`, so a model that writes letters ends there."""
    return (
        "{% for m in messages %}{{ m['role'] + ':' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ ' ' + m['content'] + '" + end + "' }}{% endgeneration %}"
        "{% else %}{{ ' ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )


def test_a_chat_reply_is_rendered_with_the_template_and_ends_at_its_end_of_turn(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = ChatTemplate(letter_template("q")).tokens(messages, build_tokenizer("byte"))
    assert bytes(ids) == b"system: be brief\nuser: hello\nassistant:"  # the end of turn is not in the prompt
    # what the sampler continues the rendered conversation with; the template's turn ends at its third letter
    sampler = Sampler.load(letter_model(tmp_path / "raw.safetensors", letter_template("q")), device="cpu")
    raw = sampler.generate(ids, SampleSettings(max_new_tokens=40, seed=2)).text
    end = raw[2]
    chat = api.load(letter_model(tmp_path / "chat.safetensors", letter_template(end)), device="cpu")
    assert chat.template.source == letter_template(end) and end in chat.template.stop
    reply = chat.chat(messages, seed=2)
    assert reply.text == raw.partition(end)[0] != "" and reply.prompt_tokens == len(ids)
    assert reply.stop_reason == "stop" and reply.message == {"role": "assistant", "content": reply.text}
    stream = chat.chat(messages, seed=2, stream=True)
    assert "".join(stream) == reply.text and untimed(stream.result) == untimed(reply)
    short = chat.chat(messages, seed=2, max_new_tokens=1)
    assert short.text == reply.text[:1] and short.stop_reason == "length"


def test_a_base_model_chats_in_the_plain_transcript_within_its_context(model):
    messages = [{"role": "user", "content": "hi"}]
    reply = model.chat(messages, temperature=0)
    prompt = model.template.render(messages)
    assert model.template.plain and prompt == "User: hi\n\nAssistant:"
    assert reply.prompt_tokens == len(prompt) and reply.tokens <= model.block_size - len(prompt)
    assert "".join(model.chat(messages, temperature=0, stream=True)) == reply.text
    with pytest.raises(NanoGPTError, match="the conversation takes 38 tokens .* context is 32"):
        model.chat([{"role": "user", "content": "a" * 20}])
    session = model.conversation(temperature=0, max_new_tokens=5)
    assert "".join(session.ask("hi")) == model.chat(messages, temperature=0, max_new_tokens=5).text


def test_a_text_the_model_trained_on_scores_lower_than_random_text(model, char_data):
    data_dir, name = char_data
    trained = (data_dir.parent / "play.txt").read_text(encoding="utf-8")[:400]
    rng = torch.Generator().manual_seed(0)
    letters = sorted(set(trained))
    noise = "".join(letters[i] for i in torch.randint(len(letters), (400,), generator=rng).tolist())
    seen, unseen = model.score([trained]), model.score(noise)
    assert seen.loss < unseen.loss - 0.5 and seen.tokens == unseen.tokens == 399
    for r in (seen, unseen):
        assert r.perplexity == pytest.approx(math.exp(r.loss))
        assert r.bits_per_byte == pytest.approx(r.loss * r.tokens / math.log(2) / r.bytes)
    pooled = model.score([trained[:200], trained[200:]])
    assert pooled.tokens == 398 and pooled.source == "2 texts"
    path = data_dir.parent / "first.txt"
    path.write_text(trained[:200], encoding="utf-8")
    assert model.score(files=[path]).loss == pytest.approx(model.score(trained[:200]).loss)
    split = model.score(data=name, data_dir=data_dir, split="val", stride=8)
    assert untimed(split) == untimed(perplexity_of_split(model.module, model.tokenizer, data_dir, name, "val", 8))
    with pytest.raises(NanoGPTError, match="give one of texts, files"):
        model.score(trained, data=name)


def test_the_callback_gets_every_typed_event_in_order_and_the_result_matches(char_data, tmp_path):
    data_dir, name = char_data
    events = []
    common = dict(data=name, data_dir=str(data_dir), device="cpu", dtype="float32", out=tmp_path / "run")
    result = api.train(
        "tiny", max_iters=30, stop_at=20, eval_interval=15, log_interval=5, callback=events.append, **common
    )
    events = [e for e in events if not isinstance(e, api.Hint)]  # a busy machine's advice may come any time
    # the step-15 evaluation is told once its checkpoint, written in the background, is on disk: after the
    # progress of step 15 (or a later one), before the final save
    late = next(i for i, e in enumerate(events) if isinstance(e, api.Evaluated) and e.step == 15)
    assert isinstance(events[late - 1], api.StepLogged) and events[late - 1].step >= 15 and late < len(events) - 1
    kinds = [type(e).__name__ for e in events[:late] + events[late + 1 :]]
    assert kinds == [
        "Status",  # loading the data
        "Status",  # building the model
        "RunStarted",
        "Status",  # first evaluation
        *["Evaluated", "StepLogged", "StepLogged", "StepLogged", "StepLogged"],
        "Saved",
    ]
    logged = [e for e in events if isinstance(e, api.StepLogged)]
    assert [e.step for e in logged] == [5, 10, 15, 20]
    evals = [e for e in events if isinstance(e, api.Evaluated)]
    assert [e.step for e in evals] == [0, 15] and events[-1] == api.Saved(20)
    assert result.stopped == "stop_at" and result.step == 20 and result.tokens == logged[-1].tokens
    assert (result.eval_step, result.val_loss, result.train_loss) == (15, evals[-1].val_loss, evals[-1].train_loss)
    assert result.best_val_loss == min(e.val_loss for e in evals)

    resumed = []
    more = api.train(resume=True, learning_rate=2e-3, eval_interval=15, callback=resumed.append, **common)
    assert resumed[0] == Change("learning_rate", 3e-3, 2e-3, 20) and more.step == 30 and more.stopped is None
    started = next(e for e in resumed if isinstance(e, api.RunStarted))
    assert started.resume and started.step == 20
    done = []
    api.train(resume=True, callback=done.append, **common)
    assert done[0] == api.Note(
        f"{tmp_path / 'run'} is already complete: step 30 of max_iters 30; raise max_iters to train it further"
    )


def test_a_config_may_be_a_preset_a_dict_a_toml_file_or_the_config_classes(char_data, tmp_path):
    data_dir, name = char_data
    flags = dict(data=name, data_dir=str(data_dir), device="cpu")
    by_preset = api.plan_training("tiny", out=tmp_path / "a", **flags)
    by_dict = api.plan_training({"preset": "tiny", **flags}, out=tmp_path / "b")
    (tmp_path / "run.toml").write_text(f'preset = "tiny"\ndata = "{name}"\ndata_dir = "{data_dir}"\ndevice = "cpu"\n')
    by_file = api.plan_training(tmp_path / "run.toml", out=tmp_path / "c")
    classes = api.plan_training(
        TrainConfig(**by_preset.plan.train.to_dict()),
        model=GPTConfig(**{**by_preset.plan.model.to_dict(), "vocab_size": 50304}),
        out=tmp_path / "d",
    )
    for other in (by_dict, by_file, classes):
        assert other.plan.model == by_preset.plan.model and other.plan.train == by_preset.plan.train
    assert by_preset.plan.model.vocab_size == load_meta(data_dir, name)["vocab_size"]  # the dataset's
    assert by_preset.run_dir == tmp_path / "a"
    assert not (tmp_path / "a").exists()  # planning writes nothing
    assert (
        api.plan_training("tiny", max_iters=7, out=tmp_path / "e", **flags).plan.train.max_iters == 7
    )  # keywords override
    with pytest.raises(NanoGPTError, match="config must be a preset name"):
        api.plan_training(3)
    with pytest.raises(NanoGPTError, match="unknown preset 'tinny'"):
        api.plan_training("tinny", **flags)


def test_prepare_returns_what_it_wrote(tmp_path, sample_text):
    (tmp_path / "play.txt").write_text(sample_text, encoding="utf-8")
    result = api.prepare(tmp_path / "play.txt", "play", tokenizer="char", data_dir=tmp_path / "data", val_fraction=0.2)
    assert result.train_tokens + result.val_tokens == len(sample_text) == result.characters
    assert result.vocab_size == len(set(sample_text)) and result.path == tmp_path / "data" / "play"
    assert result.val_tokens == pytest.approx(0.2 * len(sample_text), abs=1)
    assert (result.path / "meta.json").is_file()
    with pytest.raises(NanoGPTError, match="unknown option\\(s\\) val_frac; these exist: tokenizer"):
        api.prepare(tmp_path / "play.txt", "x", data_dir=tmp_path / "data", val_frac=0.2)
    chats = tmp_path / "chats.jsonl"
    turns = [{"role": "user", "content": "count to three"}, {"role": "assistant", "content": "one two three"}]
    chats.write_text("\n".join(json.dumps({"messages": turns}) for _ in range(10)) + "\n", encoding="utf-8")
    chat = api.prepare(chats, "chats", tokenizer="byte", data_dir=tmp_path / "data", format="chat", strict=True)
    assert chat.conversations == 10 and chat.bad == [] and 0 < chat.trained_tokens < chat.train_tokens + chat.val_tokens
    with pytest.raises(NanoGPTError, match="unknown option\\(s\\) max_docs; these exist: tokenizer, data_dir"):
        api.prepare(chats, "chats", data_dir=tmp_path / "data", format="chat", max_docs=3)
    with pytest.raises(NanoGPTError, match="unknown --format 'csv'; use text, chat, preference or prompts"):
        api.prepare(tmp_path / "play.txt", "x", data_dir=tmp_path / "data", format="csv")


def test_bad_input_is_one_sentence(model):
    with pytest.raises(NanoGPTError, match="unknown sampling setting\\(s\\) temprature; these exist: max_new_tokens"):
        model.generate("ROMEO:", temprature=0.5)
    with pytest.raises(NanoGPTError, match="--top-p must be in"):
        model.generate("ROMEO:", top_p=0)
    with pytest.raises(NanoGPTError, match="give a text or a list of texts"):
        model.generate([1, 2])
    with pytest.raises(NanoGPTError, match="message 0 must be"):
        model.chat([{"role": "user"}])
    with pytest.raises(NanoGPTError, match="--last picks the weights of --init-from RUN"):
        api.plan_training("tiny", last=True)
    with pytest.raises(NanoGPTError, match="ignore_eot is for generate"):
        model.chat([{"role": "user", "content": "hi"}], ignore_eot=True)


def test_importing_the_api_loads_no_torch_and_the_package_hands_out_its_calls():
    code = "import sys, nanogpt_cli, nanogpt_cli.api; assert 'torch' not in sys.modules; print(nanogpt_cli.load)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "function load" in out
    import nanogpt_cli

    assert nanogpt_cli.train is api.train and nanogpt_cli.prepare is api.prepare
    with pytest.raises(AttributeError):
        nanogpt_cli.nothing  # noqa: B018


def test_a_plan_started_from_a_converted_model_runs_once(char_data, tmp_path):
    """The run lets the plan's converted weights go; a second run of that plan refuses, not starts at random."""
    from test_export import save_random_gpt2

    data_dir, name = char_data
    save_random_gpt2(tmp_path / "gpt2", load_meta(data_dir, name)["tokenizer"])
    flags = dict(data=name, data_dir=str(data_dir), device="cpu", dtype="float32", max_iters=1, eval_iters=1)
    training = api.plan_training(out=tmp_path / "run", init_from=tmp_path / "gpt2", force=True, **flags)
    assert training.run().step == 1
    with pytest.raises(NanoGPTError, match=r"^this plan's starting weights were used by a run already; plan it again$"):
        training.run()
