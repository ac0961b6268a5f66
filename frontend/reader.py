"""The .sx reader: text -> located datums (language.md §1).

`grammar.lark` defines the syntax. Reading uses its terminals compiled into a
single scanner regex and an explicit stack that builds datums directly: no
parse tree, no per-token callbacks, no Python recursion (so nesting depth is
unbounded), and errors that name what was open ("unclosed '(' opened at 12:3").
`parse_with_lark` runs the grammar's LALR parser; the tests check both agree.
"""

from __future__ import annotations

import bisect
import codecs
import errno
import functools
import gc
import hashlib
import math
import os
import re
import stat
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError, VisitError

from ..diagnostics import Location, SxError, remember_source
from .data import QUASIQUOTE, QUOTE, UNQUOTE, UNQUOTE_SPLICING, Keyword, SxList, SxMap, SxVector, Symbol
from .limits import MAX_INT_DIGITS

GRAMMAR_PATH = Path(__file__).with_name("grammar.lark")

_ATOM_CONSTANTS = {"true": True, "false": False, "nil": None}
_FLOAT_WORDS = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan, "+nan": math.nan, "-nan": math.nan}
_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}
_ESCAPE_RE = re.compile(r"\\(.)", re.S)
_PREFIXES = {"'": QUOTE, "`": QUASIQUOTE, ",": UNQUOTE, ",@": UNQUOTE_SPLICING}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_CONTAINERS = {"(": SxList, "[": SxVector, "{": SxMap}
#: Punctuation terminals, by the grammar's names.
_PUNCTUATION = {
    "LPAREN": "(", "LBRACKET": "[", "LBRACE": "{",
    "RPAREN": ")", "RBRACKET": "]", "RBRACE": "}",
    "QUOTE": "'", "QUASIQUOTE": "`", "UNQUOTE": ",", "UNQUOTE_SPLICING": ",@",
    "DATUM_COMMENT": "#_",
}  # fmt: skip
_DISCARD = "#_"


@functools.cache
def _lark() -> Lark:
    return Lark(GRAMMAR_PATH.read_text(), parser="lalr", lexer="basic", maybe_placeholders=False)


def _skip_pattern() -> str:
    """What the grammar ignores, as a regex: a run of whitespace, then comments each followed by one.

    The grammar's WHITESPACE is one character; a run of it is taken as `\\s*` (several times
    faster than repeating the alternation once per character), and the comments come only
    after it, so no repetition nests in another (which would backtrack exponentially before
    a character nothing matches). Comments cannot end early, so the runs are the same.
    """
    lark = _lark()
    ignored = [t for t in lark.terminals if t.name in lark.ignore_tokens]
    spaces = [t for t in ignored if t.name == "WHITESPACE"]
    assert len(spaces) == 1 and spaces[0].pattern.to_regexp() == r"\s", "WHITESPACE is one \\s"
    comments = "|".join(t.pattern.to_regexp() for t in ignored if t.name != "WHITESPACE")
    return rf"\s*(?:(?:{comments})\s*)*"


@functools.cache
def _scanner() -> re.Pattern[str]:
    """The grammar's terminals as one regex that skips what the grammar ignores, then matches a token.

    Literal punctuation comes first (longest first, so ',@' before ','), then the
    pattern terminals in the grammar's priority order (FLOAT before INT before SYMBOL).
    """
    lark = _lark()
    tokens = [t for t in lark.terminals if t.name not in lark.ignore_tokens]
    tokens.sort(key=lambda t: (t.pattern.type != "str", -t.priority, -len(t.pattern.value)))
    alternation = "|".join(f"(?P<{t.name}>{t.pattern.to_regexp()})" for t in tokens)
    return re.compile(f"{_skip_pattern()}(?:{alternation})")


@functools.cache
def _skipper() -> re.Pattern[str]:
    """What the grammar ignores (whitespace and comments), to find where a failed scan stopped."""
    return re.compile(_skip_pattern())


def read_file(path: str) -> SxList:
    """Read every datum of the file at `path`; the result's `locs` locate each top-level form."""
    try:
        data = read_source_bytes(path)
    except FileNotFoundError:
        raise SxError(f"no such file '{path}'") from None
    except OSError as e:
        raise SxError(f"cannot read '{path}': {e.strerror or e}") from None
    text = decode_source(data, path)
    remember_source(path, text, hashlib.sha256(data).hexdigest())
    return read_text(text, path)


