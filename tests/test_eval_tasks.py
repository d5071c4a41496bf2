"""`nanogpt eval tasks`: our model as an lm-evaluation-harness model, checked against lm-eval's own `hf` backend on
our Hugging Face export. Every task is a YAML the test writes over a small local jsonl (dataset_path: json with
data_files), so nothing is downloaded; lm-eval's built-in tasks need their datasets from the Hugging Face hub and
are not run here."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.inference.loglikelihood import score_continuations
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import save_model
from nanogpt_cli.tokenizer import build_tokenizer, train_bpe

runner = CliRunner()
SUMS = [(a, b) for a in range(10) for b in range(10)]


def question(a: int, b: int) -> str:
    return f"Question: What is {a} plus {b}?\nAnswer:"


TASKS = {  # name -> the YAML's body after its dataset; {{a}}, {{b}}, ... are the jsonl's fields
    "sums_mc": """output_type: multiple_choice
doc_to_text: "Question: What is {{a}} plus {{b}}?\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
""",
    "sums_gen": """output_type: generate_until
doc_to_text: "Question: What is {{a}} plus {{b}}?\\nAnswer:"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 4, do_sample: false}
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true, regexes_to_ignore: [" "]}
""",
    "sums_roll": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "Question: What is {{a}} plus {{b}}?\\nAnswer: {{answer}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
""",
}


def write_tasks(folder: Path, docs: list[dict]) -> Path:
    """The three task YAMLs over one jsonl of documents, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    for name, body in TASKS.items():
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        (folder / f"{name}.yaml").write_text(head + body, encoding="utf-8")
    return folder


def sum_docs(n: int = 10, seed: int = 0) -> list[dict]:
    """n sums at random and two whose answer, 10, the fitted model writes: exact_match then meets hits as well as
    misses."""
    rng = random.Random(seed)
    docs = []
    for a, b in rng.sample([s for s in SUMS if sum(s) != 10], n) + [(3, 7), (6, 4)]:
        choices = [str(a + b + d) for d in (0, 1, 2)]
        rng.shuffle(choices)
        docs.append({"a": a, "b": b, "answer": str(a + b), "choices": choices, "label": choices.index(str(a + b))})
    return docs


@pytest.fixture(scope="module")
def sums(tmp_path_factory) -> dict[str, Path]:
    """A tiny model fitted a little to the sums' text with a trained BPE (with an end-of-text token, as lm-eval's
    `hf` backend needs one), saved as our checkpoint, and the task folder (export_of exports it)."""
    root = tmp_path_factory.mktemp("sums")
    text = "".join(f"{question(a, b)} {a + b}\n\n" for a, b in SUMS)
    tok = train_bpe([text], 300, "sums")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32))
    data = torch.tensor(tok.encode(text))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(100):  # enough to learn the answers' shape (" 12\n\n") and some of the sums
        starts = torch.randint(0, len(data) - 33, (16,))
        x = torch.stack([data[s : s + 32] for s in starts])
        y = torch.stack([data[s + 1 : s + 33] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_model(root / "sums.safetensors", model.eval(), {"tokenizer": tok.describe()})
    return {"run": root / "sums.safetensors", "tasks": write_tasks(root / "tasks", sum_docs()), "root": root}


def export_of(sums: dict[str, Path]) -> Path:
    from nanogpt_cli.interop.export import export

    out = sums["root"] / "hf"
    if not out.exists():
        export(sums["run"], "hf", out)
    return out


# --- scoring continuations: no lm-eval needed ---


@pytest.mark.parametrize("flags", [{}, {"pos_encoding": "learned"}, {"qk_norm": True, "norm": "rmsnorm"}])
def test_each_pair_scores_what_a_full_forward_over_it_gives(flags):
    """Shared contexts scored once, one-token and longer choices, pairs cut to the window, a head padded past the
    tokenizer's vocabulary: every pair's log-probability and greedy flag equal a plain forward over that pair."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, **flags)).eval()
    rng = random.Random(0)
    pairs = []
    for _ in range(9):
        context = [rng.randrange(61) for _ in range(rng.randint(1, 22))]  # some longer than the context
        pairs += [(context, [rng.randrange(61) for _ in range(rng.randint(1, 6))]) for _ in range(rng.randint(1, 4))]
    pairs.append((pairs[0][0], pairs[0][1][:1] * 3))  # greedy can hold: a choice of the most likely tokens

    def alone(context, continuation):
        seq = (context + continuation)[-17:]  # the window: block_size + 1, the last token never fed
        with torch.no_grad():
            logits, _ = model(torch.tensor([seq[:-1]]))
        lp = F.log_softmax(logits[0, -len(continuation) :, :61], dim=-1)
        target = torch.tensor(continuation)
        return lp[torch.arange(len(continuation)), target].sum().item(), bool((lp.argmax(-1) == target).all())

    expected = [alone(c, k) for c, k in pairs]
    for batch_size in (1, 3, 64):
        got = score_continuations(model, pairs, batch_size, vocab_size=61)
        assert [g for _, g in got] == [g for _, g in expected]
        assert max(abs(a - b) for (a, _), (b, _) in zip(got, expected)) < 1e-4


