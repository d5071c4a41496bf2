"""nanogpt inspect: the explicit attention path against the model's forward, the head probes on heads built or
trained to do one thing, the figures' files and sizes, and the JSON round trips, through the library and the CLI."""

from __future__ import annotations

import itertools
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import MLP, GPTConfig, Norm, PosEncoding
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inspect import (
    AttentionMaps,
    HeadReport,
    attention_forward,
    attention_maps,
    position_views,
    score_heads,
)
from nanogpt_cli.interop.loading import InferenceModel, load_for_inference
from nanogpt_cli.model import GPT
from nanogpt_cli.tokenizer import build_tokenizer

POS_ENCODINGS = tuple(p.value for p in PosEncoding)
NORMS = tuple(n.value for n in Norm)
MLPS = tuple(m.value for m in MLP)

runner = CliRunner()
PROMPT = "The king hath\nthee, good lord."
INDUCTION_STEPS = 500  # seed 0 learns the task (loss from ln(32) to below 1.5) within them; ~45 ms a step


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def ok(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def loaded_model(model: GPT, vocab: str = "abcdefghijklmnop") -> InferenceModel:
    """A model built in the test, with a char tokenizer, as load_for_inference returns one."""
    return InferenceModel(model.eval(), build_tokenizer("char", [vocab]), {}, torch.device("cpu"), torch.float32)


# --- the explicit path ---


def test_explicit_attention_path_computes_the_models_own_logits_for_every_kind_of_block():
    """Every position scheme x norm x MLP x QK-norm x bias, the soft-cap on in every other one: the explicit kernel's
    logits are the usual kernel's, and its probabilities are causal distributions."""
    worst = {}
    on_off = (False, True)
    combos = itertools.product(POS_ENCODINGS, NORMS, ("gelu", "swiglu", "relu2"), on_off, on_off)
    for i, (pos, norm, mlp, qk_norm, bias) in enumerate(combos):
        mlp = "gelu_tanh" if mlp == "gelu" and (i // 4) % 2 else mlp
        mlp = "geglu" if mlp == "swiglu" and (i // 4) % 2 else mlp  # the two gated MLPs in turn
        cap = 8.0 if i % 2 else None
        torch.manual_seed(i)
        config = GPTConfig(
            vocab_size=37,
            block_size=12,
            n_layer=2,
            n_head=2,
            n_embd=16,
            pos_encoding=pos,
            norm=norm,
            mlp=mlp,
            qk_norm=qk_norm,
            logit_softcap=cap,
            bias=bias,
        )
        model = GPT(config).eval()
        with torch.no_grad():  # weights large enough that the attention is far from uniform and logits are O(1)
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        idx = torch.randint(37, (2, 12))
        with torch.no_grad():
            expected, _ = model(idx)  # the fused kernel, no cache
        logits, probs = attention_forward(model, idx)
        assert probs.shape == (2, 2, 2, 12, 12)
        assert torch.allclose(probs.sum(-1), torch.ones(2, 2, 2, 12), atol=1e-5)
        assert (probs.triu(diagonal=1) == 0).all()
        assert expected.abs().max() > 0.5  # logits that are not all near zero, so the comparison means something
        worst[(pos, norm, mlp, qk_norm, cap, bias)] = (logits - expected).abs().max().item()
    bad = {k: v for k, v in worst.items() if v > 1e-5}
    assert not bad, f"explicit path differs from forward: {bad}"
    assert {k[1] for k in worst} == set(NORMS) and {k[2] for k in worst} == set(MLPS) and len(worst) == 72


def test_every_attention_map_is_a_causal_distribution(trained_run):
    loaded = load_for_inference(trained_run, device="cpu", dtype="float32")
    maps = attention_maps(loaded, PROMPT)
    L, nh, T, _ = maps.probs.shape
    assert (L, nh, T) == (2, 2, len(PROMPT))
    assert torch.allclose(maps.probs.sum(-1), torch.ones(L, nh, T), atol=1e-6)
    above = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    assert (maps.probs[..., above] == 0).all()  # exact zeros: the future is masked before the softmax
    assert (maps.probs[..., ~above] >= 0).all()
    assert maps.tokens == list(PROMPT) and maps.ids == loaded.tokenizer.encode(PROMPT)


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens(trained_run):
    loaded = load_for_inference(trained_run, device="cpu", dtype="float32")
    text = PROMPT * 3  # 3 x 31 characters; the context is 32
    maps = attention_maps(loaded, text)
    assert maps.cut == len(text) - 32 and "".join(maps.tokens) == text[-32:]


# --- the head probes ---


def one_hot_positions(n_head: int = 2) -> GPT:
    """One layer, learned positions that are one-hot (position p is e_p), token embeddings zero and RMSNorm without
    a gain to spoil it: every head's q and k are then whatever its c_attn rows make of the position alone."""
    T = 16
    model = GPT(
        GPTConfig(
            vocab_size=16,
            block_size=T,
            n_layer=1,
            n_head=n_head,
            n_embd=T * n_head,
            norm="rmsnorm",
            pos_encoding="learned",
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wpe.weight[:, :T] = torch.eye(T)
        for norm in (model.transformer.h[0].ln_1, model.transformer.h[0].ln_2, model.transformer.ln_f):
            norm.weight.fill_(1.0)
    return model


def test_a_head_built_to_copy_the_previous_token_is_labelled_previous_token():
    model = one_hot_positions()
    T, C = 16, 32
    shift = torch.diag(torch.ones(T - 1), diagonal=1)  # shift @ e_i = e_(i-1): the query of i is the key of i-1
    with torch.no_grad():
        w = model.transformer.h[0].attn.c_attn.weight  # (3C, C): q rows, then k rows, then v rows
        w[:T, :T] = 10 * shift  # head 0's query; head 1 keeps zeros: uniform attention
        w[C : C + T, :T] = torch.eye(T)  # head 0's key
    report = score_heads(loaded_model(model), length=8)
    prev, other = report.heads
    assert prev.label == "previous-token" and prev.previous_token > 0.99
    assert prev.mean_distance == pytest.approx(1.0, abs=0.01)
    # head 1 attends evenly, so it scores exactly what uniform attention does, and is mixed
    assert other.label == "mixed"
    for score in ("previous_token", "first_token", "mean_distance", "induction"):
        assert getattr(other, score) == pytest.approx(getattr(report.baseline, score), rel=1e-4)


def test_a_head_built_to_attend_to_the_first_token_is_labelled_sink():
    model = one_hot_positions(n_head=1)
    T = 16
    with torch.no_grad():
        w = model.transformer.h[0].attn.c_attn.weight
        w[0, :T] = 10.0  # every position's query is 40 e_0 (RMSNorm scales e_p by 4)
        w[T, 0] = 1.0  # only position 0 has a key along it
    (head,) = score_heads(loaded_model(model), length=8).heads
    assert head.label == "sink" and head.first_token > 0.99


def test_a_head_that_attends_to_itself_is_local():
    model = one_hot_positions(n_head=1)
    T = 16
    with torch.no_grad():
        w = model.transformer.h[0].attn.c_attn.weight
        w[:T, :T] = 1.5 * torch.eye(T)  # q.k = 4 * 1.5 * 4 / sqrt(16) = 6 on itself, 0 elsewhere: ~98% on itself
        w[T : 2 * T, :T] = torch.eye(T)
    (head,) = score_heads(loaded_model(model), length=8).heads
    assert head.previous_token < 0.4 and head.label == "local"


def repeated_stretch(g: torch.Generator, vocab: int, T: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens in which a random stretch of n tokens (4 <= n <= T/2) is followed at once by a copy of itself,
    at a random place; the targets are the copy's tokens after its first, which only an induction head can
    predict. The stretch's length changes from row to row, so no head that looks a fixed distance back can."""
    x = torch.randint(vocab, (rows, T), generator=g)
    y = torch.full((rows, T), -1)
    for r in range(rows):
        n = int(torch.randint(4, T // 2 + 1, (1,), generator=g))
        a = int(torch.randint(0, T - 2 * n + 1, (1,), generator=g))
        x[r, a + n : a + 2 * n] = x[r, a : a + n]
        y[r, a + n : a + 2 * n - 1] = x[r, a + n + 1 : a + 2 * n]  # position i predicts token i + 1
    return x, y


@pytest.mark.slow
def test_a_two_layer_model_trained_on_repeated_sequences_grows_an_induction_head_in_its_second_layer():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs ~10x slower on two threads of a busy machine than on one
    try:
        report = train_on_repeated_stretches()
    finally:
        torch.set_num_threads(threads)
    baseline = report.baseline.induction  # ~0.07: uniform attention over 10..19 tokens
    first = max(h.induction for h in report.heads if h.layer == 0)
    second = max(report.heads[2:], key=lambda h: h.induction)
    assert second.induction > 5 * baseline and second.label == "induction", report.heads
    # the first layer cannot look up what followed an earlier token by itself: it stays near the baseline
    assert first < 2 * baseline, report.heads


def train_on_repeated_stretches() -> HeadReport:
    torch.manual_seed(0)
    vocab, T = 32, 24
    model = GPT(GPTConfig(vocab_size=vocab, block_size=T, n_layer=2, n_head=2, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(INDUCTION_STEPS):
        x, y = repeated_stretch(g, vocab, T, rows=64)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 1.5, f"the task was not learned in {INDUCTION_STEPS} steps (loss {loss.item():.2f})"
    return score_heads(loaded_model(model, vocab="".join(chr(65 + i) for i in range(vocab))), length=10)


def test_score_heads_refuses_a_probe_that_does_not_fit():
    with pytest.raises(NanoGPTError, match="--length must be between 2 and half the context"):
        score_heads(loaded_model(one_hot_positions()), length=9)


# --- positions ---


@pytest.mark.parametrize("pos", POS_ENCODINGS)
def test_position_views_describe_the_scheme(pos):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=20, n_layer=1, n_head=2, n_embd=16, pos_encoding=pos)).eval()
    views = position_views(model)
    assert views.kind == pos and pos in views.summary.lower().replace("rope", "rope")
    if pos == "rope":
        assert views.wavelengths.shape == (4,) and views.wavelengths[0] == pytest.approx(2 * torch.pi)
        assert views.decay[0] == pytest.approx(1.0) and views.decay.abs().max() <= 1.0 + 1e-6
        assert views.similarity is None
    else:
        assert views.table.shape == (20, 16) and views.similarity.shape == (20, 20)
        assert torch.allclose(views.similarity.diagonal(), torch.ones(20), atol=1e-5)
    if pos == "sinusoidal":  # the sinusoidal table's similarity depends only on the distance between positions
        sim = views.similarity
        assert torch.allclose(sim.diagonal(3), sim.diagonal(3)[0].expand(17), atol=1e-5)


# --- the commands ---


@pytest.mark.slow
def test_attention_command_writes_the_grid_and_one_head_at_the_sizes_asked(trained_run, tmp_path):
    grid, one = tmp_path / "grid.png", tmp_path / "pics" / "one.png"
    out = ok("inspect", "attention", trained_run, "--prompt", PROMPT, "--out", grid, "--size", "900x700")
    assert f"wrote {grid}" in out
    assert png_size(grid) == (900, 700)
    ok(
        "inspect",
        "attention",
        trained_run,
        "--prompt",
        PROMPT,
        "--out",
        one,
        "--layer",
        "1",
        "--head",
        "0",
        "--size",
        "640x480",
    )
    assert png_size(one) == (640, 480) and one.stat().st_size > 5000
    default = tmp_path / "default.png"
    ok("inspect", "attention", trained_run, "--prompt", PROMPT, "--out", default)
    w, h = png_size(default)
    assert w > 500 and h > 500 and default.stat().st_size > 20_000


def test_attention_json_round_trips_to_the_librarys_maps(trained_run, tmp_path):
    out = ok("inspect", "attention", trained_run, "--prompt", PROMPT, "--json")
    printed = json.loads(out)
    assert not (Path.cwd() / "attention.png").exists() or printed  # --json alone draws nothing
    maps = AttentionMaps.from_dict(printed)
    expected = attention_maps(load_for_inference(trained_run, device="cpu", dtype="float32"), PROMPT)
    assert maps.tokens == expected.tokens and maps.ids == expected.ids
    assert torch.equal(maps.probs, expected.probs)  # float32 -> JSON -> float32 is exact
    assert AttentionMaps.from_dict(json.loads(json.dumps(maps.to_dict()))).to_dict() == printed
    assert printed["n_layer"] == 2 and printed["n_head"] == 2 and printed["name"] == f"{trained_run.name} (step 60)"


def test_heads_command_prints_the_table_json_and_plot(trained_run, tmp_path):
    plot = tmp_path / "heads.png"
    out = ok("inspect", "heads", trained_run, "--out", plot, "--size", "1000x640")
    for word in ("prev-token", "induction", "uniform", f"wrote {plot}"):
        assert word in out
    assert png_size(plot) == (1000, 640)
    old_name = runner.invoke(app, ["inspect", "heads", str(trained_run), "--plot", str(tmp_path / "old.png")])
    assert old_name.exit_code == 0 and "--plot is deprecated" in old_name.output and (tmp_path / "old.png").is_file()
    printed = json.loads(ok("inspect", "heads", trained_run, "--json", "--seed", "3"))
    report = HeadReport.from_dict(printed)
    assert report.to_dict() == printed and len(report.heads) == 4 and report.probe["seed"] == 3
    assert {h.label for h in report.heads} <= {"previous-token", "induction", "sink", "local", "mixed"}
    again = score_heads(load_for_inference(trained_run, device="cpu", dtype="float32"), seed=3)
    assert [h.induction for h in again.heads] == [h.induction for h in report.heads]


def test_positions_command_draws_the_scheme(trained_run, tmp_path):
    out = ok("inspect", "positions", trained_run, "--out", tmp_path / "pos.png", "--size", "1200x400")
    assert "RoPE" in out and png_size(tmp_path / "pos.png") == (1200, 400)


def test_inspect_reads_a_hugging_face_export_as_it_reads_the_run(trained_run, tmp_path):
    pytest.importorskip("transformers")
    ok("export", trained_run, "--out", tmp_path / "hf")
    from_run = json.loads(ok("inspect", "heads", trained_run, "--json"))
    from_hf = json.loads(ok("inspect", "heads", tmp_path / "hf", "--json"))
    for a, b in zip(from_run["heads"], from_hf["heads"]):
        assert a["label"] == b["label"] and a["induction"] == pytest.approx(b["induction"], abs=1e-4)
    maps = json.loads(ok("inspect", "attention", tmp_path / "hf", "--prompt", PROMPT, "--json"))
    assert maps["tokens"] == list(PROMPT) and maps["name"] == "hf"
    ok("inspect", "positions", tmp_path / "hf", "--out", tmp_path / "pos.png")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layer", "2"], "--layer must be between 0 and 1 (the model has 2 layers), got 2"),
        (["--head", "-1"], "--head must be between 0 and 1"),
        (["--size", "big"], "--size must be WIDTHxHEIGHT in pixels"),
        (["--out", "pic.bmpx"], "cannot write"),
    ],
)
def test_attention_refuses_bad_input_in_one_line(trained_run, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["inspect", "attention", str(trained_run), "--prompt", PROMPT, *args])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    assert not any(tmp_path.iterdir())  # nothing written


def test_attention_needs_a_prompt_and_matplotlib(trained_run, tmp_path, monkeypatch):
    result = runner.invoke(app, ["inspect", "attention", str(trained_run)])
    assert result.exit_code == 1 and "give the text to look at with --prompt or --prompt-file" in result.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = runner.invoke(
        app, ["inspect", "attention", str(trained_run), "--prompt", "The", "--out", str(tmp_path / "a.png")]
    )
    assert result.exit_code == 1 and 'needs the matplotlib package: pip install -e ".[plot]"' in result.output
