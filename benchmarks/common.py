"""Shared by the benchmarks: the machine's measured matmul peak, timing, and the Tiny Shakespeare path.

peak = matmul_peak(torch.device("cpu"), torch.float32)   # FLOP/s, measured now, in this process
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    return 2 * n**3 * reps / (time.perf_counter() - t0)


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


def train_in_processes(flags: dict, procs: int, run_dir: Path, threads: int | None = None) -> dict | None:
    """One `nanogpt train` run in a fresh process, or in `procs` under torchrun: the figures rank 0 reports
    (train_worker.py), or None after printing why it failed. threads: OMP_NUM_THREADS of each process."""
    result = run_dir.with_suffix(".json")
    launcher = (
        [sys.executable]
        if procs == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.run(
        launcher + [str(ROOT / "benchmarks" / "train_worker.py"), json.dumps(flags), str(run_dir), str(result)],
        env=env,
        capture_output=True,
        text=True,
    )
    if not result.is_file():
        print(f"--- {run_dir.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return dict(json.loads(result.read_text()), wall_s=time.perf_counter() - t0, returncode=proc.returncode)
