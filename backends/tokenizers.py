"""Tokenizers: text to token ids and back, by the names a loader source records (`:tokenizer`).

- `bytes`: one id per byte of the UTF-8 text (vocabulary 256, no end-of-text token);
- `gpt2`: GPT-2's byte-level BPE through `tiktoken` (vocabulary 50257, end-of-text 50256), which
  downloads the vocabulary on first use and caches it (`TIKTOKEN_CACHE_DIR`);
- `none`: ids without text; a prompt is the ids written out, separated by spaces.

`sexpgpu sample` encodes its prompt and decodes what it generates with the run's tokenizer;
`sexpgpu prepare` encodes text files into token files with the one it is given.
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from ..diagnostics import SxError
from ..dialects.exp import TOKENIZERS

#: tiktoken's cache (its environment variable) and how to fill it where there is no network.
CACHE_HINT = (
    "set TIKTOKEN_CACHE_DIR to a directory holding tiktoken's cached GPT-2 files (run "
    "`TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` on a machine with "
    "network access and copy DIR here)"
)


class TokenizerError(SxError):
    """A text the tokenizer cannot encode, or ids it cannot decode; the message says which and where."""


class Tokenizer(ABC):
    """Encodes text to ids and decodes ids to text, a piece at a time when streaming."""

    #: The name a loader source records.
    name: str
    #: How many ids it makes (the smallest vocabulary a model needs for its text).
    vocab_size: int
    #: The end-of-text id written between documents, None when it has none.
    eot: int | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of `text`; a `TokenizerError` naming the place that cannot be encoded."""

    @abstractmethod
    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens` (bytes that are not UTF-8 become U+FFFD)."""

    def streamer(self) -> Callable[[int], str]:
        """A function taking the ids of one text in order and returning the text each adds (a character
        split over several ids appears with its last id)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        return lambda token: decoder.decode(self.token_bytes(token))

    def token_bytes(self, token: int) -> bytes:
        return self.decode([token]).encode()


class ByteTokenizer(Tokenizer):
    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as err:  # a lone surrogate (from a file read with surrogateescape)
            raise TokenizerError(f"character {err.object[err.start]!r} at offset {err.start} is not Unicode "
                                 "text the bytes tokenizer can encode as UTF-8") from None

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,))


class IdTokenizer(Tokenizer):
    """`none`: the text of ids is the ids in decimal, separated by spaces."""

    name = "none"
    vocab_size = 0

    def encode(self, text: str) -> list[int]:
        tokens = []
        for position, word in enumerate(text.split(), 1):
            if not word.isdigit():
                raise TokenizerError(f"word {position}, {word!r}, is not a token id: the run's tokenizer is none "
                                     "(ids without text), so a prompt is token ids separated by spaces")
            tokens.append(int(word))
        return tokens

    def decode(self, tokens: Sequence[int]) -> str:
        return " ".join(str(t) for t in tokens)

    def streamer(self) -> Callable[[int], str]:
        separators = iter(("",))
        return lambda token: f"{next(separators, ' ')}{token}"


class TiktokenTokenizer(Tokenizer):
    """A `tiktoken.Encoding` (GPT-2's, or one a test builds with explicit ranks)."""

    def __init__(self, encoding: Any, name: str = "gpt2") -> None:
        self.encoding = encoding
        self.name = name
        self.vocab_size = int(encoding.n_vocab)
        self.eot = encoding.eot_token if "<|endoftext|>" in encoding.special_tokens_set else None

    def encode(self, text: str) -> list[int]:
        try:
            # Special tokens' text in the input is text, as nanoGPT's prepare treats it.
            return self.encoding.encode_ordinary(text)
        except UnicodeEncodeError as err:
            raise TokenizerError(f"character {err.object[err.start]!r} at offset {err.start} is not Unicode "
                                 f"text {self.name} can encode") from None

    def decode(self, tokens: Sequence[int]) -> str:
        return self.encoding.decode(list(tokens), errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token)


def load_gpt2_encoding() -> Any:
    """tiktoken's GPT-2 encoding: from its cache, else downloaded (and cached)."""
    try:
        import tiktoken
    except ImportError:
        raise SxError("the gpt2 tokenizer needs tiktoken; install it with: pip install 'sexpgpu[tokenizers]'") from None
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as err:  # no network (requests' errors), a damaged cache (tiktoken's ValueError)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SxError(f"cannot load GPT-2's vocabulary: tiktoken found no cached copy and could not download it "
                      f"({type(err).__name__}: {reason[:160]}); {CACHE_HINT}") from None


def tokenizer_named(name: str) -> Tokenizer:
    """The tokenizer a loader source names (`bytes`, `gpt2`, `none`)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenTokenizer(load_gpt2_encoding())
    if name == "none":
        return IdTokenizer()
    raise SxError(f"unknown tokenizer {name!r} (tokenizers: {', '.join(TOKENIZERS)})")


def source_tokenizer(source: dict[str, Any]) -> str:
    """The tokenizer a loader source's ids come from: its `tokenizer`, else `bytes` for a text file and
    `none` (ids without text) for the other sources."""
    named = source.get("tokenizer")
    if named is not None:
        return str(named)
    return "bytes" if source.get("kind") == "text-file" else "none"
