"""Paths the user names on the command line: read a text file or check that a folder can be made, each
failure one sentence that names the flag (a folder where a file was expected, a binary file, no permission).

    text = read_text_file(Path("prompt.txt"), "--prompt-file")
"""

from __future__ import annotations

import os
from pathlib import Path

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
