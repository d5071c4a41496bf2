"""The one exception users see: the CLI turns it into one styled line and exit code 1.

raise NanoGPTError("no dataset 'shk' in data/; these exist: shakespeare-char")
"""

from __future__ import annotations


class NanoGPTError(Exception):
    """A problem with the user's input or environment, worded as one sentence with a fix-it hint."""


def require(module: str, extra: str, what: str = "this command", package: str | None = None, also: str = ""):
    """Import an optional dependency from one of the package's extras, or say in one sentence how to install it:
    "plotting to a file needs the matplotlib package: pip install -e ".[plot]"". package: the name to show when
    it is not the module's first part (torch.utils.tensorboard needs tensorboard); also: a last clause."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise NanoGPTError(
            f'{what} needs the {package or module.split(".")[0]} package: pip install -e ".[{extra}]"{also}'
        ) from None


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its class name when it has none: for one-sentence errors."""
    return (str(e).strip() or type(e).__name__).splitlines()[0]
