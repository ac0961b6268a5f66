"""Token files: nanoGPT's headerless streams and llm.c's header, read by `token-file` and written by `prepare`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.loaders import Field, Loader
from sexpgpu.backends.token_files import (
    HEADER_BYTES,
    TokenFileError,
    read_layout,
    write_token_file,
)

from sexpgpu.diagnostics import Location, SxError


def llmc_file(path: Path, tokens, magic: int = 20240520, version: int = 1, count: int | None = None,
              dtype: str = "<u2") -> Path:
    """An llm.c token file as llm.c's `write_datafile` writes it (its header fields overridable)."""
    header = np.zeros(256, "<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype).tobytes())
    return path


def loader(tmp_path: Path, **source) -> Loader:
    return Loader("train", {"kind": "token-file", "path": "t.bin", **source}, [Field("tokens", (5,), "i32")],
                  batch=2, shuffle=False, seed=0, loc=Location(str(tmp_path / "exp.sx"), 3, 1))


def test_an_llmc_file_is_read_after_its_header_and_memory_mapped(tmp_path):
    llmc_file(tmp_path / "t.bin", range(40))
    opened = loader(tmp_path)
    assert isinstance(opened.tokens, np.memmap) and opened.tokens.offset == HEADER_BYTES
    assert opened.tokens.tolist() == list(range(40))
    assert opened.next_batch()["tokens"].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_llmc_uint32_header_gives_uint32_tokens(tmp_path):
    llmc_file(tmp_path / "t.bin", [70_000 + i for i in range(20)], magic=20240801, version=7, dtype="<u4")
    layout = read_layout(tmp_path / "t.bin")
    assert layout.dtype == np.dtype("<u4") and layout.count == 20 and layout.format == "llmc"


def test_written_files_read_back_in_both_formats(tmp_path):
    tokens = np.arange(1000) * 37 % 50257
    for file_format in ("nanogpt", "llmc"):
        path = write_token_file(tmp_path / f"{file_format}.bin", tokens, file_format)
        layout = read_layout(path)
        assert layout.format == file_format and layout.count == 1000
        assert np.array_equal(np.fromfile(path, "<u2", offset=layout.offset), tokens)
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file is left"


def test_a_file_of_uint32_ids_is_llama3_header_in_llmc(tmp_path):
    path = write_token_file(tmp_path / "big.bin", [0, 70_000, 5], "llmc", np.dtype("<u4"))
    assert np.fromfile(path, "<i4", count=3).tolist() == [20240801, 7, 3]


@pytest.mark.parametrize(("make", "source", "message"), [
    (lambda p: llmc_file(p, range(40), magic=12345), {"format": "llmc"},
     "t.bin has magic 12345 where llm.c's header has 20240520 or 20240801: not an llm.c token file"),
    (lambda p: llmc_file(p, range(40), version=3), {},
     "t.bin has llm.c magic 20240520 with version 3; that magic goes with version 1"),
    (lambda p: llmc_file(p, range(40), count=50), {},
     "t.bin has an llm.c header counting 50 tokens (100 bytes after the header), but 80 bytes follow it"),
    (lambda p: p.write_bytes(llmc_file(p, range(40)).read_bytes()[:-1]), {},
     "t.bin has an llm.c header counting 40 tokens (80 bytes after the header), but 79 bytes follow it"),
    (lambda p: p.write_bytes(b"\x00" * 100), {"format": "llmc"},
     "t.bin holds 100 bytes, less than llm.c's header of 1024 bytes (256 int32)"),
    (lambda p: llmc_file(p, range(40)), {"dtype": "u32"},
     "t.bin has an llm.c header for u16 tokens (magic 20240520, version 1), but the source says :dtype u32"),
    (lambda p: p.write_bytes(b"\x01\x00\x02"), {},
     "t.bin holds 3 bytes, not a whole number of u16 tokens (2 bytes each)"),
])  # fmt: skip
def test_a_bad_token_file_is_an_error_at_the_loader(tmp_path, make, source, message):
    make(tmp_path / "t.bin")
    with pytest.raises(SxError) as caught:
        loader(tmp_path, **source)
    assert caught.value.message == f"loader train: {message}"
    assert caught.value.loc.line == 3


def test_a_headerless_stream_whose_first_ids_are_not_a_magic_stays_headerless(tmp_path):
    """GPT-2's ids stop at 50256, below both magics' low halves (55480, 56737): no stream of them reads as a header."""
    np.asarray([50256, 308] * 600, "<u2").tofile(tmp_path / "t.bin")
    assert read_layout(tmp_path / "t.bin").format == "nanogpt"
    with pytest.raises(TokenFileError, match="has magic"):
        read_layout(tmp_path / "t.bin", "llmc")
    assert read_layout(llmc_file(tmp_path / "h.bin", range(9)), "nanogpt").count == 512 + 9
