"""Distillation: a student trained on a teacher's next-token distributions, mixed with the data's cross-entropy,
through the trainer's loss hook (the loop is the trainer's).

    request = RunRequest({"data": "shk-smol", "preset": "cpu"}, out=Path("ckpt/d"))
    job = plan_distill(request, DistillSettings(teacher="smol.gguf"))
    Trainer(job.plan, loss=job.loss, trainable=job.trainable).fit()

The loss at a position is  alpha * T^2 * KL(p_T || q_T) + (1 - alpha) * CE(y, q), with p_T and q_T the teacher's
and the student's softmax at temperature T (the T^2 keeps the gradient's scale as T changes; Hinton et al. 2015).
With top_k > 0 both distributions are folded onto k + 1 outcomes: the teacher's k most likely tokens and one
"rest" bucket holding what is left of each, so a teacher stored as its top-k (prepare --teacher) gives the same
loss as the live one. On-policy rows (GKD, Agarwal et al. 2024): the student continues the first half of a
window by sampling, the live teacher scores that continuation, and the row trains on the KL of the sampled
tokens only (the data has no next token there). Evaluation scores the data's cross-entropy alone, as every run's
does, so distilled and plain runs compare on one scale.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from nanogpt_cli.data import load_meta
from nanogpt_cli.data.batches import Taught
from nanogpt_cli.data.teacher import TeacherWriter, bytes_per_token, teacher_record
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.files import write_json
from nanogpt_cli.model import GPT
from nanogpt_cli.tokenizer import describe_difference
from nanogpt_cli.training.request import RunRequest

DEFAULTS = {"top_k": 32, "temperature": 1.0, "alpha": 0.5, "on_policy_fraction": 0.0}
FLAGS = {
    "teacher": "--teacher",
    "top_k": "--distill-top-k",
    "temperature": "--distill-temperature",
    "alpha": "--distill-alpha",
    "on_policy_fraction": "--on-policy-fraction",
}


@dataclass
class DistillSettings:
    """A distillation's settings; None: not given (the saved run's, the teacher shards' or DEFAULTS)."""

    teacher: str | None = None  # any source --init-from takes; None: the one the dataset's shards were labeled by
    top_k: int | None = None  # the teacher's most likely tokens kept, the rest as one bucket; 0: the full vocabulary
    temperature: float | None = None  # both softmaxes' temperature
    alpha: float | None = None  # the distillation term's weight; the data's cross-entropy gets 1 - alpha
    on_policy_fraction: float | None = None  # rows of each batch the student writes and the teacher scores (GKD)

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 0:
            raise NanoGPTError(f"--distill-top-k must be 0 (the full vocabulary) or more, got {self.top_k}")
        if self.temperature is not None and not self.temperature > 0:
            raise NanoGPTError(f"--distill-temperature must be above 0, got {self.temperature}")
        for name in ("alpha", "on_policy_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise NanoGPTError(f"{FLAGS[name]} must be between 0 and 1, got {value}")

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


# --- the loss ---


def teacher_targets(logits: torch.Tensor, top_k: int, temperature: float, vocab: int):
    """The teacher's distribution at each position from its logits (..., V'): the top-k ids (..., k) and their
    probabilities (..., k), most likely first; top_k 0: (None, every probability (..., vocab)). Logits past the
    tokenizer's vocab (a padded head) are not tokens and are dropped."""
    probs = torch.softmax(logits[..., :vocab].float() / temperature, dim=-1)
    if top_k == 0:
        return None, probs
    top, ids = probs.topk(min(top_k, vocab), dim=-1)
    return ids, top


class DistillHead(torch.autograd.Function):
    """The mixed loss of student logits (N, V) and its gradient, computed in chunks of rows, a few passes over
    each: autograd's version (a log-softmax, a masked logsumexp, a gather and a cross-entropy, each with its
    backward) reads a 49,152-token vocabulary's logits over twenty times, and took twice the model's own step.

    With q = softmax(z / T) and the teacher's p, the gradient of T^2 * KL over the k ids and the rest bucket is
    T * (q - r): r is p on the k ids and, elsewhere, the teacher's rest mass spread in proportion to q (the full
    vocabulary: r = p). The cross-entropy's is softmax(z) - onehot(y)."""

    CHUNK_ELEMENTS = 1 << 20  # logits a chunk holds: a few MB, so its passes stay in cache

    @staticmethod
    def forward(ctx, logits, targets, ids, probs, kl_mask, temperature: float, alpha: float, vocab: int):
        N, V = logits.shape
        ce_count = (targets != -1).sum().clamp(min=1)
        kl_count = kl_mask.sum().clamp(min=1)
        grad = torch.empty(N, V, dtype=torch.float32, device=logits.device)
        kl_total = torch.zeros((), dtype=torch.float32, device=logits.device)
        ce_total = torch.zeros((), dtype=torch.float32, device=logits.device)
        rows = max(1, DistillHead.CHUNK_ELEMENTS // V)
        for i in range(0, N, rows):
            z, t, m = logits[i : i + rows].float(), targets[i : i + rows], kl_mask[i : i + rows].float()
            chunk_ids = None if ids is None else ids[i : i + rows]
            kl, g = DistillHead._kl_chunk(z, chunk_ids, probs[i : i + rows].float(), temperature, vocab)
            kl_total += (kl * m).sum()
            g.mul_((alpha / kl_count * m).unsqueeze(1))  # d(alpha T^2 mean KL)/dz
            counted = (t != -1).float()
            picked = t.clamp(min=0).unsqueeze(1)  # (n, 1): a placeholder target where none counts
            logq = torch.log_softmax(z, dim=-1)  # (n, V)
            ce_total += (-logq.gather(1, picked).squeeze(1) * counted).sum()
            q = logq.exp_()  # softmax(z), in place
            q.scatter_add_(1, picked, torch.full_like(picked, -1.0, dtype=q.dtype))
            g.add_(q.mul_(((1 - alpha) / ce_count * counted).unsqueeze(1)))
            grad[i : i + rows] = g
        ctx.save_for_backward(grad)
        return alpha * temperature**2 * kl_total / kl_count + (1 - alpha) * ce_total / ce_count

    @staticmethod
    def _kl_chunk(z, ids, p, temperature: float, vocab: int):
        """KL(p || q) of each row (n,) and T * (q - r) (n, V), r as the class docstring says."""
        q = torch.softmax(z / temperature if temperature != 1 else z, dim=-1)  # (n, V)
        if ids is None:  # the full vocabulary: p (n, vocab), 0 past it
            kl = (torch.xlogy(p, p) - p * q[:, :vocab].log()).sum(-1)
            q[:, :vocab] -= p
            return kl, q.mul_(temperature)
        q_top = q.gather(1, ids)  # (n, k)
        outside = q.scatter(1, ids, 0.0)  # (n, V): q off the k ids, summed without cancelling
        q_rest = outside.sum(-1)
        p_rest = (1.0 - p.sum(-1)).clamp(min=0.0)
        kl = (
            (torch.xlogy(p, p) - p * q_top.log()).sum(-1)
            + torch.xlogy(p_rest, p_rest)
            - p_rest * q_rest.clamp(min=1e-30).log()
        )
        g = q.sub_(outside.mul_((p_rest / q_rest.clamp(min=1e-30)).unsqueeze(1)))  # q - the rest bucket's share
        g.scatter_add_(1, ids, -p)
        return kl, g.mul_(temperature)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_out, None, None, None, None, None, None, None


def mixed_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ids: torch.Tensor | None,
    probs: torch.Tensor,
    temperature: float,
    alpha: float,
    vocab: int,
    kl_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """alpha * T^2 * the mean KL(teacher || student) over the positions of kl_mask (default: those with a target)
    + (1 - alpha) * the mean cross-entropy over the targets (-1: none); logits (B, T, V), the teacher's targets as
    teacher_targets gives them (top-k ids and probabilities, or ids None and every probability)."""
    V = logits.size(-1)
    kl_mask = targets != -1 if kl_mask is None else kl_mask
    return DistillHead.apply(
        logits.reshape(-1, V),
        targets.reshape(-1),
        None if ids is None else ids.reshape(-1, ids.size(-1)),
        probs.reshape(-1, probs.size(-1)),
        kl_mask.reshape(-1),
        temperature,
        alpha,
        vocab,
    )


class DistillLoss:
    """The trainer's loss hook of a distillation run. The teacher's targets come with the batch (y is a Taught:
    a dataset labeled by prepare --teacher, reads_teacher) or from the live teacher's forward of the same
    inputs. Evaluation (the model in eval mode) scores the data's cross-entropy alone."""

    def __init__(self, top_k: int, temperature: float, alpha: float, on_policy: float, vocab: int, teacher, shards):
        self.top_k, self.temperature, self.alpha, self.on_policy = top_k, temperature, alpha, on_policy
        self.vocab, self.teacher, self.reads_teacher = vocab, teacher, shards

    def __call__(self, model: nn.Module, x: torch.Tensor, y) -> torch.Tensor:
        targets, ids, probs = (y.targets, y.ids, y.probs) if isinstance(y, Taught) else (y, None, None)
        if not model.training:
            _, loss = model(x, targets, keep_logits=False)
            return loss
        kl_mask = None
        if self.on_policy > 0:
            rows = torch.rand(x.size(0)) < self.on_policy  # torch's generator: saved with the run, so resume is exact
            if rows.any():
                x, targets, kl_mask = self.student_rows(model, x, targets, rows.to(x.device))
                ids = probs = None  # the rows the student wrote are scored live
        if probs is None:
            ids, probs = self.teacher_says(x)
        logits, _ = model(x)
        return mixed_loss(logits, targets, ids, probs, self.temperature, self.alpha, self.vocab, kl_mask)

    @torch.no_grad()
    def teacher_says(self, x: torch.Tensor):
        was = self.teacher.training
        self.teacher.eval()
        logits, _ = self.teacher(x)
        self.teacher.train(was)
        return teacher_targets(logits, self.top_k, self.temperature, self.vocab)

    @torch.no_grad()
    def student_rows(self, model: nn.Module, x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor):
        """The batch with `rows` rewritten by the student: their first half kept, the rest sampled (temperature
        1) token by token; those rows train on the KL at the sampled tokens' positions only (their targets -1)."""
        B, T = x.size()
        keep = T // 2
        seq = x[rows, : keep + 1]  # (b, keep + 1): the prompt and the data's first next token as the first input
        was = model.training
        model.eval()
        while seq.size(1) < T:
            logits, _ = model(seq, last_only=True)  # (b, 1, V)
            p = torch.softmax(logits[:, -1, : self.vocab].float(), dim=-1)
            seq = torch.cat([seq, torch.multinomial(p, 1)], dim=1)
        model.train(was)
        x = x.clone()
        x[rows] = seq
        targets = targets.clone()
        targets[rows] = -1
        kl_mask = (targets != -1).clone()
        kl_mask[rows, keep:] = True  # the positions whose next token the student sampled (and the last one's)
        return x, targets, kl_mask


# --- the teacher ---


def load_teacher(source: str, dataset: dict[str, Any], data: str, device) -> GPT:
    """The teacher model from any source --init-from takes, frozen, checked to share the dataset's tokenizer."""
    from nanogpt_cli.interop.loading import load_model

    model, meta = load_model(source, device=device)
    differ = describe_difference(dataset["tokenizer"], meta.get("tokenizer") or {}, f"dataset '{data}'", "the teacher")
    if differ:
        raise NanoGPTError(
            f"the teacher {source} and the student's dataset '{data}' must share a tokenizer, and they do not "
            f"({differ}); prepare the data with the teacher's tokenizer (for a .gguf: `nanogpt export "
            f"{source} --format hf --out DIR`, then `prepare --tokenizer DIR`)"
        )
    model.requires_grad_(False)
    return model.eval()


def label_dataset(
    data_dir: Path,
    name: str,
    teacher: str,
    top_k: int = DEFAULTS["top_k"],
    temperature: float = DEFAULTS["temperature"],
    context: int = 512,
    rows: int = 4,
    splits: tuple[str, ...] = ("train",),
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """prepare --teacher: the teacher's top-k next-token probabilities of every token of the splits, written
    beside their shards, in chunks of `context` tokens (a chunk's first tokens see less context), `rows` chunks
    a forward; returns what meta.json records under "teacher". on_progress(tokens done, tokens in all)."""
    if top_k < 1:
        raise NanoGPTError(
            "prepare --teacher stores the teacher's top-k; give --distill-top-k 1 or more (the full vocabulary "
            "is only for a live teacher: finetune --method distill --teacher SOURCE --distill-top-k 0)"
        )
    if context < 1:
        raise NanoGPTError(f"--teacher-context must be 1 or more, got {context}")
    meta = load_meta(data_dir, name)
    model = load_teacher(teacher, meta, name, "cpu")
    if model.config.block_size < context:
        raise NanoGPTError(
            f"--teacher-context {context} is longer than the teacher's context ({model.config.block_size})"
        )
    folder, vocab = Path(data_dir) / name, meta["vocab_size"]
    from nanogpt_cli.data.reader import open_split

    opened = {s: open_split(data_dir, name, s) for s in splits}
    total, done, started = sum(len(t) for t in opened.values()), 0, time.perf_counter()
    record = {"source": str(teacher), "top_k": top_k, "temperature": temperature, "context": context}
    for split, tokens in opened.items():
        shards = meta.get("shards", {}).get(split) or [{"file": f"{split}.bin", "tokens": meta[f"{split}_tokens"]}]
        for shard, entry in zip(tokens, shards, strict=True):
            writer = TeacherWriter(folder, entry["file"], len(shard), top_k, vocab)
            for start in range(0, len(shard), context * rows):
                block = np.asarray(shard[start : start + context * rows], dtype=np.int64)
                full = len(block) // context * context
                pieces = ([block[:full].reshape(-1, context)] if full else []) + (
                    [block[full:][None]] if full < len(block) else []
                )  # (rows, context) chunks, and a last shorter one (1, t)
                offset = start
                for piece in pieces:
                    with torch.no_grad():
                        logits, _ = model(torch.from_numpy(piece))  # (b, t, V)
                    ids, probs = teacher_targets(logits, top_k, temperature, vocab)  # (b, t, k) each
                    writer.write(offset, ids.reshape(-1, top_k).numpy(), probs.reshape(-1, top_k).numpy())
                    offset += piece.size
                done += len(block)
                if on_progress is not None:
                    on_progress(done, total)
            writer.finish()
    record["splits"] = list(splits)
    record["bytes_per_token"] = bytes_per_token(top_k, vocab)
    record["seconds"] = round(time.perf_counter() - started, 1)
    write_json(folder / "meta.json", {**meta, "teacher": record})
    return record


def shards_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The dataset's teacher labels that training reads (its train split's), or None."""
    record = teacher_record(meta)
    return record if record and "train" in record.get("splits", ()) else None


# --- planning ---


def plan_distill(
    request: RunRequest,
    settings: DistillSettings | None = None,
    lora=None,
    lora_flags: set[str] | None = None,
    world_size: int | None = None,
    teacher_device: str | None = None,
):
    """A distillation run's plan (a FinetunePlan whose `loss` is the DistillLoss). Fresh: from request.init_from
    (full or LoRA, as finetune plans it) or, without it, a new model of the flags' shape or preset; resume: the
    run's own record, which values given again must agree with. world_size: as plan_finetune's; teacher_device:
    where a live teacher is loaded (None: where this process trains)."""
    from nanogpt_cli.training.finetune import FinetunePlan, plan_finetune
    from nanogpt_cli.training.plan import plan_run

    settings = settings or DistillSettings()
    if request.resume:
        job = plan_finetune(request, lora=lora, lora_flags=lora_flags, world_size=world_size)
        values = (job.plan.finetune or {}).get("distill")
        if values is None:
            raise NanoGPTError(f"{job.plan.run_dir} is not a distillation run; resume it without --method distill")
        differ = [
            f"{FLAGS[k]} (saved {values[k]!r}, given {v!r})" for k, v in settings.given().items() if values[k] != v
        ]
        if differ:
            raise NanoGPTError(f"--resume continues the run's distillation; these differ from it: {', '.join(differ)}")
    else:
        if request.init_from is not None:
            job = plan_finetune(request, lora=lora, lora_flags=lora_flags, world_size=world_size)
        elif lora is not None:
            raise NanoGPTError(
                "LoRA adapts trained weights: give --init-from with --lora, or drop the --lora flags to distill into "
                "a new model"
            )
        else:  # a new model of the flags' shape or preset
            job = FinetunePlan(plan_run(request, world_size=world_size), None)
            job.plan.finetune = {"init_from": None, "method": "full"}
        values = fresh_values(settings, job.plan.dataset, job.plan.train.data)
        job.plan.finetune.update(objective="distill", distill=values)  # in place: LoRA's hook holds this record
    job.loss = distill_loss(values, job.plan, teacher_device)
    return job


def fresh_values(settings: DistillSettings, dataset: dict[str, Any], data: str) -> dict[str, Any]:
    """What a new distillation records: the given settings, else the dataset's teacher labels' (which a given value
    must agree with), else DEFAULTS; and whether it reads those labels ("shards")."""
    labels, given = shards_record(dataset), settings.given()
    values = {**DEFAULTS, **given, "teacher": settings.teacher, "shards": labels is not None}
    if labels is not None:
        differ = [
            f"{FLAGS[k]} {given[k]} (they are {labels[k]!r})"
            for k in ("top_k", "temperature")
            if given.get(k, labels[k]) != labels[k]
        ]
        if differ:
            raise NanoGPTError(
                f"dataset '{data}' holds its teacher's labels at --distill-top-k {labels['top_k']} and "
                f"--distill-temperature {labels['temperature']:g}, which the loss reads; drop {', '.join(differ)} or "
                "label it again with `prepare --teacher`"
            )
        values.update(
            top_k=labels["top_k"], temperature=labels["temperature"], teacher=settings.teacher or labels["source"]
        )
    live = labels is None or values["on_policy_fraction"] > 0
    if live and settings.teacher is None:
        why = (
            "its on-policy rows are scored live"
            if labels is not None
            else f"dataset '{data}' holds no teacher's labels"
        )
        raise NanoGPTError(
            f"--method distill needs --teacher SOURCE: {why} (or label the data with `prepare --teacher`)"
        )
    return values


def distill_loss(values: dict[str, Any], plan, device: str | None = None) -> DistillLoss:
    """The loss hook of a planned distillation, with its live teacher loaded (and checked) when it needs one, on
    `device` (None: where this process trains, each process's own under torchrun)."""
    from nanogpt_cli.training.distributed import process_device

    teacher = None
    if not values["shards"] or values["on_policy_fraction"] > 0:
        where = device or process_device(plan.train.device)
        teacher = load_teacher(values["teacher"], plan.dataset, plan.train.data, where)
        if teacher.config.block_size < plan.seq_len:
            raise NanoGPTError(
                f"the teacher's context ({teacher.config.block_size}) is shorter than the training sequences "
                f"({plan.seq_len}); give --seq-len {teacher.config.block_size} or less"
            )
    return DistillLoss(
        values["top_k"],
        values["temperature"],
        values["alpha"],
        values["on_policy_fraction"],
        plan.dataset["vocab_size"],
        teacher,
        values["shards"],
    )
