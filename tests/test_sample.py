"""Sampling: seeds, greedy, the cache, streaming, stop texts, end-of-text, prompts, and bad input."""

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.sample import Sampler, SampleSettings
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.tokenizer import build_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def sampler(trained_run) -> Sampler:
    return Sampler.load(trained_run, device="cpu")


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    """A random-weights model on the gpt2 tokenizer: its samples are full of tokens that are pieces of
    multi-byte characters."""
    torch.manual_seed(0)
    tok = build_tokenizer("gpt2")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16))
    path = tmp_path_factory.mktemp("gpt2") / "model.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    return path


def test_the_same_seed_gives_the_same_text(sampler):
    settings = SampleSettings(max_new_tokens=40, temperature=1.0, seed=7)
    a = sampler.generate("the", settings).text
    assert a == sampler.generate("the", settings).text
    assert a != sampler.generate("the", SampleSettings(max_new_tokens=40, temperature=1.0, seed=8)).text


def test_top_k_1_equals_greedy_and_cache_equals_no_cache(sampler):
    n = sampler.block_size - 5  # within the context, where the two paths compute the same logits
    greedy = sampler.generate("KING:", SampleSettings(max_new_tokens=n, temperature=0.0))
    top1 = sampler.generate("KING:", SampleSettings(max_new_tokens=n, temperature=1.3, top_k=1, seed=3))
    uncached = sampler.generate("KING:", SampleSettings(max_new_tokens=n, temperature=0.0, use_cache=False))
    assert greedy.token_ids == top1.token_ids == uncached.token_ids
    assert greedy.tokens == n and greedy.stop_reason == "length"


def test_streaming_equals_the_whole_text(gpt2_checkpoint):
    s = Sampler.load(gpt2_checkpoint, device="cpu")
    settings = SampleSettings(max_new_tokens=120, temperature=1.0, top_k=None, ignore_eot=True, seed=3)
    pieces = list(s.stream("naïve café 🙂", settings))
    result = s.generate("naïve café 🙂", settings)
    assert "".join(pieces) == result.text == s.tokenizer.decode(result.token_ids)


def test_streaming_never_prints_half_a_character(tmp_path):
    """A byte-level model wired to write the two bytes of 'é' (C3 A9) over and over."""
    tok = build_tokenizer("byte")
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=True, tie_embeddings=False)
    model = GPT(cfg)
    with torch.no_grad():
        for block in model.transformer.h:  # the blocks add nothing: the output reads the current token
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
        model.transformer.wte.weight.zero_()
        model.transformer.wte.weight[:, 1] = 1.0  # any token -> e_1 ...
        model.transformer.wte.weight[0xC3] = 0.0
        model.transformer.wte.weight[0xC3, 0] = 1.0  # ... but the lead byte -> e_0
        model.lm_head.weight.zero_()
        model.lm_head.weight[0xA9, 0] = 10.0  # after the lead byte comes the continuation byte
        model.lm_head.weight[0xC3, 1] = 10.0  # after anything else, a lead byte
    path = tmp_path / "e.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    s = Sampler.load(path, device="cpu")
    pieces = list(s.stream("caf", SampleSettings(max_new_tokens=10, temperature=0.0)))
    assert pieces == ["é"] * 5


def test_stop_text_ends_the_sample_before_it(sampler):
    free = sampler.generate("", SampleSettings(max_new_tokens=200, temperature=0.0)).text
    stop = free[30:32]  # a two-character text the greedy sample certainly produces
    cut = free[: free.find(stop)]
    settings = SampleSettings(max_new_tokens=200, temperature=0.0, stop=[stop, "never-there"])
    result = sampler.generate("", settings)
    assert result.text == cut and result.stop_reason == "stop"
    assert "".join(sampler.stream("", settings)) == cut


def test_a_batch_of_prompts_gives_each_the_text_it_gets_alone(sampler, gpt2_checkpoint):
    prompts = ["KING:", "the", "", "thou art the king of the"]  # different lengths: no padding, tails fed in
    # greedy runs past the context of 16; the penalty keeps this briefly trained model from repeating one character
    settings = SampleSettings(max_new_tokens=40, temperature=0.0, repetition_penalty=3.0)
    batch = sampler.generate_many(prompts, settings)
    for prompt, result in zip(prompts, batch):
        alone = sampler.generate(prompt, settings)
        assert result.token_ids == alone.token_ids and result.text == alone.text, prompt
        assert result.prompt == prompt and result.tokens == 40
    assert len({r.text for r in batch}) == len(prompts)
    bpe = Sampler.load(gpt2_checkpoint, device="cpu")  # tokens that split characters: each row decodes its own
    settings = SampleSettings(max_new_tokens=30, temperature=0.0, ignore_eot=True)
    prompts = ["naïve café 🙂", "a"]
    pieces = ["", ""]
    for piece in bpe.stream_many(prompts, settings):
        pieces[piece.row] += piece.text
    for prompt, text in zip(prompts, pieces):
        alone = bpe.generate(prompt, settings)
        assert text == alone.text == bpe.tokenizer.decode(alone.token_ids)


