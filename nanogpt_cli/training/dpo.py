"""Direct preference optimisation: learn from pairs of a better (chosen) and a worse (rejected) completion.

    result = DPO(plan_finetune(RunRequest({"data": "pairs", ...}, init_from="checkpoints/sft")), {"beta": 0.1}).fit()

The loss of Rafailov et al. (2023), "Direct Preference Optimization", eq. 7, with h the difference of the
policy's and the reference's log-ratios of the two completions (summed log-probabilities, nats):

    h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))
    sigmoid: -log sigmoid(beta h)
    ipo:     (h' - 1 / (2 beta))^2, Azar et al. (2023), with h' from log-probabilities averaged per token (as TRL)

The implicit rewards are beta times each log-ratio; their margin is beta h. DPO widens the margin by pushing
the rejected completion down, and may push the chosen one down with it (a small model then stops writing
either); --rpo-alpha A adds A times the chosen completion's cross-entropy (Pang et al. 2024, "Iterative
Reasoning Preference Optimization"; TRL's rpo_alpha), which holds it up. The reference is the start model:
with LoRA the same weights with the adapters switched off (no second copy); in a full fine-tune its
log-probabilities are computed once, before the first update, and kept beside the dataset
(DATA_DIR/NAME/reference-SHA.json, SHA the start weights' hash), so a resume or another run reads them back.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nanogpt_cli.data.preference import read_split
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.files import atomic_write
from nanogpt_cli.lora import weights_hash
from nanogpt_cli.training.events import Display
from nanogpt_cli.training.policy import Log, PolicyRun, adapters_off, check_format, pad_batch, sequence_logprobs

LOSS_TYPES = ("sigmoid", "ipo")
DEFAULTS = {"beta": 0.1, "loss_type": "sigmoid", "rpo_alpha": 0.0}


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean loss over the pairs and each pair's chosen and rejected reward (B,), from the completions'
    log-probabilities (B,) (summed for sigmoid, per-token means for ipo)."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise NanoGPTError(f"unknown --loss-type {loss_type!r}; use {' or '.join(LOSS_TYPES)}")
    return losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def completion_logprobs(model, pairs: list[dict[str, Any]], block_size: int, device, mean: bool) -> torch.Tensor:
    """Each pair's chosen and rejected completion log-probability under the model (summed, or with mean the
    per-token mean): (2B,), the chosen ones first."""
    total, count = completion_sums(model, pairs, block_size, device)
    return total / count if mean else total


def completion_sums(model, pairs: list[dict[str, Any]], block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's summed log-probability and its token count, (2B,) each, the chosen ones first."""
    seqs = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    masks = [p["chosen_mask"] for p in pairs] + [p["rejected_mask"] for p in pairs]
    x, y, m = pad_batch(seqs, masks, block_size, device)
    return (sequence_logprobs(model, x, y) * m).sum(-1), m.sum(-1).clamp(min=1)  # (2B,) each


@dataclass
class DPOResult:
    run_dir: Path
    step: int
    val_loss: float | None  # the val pairs' DPO loss at the last evaluation
    val_accuracy: float | None  # the share of val pairs whose chosen reward beats the rejected one
    stopped: str | None = None  # None: finished; "max_time" (the clock), "stop_at", "SIGINT", "SIGTERM"
    best_val_loss: float | None = None
    elapsed_s: float = 0.0  # this invocation's wall time, evaluations and saves included
    ms_per_iter: float = 0.0  # the updates' own time, evaluations and saves left out
    tokens_per_s: float = 0.0  # the tokens of the pairs the updates read


