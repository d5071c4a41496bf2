"""A run folder: the only code that knows its file names. Its checks, the staged multi-file save and the
background writer that runs it (Saver), the resume with its recovery from a save cut short, config.json and
metrics.jsonl all live here; the trainer, `runs`, `info`, `plot` and `export` ask a RunDir instead of building
paths.

    run = RunDir("checkpoints/shk"); run.save(model, optimizer, TrainerState(step=500, ...), weights_meta)
    with Saver(run) as saver: saver.save(model, optimizer, state, weights_meta, is_best)  # returns while it writes
    saved = run.restore(); saved.load_weights(model); saved.load_optimizer(optimizer)

Layout of a run folder:
    config.json            the effective model and training config, and the history of values resumes changed
    model.safetensors      the last weights; metadata: config, tokenizer, step, tokens, val_loss, version
    best.safetensors       the weights with the lowest validation loss so far (when the last save is the best,
                           a hard link to model.safetensors: one copy on disk)
    optimizer.safetensors  the optimizer's state tensors; its hyperparameters as JSON metadata
    trainer.json           step, tokens, best val loss, RNG states, grad-scaler state
    metrics.jsonl          one JSON object per evaluation (kind "eval") and per --log-interval (kind "train")
    loss.png               the loss curves, when matplotlib is installed
    report.md, report.json the report card written at the end of each training or fine-tuning invocation (finished,
                           stopped or ended by the clock), and its figures, which `nanogpt report` compares
    tokenizer.json         a Hugging Face tokenizer's file, copied from the dataset (the metadata holds its sha256)
    .lock                  locked (flock) by the process training the run, for as long as it runs: `runs` says
                           "running", and another start in the folder is refused; the kernel lets go of it when the
                           process ends, however it ends
    .NAME.staged, .NAME.prev, .NAME.tmp-PID
                           a save in progress: the new files, the previous ones, a file being written; a process
                           killed during a save leaves some behind, which the next start clears

A folder with config.json but no checkpoint file yet is an empty run: one stopped before its first save, which
the command that started it starts again (nothing of value is in it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

try:
    import fcntl
except ImportError:  # not on POSIX: no lock, and `runs` cannot tell a running run
    fcntl = None

from nanogpt_cli import __version__
from nanogpt_cli.errors import NanoGPTError, first_line
from nanogpt_cli.files import atomic_write, check_creatable, read_jsonl, write_json
from nanogpt_cli.model import GPT
from nanogpt_cli.runs.checkpoint import (
    TrainerState,
    damage,
    file_step,
    load_optimizer,
    load_weights,
    model_tensors,
    optimizer_tensors,
    write_tensors,
)

LAST, BEST = "model.safetensors", "best.safetensors"
OPTIMIZER, TRAINER, CONFIG, METRICS = "optimizer.safetensors", "trainer.json", "config.json", "metrics.jsonl"
TOKENIZER = "tokenizer.json"  # hf_tokenizer.HF_FILE: the vocabulary of a Hugging Face tokenizer travels with the run
LOSS_PLOT = "loss.png"  # drawn from metrics.jsonl at the end of `nanogpt train` when matplotlib is installed
REPORT, REPORT_DATA = "report.md", "report.json"  # the report card (training/report.py) and its figures
RUNS_DIR = Path("checkpoints")  # the folder of runs: `nanogpt runs` lists it; a bare run name is looked up in it
LOCK = ".lock"  # held by the process training the run (see the module docstring)
SAVED = (LAST, BEST, OPTIMIZER, TRAINER)  # a save's files: a run with none of them is empty


class RunDir:
    """The one owner of a run folder's layout (see the module docstring): its checks, the staged multi-file
    save and the resume with its recovery from a save cut short, config.json and metrics.jsonl."""

    FILES = (LAST, BEST, OPTIMIZER, TRAINER, CONFIG, METRICS, LOSS_PLOT, TOKENIZER)

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def last_path(self) -> Path:
        """The last weights (what --last means)."""
        return self.path / LAST

    @property
    def best_path(self) -> Path:
        return self.path / BEST

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    @property
    def loss_plot_path(self) -> Path:
        return self.path / LOSS_PLOT

    @property
    def report_path(self) -> Path:
        return self.path / REPORT

    def write_report(self, markdown: str, figures: dict[str, Any]) -> None:
        """report.md and report.json, each replaced whole."""
        with self._writing(REPORT):
            atomic_write(self.report_path, lambda tmp: tmp.write_text(markdown, encoding="utf-8"))
            write_json(self.path / REPORT_DATA, figures)

    def read_report(self) -> tuple[str, dict[str, Any]] | None:
        """The report card and its figures, or None where the run has none (yet)."""
        if not self.report_path.is_file() or not (self.path / REPORT_DATA).is_file():
            return None
        return self.report_path.read_text(encoding="utf-8"), self._read_json(REPORT_DATA)

    def has_run(self) -> bool:
        return self.path.is_dir() and any((self.path / n).exists() for n in (LAST, TRAINER, CONFIG))

    def no_run_reason(self) -> str:
        """Why a folder is not a run, in words: the files it lacks."""
        return f"no {CONFIG}, {TRAINER} or {LAST}"

    def has_trainer_state(self) -> bool:
        """Whether the folder holds what resuming needs besides weights (the trainer state or the optimizer's);
        a folder with weights only can start a new run (--init-from), not continue this one."""
        return (self.path / TRAINER).is_file() or (self.path / OPTIMIZER).is_file()

    def weights_files(self) -> list[Path]:
        """The weights files present, best first."""
        return [p for p in (self.best_path, self.last_path) if p.is_file()]

    def is_empty(self) -> bool:
        """A run stopped before its first save: our config.json (and progress lines) but not one checkpoint file. A
        folder with another config.json (a Hugging Face model's, with sharded weights) is not one: starting a run
        there deletes nothing without --force."""
        if not self.has_run() or any((self.path / n).exists() for n in SAVED):
            return False
        try:
            self.read_config()  # ours: a model and a train config
        except NanoGPTError:
            return False
        return True

    def check(self, resume: bool, force: bool) -> None:
        """A run folder must be new, empty, an empty run, or (with --resume / --force) a run; anything else, or a
        run being trained now, is refused."""
        if self.path.exists() and not self.path.is_dir():
            raise NanoGPTError(f"--out {self.path} is a file, not a folder")
        if resume and force:
            raise NanoGPTError("--resume continues the run in --out and --force deletes it; give one of them")
        owner = self.running()
        if owner is not None:
            raise NanoGPTError(f"{self.path} is being trained now{_by(owner)}; wait for it to end, or stop it first")
        if resume:
            if self.is_empty():
                raise NanoGPTError(
                    f"--resume: {self.path} was stopped before its first save, so there is nothing to resume; "
                    "start it again with the command that started it, without --resume"
                )
            if not self.has_run():
                raise NanoGPTError(
                    f"--resume: {self.path} holds no run to resume (no {TRAINER} and {CONFIG}); "
                    "start it without --resume"
                )
        elif self.has_run() and not force and not self.is_empty():
            raise NanoGPTError(
                f"{self.path} already holds a run; pass --resume to continue it or --force to "
                "start over (this deletes it)"
            )
        elif not self.has_run() and self.path.is_dir() and any(not _leftover(p.name) for p in self.path.iterdir()):
            raise NanoGPTError(f"--out {self.path} holds other files and no run; choose a new or empty folder")
        elif not self.has_run():
            check_creatable(self.path, "--out")

    def start(self, force: bool) -> None:
        """A fresh run: with --force, or in an empty run, delete the files of the run there, and nothing else."""
        if force or self.is_empty():
            for name in self.FILES:
                (self.path / name).unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)

    # --- the process that trains the run ---

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Own the folder while training in it: its lock, taken (or the run is being trained by another process,
        which is refused) and kept until the block ends; then the files a save cut short left behind are cleared.
        The kernel lets go of the lock when the process ends, kill -9 included, so it is never stale."""
        if fcntl is None:
            yield
            return
        made = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise NanoGPTError(f"cannot write into --out {self.path}: {_reason(e)}") from None
        try:
            for _ in range(40):  # `runs` holds a shared lock for a moment while it looks
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.025)
            else:
                owner = self.running() or {}
                raise NanoGPTError(
                    f"{self.path} is being trained now{_by(owner)}; wait for it to end, or stop it first"
                )
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "started": started}).encode())
            self.clear_leftovers()
            yield
        finally:
            with contextlib.suppress(OSError):  # refused before it wrote anything: no folder is left behind
                if made and [p.name for p in self.path.iterdir()] == [LOCK]:
                    (self.path / LOCK).unlink()
                    self.path.rmdir()
            os.close(fd)  # lets go of the lock; the file stays (removing it would race a process opening it)

    def running(self) -> dict[str, Any] | None:
        """The process training this run now, as its lock records it ({"pid", "started"}), or None."""
        path = self.path / LOCK
        if fcntl is None or not path.is_file():
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    record = json.loads(os.read(fd, 4096) or b"{}")
                except (OSError, ValueError):
                    record = {}
                return {"pid": None, "started": None, **(record if isinstance(record, dict) else {})}
            return None
        finally:
            os.close(fd)

    def clear_leftovers(self) -> None:
        """The files a process killed during a save left behind (its caller holds the lock, so no save is being
        written): staged and temporary files, and kept predecessors that the last complete save has replaced."""
        try:
            step = self.read_trainer().step
        except NanoGPTError:
            step = None
        for p in list(self.path.iterdir()):
            name = p.name
            if not name.startswith(".") or name == LOCK:
                continue
            if name.endswith(".staged") or ".tmp-" in name:
                p.unlink(missing_ok=True)
            elif name.endswith(".prev") and step is not None:
                # needed only while its file is from a save newer than the trainer state's (one cut short)
                final = self.path / name[1 : -len(".prev")]
                saved = file_step(final) if final.is_file() and final.name != TRAINER else None
                if final.name == TRAINER or (saved is not None and saved <= step):
                    p.unlink(missing_ok=True)

    def keep_tokenizer(self, data_dir: Path) -> None:
        """Copy the dataset's tokenizer.json into the run (a Hugging Face tokenizer; other kinds have none), so the
        run samples, serves and exports without the dataset."""
        src = Path(data_dir) / TOKENIZER
        if src.is_file() and src.resolve() != (self.path / TOKENIZER).resolve():
            shutil.copyfile(src, self.path / TOKENIZER)

    # --- config.json and metrics.jsonl ---

    def write_config(self, config: dict[str, Any], changes: dict[str, Any] | None = None) -> None:
        """config.json: the effective config, and its "history": the training values resumes changed, each entry
        {"step", "changes": [{"flag", "saved", "given"}], "time"}, kept from the file being replaced."""
        history = []
        if (self.path / CONFIG).is_file():
            try:
                history = list(self.read_config().get("history") or [])
            except NanoGPTError:
                pass  # a damaged config.json is being replaced: its history is lost with it
        if changes:
            history.append(changes)
        with self._writing(CONFIG):
            write_json(self.path / CONFIG, {**config, "history": history, "version": __version__})

    @contextlib.contextmanager
    def _writing(self, name: str) -> Iterator[None]:
        """A write of one of the run's small files: its failure is one sentence, which says what is kept."""
        try:
            yield
        except OSError as e:
            raise NanoGPTError(f"cannot write {self.path / name} ({_reason(e)}); {self.kept()}") from None

    def read_config(self) -> dict[str, Any]:
        config = self._read_json(CONFIG)
        if not isinstance(config, dict) or not {"model", "train"} <= set(config):
            raise NanoGPTError(f"{self.path / CONFIG} is damaged (no model and train config in it){self._init_hint()}")
        return config

    def read_trainer(self) -> TrainerState:
        try:
            return TrainerState.from_json(self._read_json(TRAINER))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, NanoGPTError):
                raise
            raise NanoGPTError(f"{self.path / TRAINER} is damaged (missing {e}){self._init_hint()}") from None

    def _read_json(self, name: str) -> Any:
        path = self.path / name
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise NanoGPTError(f"{path} is missing{self._init_hint()}") from None
        except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise NanoGPTError(f"{path} is damaged ({first_line(e)}){self._init_hint()}") from None

    def _init_hint(self) -> str:
        """How to go on when the run cannot be resumed: its weights, if intact, start a new run."""
        for name in (BEST, LAST):
            if damage(self.path / name) is None:
                flag = "" if name == BEST else " --last"
                return (
                    f"; its {name} (step {file_step(self.path / name)}) is intact: start a new run from it with "
                    f"`nanogpt train --init-from {self.path}{flag} --out NEW_FOLDER ...` (fresh optimizer)"
                )
        return ""

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self._writing(METRICS), open(self.path / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> tuple[list[dict[str, Any]], int]:
        """The records of metrics.jsonl, and how many lines were skipped because they are not JSON objects (a
        crash mid-write tears the last line)."""
        path = self.path / METRICS
        if not path.is_file():
            return [], 0
        return read_jsonl(path)

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines written after the checkpoint we resume from (they will be written again), and
        lines torn by a crash."""
        path = self.path / METRICS
        if not path.is_file():
            return
        records, _ = read_jsonl(path)
        lines = [json.dumps(r) for r in records if r.get("step", 0) <= step]
        with self._writing(METRICS):
            atomic_write(path, lambda tmp: tmp.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8"))

    def check_resumable(self) -> tuple[TrainerState, list[str]]:
        """Everything a resume reads, checked before anything is written: the trainer state, and weights and
        optimizer files saved at its step (or their kept predecessors). Returns the state and notes to show."""
        state = self.read_trainer()
        for name in (LAST, OPTIMIZER):
            if _matching(self.path / name, state.step) is None:
                problem = damage(self.path / name)
                if problem is None:
                    problem = f"from step {file_step(self.path / name)}, not the trainer's step {state.step}"
                raise NanoGPTError(f"cannot resume {self.path}: {name} is {problem}{self._init_hint()}")
        notes = []
        _, torn = self.read_metrics()
        if torn:
            notes.append(f"{self.path / METRICS}: skipped {torn} damaged line(s) (a crash while writing?)")
        return state, notes

    # --- save and restore ---

    def save(
        self,
        model: GPT,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        weights_meta: dict[str, Any],
        is_best: bool,
        model_state: dict | None = None,
        optimizer_state: dict | None = None,
    ) -> None:
        """One save, written now from the live tensors (Saver writes them in the background)."""
        self.write(Snapshot.take(model, optimizer, state, weights_meta, is_best, model_state, optimizer_state))

    def write(self, snap: Snapshot) -> None:
        """Write every file under a temporary name first, then rename them into place one after another, so a
        crash can at worst leave files of two adjacent saves, which restore() detects, never a half-written one.
        trainer.json is renamed last: it names the step the others must match. Each file reaches the disk before
        the renames, and the renames before this returns (fsync): a save that returned survives a power cut. A
        write that fails (a full disk, a file too large, a folder gone) is one NanoGPTError that says the
        previous save is intact, which it is: nothing of it is touched before every new file is written."""
        staged: list[tuple[Path, Path]] = []

        def stage(name: str, write) -> None:
            tmp = self.path / f".{name}.staged"
            staged.append((tmp, self.path / name))  # before the write: one cut short (Ctrl-C) is removed too
            write(tmp)
            _sync(tmp)

        try:
            stage(LAST, lambda p: write_tensors(p, snap.weights, snap.weights_meta))
            _between_files()
            if snap.is_best:  # the same bytes: a second name for the file just written, not a second write
                stage(BEST, functools.partial(_link_or_copy, staged[0][0]))
            stage(OPTIMIZER, lambda p: write_tensors(p, snap.optimizer, snap.optimizer_meta))
            stage(TRAINER, lambda p: write_json(p, snap.trainer))
            # keep the previous set reachable (hard links: no copy) until the new one is complete
            for _, final in staged:
                _prev(final).unlink(missing_ok=True)
                if final.exists():
                    os.link(final, _prev(final))
            for tmp, final in staged:
                os.replace(tmp, final)
            _sync(self.path)  # the renames themselves
            for _, final in staged:
                _prev(final).unlink(missing_ok=True)
        except (OSError, SafetensorError) as e:
            raise NanoGPTError(
                f"saving step {snap.trainer['step']:,} in {self.path} failed ({_reason(e)}); {self.kept()}"
            ) from None
        finally:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)

    def kept(self) -> str:
        """What is on disk to go on from, in words: the save that restore() would take, and how to continue."""
        try:
            step = self.restore().state.step
        except NanoGPTError:
            return "no complete checkpoint of this run is on disk"
        return f"the checkpoint of step {step:,} there is intact: once that is fixed, --resume continues from it"

    def restore(self) -> SavePoint:
        """The last complete save, to resume from. A save cut short between its renames leaves newer files
        beside the older trainer.json: their predecessors are still there as hard links, so those are taken."""
        state = self.read_trainer()
        weights, optim = (_matching(self.path / name, state.step) for name in (LAST, OPTIMIZER))
        if weights is None or optim is None:
            found = {name: file_step(self.path / name) for name in (LAST, OPTIMIZER)}
            raise NanoGPTError(
                f"the checkpoint files in {self.path} are from different steps (weights "
                f"{found[LAST]}, optimizer {found[OPTIMIZER]}, trainer {state.step}): a save was cut "
                "short; start over with --force or --init-from"
            )
        return SavePoint(state, weights, optim)


# Seconds a save sleeps between writing its weights and its optimizer: a test's way to stop or kill a run
# while a background save is half written. Never set it outside tests.
SLOW_SAVE_S = float(os.environ.get("NANOGPT_TEST_SLOW_SAVE", "0") or 0)
# The writer thread's nice value (Linux): below training, so that on a machine with no idle core the updates
# go first without starving the writer (benchmarks/README.md, Measurements behind the code).
WRITER_NICE = 10


def _between_files() -> None:
    if SLOW_SAVE_S:
        time.sleep(SLOW_SAVE_S)


@dataclass
class Snapshot:
    """One save's content, taken on the training thread: the weights' and the optimizer's tensors with their
    header metadata, and the trainer state as JSON. Taken into buffers, its tensors are host-memory copies that
    training no longer changes, which a background writer may take its time over."""

    weights: dict[str, torch.Tensor]
    weights_meta: dict[str, str]
    optimizer: dict[str, torch.Tensor]
    optimizer_meta: dict[str, str]
    trainer: dict[str, Any]
    is_best: bool

    @classmethod
    def take(
        cls,
        model: GPT,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        weights_meta: dict[str, Any],
        is_best: bool,
        model_state: dict | None = None,
        optimizer_state: dict | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> Snapshot:
        """model_state / optimizer_state: the full states when model and optimizer hold shards, gathered by
        distributed.full_states into host memory of their own (so never copied again); None: the live objects'
        states, copied into host buffers when `buffers` is given (see _host_copy), else taken as they are."""
        meta = dict(weights_meta, step=state.step, tokens=state.tokens)
        weights, weights_header = model_tensors(model, meta, model_state)
        optim, optim_header = optimizer_tensors(optimizer, state.step, optimizer_state)
        if buffers is not None:
            weights = weights if model_state is not None else _host_copy(weights, buffers, "weights.")
            optim = optim if optimizer_state is not None else _host_copy(optim, buffers, "optimizer.")
        return cls(weights, weights_header, optim, optim_header, state.to_json(), is_best)


def _host_copy(tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], prefix: str) -> dict:
    """Each tensor copied into a host buffer kept from the previous save (memory already touched: fresh memory
    costs a page fault per 4 KiB, more than the copy itself); pinned for a GPU's tensors, whose copies run
    asynchronously until one wait at the end. A CPU tensor is copied by numpy, on this thread: torch's copy runs
    on its intra-op threads, which on a busy machine made it several times slower."""
    out, on_gpu = {}, False
    for name, t in tensors.items():
        buf = buffers.get(prefix + name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = buffers[prefix + name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        if t.device.type == "cpu" and t.is_contiguous():
            np.copyto(buf.view(-1).view(torch.uint8).numpy(), t.view(-1).view(torch.uint8).numpy())
        else:
            buf.copy_(t, non_blocking=t.is_cuda)
            on_gpu = on_gpu or t.is_cuda
        out[name] = buf
    if on_gpu:
        torch.cuda.synchronize()
    return out


class Saver:
    """A run's saves, written by a background thread: save() takes a Snapshot (a host copy of the state, the
    only part that stalls the loop) and returns while the thread writes it through RunDir.write, whose staged
    renames keep a save cut short (kill -9) invisible. A save waits only for the one before it still being
    written, so the one host copy is reused; wait() (and leaving the `with` block) waits for the write in
    progress and raises its error. background=False writes every save on the caller's thread, with no copy
    (--sync-save). Under torchrun every rank has one and takes part in the gather; only rank 0's writes.

        with Saver(run) as saver: saver.save(model, optimizer, state, meta, is_best)
    """

    def __init__(self, run: RunDir, background: bool = True, writes: bool = True):
        self.run, self.background, self.writes = run, background, writes
        self._thread: threading.Thread | None = None
        self._written = threading.Event()  # set when the write in progress has ended
        self._error: BaseException | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # the host copy, reused by every save until the run ends

    def save(
        self,
        model: GPT,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        weights_meta: dict[str, Any],
        is_best: bool,
        full_states: Callable[[], tuple[dict | None, dict | None]] | None = None,
        background: bool = True,
    ) -> None:
        """Hand one save over. full_states(): the gather of a sharded model's and optimizer's states, which
        every rank joins; it comes after the wait, so rank 0 never holds two copies. background=False: write it
        now, with no copy (the last save of a run, which is waited for anyway)."""
        self.wait()
        model_state, optimizer_state = full_states() if full_states else (None, None)
        if not self.writes:
            return
        background = background and self.background
        buffers = self._buffers if background else None
        snap = Snapshot.take(model, optimizer, state, weights_meta, is_best, model_state, optimizer_state, buffers)
        if not background:
            self.run.write(snap)
            return
        self._written = threading.Event()
        self._thread = threading.Thread(target=self._write, args=(snap, self._written), name="nanogpt-save")
        self._thread.start()  # not a daemon: even an interpreter on its way out finishes the write first

    def _write(self, snap: Snapshot, written: threading.Event) -> None:
        if sys.platform == "linux":  # a lower CPU priority for this thread alone: training goes first
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            self.run.write(snap)
        except BaseException as e:  # raised on the training thread by the next save or wait
            self._error = e
        finally:
            written.set()

    def busy(self) -> bool:
        """Whether a save is being written now."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the save in progress is written; its error, if it failed."""
        if self._thread is not None:
            # the event first: a join that Ctrl-C interrupts leaves the thread looking finished (CPython before
            # 3.13), and neither a second wait nor the interpreter's exit would then wait for the write
            self._written.wait()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.wait()
        except Exception:
            if exc is None:
                raise
            # already failing: the write is finished, and the first error is the one raised
        finally:
            self._buffers.clear()