def test_a_stop_text_ends_only_its_own_sample(sampler):
    settings = SampleSettings(max_new_tokens=60, temperature=0.0, repetition_penalty=3.0)
    free_a, free_b = (r.text for r in sampler.generate_many(["KING:", "the"], settings))
    stop = next(free_a[i : i + 3] for i in range(5, 40) if free_a[i : i + 3] not in free_b)
    settings.stop = [stop]
    stopped = sampler.generate_many(["KING:", "the"], settings)
    assert stopped[0].text == free_a[: free_a.find(stop)] and stopped[0].stop_reason == "stop"
    assert stopped[1].text == free_b and stopped[1].stop_reason == "length"


def test_samples_are_one_batch_read_one_after_another(sampler):
    settings = SampleSettings(max_new_tokens=30, temperature=1.0, seed=5)
    streams = list(sampler.samples("the", settings, num_samples=3))
    texts = ["".join(s) for s in reversed(streams)]  # reading the last first still gives each its own text
    assert texts[::-1] == [r.text for r in sampler.generate_many(["the"] * 3, settings)]
    assert len(set(texts)) == 3


def test_a_seeded_sample_gives_the_same_text_alone_and_in_a_batch(sampler):
    """Row r of a batch draws from its own generator seeded with seed + r, so each row is a sample that can be
    reproduced alone, and the first of --num-samples N is the single sample of that seed."""
    settings = SampleSettings(max_new_tokens=30, temperature=1.0, top_k=None, seed=7)
    batch = sampler.generate_many(["the", "KING:", "thou art"], settings)
    for r, prompt in enumerate(["the", "KING:", "thou art"]):
        alone = sampler.generate(prompt, SampleSettings(max_new_tokens=30, temperature=1.0, top_k=None, seed=7 + r))
        assert batch[r].token_ids == alone.token_ids, prompt
    first = next(iter(sampler.samples("the", settings, num_samples=3)))
    assert "".join(first) == batch[0].text


def test_end_of_text_stops_a_bpe_model_unless_ignored(tmp_path):
    tok = build_tokenizer("gpt2")
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=True, tie_embeddings=False
    )
    model = GPT(cfg)
    with torch.no_grad():  # every position's final features are e_0, and only eot reads e_0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eot_id, 0] = 10.0
        model.lm_head.weight[tok.encode("!")[0], 0] = 9.0
    path = tmp_path / "eot.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    s = Sampler.load(path, device="cpu")
    result = s.generate("Hi", SampleSettings(max_new_tokens=10, temperature=0.0))
    assert result.text == "" and result.stop_reason == "eot" and result.tokens == 1
    ignored = s.generate("Hi", SampleSettings(max_new_tokens=3, temperature=0.0, ignore_eot=True))
    assert ignored.tokens == 3 and ignored.stop_reason == "length"
    assert s.encode_prompt("") == ([tok.eot_id], 0)


def test_prompts_empty_and_too_long(sampler):
    assert sampler.encode_prompt("") == (sampler.tokenizer.encode("\n"), 0)
    ids, cut = sampler.encode_prompt("the king " * 10)
    assert cut == 90 - sampler.block_size and len(ids) == sampler.block_size
    with pytest.raises(NanoGPTError, match="no token for 'λ'"):
        sampler.encode_prompt("λ")


def test_repetition_penalty_changes_greedy_text(sampler):
    plain = sampler.generate("the", SampleSettings(max_new_tokens=60, temperature=0.0))
    penalized = sampler.generate("the", SampleSettings(max_new_tokens=60, temperature=0.0, repetition_penalty=5.0))
    assert plain.text != penalized.text
    # a strong penalty makes the greedy continuation use more distinct characters
    assert len(set(penalized.text)) > len(set(plain.text))


def test_sample_cli_prints_prompt_and_continuation_and_separates_samples(trained_run):
    out = runner.invoke(
        app,
        [
            "sample",
            "--checkpoint",
            str(trained_run),
            "--prompt",
            "KING:",
            "--max-new-tokens",
            "20",
            "--num-samples",
            "2",
            "--seed",
            "1",
        ],
    )
    assert out.exit_code == 0, out.output
    assert out.output.count("KING:") >= 2 and "sample 2 of 2" in out.output
    again = runner.invoke(
        app,
        [
            "sample",
            "--checkpoint",
            str(trained_run),
            "--prompt",
            "KING:",
            "--max-new-tokens",
            "20",
            "--num-samples",
            "2",
            "--seed",
            "1",
            "--no-stream",
        ],
    )
    assert again.output == out.output
    interactive = runner.invoke(
        app, ["sample", "--checkpoint", str(trained_run), "-i", "--max-new-tokens", "5"], input="the\nλ\nking\n"
    )
    assert interactive.exit_code == 0
    assert interactive.output.count("prompt> ") == 4 and "no token for 'λ'" in interactive.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--min-p", "1"], "--min-p must be in [0, 1)"),
        (["--top-k", "-1"], "--top-k must be at least 1"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--repetition-penalty", "inf"], "--repetition-penalty must be a finite number"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
        (["--prompt", "λx"], "no token for 'x' 'λ'"),
    ],
)
def test_bad_sampling_input_is_one_sentence(trained_run, args, message):
    out = runner.invoke(app, ["sample", "--checkpoint", str(trained_run), "--max-new-tokens", "3", *args])
    assert out.exit_code == 1
    assert message in out.output and "Traceback" not in out.output


