"""What a benchmark shows on the terminal, through `rich`: a progress bar while it
measures, summary tables when it is done, and a PNG plot (when matplotlib is
installed; without it the run says so and the JSON rows still hold every number).

    with progress(total=len(cases), label="fused", enabled=world.rank == 0) as advance:
        for case in cases:
            ...
            advance(f"H={H} T={T}")       # one step; the text names what just finished
    print_table("all_reduce, us per op", ["size", "ours", "NCCL"], [["2 KiB", "3.9", "10.9"]])
    save_plot(draw, Path("out.png"))      # draw(plt) -> figure

Progress bars write to stdout; inside a bar, plain `print` lines appear above it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = ["console", "progress", "print_table", "save_plot", "fmt"]


def console():
    """The shared rich Console (stdout)."""
    from rich.console import Console

    global _CONSOLE
    if _CONSOLE is None:
        _CONSOLE = Console(highlight=False)
        if not _CONSOLE.is_terminal:  # a log file: wide enough for the widest table
            _CONSOLE = Console(highlight=False, width=160)
    return _CONSOLE


_CONSOLE = None


@contextlib.contextmanager
def progress(total: int, label: str, *, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A progress bar of `total` steps; yields advance(text="") that completes one step.
    enabled=False (for example on ranks other than 0) yields a no-op."""
    if not enabled:
        yield lambda text="": None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[item]}"))
    con = console()
    with Progress(*columns, console=con, auto_refresh=con.is_terminal, refresh_per_second=4) as bar:
        task = bar.add_task(label, total=total, item="")
        yield lambda text="": bar.update(task, advance=1, item=text)


def fmt(value, digits: int = 2, missing: str = "–") -> str:
    """A number for a table cell: fixed digits; None and NaN as `missing`."""
    if value is None or (isinstance(value, float) and value != value):
        return missing
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence], *, caption: str | None = None) -> None:
    """A table on the terminal; cells are shown with str()."""
    from rich.table import Table

    table = Table(caption=caption)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(c) for c in row])
    console().print(f"[bold]{title}[/bold]")
    console().print(table)


def save_plot(draw: Callable, path: Path) -> Path | None:
    """Call draw(pyplot) -> figure and write it to `path` as PNG. Returns the path, or
    None (with a message) when matplotlib is not installed or drawing failed: a plot
    must never lose the measured rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console().print("matplotlib is not installed: no PNG (pip install matplotlib); the JSON rows hold every number")
        return None
    try:
        fig = draw(plt)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    except Exception as exc:  # noqa: BLE001 - reported, the rows are already written
        console().print(f"plot failed ({type(exc).__name__}: {exc}); the JSON rows hold every number")
        return None
    return path