class DPO:
    """A DPO run over a prepared preference dataset (see the module's docstring)."""

    def __init__(
        self, job, given: dict[str, Any] | None = None, log: Log | None = None, display: Display | None = None
    ):
        self.run = PolicyRun(job, "dpo", DEFAULTS, given or {}, log, display)
        check_format(self.run.plan.dataset, "dpo", "preference")
        s = self.run.settings
        if s["loss_type"] not in LOSS_TYPES:
            raise NanoGPTError(f"unknown --loss-type {s['loss_type']!r}; use {' or '.join(LOSS_TYPES)}")
        if not s["beta"] > 0:
            raise NanoGPTError(f"--beta must be above 0, got {s['beta']}")
        cfg = self.run.cfg
        self.pairs = {split: read_split(cfg.data_dir, cfg.data, split) for split in ("train", "val")}

    def reference(self, model, split: str, idx: list[int]) -> torch.Tensor:
        """The reference's log-probabilities of these pairs: adapters off (LoRA), or the stored ones (full)."""
        mean = self.run.settings["loss_type"] == "ipo"
        if self.run.lora:
            with torch.no_grad(), adapters_off(model):
                return completion_logprobs(model, [self.pairs[split][i] for i in idx], model.config.block_size,
                                           self.run.device, mean)  # fmt: skip
        table = self.ref_table[split]
        key = "mean" if mean else "sum"
        chosen = [table[i][f"chosen_{key}"] for i in idx]
        rejected = [table[i][f"rejected_{key}"] for i in idx]
        return torch.tensor(chosen + rejected, device=self.run.device)

    def reference_table(self, model) -> dict[str, list[dict[str, float]]]:
        """Full fine-tuning: the start model's log-probabilities of every pair, computed once, kept beside the
        dataset, keyed by the start weights' hash."""
        cfg = self.run.cfg
        digest = self.run.plan.finetune.setdefault("reference_sha256", None) or weights_hash(model)
        self.run.plan.finetune["reference_sha256"] = digest
        path = Path(cfg.data_dir) / cfg.data / f"reference-{digest[:16]}.json"
        self.reference_path = path
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        if self.run.plan.resume:
            raise NanoGPTError(f"{path} is gone: the reference log-probabilities of this run; start it again")
        table: dict[str, list[dict[str, float]]] = {}
        with torch.no_grad():
            for split, pairs in self.pairs.items():
                rows = []
                for i in range(0, len(pairs), 32):
                    chunk = pairs[i : i + 32]
                    n = len(chunk)
                    s = completion_logprobs(model, chunk, model.config.block_size, self.run.device, False)
                    m = completion_logprobs(model, chunk, model.config.block_size, self.run.device, True)
                    rows += [
                        {
                            "chosen_sum": s[j].item(),
                            "rejected_sum": s[n + j].item(),
                            "chosen_mean": m[j].item(),
                            "rejected_mean": m[n + j].item(),
                        }  # fmt: skip
                        for j in range(n)
                    ]
                table[split] = rows
        return table

    def store_reference(self, table: dict[str, list[dict[str, float]]]) -> None:
        """Keep the reference table beside the dataset, for a resume or another run (once: it never changes)."""
        if not self.reference_path.is_file():
            atomic_write(self.reference_path, lambda tmp: tmp.write_text(json.dumps(table), encoding="utf-8"))

    def scores(self, model, split: str, idx: list[int]):
        """Loss, chosen and rejected rewards of these pairs."""
        s = self.run.settings
        pairs = [self.pairs[split][i] for i in idx]
        total, count = completion_sums(model, pairs, model.config.block_size, self.run.device)
        policy = total / count if s["loss_type"] == "ipo" else total
        ref = self.reference(model, split, idx)
        n = len(idx)
        loss, chosen, rejected = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], s["beta"], s["loss_type"])
        if s["rpo_alpha"]:  # RPO: plus the chosen completions' cross-entropy (nats/token), which DPO alone lets fall
            loss = loss - s["rpo_alpha"] * (total[:n] / count[:n]).mean()
        return loss, chosen, rejected

    @torch.no_grad()
    def evaluate(self, model) -> tuple[float, float]:
        """The val pairs' mean loss and preference accuracy (chosen reward above rejected)."""
        model.eval()
        losses, right, val = [], 0, self.pairs["val"]
        for i in range(0, len(val), 32):
            idx = list(range(i, min(i + 32, len(val))))
            loss, chosen, rejected = self.scores(model, "val", idx)
            losses.append(loss.item() * len(idx))
            right += int((chosen > rejected).sum())
        model.train()
        return sum(losses) / len(val), right / len(val)

    def fit(self, display: Display | None = None) -> DPOResult:
        """Train to the end, or to a signal (the steps trained are saved; an evaluation in progress is dropped)."""
        run = self.run
        if display is not None:  # what shows this run's events (given here, or when it was made)
            run.show = display
        with run.signals:
            stopped = self._fit()
        elapsed, ms, speed = run.speed()
        return DPOResult(
            run.run_dir.path, run.state.step, self.val_loss, self.val_acc, stopped, run.state.best_val_loss,
            elapsed, ms, speed,
        )  # fmt: skip

    def _fit(self) -> str | None:
        run, cfg = self.run, self.run.cfg
        model = run.setup()
        if not run.lora:
            with run.signals.interruptible():  # computed, then written: a stop leaves no half-written table
                table = self.reference_table(model)
            self.store_reference(table)
            self.ref_table = table
            run.write_config_again()
        model.train()
        s = run.settings
        run.begin(f"{cfg.batch_size} preference pairs per step; {s['loss_type']} loss, beta {s['beta']:g}"
                  + (f", rpo alpha {s['rpo_alpha']:g}" if s["rpo_alpha"] else ""))  # fmt: skip
        self.val_loss = self.val_acc = None
        if run.state.step == 0 and cfg.eval_first:
            run.show.on_status("first evaluation")
            if not self.evaluate_and_log(save=False):
                return run.signals.received
        end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters
        while run.state.step < end and not run.signals.received:
            lr = run.step_lr()
            # each step's pairs from a generator of the seed and step alone: a resume draws the same ones
            rng = random.Random(cfg.seed * 1_000_003 + run.state.step)
            idx = [rng.randrange(len(self.pairs["train"])) for _ in range(cfg.batch_size)]
            loss, chosen, rejected = self.scores(model, "train", idx)
            run.update(loss)
            tokens = sum(len(self.pairs["train"][i][k]) for i in idx for k in ("chosen", "rejected"))
            run.state.tokens += tokens
            run.stepped(tokens)
            step = run.state.step
            out_of_time = run.out_of_time()
            if step % cfg.log_interval == 0 or step == end or out_of_time:
                values = {"loss": loss.item(), "lr": lr, "reward_chosen": chosen.mean().item()}
                values |= {"reward_rejected": rejected.mean().item(), "margin": (chosen - rejected).mean().item()}
                run.log_step(values, shown=("margin",))
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
            scores = run.scored(self.evaluate)
            if scores is None:
                return False
            self.val_loss, self.val_acc = loss, accuracy = scores
            if save:
                run.save(loss)
            run.log_eval({"val_loss": loss, "val_accuracy": accuracy}, run.state.best_val_loss, saved=save)
        return True
