"""The value printer: how `eval`, diagnostics and the `macro-expand` dump write a value.

`show(value)` is the one printer. Data print in read syntax (a printed form
reads back as the same form). Any other object prints through the
``__sx_repr__()`` protocol: a method returning its text, such as
``#<loader 1 fields, batch 4>``; objects without one print ``#<TypeName>``.
"""

from __future__ import annotations

import sys
from typing import Any

from ..float_text import shortest_float
from .data import QUASIQUOTE, QUOTE, UNQUOTE, UNQUOTE_SPLICING, Keyword, SxMap, SxVector, Symbol

_QUOTE_PREFIXES = {QUOTE: "'", QUASIQUOTE: "`", UNQUOTE: ",", UNQUOTE_SPLICING: ",@"}
_STRING_ESCAPES = str.maketrans({'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"})


def show(value: Any) -> str:
    """`value` as `eval` prints it."""
    if value is None:
        return "nil"
    if value is True:
        return "true"
    if value is False:
        return "false"
    cls = value.__class__
    if cls is int:
        return _show_int(value)
    if cls is float:
        return _show_float(value)
    if cls is str:
        return '"' + value.translate(_STRING_ESCAPES) + '"'
    if cls is Symbol:
        return value.name
    if cls is Keyword:
        return ":" + value.name
    if isinstance(value, SxVector):
        return "[" + " ".join(show(x) for x in value) + "]"
    if isinstance(value, SxMap):
        return "{" + " ".join(show(x) for x in value) + "}"
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and value[0].__class__ is Symbol and value[0].name in _QUOTE_PREFIXES:
            return _QUOTE_PREFIXES[value[0].name] + show(value[1])
        return "(" + " ".join(show(x) for x in value) + ")"
    if isinstance(value, dict):
        return "{" + " ".join(f"{show(k)} {show(v)}" for k, v in value.items()) + "}"
    sx_repr = getattr(value, "__sx_repr__", None)
    if sx_repr is not None:
        return sx_repr()
    if isinstance(value, (int, float)):  # numpy scalars and other numbers
        return show(value.item() if hasattr(value, "item") else float(value))
    return f"#<{cls.__name__}>"


def show_form(form: Any) -> str:
    """A form as the `macro-expand` dump prints it (read syntax)."""
    return show(form)


def _show_int(x: int) -> str:
    try:
        return str(x)
    except ValueError:  # over Python's digit limit for int -> str (4300): print it all the same
        limit = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)
        try:
            return str(x)
        finally:
            sys.set_int_max_str_digits(limit)


def _show_float(x: float) -> str:
    # Python writes 1e+16; the reader takes both, the shorter reads better.
    return shortest_float(x).replace("e+", "e")
