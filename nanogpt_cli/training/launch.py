"""Many processes from one command: `nanogpt train --nproc N` (and `finetune --nproc N`) starts N training
processes on this machine (and with --nnodes / --rdzv-endpoint joins those of other machines) through torch's
elastic launcher, run inside this process rather than by `torchrun`, so that what the user reads is ours: a
refused configuration is one line (it is refused before any process starts), Ctrl-C stops every process after a
save and the resume command is printed once, and a process that fails ends the launch with its one line, not the
launcher's report.

    code = launch(["--data", "shk", "--preset", "tiny", "--out", "checkpoints/tiny"], Launch(nproc=2))

Each process runs `python -m nanogpt_cli train ARGS` (or finetune) with torchrun's environment (RANK,
WORLD_SIZE, ...), exactly as under `torchrun ... -m nanogpt_cli train ARGS`, which keeps working. Under either
launcher a process that meets an error writes it to the error file torch's launcher reads
(TORCHELASTIC_ERROR_FILE), so torchrun's report shows our sentence instead of "To enable traceback see ...".
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogpt_cli.config import flag
from nanogpt_cli.errors import NanoGPTError

LAUNCH_ENV = "NANOGPT_LAUNCH"  # the launch flags, for the resume command a process prints


@dataclass(frozen=True)
class Launch:
    """--nproc, --nnodes, --rdzv-endpoint: processes on this machine, machines, where they meet."""

    nproc: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None

    def __post_init__(self):
        if self.nproc < 1 or self.nnodes < 1:
            raise NanoGPTError(f"--nproc and --nnodes must be at least 1, got {self.nproc} and {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise NanoGPTError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT: the address where the machines meet "
                "(the same on every machine, one of them reachable from the others)"
            )

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def flags(self) -> list[str]:
        """The flags that launch it again (in the resume command)."""
        flags = ["--nproc", str(self.nproc)]
        if self.nnodes > 1:
            flags += ["--nnodes", str(self.nnodes)]
        if self.rdzv_endpoint:
            flags += ["--rdzv-endpoint", self.rdzv_endpoint]
        return flags


def train_args(config_flags: dict[str, Any], options: dict[str, Any], out: Path) -> list[str]:
    """`nanogpt train`'s (or finetune's) arguments for each process: the config options given (config_flags, by
    field name), the command's own options (None or False: not given) and the run folder, which the launcher
    planned."""
    args: list[str] = []
    for name, value in config_flags.items():
        if isinstance(value, bool):
            args.append(f"--{flag(name)}" if value else f"--no-{flag(name)}")
        else:
            args += [f"--{flag(name)}", str(value)]  # a Choice prints as its value
    for name, value in options.items():
        if value is True:
            args.append(f"--{flag(name)}")
        elif value is not None and value is not False:  # 0 is a value (--distill-top-k 0), not "not given"
            args += [f"--{flag(name)}", str(value)]
    return [*args, "--out", str(out)]


def launch_flags() -> str:
    """In a process that `nanogpt train --nproc` started: its launch flags ("--nproc 2 "); "" elsewhere."""
    flags = os.environ.get(LAUNCH_ENV, "")
    return f"{flags} " if flags else ""


def launch(
    args: list[str], how: Launch, run_id: str = "nanogpt", env: dict[str, str] | None = None, command: str = "train"
) -> int:
    """Run `nanogpt COMMAND ARGS` (train or finetune) in how.world_size processes and wait for them; the exit
    code to leave with: 0, 130 / 143 after Ctrl-C or SIGTERM (every process stopped after a save, rank 0 printed
    how to resume), 1 after an error (rank 0 printed it, or this prints the failed process's one line). env: more
    for each process's environment (what planning here measured: --preset auto's probe)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        # the launcher's own log lines (its start-up, "failed (exitcode: 1)", the shutdown) are not the user's
        # business: what went wrong reaches them as our one line
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
    saved_env = {name: os.environ.get(name) for name in (LAUNCH_ENV, "OMP_NUM_THREADS", *(env or {}))}
    # the processes inherit it; this process gets its own back at the end
    os.environ.update(worker_env(how), **(env or {}))
    config = LaunchConfig(
        min_nodes=how.nnodes,
        max_nodes=how.nnodes,
        nproc_per_node=how.nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=how.rdzv_endpoint or "localhost:0",  # one machine: a free port, as torchrun --standalone
        max_restarts=0,  # a failed run stops; `--resume` continues it
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "nanogpt_cli", command, *args)
        return 0
    except SignalException as e:  # Ctrl-C or SIGTERM here: passed on to every process, each saved and stopped
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode in (1, 130, 143):  # an error, or a stop: the process said so itself
            return 1 if failure.exitcode == 1 else failure.exitcode
        message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
        raise NanoGPTError(
            f"training process {rank} ended with exit code {failure.exitcode}"
            + (f" ({message})" if message else "")
            + "; the processes were stopped"
        ) from None
    except Exception as e:  # the rendezvous (another machine, the endpoint), or starting the processes
        raise NanoGPTError(f"could not launch {how.world_size} training processes: {e}") from None
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def worker_env(how: Launch) -> dict[str, str]:
    """What each process gets in its environment: the launch flags (for its resume command) and, unless
    OMP_NUM_THREADS is set already, its CPU threads: the automatic choice (device.set_threads, made from the
    load when this command started) shared out between the processes here, said in one note line; each process
    keeps that count rather than choosing its own. A --threads given reaches each process as its argument."""
    from nanogpt_cli.device import auto_threads, take_threads_choice

    env = {LAUNCH_ENV: shlex.join(how.flags())}
    if os.environ.get("OMP_NUM_THREADS"):
        return env
    choice = take_threads_choice() or auto_threads()
    if choice.source == "given":
        env["OMP_NUM_THREADS"] = str(choice.threads)
    else:  # as torchrun does, shared out: N processes of all cores each would fight
        env["OMP_NUM_THREADS"] = str(choice.per_process(how.nproc))
        print(f"note: {choice.line(how.nproc)}", file=sys.stderr, flush=True)
    return env


def record_error(message: str) -> None:
    """Under a torch launcher (ours or torchrun), write a process's error where the launcher reads it, so its
    report of the failure shows this sentence."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": f"error: {message}", "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the error is still printed; the file only improves the launcher's report
