"""Index expressions over a kernel's iteration domain: the index maps of the `kern` dialect.

A fused kernel runs over a domain `[d0, d1, ...]` and reads each operand
element through an index map: the element's offset in the operand's
contiguous storage as an expression of the domain index `(i0, i1, ...)`.
Broadcasts, transposes, slices and reshapes are such expressions (as
PyTorch Inductor's loads are sympy expressions of the loop variables), so
a view costs no copy and no kernel:

    offset = const + Σ coeff · ((i_axis // div) % mod)  [+ coeff · index(input j)]

A term with `div = 1` and no modulus is a plain stride; the others come from
reshapes that split or merge axes. A gather (`graph.take`) adds an index
loaded from another operand, normalised into `[0, dim)`. A map may also hold
guards (`graph.pad`): bounds on expressions outside which the element is
`fill` and the operand is not read.

`Expr` is exact integer arithmetic on those forms: sums, scaling, and the
floor division and remainder a reshape needs (`divmod`), which succeed only
when the result is again of that form for every index of the domain; a
caller treats a failure as "not expressible here" (fusion stops there).
Expressions are kept canonical (terms merged and sorted), so two equal maps
compare equal.

Attribute form (what `kern.kernel {maps = [...]}` and `kern.index {expr}`
hold): `{offset = c, strides = [s0, s1, ...]}` plus, when present,
`terms = [[axis, div, mod, coeff], ...]` (mod 0: none),
`gather = [input, dim, coeff]`, `guards = [[expr, size], ...]` (the element
exists where `0 <= expr < size`) and `fill` (its value elsewhere).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class Term(NamedTuple):
    """`coeff · ((i_axis // div) % mod)`; `mod = 0` means no modulus."""

    axis: int
    div: int
    mod: int
    coeff: int


class Gather(NamedTuple):
    """`coeff · idx`, idx the element of index operand `source` (an opaque key until a kernel
    numbers its inputs) at this domain index, made non-negative by adding `dim` (as numpy takes)."""

    source: Any
    dim: int
    coeff: int


class Expr(NamedTuple):
    """`const + Σ terms + Σ gathers` over a domain of the given sizes, in canonical form."""

    sizes: tuple[int, ...]
    terms: tuple[Term, ...] = ()
    const: int = 0
    gathers: tuple[Gather, ...] = ()

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def constant(cls, sizes: Sequence[int], value: int) -> Expr:
        return cls(tuple(sizes), (), value)

    @classmethod
    def axis(cls, sizes: Sequence[int], axis: int, coeff: int = 1) -> Expr:
        """`coeff · i_axis`."""
        sizes = tuple(sizes)
        if coeff == 0 or sizes[axis] <= 1:
            return cls(sizes)
        return cls(sizes, (Term(axis, 1, 0, coeff),))

    @classmethod
    def flat(cls, sizes: Sequence[int], axes: Sequence[int] | None = None) -> Expr:
        """The row-major position of the domain index over `axes` (default all): Σ i_a · stride_a."""
        axes = list(range(len(sizes))) if axes is None else list(axes)
        terms = []
        stride = 1
        for a in reversed(axes):
            terms.append(Term(a, 1, 0, stride))
            stride *= sizes[a]
        return _canonical(tuple(sizes), terms, 0, ())

    @classmethod
    def sum(cls, sizes: Sequence[int], parts: Sequence[Expr], const: int = 0) -> Expr:
        """The sum of `parts` (and `const`), canonicalised once."""
        terms: list[Term] = []
        gathers: list[Gather] = []
        for part in parts:
            terms += part.terms
            gathers += part.gathers
            const += part.const
        return _canonical(tuple(sizes), terms, const, tuple(gathers))

    def __add__(self, other: Expr | int) -> Expr:  # type: ignore[override]
        if isinstance(other, int):
            return self._replace(const=self.const + other)
        return _canonical(self.sizes, [*self.terms, *other.terms], self.const + other.const,
                          (*self.gathers, *other.gathers))

    def scaled(self, factor: int) -> Expr:
        """`factor · self` (scaling keeps the canonical form: the merge rule is scale-invariant)."""
        if factor == 0:
            return Expr(self.sizes)
        if factor == 1:
            return self
        return Expr(self.sizes, tuple(t._replace(coeff=t.coeff * factor) for t in self.terms), self.const * factor,
                    tuple(g._replace(coeff=g.coeff * factor) for g in self.gathers))

    @classmethod
    def gathered(cls, sizes: Sequence[int], source: Any, dim: int) -> Expr:
        return cls(tuple(sizes), (), 0, (Gather(source, dim, 1),))

    # -- questions ------------------------------------------------------------------------

    def term_range(self, term: Term) -> int:
        """How many values `(i // div) % mod` takes."""
        reach = -(-self.sizes[term.axis] // term.div)
        return min(reach, term.mod) if term.mod else reach

    def maximum(self) -> int:
        """The largest value over the domain (every coefficient is positive)."""
        return (self.const + sum(t.coeff * (self.term_range(t) - 1) for t in self.terms)
                + sum(g.coeff * (g.dim - 1) for g in self.gathers))

    def axes(self) -> set[int]:
        """The domain axes the expression depends on (a gather's index operand aside)."""
        return {t.axis for t in self.terms}

    def strides(self) -> list[int] | None:
        """One plain stride per domain axis when every term is plain, else None."""
        strides = [0] * len(self.sizes)
        for t in self.terms:
            if t.div != 1 or t.mod:
                return None
            strides[t.axis] += t.coeff
        return strides

    def stride_of(self, axis: int) -> int | None:
        """The plain stride of `axis` when it appears only as a plain term (0 when absent)."""
        stride = 0
        for t in self.terms:
            if t.axis == axis:
                if t.div != 1 or t.mod:
                    return None
                stride += t.coeff
        return stride

    # -- division ---------------------------------------------------------------------------

    def divmod(self, divisor: int) -> tuple[Expr, Expr] | None:
        """`(self // divisor, self % divisor)` as expressions exact for every domain index,
        or None when one of them is not of the form (a remainder that could carry).

        Each term goes whole to the quotient (a multiple of the divisor), whole to the
        remainder (too small to reach it), or is split at the divisor by div/mod; the
        constant splits by floor division. The parts left to the remainder must stay
        below the divisor together.
        """
        if divisor == 1:
            return self, Expr.constant(self.sizes, 0)
        high: list[Term] = []
        low: list[Term] = []
        for t in self.terms:
            if t.coeff % divisor == 0:
                high.append(t._replace(coeff=t.coeff // divisor))
                continue
            span = self.term_range(t)
            if t.coeff * (span - 1) < divisor:
                low.append(t)
                continue
            if divisor % t.coeff:
                return None
            k = divisor // t.coeff
            if t.mod and t.mod % k:
                return None
            high.append(Term(t.axis, t.div * k, t.mod // k if t.mod else 0, 1))
            low.append(Term(t.axis, t.div, k, t.coeff))
        high_gathers: list[Gather] = []
        low_gathers: list[Gather] = []
        for g in self.gathers:
            if g.coeff % divisor == 0:
                high_gathers.append(g._replace(coeff=g.coeff // divisor))
            elif g.coeff * (g.dim - 1) < divisor:
                low_gathers.append(g)
            else:
                return None
        quotient_const, remainder_const = divmod(self.const, divisor)
        remainder = _canonical(self.sizes, low, remainder_const, tuple(low_gathers))
        if remainder.maximum() >= divisor:
            return None
        return _canonical(self.sizes, high, quotient_const, tuple(high_gathers)), remainder

    # -- attribute form ---------------------------------------------------------------------

    def attribute(self, inputs: Mapping[Any, int] | None = None) -> dict[str, Any]:
        """The attribute dict (`inputs` numbers the gathers' sources as kernel inputs)."""
        strides = [0] * len(self.sizes)
        other: list[list[int]] = []
        for t in self.terms:
            if t.div == 1 and not t.mod:
                strides[t.axis] += t.coeff
            else:
                other.append([t.axis, t.div, t.mod, t.coeff])
        out: dict[str, Any] = {"offset": self.const, "strides": strides}
        if other:
            out["terms"] = other
        if self.gathers:
            if len(self.gathers) != 1 or inputs is None:
                raise ValueError("an index map holds at most one gather, of a numbered input")
            g = self.gathers[0]
            out["gather"] = [inputs[g.source], g.dim, g.coeff]
        return out

    @classmethod
    def from_attribute(cls, sizes: Sequence[int], attribute: Mapping[str, Any]) -> Expr:
        """The expression an attribute dict describes; gathers keep the input number as their source."""
        terms = [Term(axis, 1, 0, stride) for axis, stride in enumerate(attribute["strides"]) if stride]
        terms += [Term(*t) for t in attribute.get("terms", ())]
        gathers = ()
        if "gather" in attribute:
            source, dim, coeff = attribute["gather"]
            gathers = (Gather(source, dim, coeff),)
        return _canonical(tuple(sizes), terms, attribute["offset"], gathers)


def _canonical(sizes: tuple[int, ...], terms: Sequence[Term], const: int, gathers: Sequence[Gather]) -> Expr:
    """Terms of one axis merged where they join (`c·(i % m) + c·m·(i // m)` is `c·i`), moduli
    that wrap nothing dropped, zero terms and always-zero terms removed, the rest sorted."""
    by_axis: dict[int, list[Term]] = {}
    for t in terms:
        if t.coeff == 0:
            continue
        reach = -(-sizes[t.axis] // t.div)
        mod = t.mod if t.mod and t.mod < reach else 0
        if (mod or reach) <= 1:
            continue
        if mod != t.mod:
            t = Term(t.axis, t.div, mod, t.coeff)
        by_axis.setdefault(t.axis, []).append(t)
    merged: list[Term] = []
    for axis, axis_terms in by_axis.items():
        merged += axis_terms if len(axis_terms) == 1 else _merge_axis(sizes[axis], axis_terms)
    merged.sort()
    return Expr(sizes, tuple(merged), const, tuple(g for g in gathers if g.coeff))


def _merge_axis(size: int, terms: list[Term]) -> list[Term]:
    """One axis's terms: equal (div, mod) parts added, adjacent digit ranges joined."""
    while True:
        combined: dict[tuple[int, int], int] = {}
        for t in terms:
            combined[(t.div, t.mod)] = combined.get((t.div, t.mod), 0) + t.coeff
        terms = [Term(terms[0].axis, d, m, c) for (d, m), c in combined.items() if c]
        joined = None
        for a in terms:
            if not a.mod:
                continue
            for b in terms:
                if b is not a and b.div == a.div * a.mod and b.coeff == a.coeff * a.mod:
                    reach = -(-size // a.div)
                    mod = a.mod * b.mod if b.mod else 0
                    joined = (a, b, Term(a.axis, a.div, mod if mod and mod < reach else 0, a.coeff))
                    break
            if joined:
                break
        if joined is None:
            return terms
        a, b, term = joined
        terms = [t for t in terms if t is not a and t is not b] + [term]


def row_major_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


def reshape_groups(source: Sequence[int], target: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """The axes of a reshape in matching runs: `(source axes, target axes)` whose sizes multiply to
    the same number, each run as short as possible. Size-1 axes belong to no run (their index is
    always 0). None when the element counts differ."""
    if math.prod(source) != math.prod(target):
        return None
    src = [a for a, n in enumerate(source) if n != 1]
    dst = [a for a, n in enumerate(target) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src):
        run_src, run_dst = [src[i]], [dst[j]]
        a, b = source[src[i]], target[dst[j]]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                run_src.append(src[i])
                a *= source[src[i]]
                i += 1
            else:
                run_dst.append(dst[j])
                b *= target[dst[j]]
                j += 1
        groups.append((run_src, run_dst))
    return groups


def reshape_index(source: Sequence[int], target: Sequence[int], index: Sequence[Expr]) -> list[Expr] | None:
    """The index into `source` (shape before a reshape) of the element at `index` of `target`
    (the reshaped shape), axis by axis; None when a merged axis cannot be split again."""
    moved = _reshape_index(tuple(source), tuple(target), tuple(index))
    return None if moved is None else list(moved)


@functools.lru_cache(maxsize=1 << 16)
def _reshape_index(source: tuple[int, ...], target: tuple[int, ...], index: tuple[Expr, ...]) -> tuple[Expr, ...] | None:
    groups = reshape_groups(source, target)
    if groups is None:
        return None
    sizes = index[0].sizes if index else ()
    result: list[Expr | None] = [None] * len(source)
    for src, dst in groups:
        if len(src) == 1 and len(dst) == 1:
            result[src[0]] = index[dst[0]]
            continue
        parts = []
        stride = 1
        for axis in reversed(dst):
            parts.append(index[axis].scaled(stride))
            stride *= target[axis]
        position = Expr.sum(sizes, parts)
        for axis in reversed(src):
            split = position.divmod(source[axis])
            if split is None:
                return None
            position, result[axis] = split
    return tuple(r if r is not None else Expr(tuple(sizes)) for r in result)


def storage_offset(shape: Sequence[int], index: Sequence[Expr], sizes: Sequence[int]) -> Expr:
    """The offset in row-major storage of `shape` of the element at `index`."""
    return _storage_offset(tuple(shape), tuple(index), tuple(sizes))


@functools.lru_cache(maxsize=1 << 16)
def _storage_offset(shape: tuple[int, ...], index: tuple[Expr, ...], sizes: tuple[int, ...]) -> Expr:
    return Expr.sum(sizes, [part.scaled(stride) for stride, part in zip(row_major_strides(shape), index)])
