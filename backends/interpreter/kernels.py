"""numpy kernels for every graph op, built once per op when a graph is compiled.

A builder turns one op into a `Kernel`: a function of the operand arrays
returning the result array in the result's storage dtype, and whether it also
takes `out=` (then the compiler may hand it a reused buffer). Semantics follow
the op docstrings in `sexpgpu.dialects.graph`; the choices they leave open are
documented here and in docs/interpreter.md:

- integer `div` truncates toward zero (as C and CUDA do);
- `abs` and `neg` accept integers; every other unary op needs a float;
- a 16-bit float op computes in float32 and rounds its result once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from attrs import frozen

from ...dialects.core import Operation
from ...dialects.graph_semantics import numpy_binary, numpy_unary
from .dtypes import DtypePolicy
from .erf import erf, erf_f32


@frozen
class Kernel:
    """What one op computes: `fn(*operands)`, or `fn(*operands, out=buffer)` when `takes_out`."""

    fn: Callable[..., Any]
    takes_out: bool = False


Builder = Callable[[Operation, DtypePolicy], Kernel]
BUILDERS: dict[str, Builder] = {}


def kernel_for(op: Operation, policy: DtypePolicy) -> Kernel:
    builder = BUILDERS.get(op.name)
    if builder is None:
        raise NotImplementedError(f"the interpreter cannot run '{op.name}'")
    return builder(op, policy)


def _builds(*names: str) -> Callable[[Builder], Builder]:
    def register(builder: Builder) -> Builder:
        for name in names:
            BUILDERS[name] = builder
        return builder

    return register


def _rounded(fn: Callable[..., Any], compute: np.dtype, storage: np.dtype) -> Callable[..., Any]:
    """`fn` run on float operands widened to `compute`, its result rounded to `storage`."""

    def run(*xs: Any) -> Any:
        return np.asarray(fn(*(_widen16(x, compute) for x in xs))).astype(storage)

    return run


def _widen16(x: Any, compute: np.dtype) -> Any:
    """Widen a 16-bit float array (numpy f16 or ml_dtypes bf16) to the compute dtype; others pass."""
    dtype = np.asarray(x).dtype
    if dtype.itemsize == 2 and dtype.kind not in "iub":
        return np.asarray(x).astype(compute)
    return x


def _arith(op: Operation, policy: DtypePolicy, fn: Callable[..., Any], takes_out: bool, dtype: str) -> Kernel:
    """A kernel computing in `dtype`'s compute dtype, storing the op's result dtype."""
    storage = policy.storage(op.results[0].type.dtype)
    compute = policy.compute(dtype)
    if compute != policy.storage(dtype):
        return Kernel(_rounded(fn, compute, storage))
    return Kernel(fn, takes_out)


# -- unary, binary, compare, select -------------------------------------------------------------


def _rsqrt(x: Any, out: Any = None) -> Any:
    root = np.sqrt(x, out=out)
    return np.divide(1, root, out=root if out is not None else None)


def _erf(x: Any, out: Any = None) -> Any:
    """float64 (the f64 mode of gradient checks): the accurate Chebyshev path; float32: the fast one."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        result = erf(x)
        if out is None:
            return result
        out[...] = result
        return out
    return erf_f32(x, out=out)


#: The shared semantics (`dialects.graph_semantics`), with the interpreter's own rsqrt (writing
#: `out=`) and erf (vectorized: the shared one takes a scalar). Every unary kernel takes `out=`.
_UNARY: dict[str, Callable[..., Any]] = {**numpy_unary(), "graph.rsqrt": _rsqrt, "graph.erf": _erf}


@_builds(*_UNARY)
def _unary(op: Operation, policy: DtypePolicy) -> Kernel:
    return _arith(op, policy, _UNARY[op.name], True, op.operands[0].type.dtype)


def _truncating_div(a: Any, b: Any) -> Any:
    """Integer division rounding toward zero: a - fmod(a, b) is an exact multiple of b."""
    return (a - np.fmod(a, b)) // b


#: Arithmetic and compares, as the shared semantics compute them (integer `div` aside: `_binary`).
_BINARY: dict[str, Callable[..., Any]] = numpy_binary()


@_builds(*_BINARY)
def _binary(op: Operation, policy: DtypePolicy) -> Kernel:
    return _ufunc(op, policy, op.name)


