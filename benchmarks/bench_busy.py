"""The default CPU threads against each hand-picked count, idle and with competing CPU-bound processes that this
script starts and stops itself: `nanogpt train --preset cpu-char` as whole processes, timed from launch to exit.

    python benchmarks/bench_busy.py                          # 300 updates, 0 / 1 / 2 competitors, ~10 min
    python benchmarks/bench_busy.py --iters 60 --loads 0 1   # a quick look
    python benchmarks/bench_busy.py --readme                 # also the README's first command, idle, at full length

A run still going after --cap seconds is stopped (Ctrl-C: it saves and exits) and its time is extrapolated
from the updates it did at its mean update time; the table marks those with ~. Every competitor is a
`python -c 'while True: ...'` that ends by itself after the script's longest possible run and is killed when
its load level is done.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, shakespeare_path, table  # noqa: E402

from nanogpt_cli.device import cpu_cores, running_elsewhere  # noqa: E402

NANOGPT = [sys.executable, "-m", "nanogpt_cli"]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
ENV.pop("OMP_NUM_THREADS", None)  # the default under test is what a user gets with nothing set
README_ITERS = 2000  # cpu-char's --max-iters
SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    bf16 = "AMX" if "amx_bf16" in info else "AVX-512 BF16" if "avx512_bf16" in info else "no native bf16"
    cpu = names[0] if names else platform.processor() or "unknown CPU"
    return f"{cpu}, {cpu_cores()} cores, {bf16}; Python {platform.python_version()}"


def competitors(n: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)]) for _ in range(n)]


def timed(cmd: list[str], cap: float, cwd: Path, env: dict | None = None) -> tuple[float, bool, str]:
    """(wall seconds, cut by the cap, stderr) of one command; past the cap its process group gets Ctrl-C (a run
    saves where it is and exits), then a kill."""
    t0 = time.perf_counter()
    pipes = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or ENV, start_new_session=True, **pipes)
    try:
        _, err = proc.communicate(timeout=cap)
        return time.perf_counter() - t0, False, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        return time.perf_counter() - t0, True, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of it outlives its row


def threads_said(err: str) -> str:
    """The default's thread count as its notes said it: "1", or "2 -> 1" when the run changed it."""
    start = re.search(r"threads: (\d+) of \d+ cores \(", err)
    later = re.findall(r"threads: (\d+) of \d+ cores from now on", err)
    return " -> ".join(([start.group(1)] if start else []) + later) or "?"


