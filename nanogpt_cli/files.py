"""Files: paths the user names on the command line (read a text file, check that a folder can be made; each
failure one sentence that names the flag), and the one atomic write that every file we write goes through.

    text = read_text_file(Path("prompt.txt"), "--prompt-file")
    write_json(run_path / "notes.json", {"ok": True})   # a crash mid-write leaves the previous file intact
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanogpt_cli.errors import NanoGPTError


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file named by `what` (a flag such as --config), or a NanoGPTError saying why not."""
    path = Path(path)
    if path.is_dir():
        raise NanoGPTError(f"{what} {path} is a folder; give a file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NanoGPTError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise NanoGPTError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if b"\x00" in data:
        raise NanoGPTError(f"{what} {path} is a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NanoGPTError(f"{what} {path} is not UTF-8 text (invalid byte at offset {e.start:,})") from None


def check_creatable(path: str | Path, what: str) -> None:
    """Refuse a folder that cannot be made, before anything is written: the nearest existing ancestor must be
    a writable folder (and `path` itself, if it exists, a folder)."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise NanoGPTError(f"{what} {path} is a file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise NanoGPTError(f"cannot write into {what} {path}: permission denied")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NanoGPTError(f"cannot create {what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise NanoGPTError(f"cannot create {what} {path}: no permission to write in {parent}")


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def usual_modes(path: str | Path) -> None:
    """Give a file, or a folder and everything in it, the mode a new one gets under the user's umask (0644 and
    0755 under the usual 022): some writers (safetensors, tempfile) create theirs 0600, readable by no one else."""
    path = Path(path)
    mask = current_umask()
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp) on a temporary file beside path, then rename it into place: a crash mid-write
    leaves the previous file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        usual_modes(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8"))


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a .jsonl file, and how many non-empty lines were not one (skipped)."""
    records, bad = [], 0
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad
