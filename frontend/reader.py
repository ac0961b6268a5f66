"""The .sx reader: text -> located datums (language.md §1).

`grammar.lark` defines the syntax. Reading uses its terminals compiled into a
single scanner regex and an explicit stack that builds datums directly: no
parse tree, no per-token callbacks, no Python recursion (so nesting depth is
unbounded), and errors that name what was open ("unclosed '(' opened at 12:3").
`parse_with_lark` runs the grammar's LALR parser; the tests check both agree.
"""

from __future__ import annotations

import functools
import gc
import math
import re
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError

from sexpgpu.diagnostics import Location, SxError, remember_source

from .data import QUASIQUOTE, QUOTE, UNQUOTE, UNQUOTE_SPLICING, Keyword, SxList, SxMap, SxVector, Symbol

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


@functools.cache
def _scanner() -> re.Pattern[str]:
    """The grammar's terminals as one regex that skips what the grammar ignores, then matches a token.

    Literal punctuation comes first (longest first, so ',@' before ','), then the
    pattern terminals in the grammar's priority order (FLOAT before INT before SYMBOL).
    """
    lark = _lark()
    ignored = [t for t in lark.terminals if t.name in lark.ignore_tokens]
    tokens = [t for t in lark.terminals if t.name not in lark.ignore_tokens]
    tokens.sort(key=lambda t: (t.pattern.type != "str", -t.priority, -len(t.pattern.value)))
    skip = "|".join(t.pattern.to_regexp() for t in ignored)
    alternation = "|".join(f"(?P<{t.name}>{t.pattern.to_regexp()})" for t in tokens)
    return re.compile(f"(?:{skip})*(?:{alternation})")


@functools.cache
def _skipper() -> re.Pattern[str]:
    """What the grammar ignores (whitespace and comments), to find where a failed scan stopped."""
    lark = _lark()
    return re.compile("(?:" + "|".join(t.pattern.to_regexp() for t in lark.terminals if t.name in lark.ignore_tokens) + ")*")


def read_file(path: str) -> SxList:
    """Read every datum of the file at `path`; the result's `locs` locate each top-level form."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SxError(f"no such file '{path}'") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SxError(f"cannot read '{path}': {e}") from None
    return read_text(text, path)


def read_text(text: str, file: str = "<string>") -> SxList:
    """Read every datum of `text` (attributed to `file`) into a top-level list."""
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


def parse_number(token: str) -> int | float:
    """The value of an INT or FLOAT token."""
    word = _FLOAT_WORDS.get(token)
    if word is not None:
        return word
    if "." in token or "e" in token or "E" in token:
        return float(token)
    return int(token)


class _Frame:
    """An open list, vector or map (or the top level) while reading."""

    __slots__ = ("opener", "items", "locs", "loc", "prefixes")

    def __init__(self, opener: str, loc: Location | None) -> None:
        self.opener = opener
        self.items: list = []
        self.locs: list = []
        self.loc = loc
        #: Pending quote prefixes and datum comments, as (prefix, location), innermost last.
        self.prefixes: list[tuple[str, Location]] = []


class _Reader:
    def __init__(self, text: str, file: str) -> None:
        self.text = text
        self.file = file

    def read_all(self) -> SxList:
        text, file = self.text, self.file
        top = _Frame("", None)
        stack = [top]
        frame = top
        # Lines are found by walking the newlines as tokens advance (tokens come in order).
        line, line_start = 1, 0
        next_newline = text.find("\n")
        expected = 0
        for m in _scanner().finditer(text):
            if m.start() != expected:
                # Nothing scans at `expected`: only comments and whitespace left (finditer then
                # matched inside a comment), or an error.
                if _skipper().match(text, expected).end() == len(text):
                    break
                self._unscannable(expected)
            expected = pos = m.end()
            kind = m.lastgroup
            tok = m.group(kind)
            start = pos - len(tok)
            while 0 <= next_newline < start:
                line += 1
                line_start = next_newline + 1
                next_newline = text.find("\n", line_start)
            col = start - line_start + 1
            if kind == "STRING":
                value = parse_string_literal(tok, file, line, col)
                loc = Location(file, line, col) if "\n" in tok else Location(file, line, col, col + len(tok))
            elif kind == "SYMBOL":
                loc = Location(file, line, col, col + len(tok))
                if tok in _ATOM_CONSTANTS:
                    value = _ATOM_CONSTANTS[tok]
                else:
                    value = Symbol(tok, loc)
            elif kind == "INT" or kind == "FLOAT":
                loc = Location(file, line, col, col + len(tok))
                value = parse_number(tok)
            elif kind == "KEYWORD":
                loc = Location(file, line, col, col + len(tok))
                value = Keyword(tok[1:])
            else:
                punct = _PUNCTUATION[kind]
                loc = Location(file, line, col)
                if punct in _CLOSERS:
                    frame = _Frame(punct, loc)
                    stack.append(frame)
                    continue
                if punct in _PREFIXES or punct == _DISCARD:
                    frame.prefixes.append((punct, loc))
                    continue
                # A closing bracket.
                if frame.prefixes:
                    self._dangling_prefix(frame, f"'{punct}'")
                if frame is top:
                    raise SxError(f"unexpected '{punct}' with nothing open", loc)
                if _CLOSERS[frame.opener] != punct:
                    opened = frame.loc
                    raise SxError(
                        f"expected '{_CLOSERS[frame.opener]}' to close '{frame.opener}' opened at "
                        f"{opened.line}:{opened.col}, found '{punct}'",
                        loc,
                    )
                if frame.opener == "{" and len(frame.items) % 2:
                    raise SxError("a map needs a value for every key (odd number of forms)", frame.loc)
                value = _CONTAINERS[frame.opener](frame.items, frame.loc, frame.locs)
                loc = frame.loc
                stack.pop()
                frame = stack[-1]
            # A datum is complete: apply the prefixes waiting for it, innermost first.
            prefixes = frame.prefixes
            while prefixes:
                punct, ploc = prefixes.pop()
                if punct == _DISCARD:
                    break
                value = SxList([Symbol(_PREFIXES[punct], ploc), value], ploc, [ploc, loc])
                loc = ploc
            else:
                frame.items.append(value)
                frame.locs.append(loc)
        if expected != len(text) and _skipper().match(text, expected).end() != len(text):
            self._unscannable(expected)
        if len(stack) > 1:
            opened = stack[-1]
            raise SxError(
                f"unclosed '{opened.opener}' opened at {opened.loc.line}:{opened.loc.col}; "
                f"expected '{_CLOSERS[opened.opener]}' before the end of the file",
                opened.loc,
            )
        if top.prefixes:
            self._dangling_prefix(top, "the end of the file")
        return SxList(top.items, Location(file, 1, 1), top.locs)

    def _dangling_prefix(self, frame: _Frame, found: str) -> None:
        punct, ploc = frame.prefixes[-1]
        raise SxError(f"expected a form after '{punct}', found {found}", ploc)

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
            return parse_number(str(tok)), loc
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
    return _ToDatum(file).transform(tree)
