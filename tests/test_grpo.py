"""GRPO: group advantages, the clipped loss, rewards (built-in, a user's, one that raises), a "contains token X"
reward that a tiny model learns, the engine's batched rollouts, exact resume and the CLI."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from nanogpt_cli.api import engine_rollout
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.lora import LoRAConfig
from nanogpt_cli.model import GPT
from nanogpt_cli.training.finetune import plan_finetune
from nanogpt_cli.training.grpo import (
    GRPO,
    call_reward,
    exact_reward,
    group_advantages,
    grpo_loss,
    load_reward,
)
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import Trainer
from conftest import tiny_config, tiny_plan


def test_advantages_are_zero_for_a_group_of_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    a = group_advantages(rewards, 4)
    assert torch.equal(a[:4], torch.zeros(4))
    assert a[4:].sum().abs() < 1e-6 and a[5] > 0 > a[4]
    std = (4 * 0.25 / 3) ** 0.5  # the group's standard deviation (unbiased): mean 0.5, deviations 0.5
    torch.testing.assert_close(a[4:], torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (std + 1e-4))


def test_clipped_ratio_and_kl():
    logp = torch.log(torch.tensor([[0.5, 0.9]]))
    old = torch.log(torch.tensor([[0.25, 0.9]]))  # ratio 2 on the first token, 1 on the second
    mask = torch.ones(1, 2)
    loss, kl = grpo_loss(logp, old, None, torch.tensor([1.0]), mask, clip=0.2, kl=0.0)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)  # the positive advantage's gain stops at 1 + eps
    loss, _ = grpo_loss(logp, old, None, torch.tensor([-1.0]), mask, clip=0.2, kl=0.0)
    assert loss.item() == pytest.approx((2.0 + 1.0) / 2)  # a negative one is not clipped from below
    loss, kl = grpo_loss(logp, logp, logp, torch.tensor([0.0]), mask, clip=0.2, kl=0.1)
    assert kl.item() == 0.0 and loss.item() == 0.0  # the policy is the reference: no penalty
    ref = torch.log(torch.tensor([[0.25, 0.9]]))
    _, kl = grpo_loss(logp, logp, ref, torch.tensor([0.0]), mask, clip=0.2, kl=0.1)
    assert kl.item() == pytest.approx((0.5 - torch.log(torch.tensor(0.5)).item() - 1) / 2)


def test_exact_reward_compares_the_final_number_or_the_text():
    assert exact_reward("q", " it is 1,234", {"answer": "1234"}) == 1.0
    assert exact_reward("q", " 5 then 6", {"answer": "5"}) == 0.0
    assert exact_reward("q", " cba ", {"answer": "cba"}) == 1.0
    with pytest.raises(NanoGPTError, match="'answer'"):
        exact_reward("q", "1", {})


def test_user_reward_is_loaded_and_called_with_the_documented_arguments(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "calls = []\n"
        "def score(prompt, completion, row):\n"
        "    calls.append((prompt, completion, row))\n"
        "    return len(completion)\n"
        "def broken(prompt, completion, row):\n"
        "    raise KeyError('label')\n"
    )
    monkeypatch.chdir(tmp_path)
    score = load_reward("my_rewards:score")
    assert call_reward(score, "user: hi", " abc", {"prompt": "hi", "answer": "x"}) == 4.0
    assert sys.modules["my_rewards"].calls == [("user: hi", " abc", {"prompt": "hi", "answer": "x"})]
    with pytest.raises(NanoGPTError) as e:
        call_reward(load_reward("my_rewards:broken"), "p", "c", {})
    assert str(e.value) == "the reward my_rewards:broken raised KeyError: 'label'"
    with pytest.raises(NanoGPTError, match="has no function nothing"):
        load_reward("my_rewards:nothing")
    with pytest.raises(NanoGPTError, match="neither exact nor module:function"):
        load_reward("my_rewards")


def test_engine_rollout_decodes_a_batch_reproducibly():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3]]
    a = engine_rollout(model, prompts, 5, 1.0, torch.Generator().manual_seed(3))
    b = engine_rollout(model, prompts, 5, 1.0, torch.Generator().manual_seed(3))
    assert a == b and [len(r) for r in a] == [5, 5, 5]
    greedy = engine_rollout(model, prompts, 4, 0.0, torch.Generator())
    assert greedy[0] == greedy[2]
    stop = greedy[0][1]
    cut = engine_rollout(model, prompts[:1], 4, 0.0, torch.Generator(), stop_ids=[stop])
    assert cut[0][-1] == stop and len(cut[0]) <= 2


X = "x"  # the token the reward asks for: its byte


@pytest.fixture(scope="module")
def prompt_data(tmp_path_factory):
    """Prompts of a byte dataset, and a tiny base trained on text without many x's."""
    from nanogpt_cli.data.preference import prepare_rows

    root = tmp_path_factory.mktemp("grpo")
    rows = [{"prompt": f"say {w}:", "answer": w} for w in ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")]
    (root / "prompts.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    prepare_rows(str(root / "prompts.jsonl"), "prompts", kind="prompts", tokenizer="byte", data_dir=str(root / "data"),
                 val_fraction=0.25)  # fmt: skip
    (root / "rewards.py").write_text(f"def has_x(prompt, completion, row):\n    return float({X!r} in completion)\n")
    from nanogpt_cli.data import prepare

    (root / "text.txt").write_text("say ab: ax. say cd: cd. say ef: xf. say gh: gh. " * 100)  # x now and then
    prepare(str(root / "text.txt"), "text", tokenizer="byte", data_dir=root / "data")
    base = root / "base"
    Trainer(tiny_plan(root / "data", "text", base, max_iters=10, eval_interval=10, eval_iters=1, block_size=32)).fit()
    return root


def grpo_job(root, out, lora=None, resume=False, **flags):
    values = dict(data="prompts", data_dir=str(root / "data"), dtype="float32", device="cpu", max_iters=6)
    values.update(eval_interval=3, batch_size=4, warmup_iters=0, learning_rate=1e-2, log_interval=1)
    values.update(flags)
    return plan_finetune(
        RunRequest(values, out=out, init_from=None if resume else str(root / "base"), resume=resume), lora=lora
    )


def x_share(model, rows, n=256) -> float:
    """The share of sampled completion tokens that are X."""
    prompts = [r["ids"] for r in rows for _ in range(n // len(rows))]
    out = engine_rollout(model, prompts, 6, 1.0, torch.Generator().manual_seed(123))
    tokens = [t for row in out for t in row]
    return sum(t == ord(X) for t in tokens) / len(tokens)


def test_a_contains_x_reward_makes_the_model_emit_x_more(prompt_data, tmp_path, monkeypatch):
    monkeypatch.chdir(prompt_data)  # the reward module is imported from here
    given = {"reward": "rewards:has_x", "group_size": 8, "max_new_tokens": 6, "kl": 0.01}
    records = []
    run = GRPO(grpo_job(prompt_data, tmp_path / "run", max_iters=20), engine_rollout, given, records.append)
    rows = run.rows["train"]
    before = x_share(_base(prompt_data), rows)
    result = run.fit()
    after = x_share(run.run.model.eval(), rows)
    assert after > before + 0.1, (before, after)
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["reward"] > train[0]["reward"]
    assert {"reward", "reward_std", "kl", "length", "length_max"} <= set(train[0])
    assert result.val_reward is not None


def _base(root):
    from nanogpt_cli.interop.loading import load_model

    return load_model(str(root / "base"))[0].eval()


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4)], ids=["full", "lora"])
def test_grpo_resume_continues_exactly(prompt_data, tmp_path, monkeypatch, lora):
    monkeypatch.chdir(prompt_data)
    given = {"reward": "rewards:has_x", "group_size": 4, "max_new_tokens": 4}
    whole = []
    GRPO(grpo_job(prompt_data, tmp_path / "a", lora=lora), engine_rollout, given, whole.append).fit()
    part = []
    GRPO(grpo_job(prompt_data, tmp_path / "b", lora=lora, stop_at=3), engine_rollout, given, part.append).fit()
    GRPO(grpo_job(prompt_data, tmp_path / "b", resume=True), engine_rollout, {}, part.append).fit()
    key = ["loss", "reward", "kl", "length"]
    assert [[r[k] for k in key] for r in part if r["kind"] == "train"] == [
        [r[k] for k in key] for r in whole if r["kind"] == "train"
    ]


