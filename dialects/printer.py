"""The textual form of the IR: one op a line, MLIR-like, read back by `parser.py`.

    %3 = graph.matmul %1, %2 : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32> loc("mlp.sx":5:7)
    %4 = graph.sum %3 {axes = [0, 1], keep = false} : (tensor<4x3xf32>) -> tensor<f32> loc(unknown)
    graph.func @train {kind = "train"} loc("mlp.sx":1:1) {
      ...
    }

An op line is: results `=`, the op name, `@sym_name` when the op has one,
operands, the attribute dict (sorted by key, omitted when empty), the type
signature (omitted when the op has neither operands nor results), the
location, and `{` when regions follow. A `builtin.module` prints as its body
ops. Values are numbered `%0, %1, ...` per top-level op; a value with a name
hint prints as `%hint` (made unique), so parse-then-print reproduces the text.
"""

from __future__ import annotations

import json
import numbers
import re
from typing import Any

from ..diagnostics import Location
from ..float_text import shortest_float
from .core import Block, Operation, SymbolRef, TensorType, Value, quote_symbol

_BARE_KEY = re.compile(r"[A-Za-z_][\w$.-]*\Z")
_BARE_NAME = re.compile(r"[A-Za-z_][\w$.-]*\Z")
_NAME_CHARS = re.compile(r"[^\w$.-]")
#: Words the attribute parser reads as values, so a dict key spelled so is quoted.
_KEYWORDS = frozenset({"true", "false", "none", "inf", "nan"})
INDENT = "  "


def print_string(s: str) -> str:
    """A string attribute: double-quoted, JSON escapes, non-ASCII kept as is."""
    return json.dumps(s, ensure_ascii=False)


def print_float(x: float) -> str:
    """A float attribute: the shortest text that reads back as the same float, never as an int."""
    return shortest_float(x)


def print_location(loc: Location | None) -> str:
    """`loc("file.sx":12:5)`, `loc("my.sx":12:5 via "prelude.sx":40:3)` or `loc(unknown)`."""
    if loc is None:
        return "loc(unknown)"
    parts = []
    frame: Location | None = loc
    while frame is not None:
        parts.append(f"{print_string(frame.file)}:{frame.line}:{frame.col}")
        frame = frame.via
    return "loc(" + " via ".join(parts) + ")"


def attribute_json(value: Any) -> Any:
    """An attribute value as JSON data, as the JSON reports write it: tensor types as
    `{"shape", "dtype"}`, symbols by name, non-finite floats (which JSON lacks) as the
    strings "inf", "-inf" and "nan"; any other object as its text."""
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, (list, tuple)):
        return [attribute_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): attribute_json(v) for k, v in value.items()}
    if isinstance(value, TensorType):
        return {"shape": list(value.shape), "dtype": value.dtype}
    if isinstance(value, SymbolRef):
        return value.name
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


def print_attribute(value: Any) -> str:
    """One attribute value in the textual form."""
    # bool before int: True is an int in Python.
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "none"
    if isinstance(value, str):
        return print_string(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return print_float(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(print_attribute, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{print_key(k)} = {print_attribute(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (TensorType, SymbolRef)):
        return str(value)
    # numpy scalars and other number types
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return print_float(float(value))
    raise TypeError(f"cannot print attribute value {value!r} of type {type(value).__name__}")


def print_key(key: str) -> str:
    if _BARE_KEY.match(key) and key not in _KEYWORDS:
        return key
    return print_string(key)


def print_attr_dict(attributes: dict[str, Any], skip: str | None = None) -> str:
    """` {a = 1, b = "x"}` in sorted key order, or "" when there is nothing to print."""
    keys = sorted(k for k in attributes if k != skip)
    if not keys:
        return ""
    return " {" + ", ".join(f"{print_key(k)} = {print_attribute(attributes[k])}" for k in keys) + "}"


class _Namer:
    """Gives each value a unique name within one top-level op."""

    def __init__(self) -> None:
        self.names: dict[Value, str] = {}
        self.taken: set[str] = set()
        self.counter = 0

    def define(self, value: Value) -> str:
        hint = value.name_hint
        if hint is None:
            name = f"%{self.counter}"
            self.counter += 1
        else:
            base = hint if _BARE_NAME.match(hint) else "v_" + _NAME_CHARS.sub("_", hint)
            name, suffix = "%" + base, 1
            while name in self.taken:
                name = f"%{base}_{suffix}"
                suffix += 1
            self.taken.add(name)
        self.names[value] = name
        return name

    def use(self, value: Value) -> str:
        name = self.names.get(value)
        # A value defined outside what is printed (a detached op, a bug) still prints, visibly so.
        return name if name is not None else "%<undefined>"


def _signature(op: Operation) -> str:
    if not op.operands and not op.results:
        return ""
    ins = ", ".join(str(v.type) for v in op.operands)
    if len(op.results) == 1:
        outs = str(op.results[0].type)
    else:
        outs = "(" + ", ".join(str(r.type) for r in op.results) + ")"
    return f" : ({ins}) -> {outs}"


def _print_op(op: Operation, namer: _Namer, indent: str, out: list[str]) -> None:
    parts = [indent]
    if op.results:
        parts.append(", ".join(namer.define(r) for r in op.results))
        parts.append(" = ")
    parts.append(op.name)
    sym = op.attributes.get("sym_name")
    has_sym = isinstance(sym, str)
    if has_sym:
        parts.append(" @" + quote_symbol(sym))
    if op.operands:
        parts.append(" " + ", ".join(namer.use(v) for v in op.operands))
    parts.append(print_attr_dict(op.attributes, "sym_name" if has_sym else None))
    parts.append(_signature(op))
    parts.append(" " + print_location(op.loc))
    if not op.regions:
        out.append("".join(parts))
        return
    parts.append(" {")
    out.append("".join(parts))
    inner = indent + INDENT
    for i, region in enumerate(op.regions):
        if i:
            out.append(indent + "} {")
        labelled = len(region.blocks) > 1 or any(b.args for b in region.blocks)
        for j, block in enumerate(region.blocks):
            if labelled:
                _print_block_label(block, j, namer, indent, out)
            for child in block.ops:
                _print_op(child, namer, inner, out)
    out.append(indent + "}")


def _print_block_label(block: Block, index: int, namer: _Namer, indent: str, out: list[str]) -> None:
    args = ", ".join(f"{namer.define(a)}: {a.type}" for a in block.args)
    out.append(f"{indent}^bb{index}({args}):")


def print_op(op: Operation) -> str:
    """One op (and what its regions hold) as text, without a trailing newline.

    A `builtin.module` prints as its body; values are numbered afresh.
    """
    out: list[str] = []
    if op.name == "builtin.module":
        for child in op.body.ops:
            _print_op(child, _Namer(), "", out)
    else:
        _print_op(op, _Namer(), "", out)
    return "\n".join(out)


def print_module(module: Operation) -> str:
    """The whole module as text, one op a line, ending with a newline (empty for an empty module)."""
    text = print_op(module)
    return text + "\n" if text else ""
