"""What a person watching `sexpgpu run` sees: a progress bar, or plain lines, and a summary.

On a terminal a rich progress bar shows the step, the latest loss, tokens/s
and the time left; evaluations and checkpoints print above it. When the
output is not a terminal (a log file, CI) the same facts come as plain lines,
about twenty over the run, so a log stays short. Either way the run ends with
a one-screen summary.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

PLAIN_LINES_PER_RUN = 20


def format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def format_metrics(metrics: dict[str, float | None]) -> str:
    return "  ".join(f"{name} {value:.4f}" if value is not None else f"{name} nan" for name, value in metrics.items())


class ProgressReporter:
    """Shows the run's progress on `stream`: a live bar on a terminal, plain lines otherwise."""

    def __init__(self, total_steps: int, start_step: int, stream: TextIO | None = None,
                 interactive: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.every = max(1, (total_steps - start_step) // PLAIN_LINES_PER_RUN)
        self.console = Console(file=self.stream, highlight=False, soft_wrap=True)
        self.progress: Progress | None = None
        if self.interactive:
            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} tok/s"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, loss="-", rate="-")
            self.progress.start()

    def say(self, text: str) -> None:
        """A line that stays (an evaluation, a checkpoint, a warning)."""
        if self.progress is not None:
            self.progress.console.print(text, markup=False)
        else:
            print(text, file=self.stream, flush=True)

    def step(self, step: int, loss: float | None, tokens_per_s: float, seconds_left: float) -> None:
        shown = f"{loss:.4f}" if loss is not None else "nan"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=shown, rate=f"{tokens_per_s:,.0f}")
        elif step % self.every == 0 or step == self.total:
            self.say(f"step {step}/{self.total}  loss {shown}  {tokens_per_s:,.0f} tok/s  "
                     f"{format_seconds(seconds_left)} left")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, lines: list[tuple[str, Any]]) -> None:
        """The end-of-run summary: aligned `label  value` lines."""
        self.close()
        width = max(len(label) for label, _ in lines)
        for label, value in lines:
            print(f"  {label.ljust(width)}  {value}", file=self.stream)
        self.stream.flush()
