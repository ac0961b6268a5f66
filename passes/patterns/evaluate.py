"""A region's ops evaluated in float64 on a few sample rows, whatever the tensors' real shapes.

Every value is held in its kind's canonical shape: a row value `[R, C]`
(R sample rows of the real row length C, since a mean written as `sum * 1/C`
is only a mean at the real C), a per-row value `[R, 1]`, a column value
`[1, C]`, a whole value `[]`. Each op computes what its class says (see
`domain.OpClass`), elementwise ops with the graph dialect's own numpy
semantics (`dialects/graph_semantics.py`). Float casts are identities: the
point is the math, in float64; precision is the kernel's business.

Inputs are drawn by kind: rows with different scales and offsets (one with a
tiny spread, so an epsilon's placement shows), per-row, column and whole
values from a normal distribution, integer indices within the row.

The *regime* trial (`evaluate_regimes`) draws the inputs a guard tells apart
from the ordinary ones, where `maximum(var, eps)`, `maximum(logp, -30)` or
`log(maximum(p, 1e-30))` stop being the identity: a row of zeros, rows of
tiny and of huge scale, rows at and beyond every constant the region
compares with, and integer indices equal to each integer constant it
compares with (an ignored target).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ...dialects.core import Value
from ...dialects.graph_semantics import numpy_binary, numpy_unary
from .domain import Kind, OpClass, is_float, splat_value
from .regions import Region

#: Sample row counts of the trials (a couple of shapes); a single-row domain is sampled with one row.
SAMPLE_ROWS = (3, 5)
ROW_SCALES = np.array([1.0, 0.03, 2.5, 0.4, 1.3])
ROW_SHIFTS = np.array([0.0, 0.7, -1.2, 0.2, 0.0])

Env = dict[Value, np.ndarray]


def canonical_shape(kind: Kind, rows: int, cols: int) -> tuple[int, ...]:
    return {Kind.ROW: (rows, cols), Kind.PER_ROW: (rows, 1), Kind.COLUMN: (1, cols), Kind.WHOLE: ()}[kind]


#: The regime trial's rows: a row of zeros, then rows of tiny and of huge scale (no shift: a guard, not
#: cancellation, is what they are to show).
REGIME_SCALES = (0.0, 1e-7, 1e-3, 1e2, 1e4)
#: Ops whose constants a guard compares with.
GUARD_OPS = frozenset({"graph.maximum", "graph.minimum", "graph.eq", "graph.ne", "graph.lt", "graph.le",
                       "graph.gt", "graph.ge"})


def sample_rows(region: Region, trial: int) -> int:
    return 1 if region.domain.rows == 1 else SAMPLE_ROWS[trial]


def draw(value: Value, kind: Kind | None, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A random input for a leaf of this kind and dtype."""
    const = splat_value(value.op)
    if const is not None:
        return np.asarray(const if is_float(value) else int(const))
    shape = canonical_shape(kind or Kind.WHOLE, rows, cols)
    dtype = value.type.dtype
    if dtype == "i1":
        return rng.random(shape) < 0.5
    if not is_float(value):
        return rng.integers(0, cols, shape)
    sample = rng.standard_normal(shape)
    if kind is Kind.ROW:
        sample = sample * ROW_SCALES[:rows, None] + ROW_SHIFTS[:rows, None]
    return sample


def evaluate(region: Region, rows: int, rng: np.random.Generator, given: Mapping[Value, np.ndarray] = ()) -> Env:
    """Every value of `region` on `rows` sample rows: leaves from `given`, else drawn at random."""
    cols = region.domain.cols
    env: Env = dict(given)
    for leaf in region.leaves:
        if leaf not in env:
            env[leaf] = draw(leaf, region.kind(leaf), rows, cols, rng)
    return _run(region, env, rows)


def guard_constants(region: Region) -> list[float]:
    """The finite constants the region's maximums, minimums and comparisons compare with."""
    found: dict[float, None] = {}
    for op in region.ops:
        if op.name in GUARD_OPS:
            for operand in op.operands:
                const = splat_value(operand.op)
                if const is not None and math.isfinite(const):
                    found.setdefault(float(const), None)
    return list(found)


def evaluate_regimes(region: Region, x: Value, targets: Value | None, rng: np.random.Generator) -> list[Env]:
    """Every value of `region` on the regime trial (module docstring), with the family's input `x` held at rows
    of zeros, of tiny and huge scale and at and beyond each compared constant, and its integer `targets` (if
    any) at each integer constant; the other leaves drawn as usual. A single-row domain is evaluated once per
    regime row (its sums over rows are of one row)."""
    cols = region.domain.cols
    constants = guard_constants(region)
    # A row per constant c: elements at c, below and above it by its magnitude and more.
    steps = np.array([-1.0, 0.0, 1.0])
    regime_rows = [rng.standard_normal(cols) * scale for scale in REGIME_SCALES]
    regime_rows += [c + (1.0 + abs(c)) * steps[np.arange(cols) % 3] for c in constants]
    integers = [int(c) for c in constants if c == int(c)]
    if region.domain.rows == 1:
        return [_regime(region, x, targets, [row], integers[:1], rng) for row in regime_rows]
    return [_regime(region, x, targets, regime_rows, integers, rng)]


