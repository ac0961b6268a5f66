"""The datums of the .sx language: what the reader makes and what the evaluator computes with.

Atoms are plain Python values so that arithmetic on them is Python arithmetic:
ints, floats, strings, ``True``/``False`` and ``None`` (nil). Symbols and
keywords are small classes. Lists, vectors and maps read from source are list
subclasses that carry their own location and the location of every element
(``locs``), so an atom such as ``42`` inside a list can still be located.

Runtime values the evaluator adds (functions, macros, several values) live in
`frontend.evaluator`; tensors and experiment objects are defined by later
layers through the protocols declared here (`TensorLike`, `__sx_repr__`).
"""

from __future__ import annotations

from typing import Any

from ..diagnostics import Location


class Symbol:
    """A name. Equal to any symbol with the same name; `loc` is where this occurrence was read.

    The reader gives a symbol its source and offset (`src`, `pos`) instead of a `Location`:
    `loc` builds it on first use (most symbols are never asked where they are).
    """

    __slots__ = ("name", "_loc", "_src", "_pos")

    def __init__(self, name: str, loc: Location | None = None, src: Any = None, pos: int = 0) -> None:
        self.name = name
        self._loc = loc
        self._src = src
        self._pos = pos

    @property
    def loc(self) -> Location | None:
        loc = self._loc
        if loc is None and self._src is not None:
            loc = self._loc = self._src.loc(self._pos)
        return loc

    @loc.setter
    def loc(self, value: Location | None) -> None:
        self._loc = value
        self._src = None

    def __eq__(self, other: object) -> bool:
        return other.__class__ is Symbol and other.name == self.name  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"Symbol({self.name!r})"


class Keyword:
    """`:name`; evaluates to itself. Interned, so `is` compares keywords."""

    __slots__ = ("name",)
    _table: dict[str, Keyword] = {}

    def __new__(cls, name: str) -> Keyword:
        kw = cls._table.get(name)
        if kw is None:
            kw = super().__new__(cls)
            kw.name = name
            cls._table[name] = kw
        return kw

    def __reduce__(self):
        return (Keyword, (self.name,))

    def __repr__(self) -> str:
        return f"Keyword({self.name!r})"


class _Located(list):
    """A list, vector or map datum: `loc` is its opening bracket, `locs[i]` locates element i (or is None).

    What the reader makes carries its source (`src`, an object with `loc(offset)`), the
    offset of its bracket (`pos`) and of each element (`offs`) instead of `Location`s:
    `loc`, `locs` and `element_loc` build them on first use. Reading a file makes one
    located value per token, and building a `Location` for each was most of its cost.
    """

    __slots__ = ("_loc", "_locs", "_src", "_pos", "_offs", "origin")

    def __init__(
        self,
        items: Any = (),
        loc: Location | None = None,
        locs: list | None = None,
        src: Any = None,
        pos: int | None = None,
        offs: list[int] | None = None,
        origin: Location | None = None,
    ) -> None:
        super().__init__(items)
        self._loc = loc
        self._locs = locs
        self._src = src
        self._pos = pos
        self._offs = offs
        #: Where a quasiquote template wrote this list (it has no location of its own until a
        #: macro's expansion places it at the macro's use); None for the rest.
        self.origin = origin

    @property
    def loc(self) -> Location | None:
        loc = self._loc
        if loc is None and self._pos is not None:
            loc = self._loc = self._src.loc(self._pos)
        return loc

    @loc.setter
    def loc(self, value: Location | None) -> None:
        self._loc = value
        self._pos = None

    @property
    def locs(self) -> list | None:
        locs = self._locs
        if locs is None and self._offs is not None:
            at = self._src.loc
            locs = self._locs = [at(off) for off in self._offs]
            self._offs = None
        return locs

    @locs.setter
    def locs(self, value: list | None) -> None:
        self._locs = value
        self._offs = None

    def with_items(self, items: Any) -> _Located:
        """A datum of the same kind holding `items`, located where this one is (element i at i)."""
        return self.__class__(items, self._loc, self._locs, self._src, self._pos, self._offs, self.origin)


class SxList(_Located):
    """A list datum `( … )`. `loc` is its opening paren; `locs[i]` locates element i (or is None)."""

    __slots__ = ()


class SxVector(_Located):
    """A vector `[ … ]`: read syntax and runtime value (shapes, literal lists)."""

    __slots__ = ()


class SxMap(_Located):
    """A map literal `{ k v … }` as read: keys and values alternate. Evaluates to a `dict`."""

    __slots__ = ()


#: Quote-like prefixes and the symbol each reads as: 'x is (quote x).
QUOTE = "quote"
QUASIQUOTE = "quasiquote"
UNQUOTE = "unquote"
UNQUOTE_SPLICING = "unquote-splicing"


def loc_of(datum: object) -> Location | None:
    """Where `datum` was read, if it carries a location (symbols, lists, vectors, maps)."""
    return getattr(datum, "loc", None)


def element_loc(container: object, index: int) -> Location | None:
    """Where element `index` of a list/vector/map datum was read; falls back to the container."""
    if isinstance(container, _Located):
        offs = container._offs
        if offs is not None:
            if index < len(offs):
                return container._src.loc(offs[index])
            return container.loc
        locs = container._locs
    else:
        locs = getattr(container, "locs", None)
    if locs is not None and index < len(locs) and locs[index] is not None:
        return locs[index]
    return getattr(container, "loc", None)


class TensorLike:
    """Base class of tensor values (defined by the tracing layer).

    The scalar builtins named in `TENSOR_OPS` check their arguments: when any is
    a `TensorLike`, the call goes to ``TENSOR_OPS[name](loc, *args, **kwargs)``
    instead of computing on Python numbers.
    """

    __slots__ = ()


#: Tensor implementations of the overloaded builtins, filled by the tracing layer:
#: name -> callable(loc, *args, **kwargs).
TENSOR_OPS: dict[str, Any] = {}

#: The builtins that dispatch to `TENSOR_OPS` when given a tensor.
TENSOR_OVERLOADED = (
    "+ - * / pow min max abs sqrt exp log cos sin tanh floor ceil round = != < <= > >= not".split()
)

#: What a map key may be: keywords, strings, symbols, numbers (`1` and `1.0` are one key, as `=`
#: says) and nil. Not booleans (a Python dict takes `true` for the key `1`), and not containers,
#: tensors or functions (a key is compared by value, and those have no value that stays put).
MAP_KEY_TYPES = frozenset({Keyword, Symbol, str, int, float, type(None)})
MAP_KEY_RULE = "a map key must be a keyword, string, symbol, number or nil"


#: Names that evaluate to themselves (as a `Symbol` without location): dtypes, `none`, and the
#: storage dtypes of token files (`(token-file "x.u32" :dtype u32)`).
SELF_EVALUATING_NAMES = ("f32", "bf16", "f16", "i32", "i64", "bool", "none", "u16", "u32")