@_builds("cpu.broadcasting_binary")
def _broadcasting_binary(op: Operation, policy: DtypePolicy) -> Kernel:
    """The ufunc of `graph.<kind>`, which broadcasts its operands as the op says."""
    return _ufunc(op, policy, f"graph.{op.attributes['kind']}")


def _ufunc(op: Operation, policy: DtypePolicy, name: str) -> Kernel:
    dtype = op.operands[0].type.dtype
    if name == "graph.div" and policy.storage(dtype).kind in "iu":
        return Kernel(_truncating_div)
    return _arith(op, policy, _BINARY[name], True, dtype)


@_builds("graph.where")
def _where(op: Operation, policy: DtypePolicy) -> Kernel:
    return Kernel(np.where)


# -- reduce -------------------------------------------------------------------------------------

#: The ufunc reductions np.sum, np.max and np.min call (bound once, without their Python wrappers).
_REDUCE = {"graph.sum": np.add.reduce, "graph.max": np.maximum.reduce, "graph.min": np.minimum.reduce}


@_builds(*_REDUCE)
def _reduce(op: Operation, policy: DtypePolicy) -> Kernel:
    reduce = _REDUCE[op.name]
    axes = tuple(op.attributes["axes"])
    keep = bool(op.attributes["keep"])
    dtype = op.operands[0].type.dtype
    # numpy would sum int32 into int64 and bools into ints: keep the operand's (compute) dtype.
    accumulate = policy.compute(dtype) if op.name == "graph.sum" else None

    def fn(x: Any, out: Any = None) -> Any:
        return reduce(x, axis=axes, dtype=accumulate, out=out, keepdims=keep)

    return _arith(op, policy, fn, True, dtype)


# -- shape --------------------------------------------------------------------------------------


@_builds("graph.reshape")
def _reshape(op: Operation, policy: DtypePolicy) -> Kernel:
    shape = tuple(op.attributes["shape"])
    return Kernel(lambda x: np.reshape(x, shape))


@_builds("graph.transpose")
def _transpose(op: Operation, policy: DtypePolicy) -> Kernel:
    perm = tuple(op.attributes["perm"])
    return Kernel(lambda x: np.transpose(x, perm))


@_builds("graph.broadcast")
def _broadcast(op: Operation, policy: DtypePolicy) -> Kernel:
    shape = tuple(op.attributes["shape"])
    return Kernel(lambda x: np.broadcast_to(x, shape))


