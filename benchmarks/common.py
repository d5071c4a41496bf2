"""Shared by the benchmarks: the machine's measured matmul peak, timing, and the Tiny Shakespeare path.

    peak = matmul_peak(torch.device("cpu"), torch.float32)   # FLOP/s, measured now, in this process
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE_PATHS = [ROOT.parent / "shared" / "data" / "tinyshakespeare.txt", ROOT / "examples" / "tinyshakespeare.txt"]


def shakespeare_path() -> Path:
    for path in SHAKESPEARE_PATHS:
        if path.is_file():
            return path
    raise SystemExit("Tiny Shakespeare not found; looked in " + ", ".join(map(str, SHAKESPEARE_PATHS)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None, seconds: float = 1.0) -> float:
    """FLOP/s of a square matmul on this device and dtype, measured now: the machines drift, so MFU is
    reported against what the hardware does in the same process rather than a datasheet."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
        if device.type == "cuda" and reps % 10 == 0:
            sync(device)
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def table(title: str, header: list[str], rows: list[list]) -> None:
    """Print a rich table (plain text when piped)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*[str(c) for c in row])
    Console(width=160).print(t)