def train_row(
    tmp: Path, data: Path, iters: int, threads: int | None, cap: float, tag: str, passive: bool = False
) -> dict:
    """One run of cpu-char; passive: with OMP_WAIT_POLICY=PASSIVE (threads sleep instead of spinning)."""
    out = tmp / f"run-{tag}"
    cmd = NANOGPT + ["train", "--data", "shk", "--data-dir", str(data), "--preset", "cpu-char"]
    cmd += ["--max-iters", str(iters), "--eval-interval", str(max(iters // 3, 1)), "--no-plot", "--out", str(out)]
    cmd += [] if threads is None else ["--threads", str(threads)]
    wall, cut, err = timed(cmd, cap, tmp, dict(ENV, OMP_WAIT_POLICY="PASSIVE") if passive else None)
    state = json.loads((out / "trainer.json").read_text()) if (out / "trainer.json").is_file() else {}
    step = state.get("step", 0)
    mean_s = (state.get("speed") or {}).get("mean_ms_per_iter", 0.0) / 1000
    estimate = wall + (iters - step) * mean_s if cut and step else wall
    if not step:
        print(f"--- {tag}: no steps done:\n{err[-2000:]}", file=sys.stderr)
    chosen = threads_said(err) if threads is None else str(threads)
    for line in err.splitlines() if threads is None else []:  # what the default chose, and why
        if "note: threads:" in line:
            print(f"{tag}: {line.strip()}", flush=True)
    return dict(step=step, wall=wall, estimate=estimate, cut=cut, chosen=chosen, ms=mean_s * 1000)


def readme_row(tmp: Path, cap: float, tag: str) -> dict:
    """The README's first command (less the pip install): prepare, train cpu-char, sample; one shell."""
    work = tmp / f"readme-{tag}"
    work.mkdir()
    shk = shakespeare_path()
    line = (
        f"nanogpt prepare {shk} --name shakespeare-char --tokenizer char && nanogpt train --data shakespeare-char "
        "--preset cpu-char --out checkpoints/shakespeare-char && nanogpt sample --checkpoint "
        'checkpoints/shakespeare-char --prompt "ROMEO:" --max-new-tokens 200'
    )
    shim = work / "bin"
    shim.mkdir()
    (shim / "nanogpt").write_text(f'#!/bin/sh\nexec {sys.executable} -m nanogpt_cli "$@"\n')
    (shim / "nanogpt").chmod(0o755)
    env_path = f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"
    wall, cut, err = timed(["sh", "-c", f"PATH={env_path} {line}"], cap, work)
    state_path = work / "checkpoints" / "shakespeare-char" / "trainer.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    step, mean_s = state.get("step", 0), (state.get("speed") or {}).get("mean_ms_per_iter", 0.0) / 1000
    estimate = wall + (README_ITERS - step) * mean_s if cut and step else wall  # the sample is left out then
    return dict(step=step, wall=wall, estimate=estimate, cut=cut, chosen=threads_said(err), ms=mean_s * 1000)


def seconds(row: dict) -> str:
    return f"~{row['estimate']:.1f}" if row["cut"] else f"{row['estimate']:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300, help="updates of cpu-char per run")
    p.add_argument("--loads", type=int, nargs="+", default=[0, 1, 2], help="competing CPU-bound processes")
    p.add_argument("--threads", type=int, nargs="+", default=None, help="hand-picked counts (default: 1 to cores)")
    p.add_argument("--cap", type=float, default=60.0, help="seconds before a run is cut and extrapolated")
    p.add_argument(
        "--readme",
        type=int,
        nargs="*",
        default=None,
        help="also the README's first command at full length, with these numbers of competitors (none given: 0)",
    )
    p.add_argument("--passive", action="store_true", help="also all cores' threads with OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--readme-cap", type=float, default=900.0, help="seconds before the README command is cut")
    args = p.parse_args()
    picked = args.threads or list(range(1, cpu_cores() + 1))
    readme_at = [] if args.readme is None else args.readme or [0]
    longest = (len(picked) + 1) * (args.cap + 130) + (args.readme_cap + 130 if readme_at else 0)
    print(machine())
    print(f"load at the start: {os.getloadavg()[0]:.1f} (1 min), {running_elsewhere():g} threads running elsewhere")
    rows, t_all = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "data"
        prep = NANOGPT + ["prepare", str(shakespeare_path()), "--name", "shk", "--tokenizer", "char"]
        subprocess.run(prep + ["--data-dir", str(data)], env=ENV, check=True, capture_output=True)
        for n in args.loads:
            spin = competitors(n, longest)
            try:
                time.sleep(1.0)  # running before the runs start, as a user's other work would be
                before = f"{os.getloadavg()[0]:.1f}"
                results = {None: train_row(tmp, data, args.iters, None, args.cap, f"{n}-default")}
                for t in picked:
                    results[t] = train_row(tmp, data, args.iters, t, args.cap, f"{n}-{t}")
                if args.passive:
                    results["passive"] = train_row(tmp, data, args.iters, max(picked), args.cap, f"{n}-p", True)
                readme = readme_row(tmp, args.readme_cap, str(n)) if n in readme_at else None
            finally:
                for proc in spin:
                    proc.kill()
                    proc.wait()
            best = min(r["estimate"] for t, r in results.items() if t is not None)
            for t, r in results.items():
                setting = "default" if t is None else f"--threads {t}"
                if t == "passive":
                    setting = f"--threads {max(picked)}, OMP_WAIT_POLICY=PASSIVE"
                ratio = f"{r['estimate'] / best:.2f}x"
                rows.append([n, before, setting, r["chosen"], r["step"], f"{r['ms']:,.0f}", seconds(r), ratio])
            if readme is not None:
                rows.append(
                    [n, before, "README's first command", readme["chosen"], readme["step"], f"{readme['ms']:,.0f}"]
                    + [seconds(readme), ""]
                )
    table(
        f"cpu-char, {args.iters} updates, whole `nanogpt train` processes; ~: cut at {args.cap:g} s, extrapolated",
        ["competitors", "load", "setting", "threads", "updates", "mean ms/update", "seconds", "vs best hand-picked"],
        rows,
    )
    print(f"load at the end: {os.getloadavg()[0]:.1f}; the benchmark took {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