def test_a_continuation_longer_than_the_context_is_one_sentence():
    from nanogpt_cli.errors import NanoGPTError

    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(NanoGPTError, match="^a continuation of 5 tokens does not fit the model's context of 4$"):
        score_continuations(model, [([1], [1, 2, 3, 4, 5])])


# --- the lm-eval model ---


def test_a_group_size_from_model_args_that_is_no_number_is_one_sentence_naming_it(tmp_path):
    """lm-eval's --model_args gives it as group_size=; the CLI's --int4-group is checked before it gets here."""
    from nanogpt_cli.errors import NanoGPTError
    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM

    message = r"^--int4-group \(group_size=\) must be a whole number of inputs, got 'many'$"
    with pytest.raises(NanoGPTError, match=message):
        NanoGPTLM(str(tmp_path / "no-model"), quantize="int4", group_size="many")


def test_rolling_loglikelihood_is_what_eval_perplexity_scores(tmp_path):
    """Documents longer than the context, through the same sliding window: for a tokenizer without an end-of-text
    token, minus the rolling log-likelihood is `eval perplexity --input`'s total NLL (loss x tokens)."""
    from lm_eval.api.instance import Instance

    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM

    texts = ["the king and the queen speak of love and death, " * 3, "a sweet night; a fair day. " * 5]
    tok = build_tokenizer("char", texts)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32))
    save_model(tmp_path / "m.safetensors", model, {"tokenizer": tok.describe()})
    lm = NanoGPTLM(str(tmp_path / "m.safetensors"), device="cpu", batch_size=2)
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    for text, got in zip(texts, lm.loglikelihood_rolling(requests)):
        (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
        args = ["eval", "perplexity", "--checkpoint", str(tmp_path / "m.safetensors"), "--input"]
        out = runner.invoke(app, [*args, str(tmp_path / "doc.txt"), "--json", "--device", "cpu"])
        result = json.loads(out.output)
        assert result["tokens"] == len(text) - 1
        assert -got == pytest.approx(result["loss"] * result["tokens"], rel=1e-6)


def test_each_generation_request_keeps_its_own_stop_texts_and_limit(sums):
    """Requests with different settings in one call: each answer is what sampling its prompt alone, greedily, with
    its stop texts and token limit gives."""
    from lm_eval.api.instance import Instance

    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM
    from nanogpt_cli.inference.sample import Sampler, SampleSettings

    lm = NanoGPTLM(str(sums["run"]), device="cpu", batch_size=2)
    asks = [
        (question(1, 2), {"until": ["\n"], "max_gen_toks": 5}),
        (question(3, 4), {"until": ["\n"], "max_gen_toks": 5}),
        (question(7, 7), {"until": ["?"], "max_gen_toks": 12}),
        ("Question: What", {"until": ["Answer"], "max_gen_toks": 3}),
        (question(2, 2), {"until": ["\n"], "max_gen_toks": 5, "do_sample": False, "temperature": 0.0}),
    ]
    answers = lm.generate_until([Instance("generate_until", {}, a, i) for i, a in enumerate(asks)])
    sampler = Sampler(lm.loaded)
    for (prompt, kwargs), answer in zip(asks, answers):
        settings = SampleSettings(max_new_tokens=kwargs["max_gen_toks"], temperature=0, stop=kwargs["until"])
        assert answer == sampler.generate(prompt, settings).text
        assert not any(s in answer for s in kwargs["until"])
    assert answers[0].strip() != "" and len(sampler.tokenizer.encode(answers[3])) <= 3


def test_a_generating_rows_memory_is_the_engines_cache_for_it():
    """What row_bytes counts for a generating row, with no prompt, is what the engine's KV cache allocates for one
    row, at the model's whole context; float32 and bfloat16 alike, a sliding window's ring included."""
    from nanogpt_cli.inference.engine import Engine
    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM
    from nanogpt_cli.interop.loading import InferenceModel
    from nanogpt_cli.tokenizer import build_tokenizer

    tok = build_tokenizer("char", ["abcdefgh"])
    for flags, dtype in (({}, torch.float32), ({"n_kv_head": 1}, torch.bfloat16), ({"sliding_window": 8}, None)):
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=3, n_head=2, n_embd=32, **flags))
        model = model.to(dtype or torch.float32).eval()
        lm = NanoGPTLM(InferenceModel(model, tok, {}, torch.device("cpu"), dtype or torch.float32), source="m")
        cache = Engine(model, max_batch=1).cache
        held = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        assert lm.row_bytes(0, "generate") == held