#: What `stat` calls the files that are not regular files, as messages name them.
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)  # fmt: skip


def read_source_bytes(path: str) -> bytes:
    """The bytes of the regular file at `path`.

    Anything else (a directory, a FIFO, a device, a socket) is refused with an
    `OSError` saying what it is, before a byte is read: opening is non-blocking,
    so a FIFO with no writer cannot hang the reader, and `/dev/zero` is never
    read without end.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise OSError(errno.EINVAL, f"it is {kind}, not a file")
    with os.fdopen(fd, "rb") as f:
        return f.read()


def decode_source(data: bytes, path: str) -> str:
    """Source bytes as text: UTF-8, a leading byte-order mark skipped.

    Bytes that are not UTF-8 are an error located at the first bad byte (its line,
    and its column counted in characters, as every other location is).
    """
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start].decode("utf-8")
        line = before.count("\n") + 1
        col = len(before) - (before.rfind("\n") + 1) + 1
        remember_source(path, data.decode("utf-8", "replace"))
        raise SxError(
            f"the file is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} is {e.reason}",
            Location(path, line, col),
        ) from None


def read_text(text: str, file: str = "<string>") -> SxList:
    """Read every datum of `text` (attributed to `file`) into a top-level list; a leading byte-order mark is skipped."""
    if text.startswith("\ufeff"):
        text = text[1:]
    remember_source(file, text)
    # Reading allocates many small containers and nothing cyclic: the cyclic collector
    # would rescan the growing tree again and again (reading 1 MB took 4x longer).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Reader(text, file).read_all()
    finally:
        if collecting:
            gc.enable()


def parse_string_literal(token: str, file: str, line: int, col: int) -> str:
    """The value of a string token (quotes included); a bad escape is an error at its position."""
    body = token[1:-1]
    if "\\" not in body:
        return body

    def unescape(m: re.Match[str]) -> str:
        ch = m.group(1)
        value = _ESCAPES.get(ch)
        if value is None:
            before = token[: m.start() + 1]
            at_line = line + before.count("\n")
            at_col = (len(before) - before.rfind("\n")) if "\n" in before else col + m.start() + 1
            shown = repr(ch)[1:-1] if ch.isprintable() else repr(ch)
            raise SxError(
                f"bad escape '\\{shown}' in string; expected one of \\\" \\\\ \\n \\t",
                Location(file, at_line, at_col, at_col + 2),
            )
        return value

    return _ESCAPE_RE.sub(unescape, body)


def parse_number(token: str, loc: Location | None = None) -> int | float:
    """The value of an INT or FLOAT token; an integer of more than `MAX_INT_DIGITS` digits is an error at `loc`."""
    word = _FLOAT_WORDS.get(token)
    if word is not None:
        return word
    if "." in token or "e" in token or "E" in token:
        return float(token)
    if len(token) > MAX_INT_DIGITS:
        digits = sum(ch.isdigit() for ch in token)
        if digits > MAX_INT_DIGITS:
            raise SxError(f"integer literal of {digits} digits is too long (at most {MAX_INT_DIGITS})", loc)
    return int(token)


class SourceText:
    """A file's text as the reader saw it: turns offsets into `Location`s on demand.

    Datums keep offsets into it; `loc(offset)` finds the line (bisecting the newlines,
    indexed on first use) and gives an atom its end column, exactly as a reader that
    built every location up front would. Each offset's `Location` is built once.
    """

    __slots__ = ("file", "text", "_newlines", "_cache")

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.text = text
        self._newlines: list[int] | None = None
        self._cache: dict[int, Location] = {}

    def line_col(self, offset: int) -> tuple[int, int]:
        """1-based line and column of `offset`."""
        newlines = self._newlines
        if newlines is None:
            newlines = self._newlines = [m.start() for m in re.finditer("\n", self.text)]
        line = bisect.bisect_left(newlines, offset)
        return line + 1, offset - (newlines[line - 1] + 1 if line else 0) + 1

    def loc(self, offset: int) -> Location:
        """The location of the token at `offset`: atoms have an end column, brackets and prefixes none."""
        loc = self._cache.get(offset)
        if loc is None:
            line, col = self.line_col(offset)
            end = None
            if self.text[offset] not in _UNSPANNED:
                m = _scanner().match(self.text, offset)
                tok = m.group(m.lastgroup)
                if "\n" not in tok:
                    end = col + len(tok)
            loc = self._cache[offset] = Location(self.file, line, col, end)
        return loc


#: First characters of the tokens whose location has no end column (brackets, prefixes).
_UNSPANNED = frozenset("([{)]}'`,#")

#: Token kinds, as the reader's loop tells them apart.
_OPEN, _CLOSE, _PREFIX, _DISCARDING, _SYMBOL, _NUMBER, _STRING, _KEYWORD = range(8)
_KIND_OF_TERMINAL = {
    "LPAREN": _OPEN, "LBRACKET": _OPEN, "LBRACE": _OPEN,
    "RPAREN": _CLOSE, "RBRACKET": _CLOSE, "RBRACE": _CLOSE,
    "QUOTE": _PREFIX, "QUASIQUOTE": _PREFIX, "UNQUOTE": _PREFIX, "UNQUOTE_SPLICING": _PREFIX,
    "DATUM_COMMENT": _DISCARDING,
    "SYMBOL": _SYMBOL, "INT": _NUMBER, "FLOAT": _NUMBER, "STRING": _STRING, "KEYWORD": _KEYWORD,
}  # fmt: skip


@functools.cache
def _kinds() -> list:
    """The token kind of each scanner group number (`Match.lastindex` is the terminal's group)."""
    scanner = _scanner()
    kinds: list = [None] * (scanner.groups + 1)
    for name, index in scanner.groupindex.items():
        kinds[index] = _KIND_OF_TERMINAL[name]
    return kinds


_NOT_A_CONSTANT = object()


class _Reader:
    def __init__(self, text: str, file: str) -> None:
        self.text = text
        self.file = file
        self.src = SourceText(file, text)

    def read_all(self) -> SxList:
        text, src = self.text, self.src
        match = _scanner().match
        kinds = _kinds()
        constants = _ATOM_CONSTANTS
        # The open containers, outermost first, each saved as (opener, offset, items, offsets,
        # prefixes); the innermost one's are in the locals. The top level's opener is "".
        stack: list[tuple] = []
        opener, opened, items, offs = "", -1, [], []
        #: Pending quote prefixes and datum comments of the open container, as (prefix, offset).
        prefixes: list[tuple[str, int]] = []
        pos = 0
        while True:
            m = match(text, pos)
            if m is None:
                break
            group = m.lastindex
            start, pos = m.span(group)
            kind = kinds[group]
            if kind is _SYMBOL:
                tok = text[start:pos]
                value = constants.get(tok, _NOT_A_CONSTANT)
                if value is _NOT_A_CONSTANT:
                    value = Symbol(tok, None, src, start)
            elif kind is _OPEN:
                stack.append((opener, opened, items, offs, prefixes))
                opener, opened, items, offs, prefixes = text[start], start, [], [], []
                continue
            elif kind is _CLOSE:
                punct = text[start]
                if prefixes:
                    self._dangling_prefix(prefixes, f"'{punct}'")
                if not stack:
                    raise SxError(f"unexpected '{punct}' with nothing open", src.loc(start))
                if _CLOSERS[opener] != punct:
                    line, col = src.line_col(opened)
                    raise SxError(
                        f"expected '{_CLOSERS[opener]}' to close '{opener}' opened at {line}:{col}, found '{punct}'",
                        src.loc(start),
                    )
                if opener == "{" and len(items) % 2:
                    raise SxError("a map needs a value for every key (odd number of forms)", src.loc(opened))
                value = _CONTAINERS[opener](items, None, None, src, opened, offs)
                start = opened
                opener, opened, items, offs, prefixes = stack.pop()
            elif kind is _NUMBER:
                value = parse_number(text[start:pos], src.loc(start) if pos - start > MAX_INT_DIGITS else None)
            elif kind is _STRING:
                tok = text[start:pos]
                if "\\" in tok:
                    line, col = src.line_col(start)
                    value = parse_string_literal(tok, self.file, line, col)
                else:
                    value = tok[1:-1]
            elif kind is _KEYWORD:
                value = Keyword(text[start + 1 : pos])
            else:
                prefixes.append((text[start:pos], start))
                continue
            # A datum is complete: apply the prefixes waiting for it, innermost first.
            while prefixes:
                punct, at = prefixes.pop()
                if punct == _DISCARD:
                    break
                value = SxList([Symbol(_PREFIXES[punct], None, src, at), value], None, None, src, at, [at, start])
                start = at
            else:
                items.append(value)
                offs.append(start)
        if pos != len(text) and _skipper().match(text, pos).end() != len(text):
            self._unscannable(pos)
        if stack:
            line, col = src.line_col(opened)
            raise SxError(
                f"unclosed '{opener}' opened at {line}:{col}; expected '{_CLOSERS[opener]}' before the end of the file",
                src.loc(opened),
            )
        if prefixes:
            self._dangling_prefix(prefixes, "the end of the file")
        return SxList(items, Location(self.file, 1, 1), None, src, None, offs)

    def _dangling_prefix(self, prefixes: list[tuple[str, int]], found: str) -> None:
        punct, at = prefixes[-1]
        raise SxError(f"expected a form after '{punct}', found {found}", self.src.loc(at))

    def _unscannable(self, pos: int) -> None:
        """Raise the error for the text at `pos` that no token matches."""
        text = self.text
        pos = _skipper().match(text, pos).end()
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        ch = text[pos]
        loc = Location(self.file, line, col)
        if ch == '"':
            raise SxError("unterminated string; expected a closing '\"'", loc)
        if text.startswith("#|", pos):
            raise SxError("unterminated block comment; expected '|#'", loc)
        if ch == "#":
            shown = text[pos : pos + 2].strip() or "#"
            raise SxError(f"unknown reader syntax '{shown}'; expected '#_' or '#|'", loc)
        if ch == ":":
            raise SxError("expected a keyword name after ':'", loc)
        raise SxError(f"unexpected character {ch!r}", loc)


# -- the reference reader: the grammar's LALR parser ------------------------------------------


@v_args(inline=True)
class _ToDatum(Transformer):
    """Lark tree -> datums, with the same values and locations as the fast reader."""

    def __init__(self, file: str) -> None:
        super().__init__()
        self.file = file

    def _loc(self, tok: Token, width: bool = True) -> Location:
        end = tok.column + len(tok) if width and "\n" not in tok else None
        return Location(self.file, tok.line, tok.column, end)

    def atom(self, tok: Token):
        loc = self._loc(tok)
        if tok.type == "STRING":
            return parse_string_literal(str(tok), self.file, tok.line, tok.column), loc
        if tok.type in ("INT", "FLOAT"):
            return parse_number(str(tok), loc), loc
        if tok.type == "KEYWORD":
            return Keyword(tok[1:]), loc
        if tok in _ATOM_CONSTANTS:
            return _ATOM_CONSTANTS[str(tok)], loc
        return Symbol(str(tok), loc), loc

    def quoted(self, prefix: Token, *children):
        loc = self._loc(prefix, False)
        value, vloc = children[-1]
        return SxList([Symbol(_PREFIXES[str(prefix)], loc), value], loc, [loc, vloc]), loc

    def discarded(self, _comment: Token, *_children):
        return None

    def _container(self, cls, opener: Token, *items):
        loc = self._loc(opener, False)
        kept = [item for item in items[:-1] if item is not None]
        return cls([v for v, _ in kept], loc, [lc for _, lc in kept]), loc

    def list(self, *children):
        return self._container(SxList, *children)

    def vector(self, *children):
        return self._container(SxVector, *children)

    def map(self, *children):
        return self._container(SxMap, *children)

    def start(self, *items):
        kept = [item for item in items if item is not None]
        return SxList([v for v, _ in kept], Location(self.file, 1, 1), [lc for _, lc in kept])


def parse_with_lark(text: str, file: str = "<string>") -> SxList:
    """Read `text` with the grammar's LALR parser: the reference the fast reader is tested against."""
    try:
        tree = _lark().parse(text)
    except LarkError as e:
        line, col = getattr(e, "line", 0), getattr(e, "column", 0)
        raise SxError(f"syntax error: {str(e).splitlines()[0]}", Location(file, line, col)) from None
    try:
        return _ToDatum(file).transform(tree)
    except VisitError as e:  # a bad escape or number, raised as the fast reader raises it
        if isinstance(e.orig_exc, SxError):
            raise e.orig_exc from None
        raise
