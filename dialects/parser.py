"""Reads the textual IR that `printer.py` writes back into a `builtin.module`.

The form is line oriented: one op a line, an op with regions ends its line
with `{`, `} {` starts its next region and `}` alone closes it. Each line is
split into tokens by one regular expression (a tensor type and a location are
single tokens) and parsed by hand, which keeps parsing linear and fast on
graphs of many thousand ops. `//` starts a comment. A missing `loc(...)`
means `loc(unknown)`.

Every error is an `SxError` at `file:line:col`. Each op records where it was
written in `Operation.text_loc`, so verifier errors of an op whose own
location is unknown point at its line in the IR file.
"""

from __future__ import annotations

import json
import re
from typing import Any

import sexpgpu.dialects  # noqa: F401  (registers every op)

from ..diagnostics import Location, SxError, remember_source
from .core import (
    DTYPES,
    REGISTRY,
    Block,
    Operation,
    Region,
    SymbolRef,
    TensorType,
    Value,
    gc_paused,
)

_STRING = r'"(?:[^"\\\n]|\\.)*"'
_POS = _STRING + r":\d+:\d+"
_TOKEN = re.compile(
    r"\s*("
    rf"%[\w$.-]+"  # value
    rf"|{_STRING}"  # string
    rf"|@(?:[\w$.-]+|{_STRING})"  # symbol
    r"|tensor<[^>\s]*>"  # tensor type
    rf"|loc\((?:unknown|{_POS}(?:\s+via\s+{_POS})*)\)"  # location
    r"|->"
    r"|[-+]?\d+\.?\d*(?:[eE][-+]?\d+)?|[-+](?:inf|nan)\b"  # number (unsigned inf, nan are words)
    r"|\^[\w$.-]+"  # block label
    r"|[A-Za-z_][\w$.-]*"  # identifier, keyword or op name
    r"|//.*"  # comment
    r"|\S)"  # punctuation, or a character no token starts with
)
_TYPE = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)>\Z")
_LOC_FRAME = re.compile(rf"({_STRING}):(\d+):(\d+)")
_PUNCT = frozenset("{}()[],=:")
_KEYWORD_VALUES: dict[str, Any] = {"true": True, "false": False, "none": None, "inf": float("inf"), "nan": float("nan")}


class _Line:
    """The tokens of one line and a cursor over them."""

    __slots__ = ("tokens", "pos", "number", "text", "path")

    def __init__(self, tokens: list[str], number: int, text: str, path: str) -> None:
        self.tokens = tokens
        self.pos = 0
        self.number = number
        self.text = text
        self.path = path

    def peek(self, ahead: int = 0) -> str | None:
        i = self.pos + ahead
        return self.tokens[i] if i < len(self.tokens) else None

    def next(self, what: str) -> str:
        if self.pos >= len(self.tokens):
            raise self.error(f"expected {what}, found end of line")
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def expect(self, tok: str) -> None:
        found = self.peek()
        if found != tok:
            raise self.error(f"expected '{tok}', found {_show(found)}")
        self.pos += 1

    def accept(self, tok: str) -> bool:
        if self.pos < len(self.tokens) and self.tokens[self.pos] == tok:
            self.pos += 1
            return True
        return False

    def location(self, index: int | None = None) -> Location:
        """Where token `index` (default: the current one) starts; past the end, the end of the line."""
        index = self.pos if index is None else index
        for i, m in enumerate(_TOKEN.finditer(self.text)):
            if i == index:
                return Location(self.path, self.number, m.start(1) + 1)
        return Location(self.path, self.number, len(self.text.rstrip()) + 1)

    def error(self, message: str, index: int | None = None) -> SxError:
        return SxError(message, self.location(index))


def _show(tok: str | None) -> str:
    return "end of line" if tok is None else f"'{tok}'"


def _unquote(tok: str, line: _Line, index: int) -> str:
    """A string token's value (JSON escapes); a bad escape is an error at the token."""
    try:
        return json.loads(tok)
    except json.JSONDecodeError as err:
        raise line.error(f"bad string {tok[:40]}: {err.msg.lower()}", index) from None