def test_without_batch_size_the_rows_of_each_request_are_chosen_by_memory(sums, monkeypatch):
    """BATCH_BYTES (here shrunk to 3 generating rows, 5 scored contexts) sets the rows of each forward, and the
    answers are those of --batch-size 1 (to rounding); a given --batch-size stays the user's; "auto" is the
    default."""
    from lm_eval.api.instance import Instance

    from nanogpt_cli.inference import lm_eval_model
    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM
    from nanogpt_cli.inference.sample import Sampler

    rows = []
    generate_many, score = Sampler.generate_many, lm_eval_model.score_continuations
    monkeypatch.setattr(
        Sampler, "generate_many", lambda s, prompts, *a: rows.append(len(prompts)) or generate_many(s, prompts, *a)
    )
    monkeypatch.setattr(
        lm_eval_model, "score_continuations", lambda m, pairs, n, v: rows.append(n) or score(m, pairs, n, v)
    )
    asks = [
        Instance("generate_until", {}, (question(a, b), {"until": ["\n"], "max_gen_toks": 4}), a) for a, b in SUMS[:8]
    ]
    pairs = [Instance("loglikelihood", {}, (question(a, b), f" {a + b}"), a) for a, b in SUMS[:8]]
    one = NanoGPTLM(str(sums["run"]), device="cpu", batch_size=1)
    expected = one.generate_until(asks), one.loglikelihood(pairs)
    lm = NanoGPTLM(str(sums["run"]), device="cpu", batch_size="auto")
    assert lm.batch_size is None and NanoGPTLM(lm.loaded, source="m").batch_size is None
    assert lm.rows(lm.row_bytes(64, "generate")) == lm_eval_model.MAX_ROWS  # a tiny model: the most rows
    longest = max(len(lm.tok_encode(question(a, b) + f" {a + b}")) for a, b in SUMS[:8])
    monkeypatch.setattr(lm_eval_model, "BATCH_BYTES", 5 * lm.row_bytes(longest, "context") + 1)
    rows.clear()
    got = lm.loglikelihood(pairs)  # padded beside longer contexts: equal to rounding
    assert [g for _, g in got] == [g for _, g in expected[1]] and rows == [5]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected[1]], abs=1e-5)
    longest = max(len(lm.tok_encode(a.args[0])) for a in asks)
    monkeypatch.setattr(lm_eval_model, "BATCH_BYTES", 3 * lm.row_bytes(longest, "generate") + 1)
    rows.clear()
    assert lm.generate_until(asks) == expected[0] and rows == [3, 3, 2]
    rows.clear()
    NanoGPTLM(lm.loaded, source="m", batch_size=4).generate_until(asks)
    assert rows == [4, 4]


