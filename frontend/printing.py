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
from .data import QUASIQUOTE, QUOTE, UNQUOTE, UNQUOTE_SPLICING, Keyword, SxMap, SxVector, Symbol, TensorLike

_QUOTE_PREFIXES = {QUOTE: "'", QUASIQUOTE: "`", UNQUOTE: ",", UNQUOTE_SPLICING: ",@"}
_STRING_ESCAPES = str.maketrans({'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"})


def show(value: Any) -> str:
    """`value` as `eval` prints it.

    Containers are printed with an explicit stack, so data nested any depth prints
    (a list built by a fold 100,000 deep is as printable as a flat one).
    """
    text = _show_atom(value)
    if text is not None:
        return text
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if item.__class__ is _Text:
            out.append(item)
            continue
        text = _show_atom(item)
        if text is not None:
            out.append(text)
            continue
        if isinstance(item, dict):
            opener, closer = "{", "}"
            parts = [x for pair in item.items() for x in pair]
        elif isinstance(item, SxVector):
            opener, closer, parts = "[", "]", item
        elif isinstance(item, SxMap):
            opener, closer, parts = "{", "}", item
        elif len(item) == 2 and item[0].__class__ is Symbol and item[0].name in _QUOTE_PREFIXES:
            out.append(_QUOTE_PREFIXES[item[0].name])
            stack.append(item[1])
            continue
        else:
            opener, closer, parts = "(", ")", item
        out.append(opener)
        stack.append(_CLOSERS[closer])
        for i in range(len(parts) - 1, -1, -1):
            stack.append(parts[i])
            if i:
                stack.append(_SPACE)
    return "".join(out)


class _Text(str):
    """Literal text on `show`'s stack (a bracket or a space), as opposed to a value to print."""

    __slots__ = ()


_SPACE = _Text(" ")
_CLOSERS = {c: _Text(c) for c in ")]}"}


def _show_atom(value: Any) -> str | None:
    """`value` printed, or None when it is a container (a list, vector, map or tuple)."""
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
    if isinstance(value, (list, tuple, dict)):
        return None
    sx_repr = getattr(value, "__sx_repr__", None)
    if sx_repr is not None:
        return sx_repr()
    if isinstance(value, (int, float)):  # numpy scalars and other numbers
        return show(value.item() if hasattr(value, "item") else float(value))
    return f"#<{cls.__name__}>"


def kind_of(value: Any) -> str:
    """What a value is, for error messages: "a vector", "a number", "nil"."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Keyword):
        return "a keyword"
    if isinstance(value, Symbol):
        return "a symbol"
    if isinstance(value, SxVector):
        return "a vector"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a map"
    if isinstance(value, TensorLike):
        return "a tensor"
    if isinstance(value, (int, float)):
        return "a number"
    # Runtime values say what they are (`Closure.sx_kind` is "a function"); others by their class.
    return getattr(value, "sx_kind", None) or "a " + type(value).__name__.lower()


def shown(value: Any) -> str:
    """`value` printed for a message: a long text (a 1 MB string) is cut short."""
    text = show(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 1] + "…"


def described(value: Any) -> str:
    """`value` printed for a message, with what it is unless that is plain ("nil")."""
    kind, text = kind_of(value), shown(value)
    return text if kind == text else f"{text} ({kind})"


#: Characters of a value an error message quotes.
_MAX_SHOWN = 200


def short_int(value: Any) -> str:
    """A number as a message shows it: an integer of many digits by its first ones and its length."""
    text = show(value)
    if value.__class__ is int and len(text) > 24:
        return f"{text[:12]}… ({len(text.lstrip('-'))} digits)"
    return text


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
