"""The run record's event log: `DIR/events.jsonl`, one JSON object a line.

Every event has `type` and `time` (seconds since the epoch). The types and
their fields are the JSON Schema `sexpgpu/schemas/events.schema.json`, shipped
with the package and documented in `docs/verbs/run.md`. Numbers that are not
finite (a diverged loss) are written as `null`, since JSON has no NaN; the
`end` event names the offending metric and its value as text.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

EVENT_TYPES = ("start", "lowering", "step", "eval", "diagnostic", "checkpoint", "end")
END_STATUSES = ("done", "interrupted", "diverged", "failed")


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def make_record_dir(path: Path) -> None:
    """Create a run record's directory (and its parents): a path that is a file, or a place that
    cannot be written, is a wrong command line naming it."""
    from ..diagnostics import UsageError, display_path

    shown = display_path(str(path))
    if path.exists() and not path.is_dir():
        raise UsageError(f"cannot write the run record to {shown}: it is a file, not a directory; choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.TemporaryFile(dir=path)
    except OSError as err:
        raise UsageError(f"cannot write the run record to {shown}: {err.strerror or err}; choose another --out") from None
    probe.close()


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
    """Appends events to `events.jsonl`; each line is flushed at once so a crash loses at most one.

    A log whose last line was torn by a killed run gets its newline first, so the
    next event starts a line of its own (the torn line stays, and readers skip it).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        make_record_dir(self.path.parent)
        try:
            self._file = open(self.path, "a+b")  # noqa: SIM115  (closed by close())
            if self._file.tell() > 0:
                self._file.seek(-1, os.SEEK_END)
                if self._file.read(1) != b"\n":
                    self._file.write(b"\n")
                    self._file.flush()
        except OSError as err:
            raise self._cannot_write(err) from None

    def write(self, type_: str, **fields: Any) -> dict[str, Any]:
        if type_ not in EVENT_TYPES:
            raise ValueError(f"unknown event type {type_}")
        event = {"type": type_, "time": round(time.time(), 3), **_jsonable(fields)}
        try:
            self._file.write((json.dumps(event, allow_nan=False) + "\n").encode())
            self._file.flush()
            if type_ in ("checkpoint", "end"):
                os.fsync(self._file.fileno())
        except OSError as err:  # a full disk, a vanished mount
            raise self._cannot_write(err) from None
        return event

    def _cannot_write(self, err: OSError) -> Exception:
        from ..diagnostics import SxError, display_path

        return SxError(f"cannot write the event log {display_path(str(self.path))}: {err.strerror or err}")

    def close(self) -> None:
        # Every event was flushed when written; what a failed write left buffered is already reported.
        with contextlib.suppress(OSError):
            self._file.close()


#: What may follow the digits a JSON decoder took when a number was cut short: `1.`, `2e`, `3e-`.
_NUMBER_TAIL = re.compile(r"[-+.eE0-9]*")


def _torn(line: str, err: json.JSONDecodeError) -> bool:
    """Whether a line that is not JSON is an event cut short (a run killed while writing it).

    Every event is one JSON object, so a torn one starts with `{` and fails only for
    want of the rest: inside a string, or where the line ends (or ends partway
    through a number, `true`, `false` or `null`). A line edited into something
    else fails earlier and is no torn event.
    """
    if not line.startswith("{"):
        return False
    if err.msg.startswith("Unterminated string"):
        return True
    rest = line[err.pos :].rstrip()
    return _NUMBER_TAIL.fullmatch(rest) is not None or any(word.startswith(rest) for word in ("true", "false", "null"))


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event of a log, in order; lines torn by a killed run (the last, or one a resumed run
    terminated) are skipped.

    Any other line that is not a JSON object is an error located at it: the log was
    edited or is not a run's.
    """
    from ..diagnostics import Location, SxError, remember_source

    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError as err:
        raise SxError(f"cannot read {path}: {err.strerror or err}") from None
    remember_source(str(path), text)
    events = []
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as err:
            if _torn(line, err):
                continue
            raise SxError(
                f"not a run's event log: this line is not JSON ({err.msg.lower()})",
                Location(str(path), i + 1, err.colno),
            ) from None
        if not isinstance(event, dict):
            raise SxError("not a run's event log: this line is not a JSON object", Location(str(path), i + 1, 1))
        wrong = _malformed(event)
        if wrong is not None:
            raise SxError(f"not a run's event log: {wrong}", Location(str(path), i + 1, 1))
        events.append(event)
    return events


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _malformed(event: dict[str, Any]) -> str | None:
    """What is wrong with the fields readers of the log rely on (the step, the loss, the metrics), if anything."""
    kind = event.get("type")
    if not isinstance(kind, str):
        return "this event has no type"
    if kind not in ("step", "eval", "diagnostic", "checkpoint"):
        return None
    step = event.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"this {kind} event's step is not a step number"
    if not _is_number(event.get("loss")):
        return f"this {kind} event's loss is not a number"
    for key in ("metrics", "counters", "values"):
        table = event.get(key, {})
        if not isinstance(table, dict) or not all(_is_number(v) for v in table.values()):
            return f"this {kind} event's {key} are not numbers by name"
    return None


def events_schema() -> dict[str, Any]:
    """The JSON Schema every line of `events.jsonl` satisfies."""
    text = resources.files("sexpgpu").joinpath("schemas/events.schema.json").read_text(encoding="utf-8")
    return json.loads(text)
