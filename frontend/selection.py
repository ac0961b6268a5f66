"""Knobs, variants and the selection (language.md §3).

`(defknobs (name default "doc") …)` declares the knobs; `(defvariant name :knob
value …)` names a set of overrides. The *selection* of a compilation is the
defaults, then the chosen variant's values, then each `--set knob=value`, and
every knob remembers where its value came from (`default`, `variant`, `set`).

Variants are applied when `defknobs` runs, so knob values are constants for
every form after it; the evaluate pass therefore hands the variants found
among the file's top-level forms to `Selection` before evaluation starts, and
the `defvariant` forms themselves only print their name.

A `--set` value is parsed by the type of the knob's default: int, float, bool
(`true`/`false`), string, or a dtype name (`f32 bf16 f16 i32 i64 bool none`).

An unknown `--variant` or `--set` knob is a wrong command line (`UsageError`,
exit 2), not an error in the file; a value the knob's type does not take is
located at the knob's declaration.
"""

from __future__ import annotations

import math
from typing import Any

from attrs import define, field

from ..diagnostics import Location, SxError, UsageError, nearest
from ..float_text import shortest_float
from .data import SELF_EVALUATING_NAMES, Symbol

SOURCES = ("default", "variant", "set")


@define
class Knob:
    name: str
    default: Any
    doc: str | None
    loc: Location | None


@define
class Variant:
    """`(defvariant name :knob value …)`: values by knob, each with where it was written."""

    name: str
    values: dict[str, Any]
    loc: Location | None
    value_locs: dict[str, Location | None] = field(factory=dict)


def knob_type(value: Any) -> str:
    """The type a knob's values must have, named as messages show it."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Symbol) and value.name in SELF_EVALUATING_NAMES:
        return "dtype"
    return "value"


def described_type(kind: str) -> str:
    """A knob type with its article: "an int", "a float"."""
    return f"an {kind}" if kind == "int" else f"a {kind}"


def show_value(value: Any) -> str:
    """A knob value or folded constant as messages and reports write it (`knobs`, `explain`, `diff`): `true`,
    `nil`, a float as the shortest text that reads back as it, without a trailing `.0` (`0.0015`, `1e-10`,
    `1`, `nan`), a list as a vector (`[0.9 0.95]`), a dtype or other symbol by its name and a string as its
    text: the IR keeps a dtype knob as its name, so a report could not tell the two apart."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "nil"
    if isinstance(value, float):
        return shortest_float(value).removesuffix(".0")
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(show_value(v) for v in value) + "]"
    if isinstance(value, Symbol):
        return value.name
    return str(value)


def plain_value(value: Any) -> Any:
    """A knob value as an IR attribute or JSON value (a dtype symbol becomes its name)."""
    return value.name if isinstance(value, Symbol) else value


def conform(knob: Knob, value: Any) -> Any:
    """`value` as a value of `knob`'s type, or None when it has another type.

    An int is accepted for a float knob (and becomes a float).
    """
    kind = knob_type(knob.default)
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "value" or knob_type(value) == kind:
        return value
    return None


def parse_set_value(knob: Knob, text: str) -> Any:
    """Parse the text of `--set knob=text` by the type of the knob's default."""
    kind = knob_type(knob.default)
    try:
        if kind == "bool":
            if text not in ("true", "false"):
                raise ValueError
            return text == "true"
        if kind == "int":
            return int(text)
        if kind == "float":
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
        if kind == "dtype":
            if text not in SELF_EVALUATING_NAMES:
                raise ValueError
            return Symbol(text)
        if kind == "string":
            return text
    except ValueError:
        pass
    else:
        raise SxError(f"knob '{knob.name}' cannot be set from the command line (its default is not a plain value)", knob.loc)
    expected = {"dtype": "a dtype (" + ", ".join(SELF_EVALUATING_NAMES) + ")", "bool": "true or false",
                "float": "a finite float"}.get(kind, described_type(kind))
    raise SxError(
        f"--set {knob.name}={text}: knob '{knob.name}' takes {expected} (its default is {show_value(knob.default)})",
        knob.loc,
    )