def test_a_raising_reward_stops_the_run_with_one_sentence(prompt_data, tmp_path, monkeypatch):
    monkeypatch.chdir(prompt_data)
    (tmp_path / "bad_reward.py").write_text("def score(prompt, completion, row):\n    return row['missing']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = GRPO(grpo_job(prompt_data, tmp_path / "run"), engine_rollout, {"reward": "bad_reward:score"})
    with pytest.raises(NanoGPTError, match=r"^the reward bad_reward:score raised KeyError: 'missing'$"):
        run.fit()


def test_grpo_refuses_seq_len_it_scores_each_completion_whole(prompt_data, tmp_path):
    with pytest.raises(NanoGPTError, match=r"^--seq-len has no effect with --method grpo, .*; drop it$"):
        grpo_job(prompt_data, tmp_path / "x", seq_len=16)


def test_cli_prepare_prompts_and_finetune_grpo(prompt_data, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from nanogpt_cli.cli.app import app

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"n {w}", "answer": str(len(w))} for w in ("ab", "abc", "abcd", "a")]
    (tmp_path / "rows.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n{}\n")
    runner = CliRunner()
    args = ["prepare", "rows.jsonl", "--name", "c", "--format", "prompts", "--tokenizer", "byte"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "skipped line 5: the row has neither 'prompt' nor 'messages'" in r.output and "4 prompts" in r.output
    args = ["finetune", "--method", "grpo", "--init-from", str(prompt_data / "base"), "--data", "c", "--lora"]
    args += ["--max-iters", "2", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4", "--out", "run"]
    r = runner.invoke(app, [*args, "--dtype", "float32", "--log-interval", "1"])
    assert r.exit_code == 0, r.output
    # train's display: start lines, progress lines, evaluation lines and the closing table
    lines = r.output.splitlines()
    assert any(line.startswith("fine-tune: GRPO, LoRA r 8, alpha 16 on attn.c_attn; ") for line in lines)
    assert "batch: 2 prompts x 2 completions per step, up to 4 new tokens" in r.output
    assert "training from step 0 of 2 on cpu (float32) -> run" in r.output
    assert [line.split(" | ")[0] for line in lines if " | loss " in line] == ["step 1/2", "step 2/2"]
    assert any(line.startswith("step 2: val reward ") and "checkpoint saved" in line for line in lines)
    assert "grpo run run" in r.output and "best val reward" in r.output and "ms/iter" in r.output
    assert "reward_std" not in r.output  # the metrics file's raw records stay in the file
    report = (tmp_path / "run" / "report.md").read_text()
    assert "finished at step 2." in report and "| val reward (greedy) | " in report and "| best val reward | " in report
    assert "| train KL to the reference | " in report and "bits per byte" not in report


def test_a_chat_rows_reply_is_its_answer():
    from nanogpt_cli.data.preference import read_rows

    chat = {"messages": [{"role": "user", "content": "count ab"}, {"role": "assistant", "content": "2"}], "id": 7}
    rows, bad = read_rows(
        [json.dumps(chat), json.dumps({"messages": [{"role": "assistant", "content": "2"}]})], "prompts"
    )
    assert rows == [({"answer": "2", "id": 7, "prompt": [{"role": "user", "content": "count ab"}]}, 1)]
    assert bad == [(2, "the conversation has no prompt before its assistant turn")]


@pytest.mark.slow
def test_sigterm_during_a_rollout_stops_at_once_saves_the_steps_trained_and_resumes(prompt_data, tmp_path, monkeypatch):
    import os
    import signal
    import subprocess
    import sys
    import time

    # a reward that takes its time (REWARD_SLEEP s a completion) and notes each call: a step's rollout is long
    calls = tmp_path / "calls.txt"
    (tmp_path / "slow_reward.py").write_text(
        "import os, time\n"
        "def score(prompt, completion, row):\n"
        f"    open({str(calls)!r}, 'a').write('.')\n"
        "    time.sleep(float(os.environ.get('REWARD_SLEEP', '0')))\n"
        "    return float('x' in completion)\n"
    )
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "nanogpt_cli",
        "finetune",
        "--method",
        "grpo",
        "--init-from",
        str(prompt_data / "base"),
    ]
    cmd += ["--data", "prompts", "--data-dir", str(prompt_data / "data"), "--lora", "--max-iters", "50"]
    cmd += ["--batch-size", "2", "--group-size", "4", "--max-new-tokens", "4", "--reward", "slow_reward:score"]
    cmd += ["--eval-interval", "100", "--no-eval-first", "--dtype", "float32", "--device", "cpu", "--out", str(run)]
    env = {**os.environ, "REWARD_SLEEP": "0.3"}  # 8 completions a step: 2.4 s of rewards
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (calls.is_file() and len(calls.read_text()) >= 10):  # step 1 done, step 2's rollout under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert took < 15, f"{took:.1f} s to stop"
    assert len(calls.read_text()) < 16  # step 2's rollout was dropped, not finished
    assert f"stopped by SIGTERM after step 1; resume with: nanogpt finetune --method grpo --out {run} --resume" in (
        " ".join(err.split())
    )
    assert "step 1: checkpoint saved" in " ".join(out.split()) and "grpo run" in out
    assert json.loads((run / "trainer.json").read_text())["step"] == 1
    report = (run / "report.md").read_text()  # written at once: no samples after a signal
    assert "stopped early (SIGTERM) at step 1." in report and "the run was stopped by a signal" in report
    monkeypatch.chdir(tmp_path)
    result = GRPO(grpo_job(prompt_data, run, resume=True, max_iters=2), engine_rollout).fit()
    assert result.step == 2 and result.stopped is None