def _axis_index(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


@_builds("graph.slice")
def _slice(op: Operation, policy: DtypePolicy) -> Kernel:
    index = _axis_index(op.attributes["axis"], slice(op.attributes["start"], op.attributes["end"]))
    return Kernel(lambda x: np.asarray(x)[index])


@_builds("graph.pad")
def _pad(op: Operation, policy: DtypePolicy) -> Kernel:
    result = op.results[0].type
    storage = policy.storage(result.dtype)
    before = op.attributes["before"]
    index = _axis_index(op.attributes["axis"], slice(before, before + op.operands[0].type.shape[op.attributes["axis"]]))

    axis = op.attributes["axis"]
    # The zero margins on either side of the operand (a reused buffer holds stale values there).
    margins = [_axis_index(axis, slice(0, before)),
               _axis_index(axis, slice(before + op.operands[0].type.shape[axis], None))]

    def pad(x: Any, out: Any = None) -> Any:
        if out is None:
            out = np.zeros(result.shape, storage)
        else:
            for margin in margins:
                out[margin] = 0
        out[index] = x
        return out

    return Kernel(pad, takes_out=True)


@_builds("cpu.pad_sum")
def _pad_sum(op: Operation, policy: DtypePolicy) -> Kernel:
    """Each operand plus zero in its range (what the adds computed there: x + 0 + … + 0 is x + 0,
    which only turns -0 into +0), zeros elsewhere: no padded copies."""
    result = op.results[0].type
    storage = policy.storage(result.dtype)
    axis = op.attributes["axis"]
    ranges = [(start, start + v.type.shape[axis]) for v, start in zip(op.operands, op.attributes["starts"])]
    pieces = [_axis_index(axis, slice(start, end)) for start, end in ranges]
    margins, covered = [], 0
    for start, end in sorted(ranges) + [(result.shape[axis], result.shape[axis])]:
        if start > covered:
            margins.append(_axis_index(axis, slice(covered, start)))
        covered = end
    zero = np.zeros((), storage)

    def pad_sum(*xs: Any, out: Any = None) -> Any:
        if out is None:
            out = np.empty(result.shape, storage)
        for margin in margins:
            out[margin] = 0
        for x, piece in zip(xs, pieces):
            np.add(x, zero, out=out[piece])
        return out

    return Kernel(pad_sum, takes_out=True)


@_builds("graph.concat")
def _concat(op: Operation, policy: DtypePolicy) -> Kernel:
    axis = op.attributes["axis"]
    return Kernel(lambda *xs: np.concatenate(xs, axis=axis))


@_builds("graph.squeeze")
def _squeeze(op: Operation, policy: DtypePolicy) -> Kernel:
    axis = op.attributes["axis"]
    return Kernel(lambda x: np.squeeze(x, axis))


@_builds("graph.expand_dims")
def _expand_dims(op: Operation, policy: DtypePolicy) -> Kernel:
    axis = op.attributes["axis"]
    return Kernel(lambda x: np.expand_dims(x, axis))


# -- contract, index ----------------------------------------------------------------------------


def _matmul_fn(a: Any, b: Any, out: Any = None) -> Any:
    """np.matmul, with a [… M K] @ [K N] product whose left side is contiguous run as one
    [(…·M) K] @ [K N] BLAS call (numpy would loop over the leading dims, one small gemm each)."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous and (out is None or out.flags.c_contiguous):
        flat = np.matmul(a.reshape(-1, a.shape[-1]), b,
                         out=None if out is None else out.reshape(-1, b.shape[-1]))
        return flat.reshape(a.shape[:-1] + b.shape[-1:]) if out is None else out
    return np.matmul(a, b, out=out)


@_builds("graph.matmul", "cpu.matmul")
def _matmul(op: Operation, policy: DtypePolicy) -> Kernel:
    a, b = (v.type for v in op.operands)
    if a.rank >= 3 and b.rank >= 3 and not policy.rounds(b.dtype):
        return _arith(op, policy, _batched_matmul_fn(b.shape, policy.storage(b.dtype)), True, a.dtype)
    return _arith(op, policy, _matmul_fn, True, a.dtype)


def _batched_matmul_fn(shape: tuple[int, ...], dtype: np.dtype) -> Callable[..., Any]:
    """np.matmul of stacks, with a right side whose matrices are column-major (a transposed view,
    e.g. attention's kᵀ) first copied into a row-major scratch array: OpenBLAS runs a stack of
    small gemms with a transposed B about 1.7 times slower than the copy and plain gemms take."""
    scratch: list[np.ndarray] = []

    def matmul(a: Any, b: Any, out: Any = None) -> Any:
        b = np.asarray(b)
        if b.strides[-2] == b.itemsize and b.shape[-1] > 1 and b.shape[-2] > 1:
            if not scratch:
                scratch.append(np.empty(shape, dtype))
            np.copyto(scratch[0], b)
            b = scratch[0]
        return np.matmul(a, b, out=out)

    return matmul


@_builds("cpu.matmul_sum")
def _matmul_sum(op: Operation, policy: DtypePolicy) -> Kernel:
    return Kernel(_batch_summed_matmul, takes_out=True)


def _batch_summed_matmul(a: Any, b: Any, out: Any = None) -> Any:
    """Σ_i a[i] @ b[i] for a [B M K] and b [B K N], as one [M B·K] @ [B·K N] product.

    This is `sum(matmul(a, b), axis 0)`, the weight gradient of a linear layer
    applied over a batch, without the [B M N] intermediate. `a` is usually the
    transpose of a contiguous [B K M] array, and then both reshapes are views.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    batch, m, k = a.shape
    left = a.transpose(1, 0, 2).reshape(m, batch * k)
    right = b.reshape(batch * k, b.shape[-1])
    return np.matmul(left, right, out=out)


@_builds("graph.take")
def _take(op: Operation, policy: DtypePolicy) -> Kernel:
    axis = op.attributes["axis"]
    return Kernel(lambda x, idx: np.take(x, idx, axis=axis))


@_builds("graph.take_along")
def _take_along(op: Operation, policy: DtypePolicy) -> Kernel:
    axis = op.attributes["axis"]
    return Kernel(lambda x, idx: np.take_along_axis(x, idx, axis=axis))


def _accumulating(op: Operation, policy: DtypePolicy, place: Callable[[Any, Any, Any], None]) -> Kernel:
    """Zeros of the result type with the updates added at the indices, summed in the compute dtype."""
    result = op.results[0].type
    storage = policy.storage(result.dtype)
    compute = policy.compute(result.dtype)

    def scatter(idx: Any, updates: Any) -> Any:
        acc = np.zeros(result.shape, compute)
        place(acc, idx, _widen16(updates, compute))
        return acc if compute == storage else acc.astype(storage)

    return Kernel(scatter)


def _add_rows_at(acc: Any, idx: Any, upd: Any) -> None:
    """acc[idx[j]] += upd[j] over axis 0, in the order np.add.at adds them (so the same bits):
    the updates grouped by index with a stable sort, each group summed by np.add.reduceat."""
    n = acc.shape[0]
    flat = np.asarray(idx).reshape(-1)
    flat = np.where(flat < 0, flat + n, flat)  # one row, one group, whichever way it was named
    rows = np.asarray(upd).reshape((flat.size,) + acc.shape[1:])
    if flat.size == 0:
        return
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    acc[ordered[starts]] += np.add.reduceat(rows[order], starts, axis=0)


@_builds("graph.scatter_add")
def _scatter_add(op: Operation, policy: DtypePolicy) -> Kernel:
    axis = op.attributes["axis"]
    if axis == 0:
        return _accumulating(op, policy, _add_rows_at)
    return _accumulating(op, policy, lambda acc, idx, upd: np.add.at(acc, _axis_index(axis, idx), upd))


@_builds("graph.scatter_add_along")
def _scatter_add_along(op: Operation, policy: DtypePolicy) -> Kernel:
    axis = op.attributes["axis"]
    shape = op.operands[0].type.shape
    # Every axis but `axis` is indexed by its own position, as take_along_axis reads it.
    grid = list(np.indices(shape, sparse=True))

    def place(acc: Any, idx: Any, upd: Any) -> None:
        index = list(grid)
        index[axis] = idx
        np.add.at(acc, tuple(index), upd)

    return _accumulating(op, policy, place)


@_builds("graph.one_hot")
def _one_hot(op: Operation, policy: DtypePolicy) -> Kernel:
    classes = np.arange(op.attributes["n"])
    storage = policy.storage(op.results[0].type.dtype)
    return Kernel(lambda idx: (np.expand_dims(idx, -1) == classes).astype(storage))


@_builds("graph.cast")
def _cast(op: Operation, policy: DtypePolicy) -> Kernel:
    source = op.operands[0].type.dtype
    target = op.attributes["dtype"]
    storage = policy.storage(target)
    compute = policy.compute(source)
    if target == "i1":
        return Kernel(lambda x: np.not_equal(_widen16(x, compute), 0))
    if policy.rounds(source) or policy.rounds(target):
        return Kernel(lambda x: _widen16(x, compute).astype(storage))

    def cast(x: Any, out: Any = None) -> Any:
        # Into a reused buffer: copyto casts element by element exactly as astype does.
        if out is None:
            return np.asarray(x).astype(storage)
        np.copyto(out, x, casting="unsafe")
        return out

    return Kernel(cast, takes_out=True)


# -- values fixed when the graph is compiled ----------------------------------------------------


def constant_value(op: Operation, policy: DtypePolicy) -> np.ndarray:
    """The array a `graph.const` or `graph.iota` stands for (computed once, never written)."""
    result = op.results[0].type
    storage = policy.storage(result.dtype)
    if op.name == "graph.iota":
        axis = op.attributes["axis"]
        line = np.arange(result.shape[axis], dtype=storage)
        line = line.reshape([-1 if i == axis else 1 for i in range(result.rank)])
        value = np.broadcast_to(line, result.shape)
    else:
        raw = op.attributes["value"]
        value = np.array(raw, dtype=storage) if isinstance(raw, list) else np.full(result.shape, raw, storage)
    value = np.array(value, order="C")  # a contiguous copy (ascontiguousarray would make scalars 1-d)
    value.flags.writeable = False
    return value