def _regime(region: Region, x: Value, targets: Value | None, regime_rows: list[np.ndarray], integers: list[int],
            rng: np.random.Generator) -> Env:
    rows, cols = len(regime_rows), region.domain.cols
    env: Env = {x: np.array(regime_rows)}
    if targets is not None:
        env[targets] = rng.integers(0, cols, (rows, 1))
        count = min(len(integers), rows)
        env[targets][:count, 0] = integers[:count]
    for leaf in region.leaves:
        if leaf in env:
            continue
        kind = region.kind(leaf)
        # Rows other than the input are drawn at the ordinary scales, repeated over the regime's rows.
        env[leaf] = (draw(leaf, kind, len(ROW_SCALES), cols, rng)[np.arange(rows) % len(ROW_SCALES)]
                     if kind is Kind.ROW else draw(leaf, kind, rows, cols, rng))
    return _run(region, env, rows)


def _run(region: Region, env: Env, rows: int) -> Env:
    cols = region.domain.cols
    with np.errstate(all="ignore"):
        for op in region.ops:
            if op.result in env:
                continue  # held (the regime trial's input)
            classified = region.classes[op]
            args = []
            for operand, kind in zip(op.operands, classified.operand_kinds):
                value = env[operand]
                if value.ndim == 0 and kind is not Kind.WHOLE:
                    value = np.broadcast_to(value, canonical_shape(kind, rows, cols))
                args.append(value)
            result = _compute(op.name, op.attributes, classified.op_class, args, rows, cols)
            shape = canonical_shape(classified.result_kind, rows, cols)
            env[op.result] = result if result.shape == shape else np.broadcast_to(result, shape)
    return env


def _compute(name: str, attributes: Mapping, op_class: OpClass, args: list[np.ndarray], rows: int,
             cols: int) -> np.ndarray:
    if op_class is OpClass.ELEMENTWISE:
        return _elementwise(name, attributes, args)
    if op_class in (OpClass.BROADCAST, OpClass.VIEW):
        return args[0]
    if op_class in (OpClass.REDUCE_ROW, OpClass.REDUCE_ROWS, OpClass.REDUCE_ALL):
        reduce = {"graph.sum": np.sum, "graph.max": np.max, "graph.min": np.min}[name]
        if op_class is OpClass.REDUCE_ALL:
            return np.asarray(reduce(args[0]))
        return reduce(args[0], axis=1 if op_class is OpClass.REDUCE_ROW else 0, keepdims=True)
    if op_class is OpClass.TAKE_ALONG:
        x, idx = args
        return np.take_along_axis(x, _wrapped(idx, cols), axis=1)
    if op_class is OpClass.ONE_HOT:
        return (np.arange(cols)[None, :] == args[0]).astype(np.float64)
    if op_class is OpClass.SCATTER_ALONG:
        idx, updates = args
        out = np.zeros((rows, cols))
        np.add.at(out, (np.arange(rows), _wrapped(idx, cols)[:, 0]), updates[:, 0])
        return out
    if op_class is OpClass.IOTA:
        return np.broadcast_to(np.arange(cols), (rows, cols))
    raise AssertionError(f"no evaluation for {op_class}")


def _wrapped(idx: np.ndarray, cols: int) -> np.ndarray:
    """numpy's negative indices count from the end; out-of-range ones are clipped to stay computable."""
    idx = np.asarray(idx).astype(np.int64)
    return np.clip(np.where(idx < 0, idx + cols, idx), 0, cols - 1)


def _elementwise(name: str, attributes: Mapping, args: list[np.ndarray]) -> np.ndarray:
    if name == "graph.cast":
        return _cast(args[0], attributes["dtype"])
    if name == "graph.where":
        return np.where(*args)
    if name == "graph.erf":
        return np.frompyfunc(math.erf, 1, 1)(args[0]).astype(np.float64)
    unary = numpy_unary().get(name)
    if unary is not None:
        return np.asarray(unary(args[0]))
    return np.asarray(numpy_binary()[name](*args))


def _cast(value: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "i1":
        return value != 0
    if dtype in ("i32", "i64"):
        return value.astype(np.int64)
    return value.astype(np.float64)
