"""What a person watching `sexpgpu run` sees: a progress bar, or plain lines, and a summary.

On a terminal a rich progress bar shows the step, the latest loss, tokens/s
(records/s when the data is not a token stream) and the time left; evaluations and checkpoints print above it. When the
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


class Throughput:
    """A run's training throughput: what its steps processed over the seconds they took.

    `unit` is what the train loader counts: `tokens` for a token source, `records` otherwise
    (the elements of its first field are the `tokens_per_s` of the event log either way).
    The first step of a process warms up (its graphs' first calls), so when later steps ran it
    is left out; compilation, evaluations and checkpoints are never counted.
    """

    def __init__(self, unit: str) -> None:
        self.unit = unit
        #: (step, amount in `unit`, tokens, seconds) of each step.
        self.steps: list[tuple[int, int, int, float]] = []

    def add(self, step: int, amount: int, tokens: int, seconds: float) -> None:
        self.steps.append((step, amount, tokens, seconds))

    def _measured(self) -> list[tuple[int, int, int, float]]:
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    def per_second(self, column: int = 1) -> float:
        """The mean rate over the measured steps, in `unit` (column 2: in tokens)."""
        measured = self._measured()
        seconds = sum(entry[3] for entry in measured)
        return sum(entry[column] for entry in measured) / seconds if seconds > 0 else 0.0

    def tokens_per_second(self) -> float:
        return self.per_second(2)

    def describe(self) -> str:
        """The summary's line: the rate and what it counts."""
        measured = self._measured()
        if not measured:
            return f"no training step ran, no {self.unit}/s"
        first, last = measured[0][0], measured[-1][0]
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        warm_up = "the first step's warm-up, " if len(self.steps) > 1 else ""
        return (f"{self.per_second():,.0f} {self.unit}/s over {steps} (training only: not compilation, {warm_up}"
                "evaluations or checkpoints)")


class ProgressReporter:
    """Shows the run's progress on `stream`: a live bar on a terminal, plain lines otherwise.

    `unit` names what the rate counts (`tok` or `rec`), as in `42,103 tok/s`.
    """

    def __init__(self, total_steps: int, start_step: int, stream: TextIO | None = None,
                 interactive: bool | None = None, unit: str = "tok") -> None:
        self.stream = stream or sys.stdout
        self.unit = unit
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
                TextColumn(f"{{task.fields[rate]}} {unit}/s"),
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
        """A step's line (every few steps when not on a terminal): `tokens_per_s` is in the reporter's unit."""
        shown = f"{loss:.4f}" if loss is not None else "nan"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=shown, rate=f"{tokens_per_s:,.0f}")
        elif step % self.every == 0 or step == self.total:
            self.say(f"step {step}/{self.total}  loss {shown}  {tokens_per_s:,.0f} {self.unit}/s  "
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
