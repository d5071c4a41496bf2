"""Group relative policy optimisation: learn from rewards on the model's own completions.

    GRPO(plan_finetune(RunRequest({"data": "count-prompts", ...}, init_from=...)), rollout=engine_rollout).fit()

Shao et al. (2024), "DeepSeekMath", section 4.1. Each update draws --batch-size prompts, decodes --group-size
completions of each (rollout: a callable that decodes in batches; the engine's in api.engine_rollout, passed in
because training does not import inference), scores them with the reward, and normalises each reward within its
group: A = (r - mean) / (std + 1e-4), so a group whose completions all score the same teaches nothing. The loss,
per completion token and averaged per completion, then over completions:

    -(min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) - kl * KL),   ratio = pi / pi_old
    KL = ref / pi - log(ref / pi) - 1   (the unbiased, always positive estimator of the paper's eq. 4)

pi_old is the policy that decoded the completions; with --grpo-updates 1 (one update per batch, the default)
the ratio is 1 and the clip only starts to matter from a second update on the same batch. The reference is the
start model: LoRA's base with the adapters off, or a frozen copy of the start weights in a full fine-tune.

A reward is `exact` (the row's "answer" against the last number of the completion when the answer is a number,
else against the whole completion, stripped), or --reward module:function, called as
function(prompt, completion, row) with the prompt and completion texts and the prepared row (a dict: "prompt"
and every other field of the line), returning a float.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanogpt_cli.data.preference import read_split
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import tokenizer_from_description
from nanogpt_cli.training.events import Display
from nanogpt_cli.training.policy import Log, PolicyRun, adapters_off, check_format, pad_batch, sequence_logprobs
from nanogpt_cli.training.signals import Interrupted

# (model, prompts' token ids, max_new_tokens, temperature, generator, stop_ids) -> each prompt's new token ids
Rollout = Callable[[Any, Sequence[Sequence[int]], int, float, torch.Generator, Sequence[int]], list[list[int]]]
Reward = Callable[[Any, str, dict], float]
DEFAULTS = {
    "group_size": 8,
    "kl": 0.02,
    "clip": 0.2,
    "max_new_tokens": 32,
    "rollout_temperature": 1.0,
    "grpo_updates": 1,
    "reward": "exact",
}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def exact_reward(prompt: Any, completion: str, row: dict) -> float:
    """1.0 when the completion's final answer is the row's "answer", else 0.0 (see the module's docstring)."""
    if "answer" not in row:
        raise NanoGPTError("the exact reward needs an 'answer' field in every row (or a chat row's reply)")
    answer = str(row["answer"]).strip()
    if NUMBER.fullmatch(answer):
        found = NUMBER.findall(completion)
        return float(bool(found) and found[-1].replace(",", "") == answer.replace(",", ""))
    return float(completion.strip() == answer)


def load_reward(name: str) -> Reward:
    """`exact`, or module:function importable from here (the current folder is on the path)."""
    if name == "exact":
        return exact_reward
    module, _, function = name.partition(":")
    if not module or not function:
        raise NanoGPTError(f"--reward {name!r} is neither exact nor module:function")
    import sys

    sys.path.insert(0, str(Path.cwd()))
    try:
        found = getattr(importlib.import_module(module), function, None)
    except ImportError as e:
        raise NanoGPTError(f"--reward {name}: cannot import {module} ({e})") from None
    finally:
        sys.path.remove(str(Path.cwd()))
    if not callable(found):
        raise NanoGPTError(f"--reward {name}: {module} has no function {function}")
    return found


def call_reward(reward: Reward, prompt: Any, completion: str, row: dict) -> float:
    """The reward as a float; a reward that raises or returns something else is one sentence naming it."""
    name = f"{getattr(reward, '__module__', '?')}:{getattr(reward, '__qualname__', reward)}"
    try:
        value = reward(prompt, completion, row)
    except NanoGPTError:
        raise
    except Exception as e:
        raise NanoGPTError(f"the reward {name} raised {type(e).__name__}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NanoGPTError(f"the reward {name} returned {type(value).__name__}, not a float")
    return float(value)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each reward minus its group's mean, over the group's standard deviation (+1e-4): (N,) -> (N,), N rewards in
    groups of group_size consecutive ones. Equal rewards in a group give 0."""
    g = rewards.view(-1, group_size)  # (prompts, group_size)
    std = g.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
    return ((g - g.mean(dim=1, keepdim=True)) / (std + 1e-4)).view(-1)


def grpo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
    mask: torch.Tensor, clip: float, kl: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The loss (a scalar) and the mean KL to the reference, from per-token log-probabilities (B, T), the
    completions' advantages (B,) and the completion mask (B, T)."""
    ratio = torch.exp(logp - old_logp)  # (B, T)
    a = advantages.unsqueeze(1)  # (B, 1)
    objective = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)  # (B, T)
    per_token_kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = ref_logp - logp
        per_token_kl = torch.exp(d) - d - 1
    per_token = -(objective - kl * per_token_kl)
    lengths = mask.sum(1).clamp(min=1)
    loss = ((per_token * mask).sum(1) / lengths).mean()
    return loss, ((per_token_kl * mask).sum(1) / lengths).mean().detach()


def cut_at_stop(tok, ids: list[int], stops: Sequence[str], eot_id: int | None) -> tuple[list[int], str]:
    """The completion up to and including the token that finishes a stop text (or the end-of-text token), and
    its text before the stop."""
    for k in range(1, len(ids) + 1):
        if eot_id is not None and ids[k - 1] == eot_id:
            return ids[:k], tok.decode(ids[: k - 1])
        text = tok.decode(ids[:k])
        for stop in stops:
            if stop and stop in text:
                return ids[:k], text[: text.index(stop)]
    return ids, tok.decode(ids)


@dataclass
class GRPOResult:
    run_dir: Path
    step: int
    val_reward: float | None  # the val prompts' mean reward of the greedy completion, at the last evaluation
    stopped: str | None = None  # None: finished; "max_time" (the clock), "stop_at", "SIGINT", "SIGTERM"
    best_val_reward: float | None = None
    elapsed_s: float = 0.0  # this invocation's wall time, evaluations and saves included
    ms_per_iter: float = 0.0  # the updates' own time (rollouts included), evaluations and saves left out
    tokens_per_s: float = 0.0  # the completion tokens the updates trained on


class GRPO:
    """A GRPO run over a prepared prompts dataset (see the module's docstring)."""

    def __init__(
        self,
        job,
        rollout: Rollout,
        given: dict[str, Any] | None = None,
        log: Log | None = None,
        display: Display | None = None,
    ):
        self.run = PolicyRun(job, "grpo", DEFAULTS, given or {}, log, display)
        dataset = self.run.plan.dataset
        check_format(dataset, "grpo", "prompts")
        s = self.run.settings
        for name in ("group_size", "max_new_tokens", "grpo_updates"):
            if not int(s[name]) >= 1:
                raise NanoGPTError(f"--{name.replace('_', '-')} must be at least 1, got {s[name]}")
        if s["kl"] < 0 or s["rollout_temperature"] <= 0:
            raise NanoGPTError("--kl must be at least 0 and --rollout-temperature above 0")
        self.rollout, self.reward = rollout, load_reward(s["reward"])
        cfg = self.run.cfg
        self.rows = {split: read_split(cfg.data_dir, cfg.data, split) for split in ("train", "val")}
        self.tok = tokenizer_from_description(dataset["tokenizer"])
        self.stops, self.eot_id = dataset.get("stop") or [], dataset.get("eot_id")

    def complete(self, model, rows: list[dict], n: int, temperature: float, generator) -> list[dict]:
        """n completions of each row, decoded in one batch: their ids (cut at the stop), texts and rewards."""
        prompts = [r["ids"] for r in rows for _ in range(n)]
        limit = min(int(self.run.settings["max_new_tokens"]), model.config.block_size - max(map(len, prompts)))
        if limit < 1:
            raise NanoGPTError(f"a prompt fills the model's context of {model.config.block_size:,} tokens")
        model.eval()
        stop_ids = [self.eot_id] if self.eot_id is not None else []
        new = self.rollout(model, prompts, limit, temperature, generator, stop_ids)
        model.train()
        out = []
        for i, ids in enumerate(new):
            row = rows[i // n]
            ids, text = cut_at_stop(self.tok, list(ids), self.stops, self.eot_id)
            reward = call_reward(self.reward, self.tok.decode(row["ids"]), text, row["row"])
            out.append({"prompt": row["ids"], "ids": ids, "text": text, "reward": reward})
        return out

    def policy_logprobs(self, model, done: list[dict]):
        seqs = [d["prompt"] + d["ids"] for d in done]
        masks = [[0] * len(d["prompt"]) + [1] * len(d["ids"]) for d in done]
        x, y, m = pad_batch(seqs, masks, model.config.block_size, self.run.device)
        return x, y, m

    def train_step(self, model, reference) -> dict[str, float]:
        run, cfg, s = self.run, self.run.cfg, self.run.settings
        # the step's prompts and sampling from the seed and the step alone: a resume decodes the same ones
        rng = random.Random(cfg.seed * 1_000_003 + run.state.step)
        rows = [self.rows["train"][rng.randrange(len(self.rows["train"]))] for _ in range(cfg.batch_size)]
        generator = torch.Generator(run.device).manual_seed(cfg.seed * 1_000_003 + run.state.step)
        # the rollout and the scoring read the weights only: a signal drops them (the step is drawn again on resume)
        with run.signals.interruptible():
            try:
                done = self.complete(model, rows, int(s["group_size"]), float(s["rollout_temperature"]), generator)
            finally:
                model.train()
            rewards = torch.tensor([d["reward"] for d in done])
            advantages = group_advantages(rewards, int(s["group_size"])).to(run.device)
            x, y, m = self.policy_logprobs(model, done)
            with torch.no_grad():
                old = sequence_logprobs(model, x, y)
                ref = None
                if s["kl"] > 0:
                    with adapters_off(model) if reference is None else contextlib.nullcontext():
                        ref = sequence_logprobs(reference or model, x, y)
        lr = run.step_lr()
        for _ in range(int(s["grpo_updates"])):
            loss, kl = grpo_loss(sequence_logprobs(model, x, y), old, ref, advantages, m, s["clip"], s["kl"])
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        run.state.step += 1
        run.state.tokens += int(m.sum())
        run.stepped(int(m.sum()))
        lengths = [len(d["ids"]) for d in done]
        return {
            "loss": loss.item(), "lr": lr, "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
            "kl": kl.item(), "length": sum(lengths) / len(lengths), "length_max": max(lengths),
        }  # fmt: skip

    @torch.no_grad()
    def evaluate(self, model) -> float:
        """The val prompts' mean reward of one greedy completion each (temperature 0), decoded in batches."""
        val, total = self.rows["val"], 0.0
        for i in range(0, len(val), 64):
            done = self.complete(model, val[i : i + 64], 1, 0.0, torch.Generator(self.run.device).manual_seed(0))
            total += sum(d["reward"] for d in done)
        return total / len(val)

    def fit(self, display: Display | None = None) -> GRPOResult:
        """Train to the end, or to a signal (the steps trained are saved; a rollout or an evaluation in progress
        is dropped)."""
        run = self.run
        if display is not None:  # what shows this run's events (given here, or when it was made)
            run.show = display
        with run.signals:
            stopped = self._fit()
        best = -run.state.best_val_loss if run.state.best_val_loss is not None else None
        elapsed, ms, speed = run.speed()
        return GRPOResult(run.run_dir.path, run.state.step, self.val, stopped, best, elapsed, ms, speed)

    def _fit(self) -> str | None:
        run, cfg, s = self.run, self.run.cfg, self.run.settings
        model = run.setup()
        reference = None
        if not run.lora and run.settings["kl"] > 0:  # a frozen copy of the start weights (of the run's start)
            with run.signals.interruptible():
                reference = self._start_copy(model)
        model.train()
        run.begin(
            f"{cfg.batch_size} prompts x {s['group_size']} completions per step, up to {s['max_new_tokens']} new "
            f"tokens at temperature {s['rollout_temperature']:g}; reward {s['reward']}, kl {s['kl']:g}"
        )
        self.val = None
        if run.state.step == 0 and cfg.eval_first:
            run.show.on_status("first evaluation")
            if not self.evaluate_and_log(save=False):
                return run.signals.received
        end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters
        while run.state.step < end and not run.signals.received:
            try:
                values = self.train_step(model, reference)
            except Interrupted:
                break
            step = run.state.step
            if not all(map(math.isfinite, values.values())):
                raise NanoGPTError(f"the loss became non-finite at step {step}; try a lower --learning-rate")
            out_of_time = run.out_of_time()
            if step % cfg.log_interval == 0 or step == end or out_of_time:
                run.log_step(values, shown=("reward", "kl"))
            if step % cfg.eval_interval == 0 or step == end or out_of_time:
                if not self.evaluate_and_log(save=True):
                    break
            if out_of_time:
                break
        return run.ended(end)

    def evaluate_and_log(self, save: bool) -> bool:
        """An evaluation, its lines and (with save) a save; False when a signal dropped it."""
        run = self.run
        with run.untimed():
            val = run.scored(self.evaluate)
            if val is None:
                return False
            self.val = val
            if save:
                run.save(-val)  # the best weights are those of the highest val reward
            best = -run.state.best_val_loss if run.state.best_val_loss is not None else None
            run.log_eval({"val_reward": val}, best, saved=save)
        return True

    def _start_copy(self, model):
        """The reference of a full fine-tune: the start weights, frozen (on resume, loaded from the start)."""
        from nanogpt_cli.interop.loading import load_model

        plan = self.run.plan
        if not plan.resume:
            reference = copy.deepcopy(model)
        else:  # the run's record names where it started
            reference, _ = load_model(plan.finetune["init_from"], last=plan.finetune.get("init_last", False))
            reference.to(self.run.device)
        reference.eval()
        for p in reference.parameters():
            p.requires_grad_(False)
        return reference
