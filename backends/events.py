"""The run record's event log: `DIR/events.jsonl`, one JSON object a line.

Every event has `type` and `time` (seconds since the epoch). The types and
their fields are the JSON Schema `sexpgpu/schemas/events.schema.json`, shipped
with the package and documented in `docs/verbs/run.md`. Numbers that are not
finite (a diverged loss) are written as `null`, since JSON has no NaN; the
`end` event names the offending metric and its value as text.
"""

from __future__ import annotations

import json
import math
import os
import time
from importlib import resources
from pathlib import Path
from typing import Any

EVENT_TYPES = ("start", "lowering", "step", "eval", "diagnostic", "checkpoint", "end")
END_STATUSES = ("done", "interrupted", "diverged", "failed")


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _jsonable(value: Any) -> Any:
    """Plain JSON values: numpy scalars become Python numbers, non-finite floats null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, int):
        return value
    return str(value)


class EventLog:
    """Appends events to `events.jsonl`; each line is flushed at once so a crash loses at most one."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (closed by close())

    def write(self, type_: str, **fields: Any) -> dict[str, Any]:
        if type_ not in EVENT_TYPES:
            raise ValueError(f"unknown event type {type_}")
        event = {"type": type_, "time": round(time.time(), 3), **_jsonable(fields)}
        self._file.write(json.dumps(event, allow_nan=False) + "\n")
        self._file.flush()
        if type_ in ("checkpoint", "end"):
            os.fsync(self._file.fileno())
        return event

    def close(self) -> None:
        self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event of a log, in order (a torn last line from a killed run is skipped).

    A line that is not a JSON object anywhere else is an error located at it:
    the log was edited or is not a run's.
    """
    from ..diagnostics import Location, SxError

    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    events = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last:
                continue  # torn by a killed run
            raise SxError(
                f"not a run's event log: this line is not JSON ({err.msg.lower()})",
                Location(str(path), i + 1, err.colno),
            ) from None
        if not isinstance(event, dict):
            raise SxError("not a run's event log: this line is not a JSON object", Location(str(path), i + 1, 1))
        events.append(event)
    return events


def events_schema() -> dict[str, Any]:
    """The JSON Schema every line of `events.jsonl` satisfies."""
    text = resources.files("sexpgpu").joinpath("schemas/events.schema.json").read_text(encoding="utf-8")
    return json.loads(text)