@dataclass
class SavePoint:
    """One complete save in a run folder: the trainer state and the weights and optimizer files of its step.
    The trainer loads the weights before it wraps the model for many processes, the optimizer after."""

    state: TrainerState
    weights: Path
    optimizer: Path

    def load_weights(self, model: GPT) -> None:
        load_weights(model, self.weights)

    def load_optimizer(self, optimizer, load: Callable[[torch.optim.Optimizer, dict], None] | None = None) -> None:
        """load(part, state): how each optimizer part takes its state (see checkpoint.load_optimizer)."""
        load_optimizer(self.optimizer, optimizer, load)


def find_run(source: str | Path) -> str | Path:
    """Where a source the user gave points: itself when it exists (a path that exists always wins), is hf:NAME or
    has a folder in it; a bare run name as `nanogpt runs` prints it ("shk") is that run's folder under RUNS_DIR
    when there is one. Whatever names nothing comes back as given, for the loader's own error."""
    text = str(source)
    if text.startswith("hf:") or text in ("", ".", "..") or Path(text).name != text or Path(text).exists():
        return source
    named = RUNS_DIR / text
    return named if named.exists() else source


def resolve_weights(path: str | Path, last: bool = False) -> Path:
    """A weights file from a run folder (best, or last with last=True), a file path or a bare run name (find_run),
    with a clear error; a damaged file is refused with a pointer to an intact one where the folder has it."""
    path = Path(find_run(path))
    if path.is_dir():
        names = [LAST] if last else [BEST, LAST]
        for name in names:
            if (path / name).is_file():
                _check_intact(path / name)
                return path / name
        found = sorted(p.name for p in path.iterdir())
        hint = ""
        if last and (path / BEST).is_file() and damage(path / BEST) is None:
            hint = f"; its {BEST} is intact: use it without --last"
        raise NanoGPTError(f"no checkpoint in {path}: it holds {', '.join(found) or 'nothing'}{hint}")
    if not path.exists():
        raise NanoGPTError(missing_source(path))
    _check_intact(path)
    return path


