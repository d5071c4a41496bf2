"""Rich consoles, the training progress display and result tables. Rich styling only on a terminal.

    from nanogpt_cli.ui import console; console.print(table)
"""

from __future__ import annotations

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