@pytest.mark.slow
def test_the_command_scores_as_simple_evaluate_with_our_model_does(sums, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM

    names = "sums_mc,sums_gen,sums_roll"
    args = ["eval", "tasks", str(sums["run"]), "--tasks", names, "--include-path", str(sums["tasks"])]
    args += ["--json", "--limit", "8", "--output-path", str(tmp_path / "out"), "--device", "cpu"]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    ours = json.loads(out.stdout)["results"]

    lm = NanoGPTLM(str(sums["run"]), device="cpu")
    manager = TaskManager(include_path=str(sums["tasks"]), include_defaults=False)
    theirs = lm_eval.simple_evaluate(model=lm, tasks=names.split(","), limit=8, task_manager=manager)["results"]
    assert ours == theirs
    assert set(ours) == {"sums_mc", "sums_gen", "sums_roll"} and ours["sums_mc"]["sample_len"] == 8
    written = sorted(p.name.split("_")[0] for p in (tmp_path / "out").rglob("*.json*"))
    assert written == ["results", "samples", "samples", "samples"]


@pytest.mark.slow
def test_quantize_scores_the_quantized_model_and_the_results_say_so(sums, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from nanogpt_cli.inference.backends.quantize import QuantizedLinear
    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM

    names = "sums_mc,sums_roll"
    base = ["eval", "tasks", str(sums["run"]), "--tasks", names, "--include-path", str(sums["tasks"])]
    base += ["--json", "--limit", "8", "--device", "cpu"]
    runs = {q: runner.invoke(app, [*base, *q]) for q in ((), ("--quantize", "int4", "--int4-group", "32"))}
    assert all(r.exit_code == 0 for r in runs.values()), [r.output for r in runs.values()]
    floats, int4 = (json.loads(r.stdout) for r in runs.values())
    assert int4["config"]["model_args"] == {"pretrained": str(sums["run"]), "quantize": "int4", "group_size": 32}

    lm = NanoGPTLM(str(sums["run"]), device="cpu", quantize="int4", group_size="32")  # as --model_args passes it
    assert sum(isinstance(m, QuantizedLinear) for m in lm.model.modules()) == 2 * 4
    manager = TaskManager(include_path=str(sums["tasks"]), include_defaults=False)
    theirs = lm_eval.simple_evaluate(model=lm, tasks=names.split(","), limit=8, task_manager=manager)["results"]
    assert int4["results"] == theirs
    # the quantized model's own scores: near the float model's, not equal to them
    a, b = (r["results"]["sums_roll"]["word_perplexity,none"] for r in (floats, int4))
    assert a != b and abs(b / a - 1) < 0.2


@pytest.mark.slow
def test_scores_equal_lm_evals_hf_backend_on_our_hugging_face_export(sums):
    """Per document: multiple-choice and rolling log-likelihoods within 1e-4, greedy answers alike; the task
    scores (acc, acc_norm, exact_match) equal exactly."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import nanogpt_cli as nanogpt
    from nanogpt_cli.cli.ui import console, tasks_table

    names = ["sums_mc", "sums_gen", "sums_roll"]
    ours = nanogpt.load(sums["run"], device="cpu", dtype="float32").evaluate_tasks(
        names, include_path=sums["tasks"], batch_size=4
    )
    manager = TaskManager(include_path=str(sums["tasks"]), include_defaults=False)
    hf = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(export_of(sums)), "dtype": "float32"},
        device="cpu",
        batch_size=4,
        tasks=names,
        task_manager=manager,
    )
    for task in names:
        for mine, theirs in zip(ours.samples[task], hf["samples"][task], strict=True):
            assert mine["doc_id"] == theirs["doc_id"]
            if task == "sums_gen":
                assert mine["resps"] == theirs["resps"]
            else:
                a, b = [r[0] for r in mine["resps"]], [r[0] for r in theirs["resps"]]
                if task == "sums_mc":  # (logprob, greedy) per choice
                    assert [g for _, g in a] == [g for _, g in b]
                    a, b = [lp for lp, _ in a], [lp for lp, _ in b]
                assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    for task, metric in (("sums_mc", "acc"), ("sums_mc", "acc_norm"), ("sums_gen", "exact_match")):
        assert ours.results["results"][task][f"{metric},none"] == hf["results"][task][f"{metric},none"]
    assert ours.results["results"]["sums_gen"]["exact_match,none"] > 0  # the fitted model answers some
    with console.capture() as shown:
        console.print(tasks_table(ours, "sums"))
    rows = [line.split("│")[1:-1] for line in shown.get().splitlines() if line.startswith("│")]
    assert [r[0].strip() for r in rows] == ["sums_mc", "sums_mc", "sums_gen", "sums_roll", "sums_roll", "sums_roll"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--limit", "0"], "--limit must be at least 1 document per task, got 0"),
        (["--include-path", "{tmp}/nowhere"], "--include-path {tmp}/nowhere does not exist"),
        (["--num-fewshot", "-1"], "--num-fewshot must be 0 or more, got -1"),
        (["--quantize", "int3"], "--quantize must be one of int8, int4, got 'int3'"),
        (["--quantize", "int4", "--int4-group", "48"], "--int4-group must be one of 32, 64, 128, 256, got 48"),
    ],
)
def test_bad_options_are_one_sentence_before_anything_loads(args, message, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = runner.invoke(app, ["eval", "tasks", str(tmp_path / "no-model"), "--tasks", "sums_mc", *args])
    assert out.exit_code == 1
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message.replace('{tmp}', str(tmp_path))}"), lines


@pytest.mark.slow
def test_an_unknown_task_is_one_sentence_naming_close_ones(sums):
    """A name neither the include path nor lm-eval's built-in index (read in full: seconds) knows."""
    args = ["eval", "tasks", str(sums["run"]), "--tasks", "sums_mcq", "--include-path", str(sums["tasks"])]
    out = runner.invoke(app, [*args, "--device", "cpu"])
    assert out.exit_code == 1
    said = out.output.strip()
    assert len(said.splitlines()) == 1 and "(close: sums_mc, " in said
    assert said.startswith("error: unknown task 'sums_mcq': no lm-eval task, group or tag has that name, and it is")
