"""The load generator's progress bar."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplayProgress:
    """A rich progress bar on stderr: completions, with the errors so far."""

    total: int
    description: str
    _errors: int = 0
    _bar: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(),
                             console=Console(stderr=True), transient=False)
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=self.total, errors=0)

    def done(self, ok: bool) -> None:
        self._errors += not ok
        self._bar.update(self._task, advance=1, errors=self._errors)

    def close(self) -> None:
        self._bar.stop()