def missing_source(path: str | Path) -> str:
    """The error for a source that names nothing: the paths tried (a bare name is also tried under RUNS_DIR) and
    the runs (and exports, which hold a config.json too) in the folder it would be in."""
    path = Path(path)
    bare = path.name == str(path)
    folder = RUNS_DIR if bare else path.parent
    tried = f"checkpoint {path} does not exist" + (f", nor does {RUNS_DIR / path}" if bare else "")
    if not folder.is_dir():
        return f"{tried}; there is no folder {folder}"
    runs = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and RunDir(p).has_run())
    return f"{tried}; runs in {folder}: {', '.join(runs)}" if runs else f"{tried}; {folder} holds no runs"


def _check_intact(path: Path) -> None:
    """Refuse a damaged weights file, naming an intact alternative in its run folder: best for last and the
    other way round (the --last flag switches), or the previous save kept during a save that was cut short."""
    problem = damage(path)
    if problem is None:
        return
    hints = []
    other = {LAST: BEST, BEST: LAST}.get(path.name)
    if other and damage(path.parent / other) is None:
        step = file_step(path.parent / other)
        use = "with --last" if other == LAST else "without --last"
        hints.append(f"its {other} (step {step}) is intact: use it {use}")
    if damage(_prev(path)) is None:
        hints.append(f"the previous save {_prev(path).name} is intact: move it to {path.name} to use it")
    hint = f"; {'; '.join(hints)}" if hints else ""
    raise NanoGPTError(f"{path} is {problem}{hint}")


