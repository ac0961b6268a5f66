"""Tokenizers and `prepare`, with a small BPE built in the process (tiktoken takes explicit ranks): no download."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from sexpgpu.backends import preparing, tokenizers
from sexpgpu.backends.preparing import prepare
from sexpgpu.backends.token_files import read_layout
from sexpgpu.backends.tokenizers import (
    ByteTokenizer,
    IdTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    tokenizer_named,
)

from sexpgpu.diagnostics import SxError, UsageError

ROOT = Path(__file__).resolve().parents[2]
#: GPT-2's pre-tokenizer (tiktoken's `gpt2` encoding uses the same).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"\n\n", b"an", b"and", b" a", b" and"]


def small_bpe(eot: int | None = None) -> tiktoken.Encoding:
    """Byte-level BPE: the 256 bytes, a few merges, and an end-of-text token (after them, or at `eot`)."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in MERGES:
        ranks[merge] = len(ranks)
    return tiktoken.Encoding(name="small-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks) if eot is None else eot})


@pytest.fixture
def gpt2(monkeypatch) -> tiktoken.Encoding:
    """`gpt2` resolves to the small BPE."""
    encoding = small_bpe()
    monkeypatch.setattr(tokenizers, "load_gpt2_encoding", lambda: encoding)
    return encoding


def test_bytes_encode_utf8_and_stream_a_character_split_over_ids():
    tok = ByteTokenizer()
    ids = tok.encode("café")
    assert ids == [99, 97, 102, 195, 169]
    stream = tok.streamer()
    assert [stream(t) for t in ids] == ["c", "a", "f", "", "é"]
    assert tok.decode(ids) == "café"


def test_ids_tokenizer_reads_and_writes_ids():
    tok = IdTokenizer()
    assert tok.encode(" 3 14\n15 ") == [3, 14, 15]
    stream = tok.streamer()
    assert "".join(stream(t) for t in [3, 14, 15]) == "3 14 15" == tok.decode([3, 14, 15])
    with pytest.raises(TokenizerError, match="word 2, 'x', is not a token id"):
        tok.encode("1 x")


def test_gpt2_tokenizer_is_tiktoken_with_its_end_of_text(gpt2):
    tok = tokenizer_named("gpt2")
    assert isinstance(tok, TiktokenTokenizer) and tok.eot == gpt2.eot_token == 267 and tok.vocab_size == 268
    ids = tok.encode("the cat and the <|endoftext|>")
    assert 267 not in ids, "special tokens' text in the input is text"
    assert tok.decode(ids) == "the cat and the <|endoftext|>"
    assert b"".join(tok.token_bytes(t) for t in ids) == b"the cat and the <|endoftext|>"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def stream_of(path: Path) -> list[int]:
    layout = read_layout(path)
    return np.fromfile(path, layout.dtype, offset=layout.offset).tolist()


def test_prepare_writes_end_of_text_between_documents_and_splits_on_lines(tmp_path, gpt2):
    a = write(tmp_path / "a.txt", "the theme and\nthe end\n")
    b = write(tmp_path / "b.txt", "an ant\nin the inn\nthe last line\nand one more\n")
    result = prepare([a, b], tokenizer_named("gpt2"), tmp_path / "out", val=0.34, format="llmc")
    # 6 lines: the last int(6 * 0.34) = 2 go to val.
    eot = gpt2.eot_token
    assert stream_of(tmp_path / "out" / "train.bin") == [
        *gpt2.encode_ordinary("the theme and\nthe end\n"), eot, *gpt2.encode_ordinary("an ant\nin the inn\n")]
    assert stream_of(tmp_path / "out" / "val.bin") == gpt2.encode_ordinary("the last line\nand one more\n")
    assert result.dtype == "u16" and result.files["val"][1] == len(stream_of(tmp_path / "out" / "val.bin"))


def test_prepare_in_small_pieces_gives_the_ids_of_the_whole_text(tmp_path, gpt2, monkeypatch):
    """Pieces are cut where the pre-tokenizer cuts anyway: trailing spaces, blank lines and indented lines
    (where a cut would change the ids) are never cut at."""
    lines = ["the and  \n", "\n", "\n", "  indented the\n", "then\n", "in and out\n", "'s the\n"] * 40
    text = "".join(lines)
    monkeypatch.setattr(preparing, "_PIECE", 37)
    prepare([write(tmp_path / "t.txt", text + "last\n")], tokenizer_named("gpt2"), tmp_path / "out",
            val=1 / (len(lines) + 1))
    assert stream_of(tmp_path / "out" / "train.bin") == gpt2.encode_ordinary(text)


def test_prepare_writes_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizers, "load_gpt2_encoding", lambda: small_bpe(eot=70_000))
    text = write(tmp_path / "t.txt", "one\ntwo\n")
    train = [*small_bpe().encode_ordinary("one\ntwo\n"), 70_000, *small_bpe().encode_ordinary("one\n")]
    for file_format in ("llmc", "nanogpt"):
        out = tmp_path / file_format
        result = prepare([text, text], tokenizer_named("gpt2"), out, val=0.25, format=file_format)
        assert result.dtype == "u32"
        offset = 1024 if file_format == "llmc" else 0
        assert np.fromfile(out / "train.bin", "<u4", offset=offset).tolist() == train
    assert np.fromfile(tmp_path / "llmc" / "train.bin", "<i4", count=3).tolist() == [20240801, 7, len(train)]


def test_prepare_refuses_bad_input_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SxError, match="cannot read .*missing.txt: no such file"):
        prepare([tmp_path / "missing.txt"], ByteTokenizer(), out)
    with pytest.raises(SxError, match="the text has 1 line: too few to split into train.bin and val.bin"):
        prepare([write(tmp_path / "one.txt", "just one line")], ByteTokenizer(), out)
    (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(SxError, match="latin1.txt: after line 0: the text is not UTF-8"):
        prepare([tmp_path / "latin1.txt"], ByteTokenizer(), out)
    with pytest.raises(UsageError, match="--val is the fraction of lines"):
        prepare([write(tmp_path / "two.txt", "a\nb\n")], ByteTokenizer(), out, val=1.0)
    assert not out.exists() or not list(out.iterdir())


def test_gpt2_without_network_or_cache_is_one_line_naming_the_cache(tmp_path):
    """An empty tiktoken cache and a proxy nobody listens on: no vocabulary, one line, exit 1, no file."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache), "HTTPS_PROXY": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    result = subprocess.run([sys.executable, "-m", "sexpgpu.tools.main", "prepare", "examples/data/corpus.txt",
                             "--tokenizer", "gpt2", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("error: cannot load GPT-2's vocabulary: tiktoken found no cached copy")
    assert "TIKTOKEN_CACHE_DIR" in result.stderr and "get_encoding('gpt2')" in result.stderr
    assert not (tmp_path / "out").exists()