def _unknown_knob(name: str, knobs: dict[str, Knob]) -> str:
    hint = nearest(name, knobs)
    return f"unknown knob '{name}'" + (f"; did you mean '{hint}'?" if hint else f" (knobs: {', '.join(knobs) or 'none'})")


@define
class Selection:
    """The knobs a file declares, its variants, and the chosen variant and `--set` overrides."""

    variant: str | None = None
    sets: list[str] = field(factory=list)
    variants: dict[str, Variant] = field(factory=dict)
    knobs: dict[str, Knob] = field(factory=dict)
    #: knob -> (selected value, source); filled by `select`.
    values: dict[str, tuple[Any, str]] = field(factory=dict)
    #: Where `defknobs` was.
    loc: Location | None = None

    def add_variant(self, variant: Variant) -> None:
        if variant.name in self.variants:
            first = self.variants[variant.name].loc
            raise SxError(f"variant '{variant.name}' is defined twice (first at {first})", variant.loc)
        self.variants[variant.name] = variant

    def select(self, knobs: list[Knob], loc: Location | None) -> dict[str, Any]:
        """Declare the knobs and compute their selected values; returns knob -> value."""
        if self.knobs:
            first = next(iter(self.knobs.values())).loc
            raise SxError(f"defknobs appears twice (knobs first declared at {first})", loc)
        self.loc = loc
        for knob in knobs:
            if knob.name in self.knobs:
                raise SxError(f"knob '{knob.name}' is declared twice", knob.loc)
            self.knobs[knob.name] = knob
        self.values = {k.name: (k.default, "default") for k in knobs}
        if self.variant is not None:
            chosen = self.variants.get(self.variant)
            if chosen is None:
                raise UsageError(self._unknown_variant(self.variant))
            for name, value in chosen.values.items():
                self.values[name] = (self._checked(name, value, chosen.value_locs.get(name)), "variant")
        for item in self.sets:
            name, eq, text = item.partition("=")
            name = name.strip()
            if not eq or not name:
                raise UsageError(f"--set expects KNOB=VALUE, got '{item}'")
            if name not in self.knobs:
                raise UsageError(f"--set {item}: {_unknown_knob(name, self.knobs)}")
            self.values[name] = (parse_set_value(self.knobs[name], text.strip()), "set")
        return {name: value for name, (value, _) in self.values.items()}

    def check_variant(self, variant: Variant) -> None:
        """Every key of a variant must be a knob of its type (checked even when it is not chosen)."""
        for name, value in variant.values.items():
            self._checked(name, value, variant.value_locs.get(name) or variant.loc)

    def _checked(self, name: str, value: Any, loc: Location | None) -> Any:
        knob = self.knobs.get(name)
        if knob is None:
            raise SxError(_unknown_knob(name, self.knobs), loc)
        conformed = conform(knob, value)
        if conformed is None:
            raise SxError(
                f"knob '{name}' takes {described_type(knob_type(knob.default))} (its default is {show_value(knob.default)}), "
                f"got {show_value(value)}",
                loc,
            )
        return conformed

    def _unknown_variant(self, name: str) -> str:
        known = ", ".join(self.variants) or "none"
        hint = nearest(name, self.variants)
        return f"unknown variant '{name}'" + (f"; did you mean '{hint}'?" if hint else "") + f" (variants: {known})"

    def check_command_line(self) -> None:
        """Selection flags given to a file that declares no knobs are command-line errors too."""
        if self.knobs:
            return
        if self.variant is not None:
            raise UsageError(self._unknown_variant(self.variant))
        if self.sets:
            name = self.sets[0].partition("=")[0]
            raise UsageError(f"--set {self.sets[0]}: unknown knob '{name}' (the file declares no knobs)")
