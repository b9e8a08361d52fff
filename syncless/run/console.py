"""Printing tables that stay readable in log files."""

from __future__ import annotations

from rich.console import Console, RenderableType


def print_wide(console: Console, renderable: RenderableType, min_width: int = 140) -> None:
    """Print ``renderable``, at least ``min_width`` columns wide when not on a terminal.

    A pipe or a log file reports 80 columns, which folds a wide table's numbers into
    ellipses; a terminal keeps its own width (and any live display keeps working).
    """
    if console.quiet:
        return
    if console.is_terminal or console.width >= min_width:
        console.print(renderable)
    else:
        Console(file=console.file, width=min_width, no_color=console.no_color).print(renderable)
