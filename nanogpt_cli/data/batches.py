"""Training batches: random windows of a prepared dataset's shards (or packed conversations), as tensors.

batches = Batches(Path("data"), "shk", block_size=64, batch_size=12, device=torch.device("cpu"), seed=1337)
x, y = batches.get_batch("train")   # (B, T) inputs and next-token targets (-1 where the loss skips)
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from nanogpt_cli.data.reader import open_conversations, open_mask_split, open_split, pack_windows
from nanogpt_cli.data.teacher import open_teacher_split
from nanogpt_cli.errors import NanoGPTError


class Taught(NamedTuple):
    """A batch's targets with the teacher's top-k next-token probabilities at each input position (a dataset
    labeled by `prepare --teacher`), which a distillation's loss reads in place of y."""

    targets: torch.Tensor  # (B, T) next tokens, -1 where the loss skips
    ids: torch.Tensor  # (B, T, k) the teacher's most likely next tokens
    probs: torch.Tensor  # (B, T, k) their probabilities (padding: 0)


class Batches:
    """Random (block_size + 1)-token windows from the train and val shards, never across two shards. A chat
    dataset that records its conversations is read as packed windows instead (data.reader.pack_windows): whole
    conversations where they fit, padded at the end with targets that do not count. block_size is the training
    sequence's length (--seq-len, else the model's context); length_flag names the flag that set it, for errors."""

    def __init__(
        self,
        data_dir: Path,
        name: str,
        block_size: int,
        batch_size: int,
        device: torch.device,
        seed: int,
        loss_mask: bool = True,
        length_flag: str = "--block-size",
        teacher: bool = False,
    ):
        self.splits = {s: open_split(data_dir, name, s) for s in ("train", "val")}
        # chat datasets: a mask per token; a target whose mask is 0 becomes -1, which the loss ignores
        # (loss_mask=False: every token of the conversations is a target)
        self.masks = {s: open_mask_split(data_dir, name, s) if loss_mask else None for s in ("train", "val")}
        # teacher=True: the train split's batches carry the teacher's labels (Taught), which must be there
        self.teacher = open_teacher_split(data_dir, name, "train") if teacher else None
        if teacher and self.teacher is None:
            raise NanoGPTError(f"dataset '{name}' has no teacher's labels; run `nanogpt prepare --teacher` on it")
        self.packed: dict[str, np.ndarray | None] = {}  # (n, 3): shard, offset, tokens of each packed window
        for split, tokens in self.splits.items():
            lengths = open_conversations(data_dir, name, split)
            self.packed[split] = None if lengths is None else pack_windows(lengths, tokens.counts, block_size + 1)
        for split, tokens in self.splits.items():
            if self.packed[split] is not None and len(self.packed[split]):
                continue
            if tokens.num_windows(block_size + 1) == 0:
                longest = (
                    f" (the longest of its {len(tokens.counts)} shards has {max(tokens.counts):,})"
                    if len(tokens.counts) > 1
                    else ""
                )
                raise NanoGPTError(
                    f"the {split} split of '{name}' has {len(tokens):,} tokens{longest}, fewer than "
                    f"{length_flag} + 1 = {block_size + 1}; use a smaller {length_flag} or more data"
                )
        self.block_size, self.batch_size, self.device = block_size, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, split: str, generator: torch.Generator | None = None) -> list[tuple[int, int]]:
        """Where the windows of one batch start, (shard, offset) each, or (shard, offset, tokens) for packed
        windows: the random part, which every rank draws alike."""
        packed = self.packed[split]
        if packed is not None:
            ix = torch.randint(len(packed), (self.batch_size,), generator=generator or self.generator)
            return [tuple(row) for row in packed[ix.numpy()].tolist()]
        return self.splits[split].starts(self.batch_size, self.block_size + 1, generator or self.generator)

    def load(self, split: str, starts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._load(split, starts)
        if split == "train" and self.teacher is not None:
            ids, probs = self.teacher.read(starts, self.block_size)  # (B, T, k) each
            return x, Taught(y, self.to_device(torch.from_numpy(ids)), self.to_device(torch.from_numpy(probs)))
        return x, y

    def _load(self, split: str, starts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        data, T = self.splits[split], self.block_size
        if self.packed[split] is not None:
            return self._load_packed(split, starts)
        windows = self.to_device(torch.from_numpy(data.read(starts, T + 1).astype(np.int64)))  # (B, T+1)
        x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each, sliced on the device
        if self.masks[split] is not None:
            keep = torch.from_numpy(self.masks[split].read(starts, T + 1).astype(np.bool_)[:, 1:].copy())  # (B, T)
            y = y.masked_fill(~self.to_device(keep), -1)
        return x, y

    def _load_packed(self, split: str, starts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed windows, each padded to T+1 tokens; the padding's targets (and those under mask 0) are -1."""
        T1 = self.block_size + 1
        tokens, masks = self.splits[split], self.masks[split]
        ids = np.zeros((len(starts), T1), dtype=np.int64)
        keep = np.zeros((len(starts), T1), dtype=np.bool_)
        for row, (shard, offset, n) in enumerate(starts):
            ids[row, :n] = tokens.shard(shard)[offset : offset + n]
            keep[row, :n] = masks.shard(shard)[offset : offset + n] if masks is not None else True
        windows = self.to_device(torch.from_numpy(ids))  # (B, T+1)
        x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
        return x, y.masked_fill(~self.to_device(torch.from_numpy(keep[:, 1:].copy())), -1)

    def to_device(self, windows: torch.Tensor) -> torch.Tensor:
        """One copy of the whole (B, T+1) block. On CUDA it is pinned first, contiguous as it is, so the copy is
        asynchronous (a sliced view would go through an unpinned temporary)."""
        if self.device.type == "cuda":
            return windows.pin_memory().to(self.device, non_blocking=True)
        return windows.to(self.device)

    def get_batch(self, split: str, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.load(split, self.draw(split, generator))

    def fixed_batches(
        self, split: str, n: int, seed: int, share: list[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same n batches at every evaluation: curves move because the model does, not the sample. Under
        torchrun a rank loads only its share of them (indices into the n)."""
        g = torch.Generator().manual_seed(seed)
        starts = [self._scored_draw(split, g) for _ in range(n)]
        return [self.load(split, starts[i]) for i in (range(n) if share is None else share)]

    def _scored_draw(self, split: str, g: torch.Generator, tries: int = 100) -> list[tuple[int, ...]]:
        """An evaluation batch: on a chat dataset, one with at least one trained target (a batch of prompts only
        would score 0 and pull the mean down), drawn again from the same generator up to `tries` times."""
        masks = self.masks[split]
        for _ in range(tries):
            starts = self.draw(split, g)
            if masks is None:
                return starts
            if any(
                masks.shard(s[0])[s[1] + 1 : s[1] + (s[2] if len(s) == 3 else self.block_size + 1)].any()
                for s in starts
            ):
                return starts
        return starts