def _link_or_copy(src: Path, dst: Path) -> None:
    """dst as a hard link to src (one copy of the bytes on disk); a copy where the filesystem has no links. Files
    are only ever replaced, never written in place, so the two names stay independent."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _prev(path: Path) -> Path:
    return path.with_name(f".{path.name}.prev")


def _matching(path: Path, step: int) -> Path | None:
    """path, or its kept predecessor, whichever was saved at step."""
    for candidate in (path, _prev(path)):
        if candidate.is_file() and file_step(candidate) == step:
            return candidate
    return None


def _leftover(name: str) -> bool:
    """A file of ours that is no run by itself: the lock, or what a save cut short left behind."""
    return name == LOCK or (name.startswith(".") and (name.endswith((".staged", ".prev")) or ".tmp-" in name))


def _by(owner: dict[str, Any]) -> str:
    """ " by process 1234 (since 2026-01-01T10:00:00+00:00)", from a lock's record, or "" where it has none."""
    if not owner.get("pid"):
        return ""
    return f" by process {owner['pid']}" + (f" (since {owner['started']})" if owner.get("started") else "")


def _reason(e: BaseException) -> str:
    """An I/O error in words: "No space left on device" (safetensors wraps the system's error in its own)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = first_line(e)
    text = text.split("I/O error: ", 1)[-1]  # "Error while serializing: I/O error: File too large (os error 27)"
    return text.split(" (os error", 1)[0]


def _sync(path: Path) -> None:
    """Have a file's data, or a folder's entries, reach the disk (where the platform syncs folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():  # Windows opens no folders: its renames are as durable as it makes them
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)
