"""`sexpgpu prepare`: text files to `train.bin` and `val.bin`, in nanoGPT's or llm.c's token files.

The inputs are read in order as one text, each file a document: a tokenizer
with an end-of-text token (`gpt2`) writes it between two documents of a split,
as nanoGPT's `prepare.py` does; `bytes` has none, and its files simply follow
each other. The split is by lines: the last `max(1, int(lines × val))` lines
go to `val.bin`, the rest to `train.bin` (nanoGPT's Shakespeare split, 90/10 by
default, kept on line boundaries; for `examples/data/corpus.txt` it is the
bundled `train.u16`/`val.u16` split exactly).

Text is encoded in pieces of about `_PIECE` characters cut where GPT-2's
pre-tokenizer would cut anyway (after a line break that follows and precedes
non-space characters), so the ids are those of encoding each split whole while
memory stays bounded. Both files are written to temporary siblings and renamed
into place when whole: a failure writes nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from attrs import frozen

from ..diagnostics import SxError, UsageError, display_path
from .token_files import NAME_OF_DTYPE, TokenFileWriter, dtype_for_vocabulary
from .tokenizers import Tokenizer

#: Characters read and encoded at once.
_PIECE = 1 << 20
#: The default fraction of lines that goes to val.bin (nanoGPT's Shakespeare split).
DEFAULT_VAL = 0.1
FORMATS = ("nanogpt", "llmc")


@frozen
class Prepared:
    """What `prepare` wrote: each split's file and token count, the dtype, the rate."""

    files: dict[str, tuple[Path, int]]
    dtype: str
    format: str
    tokenizer: str
    seconds: float
    tokens_per_s: float


def _safe_cut(text: str) -> int:
    """The end of the longest prefix of `text` that ends a line between two non-space characters, 0 if none."""
    end = len(text) - 1
    while True:
        cut = text.rfind("\n", 1, end)
        if cut < 0:
            return 0
        if not text[cut - 1].isspace() and not text[cut + 1].isspace():
            return cut + 1
        end = cut


def _count_lines(path: Path) -> int:
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _check_inputs(paths: list[Path]) -> list[int]:
    """Each input's line count; a missing, unreadable or non-UTF-8 input is one clear line."""
    counts = []
    for path in paths:
        if not path.exists():
            raise SxError(f"cannot read {display_path(str(path))}: no such file")
        if not path.is_file():
            raise SxError(f"cannot read {display_path(str(path))}: it is not a file")
        try:
            counts.append(_count_lines(path))
        except OSError as err:
            raise SxError(f"cannot read {display_path(str(path))}: {err.strerror or err}") from None
    return counts


def _lines(path: Path) -> Iterator[str]:
    """The file's lines, newlines kept; text that is not UTF-8 is an error naming the line it follows."""
    with open(path, encoding="utf-8", newline="") as f:
        number = 0
        while True:
            try:
                batch = f.readlines(_PIECE)
            except UnicodeDecodeError as err:
                raise SxError(f"{display_path(str(path))}: after line {number}: the text is not UTF-8 "
                              f"({err.reason} at byte {err.start} of the block read)") from None
            if not batch:
                return
            number += len(batch)
            yield from batch


class _Split:
    """One output file being written: text is added, encoded a safe piece at a time."""

    def __init__(self, writer: TokenFileWriter, tokenizer: Tokenizer, counted: Callable[[int], None]) -> None:
        self.writer = writer
        self.tokenizer = tokenizer
        self.counted = counted
        self.pending: list[str] = []
        self.pending_chars = 0
        self.document_open = False

    def add(self, text: str) -> None:
        self.pending.append(text)
        self.pending_chars += len(text)
        if self.pending_chars >= _PIECE:
            text = "".join(self.pending)
            cut = len(text) if self.tokenizer.name == "bytes" else _safe_cut(text)
            self.pending, self.pending_chars = [text[cut:]], len(text) - cut
            self._encode(text[:cut])

    def end_document(self) -> None:
        """The rest of a document; the next one starts after an end-of-text token."""
        self._encode("".join(self.pending))
        self.pending, self.pending_chars = [], 0
        if self.writer.count and self.tokenizer.eot is not None:
            self.document_open = True

    def _encode(self, text: str) -> None:
        if not text:
            return
        tokens = self.tokenizer.encode(text)
        if self.document_open:
            tokens = [self.tokenizer.eot, *tokens]
            self.document_open = False
        self.writer.add(np.asarray(tokens, dtype=np.int64))
        self.counted(len(tokens))


