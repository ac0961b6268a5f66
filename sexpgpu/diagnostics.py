"""Located diagnostics shared by every layer.

A user error is a `SxError` carrying a `Location`; the tools render it as a
compiler does (``file:line:col: error: message``, the source line, a caret)
and exit 1. Anything else that escapes is an internal bug and exits 3.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO

from attrs import define, field, frozen

#: Source text of every file read in this process, so a diagnostic can show its line.
_SOURCES: dict[str, str] = {}
#: SHA-256 of the bytes of every source file read from disk in this process.
_DIGESTS: dict[str, str] = {}


def remember_source(path: str, text: str, sha256: str | None = None) -> None:
    """Record the text of `path` so diagnostics located in it can quote lines (and the hash of its bytes)."""
    _SOURCES[path] = text
    if sha256 is not None:
        _DIGESTS[path] = sha256


def source_digest(path: str) -> str | None:
    """SHA-256 of the bytes of `path` as this process read them as source; None when it read no such file."""
    return _DIGESTS.get(path)


def source_line(path: str, line: int) -> str | None:
    """Line `line` of a source this process read; never a file only a location names (it is not opened)."""
    text = _SOURCES.get(path)
    if text is None:
        return None
    lines = text.splitlines()
    if 1 <= line <= len(lines):
        return lines[line - 1]
    return None


@frozen
class Location:
    """A position in a source file (1-based line and column).

    `via` is the frame the position was reached through when the user's form
    called library code (the prelude, a macro): the primary position is always
    the user's, `via` keeps the library's.
    """

    file: str
    line: int
    col: int
    end_col: int | None = None
    via: Location | None = None

    def __str__(self) -> str:
        return f"{display_path(self.file)}:{self.line}:{self.col}"

    def short(self) -> str:
        """`file:line`, as reports show it."""
        return f"{display_path(self.file)}:{self.line}"

    def with_via(self, via: Location | None) -> Location:
        return Location(self.file, self.line, self.col, self.end_col, via)


UNKNOWN = Location("<unknown>", 0, 0)


def display_path(path: str) -> str:
    """A path as diagnostics show it: relative to the working directory when below it."""
    if path.startswith("<"):
        return path
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


@frozen
class Note:
    loc: Location | None
    message: str


class SxError(Exception):
    """A user error at a location: bad source, bad IR, bad selection, bad data."""

    def __init__(
        self,
        message: str,
        loc: Location | None = None,
        notes: Iterable[Note] = (),
        trail: Iterable[Location] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.notes = list(notes)
        #: "called from" frames, innermost first.
        self.trail = list(trail)

    def render(self) -> str:
        return render_diagnostic("error", self.message, self.loc, self.notes, self.trail)


class UsageError(Exception):
    """The command line is wrong (exit 2)."""


def caret_lines(loc: Location) -> list[str]:
    line = source_line(loc.file, loc.line)
    if line is None or loc.col < 1:
        return []
    width = max(1, (loc.end_col - loc.col) if loc.end_col and loc.end_col > loc.col else 1)
    pad = "".join(ch if ch == "\t" else " " for ch in line[: loc.col - 1])
    return [f"  {line}", f"  {pad}^{'~' * (width - 1)}"]


def render_diagnostic(
    severity: str,
    message: str,
    loc: Location | None,
    notes: Iterable[Note] = (),
    trail: Iterable[Location] = (),
) -> str:
    out = [f"{loc}: {severity}: {message}" if loc else f"{severity}: {message}"]
    if loc:
        out += caret_lines(loc)
        if loc.via is not None:
            out.append(f"  in library code at {loc.via}")
    for frame in trail:
        out.append(f"  called from {frame.short()}")
    for note in notes:
        out.append(f"{note.loc}: note: {note.message}" if note.loc else f"note: {note.message}")
        if note.loc:
            out += caret_lines(note.loc)
    return "\n".join(out)


def warn(message: str, loc: Location | None = None, stream: TextIO | None = None) -> None:
    print(render_diagnostic("warning", message, loc), file=stream or sys.stderr)


@frozen
class Diagnostic:
    """One diagnostic as a sink collected it: "error", "warning" or "note", its message, where."""

    severity: str
    message: str
    loc: Location | None


@define
class DiagnosticSink:
    """The diagnostics of one compilation, in the order they were raised.

    A warning is printed on standard error as it is raised, unless `echo` is off
    (`sexpgpu-opt --verify-diagnostics` checks them instead). An error stops the
    compilation: whoever runs it records the error (`raising`) and the tool
    prints it. An error's notes follow it.
    """

    echo: bool = True
    diagnostics: list[Diagnostic] = field(factory=list)

    def warning(self, message: str, loc: Location | None = None) -> None:
        self.diagnostics.append(Diagnostic("warning", message, loc))
        if self.echo:
            warn(message, loc)

    def error(self, err: SxError) -> None:
        """Record `err` with its notes; an error gathering several (the verifier's) lists them in `errors`."""
        for single in getattr(err, "errors", [err]):
            self.diagnostics.append(Diagnostic("error", single.message, single.loc))
            self.diagnostics.extend(Diagnostic("note", note.message, note.loc) for note in single.notes)

    @contextmanager
    def raising(self) -> Iterator[None]:
        """Record the user error that escapes the block, and let it go on."""
        try:
            yield
        except SxError as err:
            self.error(err)
            raise


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate to suggest for a misspelt `name` ("did you mean"), or None.

    The nearest by edit distance (an adjacent transposition counts as one edit)
    within one edit for a name of up to 3 characters ('mpa' is 'map', 'x' is
    not 'exp') and max(2, len // 3) edits for a longer one; failing that, the
    most similar by `difflib` ratio (at least 0.6), so a transposition in a short
    name ('lenght' for 'len') still finds it. A candidate sharing no character
    with `name` is never suggested ('c' is not a misspelt '-'). Ties are broken
    by name, so the order of `candidates` does not matter.
    """
    candidates = [c for c in candidates if not set(c).isdisjoint(name)]
    limit = 1 if len(name) <= 3 else max(2, len(name) // 3)
    best_edit = min(((_edits(name, c, limit + 1), c) for c in candidates), default=None)
    if best_edit is not None and best_edit[0] <= limit:
        return best_edit[1]
    scored = [
        (difflib.SequenceMatcher(None, name, c).ratio(), len(os.path.commonprefix([name, c])), c) for c in candidates
    ]
    best = max(scored, default=None)
    return best[2] if best is not None and best[0] >= 0.6 else None


def _edits(a: str, b: str, cap: int) -> int:
    """Edit distance with adjacent transpositions counted as one edit; `cap` once it exceeds it."""
    if abs(len(a) - len(b)) >= cap:
        return cap
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) >= cap:
            return cap
        prev2, prev = prev, cur
    return min(prev[-1], cap)
