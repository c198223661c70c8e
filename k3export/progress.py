"""Progress bars for the few long loops (stage builds, check steps, network evaluation, the export).

One helper, `track`, wraps an iterable in a rich bar on stderr (description, bar, done/total,
elapsed and remaining time), or in nothing: it is quiet when stderr is not a terminal (logs, CI,
pipes, tests) or after `set_quiet(True)` (`--quiet`). Bars are transient: once a loop ends its
bar is gone, and the lines the loop printed stay. `spinner` shows elapsed time for one long call
whose length is unknown (the export's torch.export and ONNX translation).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def enabled() -> bool:
    """Whether bars are shown: stderr is a terminal and --quiet was not given."""
    return not _quiet and sys.stderr.isatty()


def _progress(*columns: object):  # -> rich.progress.Progress
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(file=sys.stderr), transient=True)


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Yields `items`, advancing a bar after each (total: len(items) unless given)."""
    if not enabled():
        yield from items
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    total = total if total is not None else len(items)  # type: ignore[arg-type]
    with _progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("remaining"), TimeRemainingColumn()) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


@contextlib.contextmanager
def spinner(description: str) -> Iterator[None]:
    """A spinner with elapsed time for the duration of the block."""
    if not enabled():
        yield
        return
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    with _progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) as bar:
        bar.add_task(description, total=None)
        yield
