"""The one exception users see: the CLI turns it into one styled line and exit code 1.

    raise NanoGPTError("no dataset 'shk' in data/; these exist: shakespeare-char")
"""


class NanoGPTError(Exception):
    """A problem with the user's input or environment, worded as one sentence with a fix-it hint."""