def test_missing_or_invalid_checkpoints_are_one_sentence(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00not a checkpoint at all")
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(plain))
    cases = [
        (tmp_path / "missing", "does not exist"),
        (junk, "is truncated or damaged"),
        (plain, "not a nanogpt checkpoint"),
        (tmp_path, "no checkpoint in"),
    ]
    for path, message in cases:
        out = runner.invoke(app, ["sample", "--checkpoint", str(path)])
        assert out.exit_code == 1, path
        assert message in out.output and "Traceback" not in out.output


def test_top_k_0_means_no_top_k(trained_run):
    def text(*args):
        out = runner.invoke(
            app,
            [
                "sample",
                "--checkpoint",
                str(trained_run),
                "--prompt",
                "KING:",
                "--max-new-tokens",
                "40",
                "--seed",
                "2",
                "--temperature",
                "1.5",
                *args,
            ],
        )
        assert out.exit_code == 0, out.output
        return out.output

    vocab = str(len(json.loads((trained_run / "config.json").read_text())["dataset"]["tokenizer"]["chars"]))
    assert text("--top-k", "0") == text("--top-k", vocab)  # all tokens kept
    assert text("--top-k", "0") != text("--top-k", "2")


def test_prompt_with_interactive_is_the_first_prompt(trained_run):
    out = runner.invoke(
        app,
        [
            "sample",
            "--checkpoint",
            str(trained_run),
            "-i",
            "--prompt",
            "QUEEN:",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        ],
        input="KING:\n",
    )
    assert out.exit_code == 0, out.output
    first, second = out.output.split("prompt> ")[1:3]
    assert first.startswith("QUEEN:\nQUEEN:") and second.startswith("KING:")


def test_sample_separators_stay_out_of_stdout_and_json_gives_one_object_per_sample(trained_run):
    args = ["sample", "--checkpoint", str(trained_run), "--prompt", "KING:", "--max-new-tokens", "12"]
    plain = runner.invoke(app, [*args, "--num-samples", "3", "--temperature", "0"])
    assert plain.exit_code == 0, plain.output
    assert "sample" not in plain.stdout and "─" not in plain.stdout and "sample 3 of 3" in plain.stderr
    assert plain.stdout.count("KING:") == 3
    assert "tok/s" not in plain.output  # not a terminal: the text alone (--json has the speed)
    out = runner.invoke(app, [*args, "--num-samples", "3", "--temperature", "0", "--json"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["sample"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert set(r) == {"sample", "prompt", "text", "tokens", "stop_reason", "tokens_per_s"}
        assert r["prompt"] + r["text"] + "\n" in plain.stdout and r["stop_reason"] in ("length", "eot", "stop")
        assert 0 < r["tokens"] <= 12 and r["tokens_per_s"] > 0


def test_interactive_sampling_says_how_to_leave_and_leaves_on_a_new_line(trained_run):
    out = runner.invoke(app, ["sample", "--checkpoint", str(trained_run), "-i", "--max-new-tokens", "3"], input="the\n")
    assert out.exit_code == 0, out.output
    assert "Ctrl-D" in out.stderr
    assert out.stdout.endswith("prompt> \n")  # Ctrl-D at the prompt: the shell's prompt starts a line of its own


@pytest.mark.slow  # the CLI as a subprocess
def test_on_a_terminal_each_sample_shows_its_speed(trained_run):
    import os
    import re
    import select
    import subprocess
    import sys

    fd, child = os.openpty()
    cmd = [sys.executable, "-m", "nanogpt_cli", "sample", "--checkpoint", str(trained_run), "--prompt", "KING:"]
    cmd += ["--max-new-tokens", "12", "--num-samples", "2", "--ignore-eot", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    os.close(child)
    shown = b""
    try:
        while select.select([fd], [], [], 60)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child is gone
                break
            if not chunk:
                break
            shown += chunk
        assert proc.wait(timeout=60) == 0, shown
    finally:
        proc.kill()
        os.close(fd)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode()).replace("\r", "")
    speeds = re.findall(r"^\(12 tokens, [\d,]+\.\d tok/s, --max-new-tokens reached\)$", text, re.M)
    assert len(speeds) == 2, text  # one quiet line after each sample