class _Progress:
    """Bytes read of the total, tokens and tokens/s: a bar on a terminal, a line every tenth otherwise."""

    def __init__(self, total_bytes: int, stream: object, interactive: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self.total = max(total_bytes, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.tokens = 0
        self.read = 0
        self.next_line = 0.1
        self.bar: Progress | None = None
        if interactive:
            self.bar = Progress(TextColumn("prepare"), BarColumn(), DownloadColumn(),
                                TextColumn("{task.fields[tokens]} tokens  {task.fields[rate]} tok/s"),
                                TimeRemainingColumn(), console=Console(file=stream))  # type: ignore[arg-type]
            self.task = self.bar.add_task("prepare", total=self.total, tokens="0", rate="-")
            self.bar.start()

    def rate(self) -> float:
        seconds = time.perf_counter() - self.started
        return self.tokens / seconds if seconds > 0 else 0.0

    def update(self, read: int) -> None:
        self.read = read
        if self.bar is not None:
            self.bar.update(self.task, completed=read, tokens=f"{self.tokens:,}", rate=f"{self.rate():,.0f}")
        elif read / self.total >= self.next_line:
            while self.next_line <= read / self.total:
                self.next_line += 0.1
            print(f"prepare: {100 * read / self.total:.0f}% of the text, {self.tokens:,} tokens, "
                  f"{self.rate():,.0f} tok/s", file=self.stream, flush=True)  # type: ignore[call-overload]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def prepare(paths: list[str | Path], tokenizer: Tokenizer, out_dir: str | Path, val: float = DEFAULT_VAL,
            format: str = "nanogpt", stream: object = None, interactive: bool = False) -> Prepared:  # noqa: A002
    """Encode the text files into `out_dir/train.bin` and `out_dir/val.bin` (see the module docstring);
    the progress goes to `stream` (standard error by default), as a bar when `interactive`."""
    if format not in FORMATS:
        raise UsageError(f"--format must be nanogpt or llmc, not {format}")
    if not 0 < val < 1:
        raise UsageError(f"--val is the fraction of lines for val.bin, above 0 and below 1; got {val}")
    inputs = [Path(p) for p in paths]
    line_counts = _check_inputs(inputs)
    total_lines = sum(line_counts)
    val_lines = max(1, int(total_lines * val))
    if total_lines - val_lines < 1:
        raise SxError(f"the text has {total_lines} line{'s' * (total_lines != 1)}: too few to split into "
                      "train.bin and val.bin (each needs a line)")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SxError(f"cannot make {display_path(str(out))}: {err.strerror or err}") from None
    dtype = dtype_for_vocabulary(tokenizer.vocab_size)
    progress = _Progress(sum(p.stat().st_size for p in inputs), stream, interactive)

    def counted(n: int) -> None:
        progress.tokens += n

    writers = {name: TokenFileWriter(out / f"{name}.bin", format, dtype) for name in ("train", "val")}
    try:
        splits = {name: _Split(writer, tokenizer, counted) for name, writer in writers.items()}
        line_index, read = 0, 0
        for path in inputs:
            for line in _lines(path):
                split = splits["train" if line_index < total_lines - val_lines else "val"]
                if line_index == total_lines - val_lines and line_index:
                    splits["train"].end_document()
                line_index += 1
                read += len(line)
                split.add(line)
                if read >= progress.read + _PIECE:
                    progress.update(read)
            for split in splits.values():
                split.end_document()
        progress.update(progress.total)
        files = {name: (writer.close(), writer.count) for name, writer in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    finally:
        progress.close()
    seconds = time.perf_counter() - progress.started
    return Prepared(files, NAME_OF_DTYPE[dtype], format, tokenizer.name, seconds, progress.rate())