#: The most digits an integer in textual IR may have (Python's limit on converting text to an int).
MAX_INT_DIGITS = 4300


def _integer(tok: str, line: _Line, index: int) -> int:
    if len(tok) > MAX_INT_DIGITS:
        raise line.error(f"integer of {len(tok)} digits is too long (at most {MAX_INT_DIGITS})", index)
    try:
        return int(tok)
    except ValueError:  # `->` where a value should be
        raise line.error(f"expected an integer, found '{tok}'", index) from None


class Parser:
    """Parses one file of textual IR; `parse_module` is the entry point."""

    def __init__(self, text: str, path: str) -> None:
        self.text = text
        self.path = path
        self.types: dict[str, TensorType] = {}
        self.locs: dict[str, Location | None] = {}
        self.signatures: dict[tuple[str, ...], tuple[list[TensorType], list[TensorType]]] = {}
        #: Values by name within the current top-level op.
        self.values: dict[str, Value] = {}

    # -- lines ---------------------------------------------------------------------------------

    def lines(self) -> list[_Line]:
        out = []
        findall = _TOKEN.findall
        for number, text in enumerate(self.text.split("\n"), 1):
            tokens = findall(text)
            if tokens and tokens[-1].startswith("//"):
                tokens.pop()
            if tokens:
                out.append(_Line(tokens, number, text, self.path))
        return out

    def parse(self) -> Operation:
        module = Operation.create("builtin.module", regions=[Region.with_block()])
        module.text_loc = Location(self.path, 1, 1)
        #: The blocks being filled, innermost last, with the op whose region each is in.
        stack: list[tuple[Block, Operation]] = [(module.body, module)]
        for line in self.lines():
            first = line.tokens[0]
            if first == "}":
                self._close_region(line, stack)
                continue
            if first.startswith("^"):
                self._block_label(line, stack)
                continue
            if len(stack) == 1:
                self.values = {}
            op = self.parse_op(line)
            stack[-1][0].append(op)
            if line.accept("{"):
                op.add_region(Region.with_block())
                stack.append((op.regions[-1].blocks[0], op))
            if line.pos < len(line.tokens):
                raise line.error(f"expected end of line after the op, found {_show(line.peek())}")
        if len(stack) > 1:
            owner = stack[-1][1]
            raise SxError(f"'{owner.name}' region is not closed: expected '}}'", owner.text_loc)
        return module

    def _close_region(self, line: _Line, stack: list[tuple[Block, Operation]]) -> None:
        if len(stack) == 1:
            raise line.error("'}' closes no region")
        _, owner = stack.pop()
        line.pos = 1
        if line.accept("{"):
            owner.add_region(Region.with_block())
            stack.append((owner.regions[-1].blocks[0], owner))
        if line.pos < len(line.tokens):
            raise line.error(f"expected end of line after '}}', found {_show(line.peek())}")

    def _block_label(self, line: _Line, stack: list[tuple[Block, Operation]]) -> None:
        """`^bb1(%a: tensor<f32>):` starts a block (the first label names the region's first block)."""
        if len(stack) == 1:
            raise line.error("a block label outside any region")
        block, owner = stack[-1]
        region = owner.regions[-1]
        if block.args or len(block) or block is not region.blocks[0]:
            block = region.add_block(Block())
            stack[-1] = (block, owner)
        line.pos = 1
        if line.accept("("):
            while not line.accept(")"):
                if block.args:
                    line.expect(",")
                index = line.pos
                name = line.next("a block argument")
                line.expect(":")
                self._define(line, name, block.add_arg(self.parse_type(line)), index)
        line.expect(":")
        if line.pos < len(line.tokens):
            raise line.error(f"expected end of line after the block label, found {_show(line.peek())}")

    # -- ops -----------------------------------------------------------------------------------

    def parse_op(self, line: _Line) -> Operation:
        # The hot path of the parser: tokens are read through locals, and a
        # signature seen before (most are) is one dictionary lookup.
        toks, n, i = line.tokens, len(line.tokens), 0
        result_names: list[tuple[str, int]] = []
        if toks[0][0] == "%":
            while True:
                if i >= n or toks[i][0] != "%":
                    raise line.error(f"expected a result name, found {_show(toks[i] if i < n else None)}", i)
                result_names.append((toks[i], i))
                i += 1
                if i < n and toks[i] == ",":
                    i += 1
                    continue
                break
            if i >= n or toks[i] != "=":
                raise line.error(f"expected '=', found {_show(toks[i] if i < n else None)}", i)
            i += 1
        if i >= n:
            raise line.error("expected an op name, found end of line", i)
        name_index = i
        name = toks[i]
        i += 1
        if REGISTRY.lookup(name) is None:
            raise line.error(f"unknown op '{name}'", name_index)
        attributes: dict[str, Any] = {}
        if i < n and toks[i][0] == "@":
            tok = toks[i]
            if len(tok) == 1:
                raise line.error("expected a symbol name after '@'", i)
            attributes["sym_name"] = _unquote(tok[1:], line, i) if tok[1] == '"' else tok[1:]
            i += 1
        operands: list[Value] = []
        operand_index = i
        if i < n and toks[i][0] == "%":
            values = self.values
            while True:
                tok = toks[i] if i < n else None
                value = values.get(tok)  # type: ignore[arg-type]
                if value is None:
                    if tok is not None and tok[0] == "%":
                        raise line.error(f"use of undefined value {tok}", i)
                    raise line.error(f"expected an operand, found {_show(tok)}", i)
                operands.append(value)
                i += 1
                if i < n and toks[i] == ",":
                    i += 1
                    continue
                break
        # A region's `{` ends its line; a `{` with more after it opens the attribute dict.
        if i < n - 1 and toks[i] == "{":
            line.pos = i
            attributes.update(self.parse_attr_dict(line))
            i = line.pos
        result_types: list[TensorType] = []
        if i < n and toks[i] == ":":
            line.pos = i + 1
            operand_types, result_types = self.parse_signature(line)
            if len(operand_types) != len(operands):
                raise line.error(
                    f"the signature gives {len(operand_types)} operand types for {len(operands)} operands", i + 1
                )
            for k, (value, declared) in enumerate(zip(operands, operand_types)):
                if value.type != declared:
                    raise line.error(f"operand {k} has type {value.type} but the signature says {declared}",
                                     operand_index)
            i = line.pos
        if len(result_types) != len(result_names):
            raise line.error(f"'{name}' names {len(result_names)} results but its signature gives {len(result_types)}",
                             name_index)
        loc = None
        if i < n and toks[i].startswith("loc("):
            loc = self.parse_location(line, i)
            i += 1
        line.pos = i
        op = Operation.create(name, operands, result_types, attributes, loc=loc)
        text = line.text
        op.text_loc = Location(self.path, line.number, len(text) - len(text.lstrip()) + 1)
        for (res_name, index), value in zip(result_names, op.results):
            self._define(line, res_name, value, index)
        return op

    def _define(self, line: _Line, name: str, value: Value, index: int) -> None:
        if not name.startswith("%"):
            raise line.error(f"expected a value name, found '{name}'", index)
        if name in self.values:
            raise line.error(f"redefinition of value {name}", index)
        self.values[name] = value
        hint = name[1:]
        if not hint.isdigit():
            value.name_hint = hint

    def parse_signature(self, line: _Line) -> tuple[list[TensorType], list[TensorType]]:
        """`(operand types) -> result type(s)`, up to the location or the region's `{`."""
        toks = line.tokens
        end = len(toks)
        if toks[end - 1] == "{":
            end -= 1
        if end > line.pos and toks[end - 1].startswith("loc("):
            end -= 1
        key = tuple(toks[line.pos : end])
        cached = self.signatures.get(key)
        if cached is not None:
            line.pos = end
            return cached
        line.expect("(")
        operand_types = self._type_list(line)
        line.expect("->")
        if line.peek() == "(":
            line.pos += 1
            result_types = self._type_list(line)
        else:
            result_types = [self.parse_type(line)]
        if line.pos == end:
            self.signatures[key] = (operand_types, result_types)
        return operand_types, result_types

    def _type_list(self, line: _Line) -> list[TensorType]:
        """Types up to and including the closing `)`."""
        types: list[TensorType] = []
        while not line.accept(")"):
            if types:
                line.expect(",")
            types.append(self.parse_type(line))
        return types

    def parse_type(self, line: _Line) -> TensorType:
        index = line.pos
        tok = line.next("a tensor type")
        cached = self.types.get(tok)
        if cached is not None:
            return cached
        m = _TYPE.match(tok)
        if m is None:
            raise line.error(f"expected a tensor type like tensor<4x8xf32>, found '{tok}'", index)
        dtype = m.group(2)
        if dtype not in DTYPES:
            raise line.error(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})", index)
        dims = m.group(1)
        tt = TensorType(tuple(_integer(d, line, index) for d in dims[:-1].split("x")) if dims else (), dtype)
        self.types[tok] = tt
        return tt

    def parse_location(self, line: _Line, index: int) -> Location | None:
        tok = line.tokens[index]
        if tok in self.locs:
            return self.locs[tok]
        frames = [(_unquote(f, line, index), _integer(ln, line, index), _integer(col, line, index))
                  for f, ln, col in _LOC_FRAME.findall(tok)]
        loc = None
        for file, ln, col in reversed(frames):
            loc = Location(file, ln, col, via=loc)
        self.locs[tok] = loc
        return loc

    # -- attributes ----------------------------------------------------------------------------

    def parse_attr_dict(self, line: _Line) -> dict[str, Any]:
        line.expect("{")
        out: dict[str, Any] = {}
        while not line.accept("}"):
            if out:
                line.expect(",")
            index = line.pos
            tok = line.next("an attribute name")
            if tok[0] == '"':
                key = _unquote(tok, line, index)
            elif tok[0].isalpha() or tok[0] == "_":
                key = tok
            else:
                raise line.error(f"expected an attribute name, found '{tok}'", index)
            if key in out:
                raise line.error(f"duplicate attribute '{key}'", index)
            line.expect("=")
            out[key] = self.parse_attribute(line)
        return out

    def parse_attribute(self, line: _Line) -> Any:
        index = line.pos
        tok = line.next("an attribute value")
        c = tok[0]
        if c == '"':
            return _unquote(tok, line, index)
        if c.isdigit() or (c in "-+" and len(tok) > 1):
            if "." in tok or "e" in tok or "E" in tok or tok[-1] in "fn":
                return float(tok)
            return _integer(tok, line, index)
        if c == "[":
            items = []
            while not line.accept("]"):
                if items:
                    line.expect(",")
                items.append(self.parse_attribute(line))
            return items
        if c == "{":
            line.pos -= 1
            return self.parse_attr_dict(line)
        if c == "@":
            if len(tok) == 1:
                raise line.error("expected a symbol name after '@'", index)
            return SymbolRef(_unquote(tok[1:], line, index) if tok[1] == '"' else tok[1:])
        if tok.startswith("tensor<"):
            line.pos -= 1
            return self.parse_type(line)
        if tok in _KEYWORD_VALUES:
            return _KEYWORD_VALUES[tok]
        raise line.error(f"expected an attribute value, found '{tok}'", index)


def parse_module(text: str, path: str = "<ir>", verify: bool = True) -> Operation:
    """Parse textual IR into a `builtin.module`; with `verify`, run every op's verifier too.

    Syntax errors and undefined values raise `SxError` at `path:line:col`;
    verifier errors raise the first `VerifyError` (use `verify=False` and
    `passes.verify.verify_errors` to collect them all).
    """
    remember_source(path, text)
    with gc_paused():
        module = Parser(text, path).parse()
    if verify:
        module.verify()
    return module
