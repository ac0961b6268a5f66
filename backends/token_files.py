"""Token files: nanoGPT's headerless streams and llm.c's files with a header, read and written.

nanoGPT (`data/*/prepare.py`) writes a bare little-endian uint16 stream. llm.c
(`dev/data/data_common.py`) writes 256 little-endian int32 first: the magic,
a version, the token count, zeros; then the tokens. Its two headers:

- magic 20240520, version 1: uint16 tokens (GPT-2's vocabulary);
- magic 20240801, version 7: uint32 tokens (a vocabulary past 65536, llm.c's Llama 3).

Reading opens a memory map: only the header's page is read, so a file of any
size opens at once and a loader's memory does not grow with it. Writing goes
to a temporary sibling, renamed into place once whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from attrs import frozen

#: llm.c's header: 256 little-endian int32.
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
#: llm.c's (magic, version) → the tokens' numpy dtype.
LLMC_HEADERS = {(20240520, 1): np.dtype("<u2"), (20240801, 7): np.dtype("<u4")}
#: The token dtype → llm.c's (magic, version) for it.
LLMC_HEADER_OF = {dtype: header for header, dtype in LLMC_HEADERS.items()}
LLMC_MAGICS = {magic for magic, _ in LLMC_HEADERS}
#: The names of the token dtypes (`:dtype`), and back.
DTYPE_NAMES = {"u16": np.dtype("<u2"), "u32": np.dtype("<u4")}
NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPE_NAMES.items()}


class TokenFileError(ValueError):
    """A token file that is not what it claims to be; the message says what and where."""


@frozen
class TokenFileLayout:
    """Where a file's tokens are: after `offset` bytes, `count` of `dtype`; `header` names llm.c's."""

    offset: int
    count: int
    dtype: np.dtype
    header: tuple[int, int] | None

    @property
    def format(self) -> str:
        return "llmc" if self.header is not None else "nanogpt"


def dtype_for_vocabulary(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in it, else uint32."""
    return DTYPE_NAMES["u16"] if vocab_size <= 1 << 16 else DTYPE_NAMES["u32"]


def read_layout(path: Path, format: str = "auto", dtype: str | None = None) -> TokenFileLayout:  # noqa: A002
    """The layout of the token file at `path`, from its size and (at most) its first 1 KiB.

    `format`: `auto` (llm.c's header when the file starts with one of its magics, else a headerless
    stream), `llmc` (the header is required) or `nanogpt` (headerless). `dtype` (`u16`, `u32`, or
    None: u16 unless a header says otherwise) must agree with a header. Raises `TokenFileError`.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    first = int(np.frombuffer(head[:4], "<i4")[0]) if len(head) >= 4 else None
    if format == "llmc" or (format == "auto" and first in LLMC_MAGICS):
        return _llmc_layout(head, size, dtype)
    token_dtype = DTYPE_NAMES[dtype or "u16"]
    if size % token_dtype.itemsize:
        raise TokenFileError(f"holds {size} bytes, not a whole number of {dtype or 'u16'} tokens "
                             f"({token_dtype.itemsize} bytes each)")
    return TokenFileLayout(0, size // token_dtype.itemsize, token_dtype, None)


def _llmc_layout(head: bytes, size: int, dtype: str | None) -> TokenFileLayout:
    if len(head) < HEADER_BYTES:
        raise TokenFileError(f"holds {size} bytes, less than llm.c's header of {HEADER_BYTES} bytes "
                             f"({HEADER_INTS} int32)")
    header = np.frombuffer(head, "<i4")
    magic, version, count = (int(x) for x in header[:3])
    if magic not in LLMC_MAGICS:
        known = " or ".join(str(m) for m in sorted(LLMC_MAGICS))
        raise TokenFileError(f"has magic {magic} where llm.c's header has {known}: not an llm.c token file")
    token_dtype = LLMC_HEADERS.get((magic, version))
    if token_dtype is None:
        expected = next(v for m, v in LLMC_HEADERS if m == magic)
        raise TokenFileError(f"has llm.c magic {magic} with version {version}; that magic goes with version "
                             f"{expected}")
    if dtype is not None and DTYPE_NAMES[dtype] != token_dtype:
        raise TokenFileError(f"has an llm.c header for {NAME_OF_DTYPE[token_dtype]} tokens "
                             f"(magic {magic}, version {version}), but the source says :dtype {dtype}")
    body = size - HEADER_BYTES
    if count < 0 or body != count * token_dtype.itemsize:
        raise TokenFileError(f"has an llm.c header counting {count} tokens ({count * token_dtype.itemsize} bytes "
                             f"after the header), but {body} bytes follow it")
    return TokenFileLayout(HEADER_BYTES, count, token_dtype, (magic, version))


def open_tokens(path: Path, layout: TokenFileLayout) -> np.ndarray:
    """The file's tokens as a read-only memory map (an empty array for no tokens)."""
    if layout.count == 0:
        return np.zeros(0, layout.dtype)
    return np.memmap(path, dtype=layout.dtype, mode="r", offset=layout.offset, shape=(layout.count,))


class TokenFileWriter:
    """Writes one token file in pieces: `add` tokens as they come, `close` to put it in place.

    The file is written to a temporary sibling and renamed over `path` once whole (its header, for
    llm.c, counting every token), so a failure leaves no partial file behind; `discard` removes it.
    """

    def __init__(self, path: Path, format: str, dtype: np.dtype) -> None:  # noqa: A002
        if format == "llmc" and dtype not in LLMC_HEADER_OF:
            raise ValueError(f"llm.c has no header for {dtype} tokens")
        self.path = Path(path)
        self.format = format
        self.dtype = np.dtype(dtype)
        self.count = 0
        self._temporary = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._file = open(self._temporary, "wb")
        if format == "llmc":
            self._file.write(bytes(HEADER_BYTES))  # rewritten with the count by `close`

    def add(self, tokens: Iterable[int] | np.ndarray) -> None:
        array = np.asarray(tokens, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() >= 1 << (8 * self.dtype.itemsize)):
            raise ValueError(f"token id {int(array.max())} does not fit {self.dtype}")
        self._file.write(array.astype(self.dtype).tobytes())
        self.count += int(array.size)

    def close(self) -> Path:
        if self.format == "llmc":
            if self.count >= 1 << 31:
                raise ValueError(f"{self.count} tokens are more than llm.c's header can count (2^31 - 1)")
            header = np.zeros(HEADER_INTS, "<i4")
            header[0], header[1] = LLMC_HEADER_OF[self.dtype]
            header[2] = self.count
            self._file.seek(0)
            self._file.write(header.tobytes())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temporary, self.path)
        return self.path

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._temporary.unlink(missing_ok=True)


def write_token_file(path: Path, tokens: Iterable[int] | np.ndarray, format: str = "nanogpt",  # noqa: A002
                     dtype: np.dtype | None = None) -> Path:
    """Write a whole token file at once (uint16 unless `dtype` says otherwise)."""
    writer = TokenFileWriter(path, format, np.dtype(dtype or DTYPE_NAMES["u16"]))
    try:
        writer.add(tokens)
        return writer.close()
    except BaseException:
        writer.discard()
        raise
