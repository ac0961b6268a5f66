"""C for the kernels of a lowered module: fused groups, row programs, the cross-entropy tail, templates.

Every `kern.kernel` symbol becomes one `static void` C function taking its inputs then its outputs as typed
pointers (`render_kernel`). Storage is f32, bf16 (`uint16_t`), f16, integers or booleans; every float is
loaded into f32, computed in f32 and rounded once when stored, as on the GPU (`backends/cuda/render/fused.py`
says the same of its CUDA); math is the C library's single-precision functions (compiled without
fast-math, so NaNs and infinities behave as numpy's).

- `pointwise`, `multi_tensor_update`, `copy`: a loop over the domain's outer axes (one flat index, split
  among OpenMP threads when the domain is large; with fewer than `CHUNKED_BELOW` outer indices, as a flat
  update over every parameter, also cut into runs of `INNER_CHUNK` along the innermost axis, which a single
  outer index left to one thread) around a loop over its innermost axis that the compiler vectorizes
  (`#pragma omp simd`: an output may be written over an input it reads through the identity map, which a
  vector of lanes reads before it writes).
- `reduction`: the kept indices in blocks (one block an OpenMP iteration). When the reduced axes are
  innermost a block is one kept index (a row) and its reduced indices go to `LANES` lanes in row-major order,
  combined in a fixed tree (`lane_loops`): vectorized, in an order set by the sizes alone. Otherwise (a
  column sum) the rows are cut into fixed runs (`row_runs`), each walked in order into its own partial row
  by one thread, its inner loop over contiguous columns, and the partial rows are added in order: each
  result is the same f32 sum (64-bit for integers) for any thread count, and the threads read disjoint
  rows (given runs of columns each, they read every row's cache lines and ran no faster than one). A
  reduction to one value of many elements adds fixed chunks of `SCALAR_CHUNK` elements in parallel, each in
  `LANES` lanes, and
  then the chunk sums in order: the same result for any thread count, and a more accurate one than one
  long sum. Where a loop decomposes its index into several axes, a read or write row-major over them uses
  the index itself (`index_code`), so the compiler sees a contiguous access.
- guards: an operand read through a concat's or pad's range of the innermost axis splits that loop into
  segments where each such operand is read unguarded or not at all (`FusedKernel._segments`), so the loop
  vectorizes without masked loads.
- `row` and `cross_entropy`: one row an iteration, each row's reductions in f32 lanes (`lane_loops`); a norm's
  backward writes the column sums of its rows into `partials` fixed chunks of rows (the partial rows the
  lowering planned), which its column-sum kernels then add in order.
- `scatter_add`: each thread owns a range of columns and adds the source rows in index order.
- `fill`: the value, rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ...dialects.core import Operation, TensorType, Value
from ...dialects.index_maps import Expr, Term

#: A loop over at least this many elements is split among OpenMP threads (below it, a parallel region's
#: start costs more than the work).
PARALLEL_FROM = 1 << 17
#: A column sum (reduced axes outer) cuts its rows into at most this many runs (a power of two, by the
#: sizes alone) of at least `ROW_RUN` rows, each summed into its own partial row by one thread.
ROW_RUNS = 16
ROW_RUN = 64
#: The lanes of a reduction along a row (`lane_loops`): two AVX2 vectors of f32.
LANES = 16
#: An element-wise loop whose outer axes give fewer iterations than this (a flat update over every
#: parameter has one) is also cut along its innermost axis, into runs of `INNER_CHUNK` elements, so its
#: threads share it (each element is computed alike wherever the cuts fall).
CHUNKED_BELOW = 64
INNER_CHUNK = 16384
#: A reduction to one value of more elements than this adds chunks of this many in parallel.
SCALAR_CHUNK = 4096

FLOATS = ("f32", "bf16", "f16")
INTEGERS = ("i32", "i64")
STORAGE = {"f32": "float", "bf16": "uint16_t", "f16": "_Float16", "i32": "int32_t", "i64": "int64_t",
           "i1": "uint8_t"}
VALUE = {"f32": "float", "bf16": "float", "f16": "float", "i32": "int32_t", "i64": "int64_t", "i1": "int"}

#: What every translation unit starts with: bf16 conversions (round to nearest even; a NaN stays a NaN),
#: numpy's NaN-propagating max and min.
PRELUDE = r"""#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float sx_bf16_f32(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t sx_f32_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float sx_round_bf16(float f) { return sx_bf16_f32(sx_f32_bf16(f)); }
static inline float sx_fmax(float a, float b) { return (a > b || a != a) ? a : b; }
static inline float sx_fmin(float a, float b) { return (a < b || a != a) ? a : b; }
static inline long long sx_imax(long long a, long long b) { return a > b ? a : b; }
static inline long long sx_imin(long long a, long long b) { return a < b ? a : b; }

/* exp and erf without a call, so loops over them vectorize (glibc's vector math needs -ffast-math).
   sx_expf: exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), exp(r) a degree-6
   polynomial (Cephes' expf): within 1.5 ulps (measured); 0 from -87 down (no results below 2^-126), inf above
   ln(FLT_MAX), NaN kept. sx_erff: Eigen's and XLA's float erf, x P(x^2) / Q(x^2) of degrees 13/10 on
   [-4, 4] (erf(+-4) is +-1 in f32): within 7 ulps (measured: 5.5 with fused multiply-adds, 6.5 without;
   the interpreter's erf is within 1.6). Their polynomials step by fused multiply-adds where the host has
   them (as Eigen's do): a GELU's kernels are bound by these steps (22% faster measured), and neither
   function is numpy's anyway, so no rounding of the interpreter's is given up; every other product stays
   unfused. */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define SX_MADD(a, b, c) __builtin_fmaf(a, b, c)
#else
#define SX_MADD(a, b, c) ((a) * (b) + (c))
#endif
static inline __attribute__((always_inline)) float sx_expf(float x) {
    /* clamps by comparisons (fminf and fmaxf are calls, which keep a loop from vectorizing) */
    const float low = x < -88.0f ? -88.0f : x, c = low > 88.72283935546875f ? 88.72283935546875f : low;
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = SX_MADD(p, r, 1.3981999507e-3f);
    p = SX_MADD(p, r, 8.3334519073e-3f);
    p = SX_MADD(p, r, 4.1665795894e-2f);
    p = SX_MADD(p, r, 1.6666665459e-1f);
    p = SX_MADD(p, r, 5.0000001201e-1f);
    const float y = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 126) << 23;  /* 2^(n-1): n reaches 128 below ln(FLT_MAX) */
    float scale; memcpy(&scale, &e, 4);
    const float v = (y * scale) * 2.0f;
    return x != x ? x : (x > 88.72283935546875f ? INFINITY : (x < -88.0f ? 0.0f : v));
}
static inline float sx_erff(float x) {
    const float low = x < -4.0f ? -4.0f : x, c = low > 4.0f ? 4.0f : low;
    const float x2 = c * c;
    float p = SX_MADD(x2, -2.72614225801306e-10f, 2.77068142495902e-08f);
    p = SX_MADD(x2, p, -2.10102402082508e-06f);
    p = SX_MADD(x2, p, -5.69250639462346e-05f);
    p = SX_MADD(x2, p, -7.34990630326855e-04f);
    p = SX_MADD(x2, p, -2.95459980854025e-03f);
    p = SX_MADD(x2, p, -1.60960333262415e-02f);
    float q = SX_MADD(x2, -1.45660718464996e-05f, -2.13374055278905e-04f);
    q = SX_MADD(x2, q, -1.68282697438203e-03f);
    q = SX_MADD(x2, q, -7.37332916720468e-03f);
    q = SX_MADD(x2, q, -1.42647390514189e-02f);
    return x != x ? x : c * p / q;
}
"""

_UNARY = {"graph.neg": "(-{0})", "graph.exp": "sx_expf({0})", "graph.log": "logf({0})", "graph.sqrt": "sqrtf({0})",
          "graph.rsqrt": "(1.0f / sqrtf({0}))", "graph.tanh": "tanhf({0})", "graph.erf": "sx_erff({0})",
          "graph.abs": "fabsf({0})", "graph.recip": "(1.0f / {0})", "graph.sin": "sinf({0})",
          "graph.cos": "cosf({0})"}
_BINARY = {"graph.add": "({0} + {1})", "graph.sub": "({0} - {1})", "graph.mul": "({0} * {1})",
           "graph.div": "({0} / {1})", "graph.pow": "powf({0}, {1})", "graph.eq": "({0} == {1})",
           "graph.ne": "({0} != {1})", "graph.lt": "({0} < {1})", "graph.le": "({0} <= {1})",
           "graph.gt": "({0} > {1})", "graph.ge": "({0} >= {1})"}
FLOAT_IDENTITY = {"sum": "0.0f", "max": "-INFINITY", "min": "INFINITY"}
_INT_IDENTITY = {"sum": "0", "max": "(-0x7fffffffffffffffLL - 1)", "min": "0x7fffffffffffffffLL"}


def reduction_identity(which: str, integral: bool) -> str:
    """C of the value a `sum`, `max` or `min` reduction starts from."""
    return (_INT_IDENTITY if integral else FLOAT_IDENTITY)[which]


class UnsupportedKernel(ValueError):
    """A kernel the C renderer has no code for (a bug: the lowering made something this target cannot run)."""


# -- loads, stores, literals ------------------------------------------------------------------------

def load(dtype: str, pointer: str, index: str) -> str:
    """C reading element `index` of `pointer` as its value type (floats widened to f32)."""
    if dtype == "bf16":
        return f"sx_bf16_f32({pointer}[{index}])"
    if dtype == "f16":
        return f"(float){pointer}[{index}]"
    return f"{pointer}[{index}]"


def store(dtype: str, pointer: str, index: str, value: str) -> str:
    """C writing `value` into element `index` of `pointer`, rounded once to its storage."""
    if dtype == "bf16":
        return f"{pointer}[{index}] = sx_f32_bf16({value});"
    if dtype == "i1":
        return f"{pointer}[{index}] = ({value}) != 0;"
    return f"{pointer}[{index}] = ({STORAGE[dtype]})({value});"


def float_literal(value: float) -> str:
    """`value` as a C float literal of the same f32."""
    value = float(np.float32(value))
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = f"{value:.9g}"
    if not any(ch in text for ch in ".en"):
        text += ".0"
    return f"{text}f"


def literal(value: Any, dtype: str) -> str:
    if dtype == "i1":
        return "1" if value else "0"
    if dtype in INTEGERS:
        return f"{int(value)}LL" if dtype == "i64" else str(int(value))
    if dtype == "bf16":
        import ml_dtypes

        value = float(np.asarray(value, dtype=ml_dtypes.bfloat16))
    return float_literal(value)


def parameters(kernel: Operation) -> list[str]:
    """The C parameters of a kernel: `in<k>` for its inputs (const), `out<k>` for its outputs."""
    attrs = kernel.attributes
    params = [f"const {STORAGE[t.dtype]}* in{k}" for k, t in enumerate(attrs["inputs"])]
    params += [f"{STORAGE[t.dtype]}* out{k}" for k, t in enumerate(attrs["outputs"])]
    return params


#: Axes a loop decomposed (row-major) from one flat index, and that index's C name.
Flat = tuple[str, Sequence[int]]


def index_code(expr: Expr, gathered: dict[Any, str] | None = None, flat: Flat | None = None) -> str:
    """C for an index expression of the domain variables `i0, i1, ...` (64-bit). Where the loop decomposed
    `flat`'s axes from one index and `expr` reads them as one run (its coefficients on them the row-major
    strides times one factor), they are read as that index times the factor: a compiler sees an access
    contiguous along the loop (and vectorizes it with loads, not gathers), which `% size` and `/ size`
    hide from it."""
    terms, run = _flat_run(expr, flat)
    parts = [f"{expr.const}LL"] if expr.const or not (terms or expr.gathers or run) else []
    for t in terms:
        var = f"i{t.axis}" if t.div == 1 else f"(i{t.axis} / {t.div}LL)"
        if t.mod:
            var = f"({var} % {t.mod}LL)"
        parts.append(var if t.coeff == 1 else f"{var} * {t.coeff}LL")
    if run:
        parts.append(run)
    for g in expr.gathers:
        assert gathered is not None
        name = gathered[g.source]
        parts.append(name if g.coeff == 1 else f"{name} * {g.coeff}LL")
    return " + ".join(parts)


def _flat_run(expr: Expr, flat: Flat | None) -> tuple[tuple[Term, ...], str | None]:
    """`expr`'s terms without those `flat`'s index replaces, and the C of that index's part (None if it
    replaces none)."""
    if flat is None or len(flat[1]) < 2:  # one axis is the flat index itself
        return expr.terms, None
    name, axes = flat[0], [a for a in flat[1] if expr.sizes[a] > 1]  # an axis of one element adds nothing
    on_axes = {t.axis: t for t in expr.terms if t.axis in axes}
    if (len(on_axes) != len(axes) or sum(t.axis in axes for t in expr.terms) != len(axes)
            or any(t.div != 1 or t.mod for t in on_axes.values())):
        return expr.terms, None
    factor = on_axes[axes[-1]].coeff
    strides = _row_major([expr.sizes[a] for a in axes])
    if any(on_axes[a].coeff != factor * stride for a, stride in zip(axes, strides)):
        return expr.terms, None
    return tuple(t for t in expr.terms if t.axis not in axes), name if factor == 1 else f"{name} * {factor}LL"


def row_major_expr(domain: Sequence[int]) -> Expr:
    """The row-major index of the whole domain, as an index expression."""
    return Expr(tuple(domain), tuple(Term(d, 1, 0, stride) for d, stride in enumerate(_row_major(domain))))


def row_runs(rows: int) -> int:
    """How many runs a column sum cuts its `rows` into: a power of two up to `ROW_RUNS`, each at least
    `ROW_RUN` rows (the sizes alone decide, so the sums do not depend on the thread count)."""
    runs = 1
    while runs < ROW_RUNS and rows // (2 * runs) >= ROW_RUN:
        runs *= 2
    return runs


def parallel_for(count: str | int, work: int) -> str:
    """The OpenMP pragma of a loop of `count` iterations doing `work` element operations in all: parallel
    when the work is large enough, with static scheduling (each thread a fixed range)."""
    return f"#pragma omp parallel for schedule(static) if({work} >= {PARALLEL_FROM})"


def combined(which: str, integral: bool, a: str, b: str) -> str:
    """C combining two partial results of a `sum`, `max` or `min` reduction."""
    return f"{a} + {b}" if which == "sum" else f"sx_{'i' if integral else 'f'}{which}({a}, {b})"


def lane_loops(w: Writer, index: str, count: int | str, lanes: Sequence[tuple[str, str, str, str, bool]],
               element: Callable[[Writer], None]) -> None:
    """A reduction over `count` elements (a number, or a C expression) in `LANES` lanes: element `index` goes
    to lane `l = index % LANES` of each array in `lanes` ((name, C type, identity, sum/max/min, integral));
    `element` writes the C of one element (using `index` and `l`). The lanes are then combined pairwise in a
    fixed tree into `name[0]`. The order depends on `count` alone, so not on the thread count, and the loop
    over a vector of lanes vectorizes where one sequential f32 sum cannot without changing its order."""
    for name, ctype, identity, _, _ in lanes:
        w.line(f"{ctype} {name}[{LANES}];")
        w.line(f"for (int l = 0; l < {LANES}; ++l) {name}[l] = {identity};")
    if isinstance(count, int):
        full, tail = (f"{count // LANES * LANES}LL" if count >= LANES else None), count % LANES
    else:
        w.line(f"const long long {index}_count = {count}, {index}_full = {index}_count / {LANES} * {LANES};")
        full, tail = f"{index}_full", f"{index}_count - {index}_full"
    if full:
        w.open(f"for (long long {index}_l = 0; {index}_l < {full}; {index}_l += {LANES})")
        w.line("#pragma omp simd")
        w.open(f"for (int l = 0; l < {LANES}; ++l)")
        w.line(f"const long long {index} = {index}_l + l;")
        element(w)
        w.close()
        w.close()
    if tail:
        w.open(f"for (int l = 0; l < {tail}; ++l)")
        w.line(f"const long long {index} = {full or '0LL'} + l;")
        element(w)
        w.close()
    w.open(f"for (int width = {LANES // 2}; width > 0; width /= 2)")
    for name, _, _, which, integral in lanes:
        w.line(f"for (int l = 0; l < width; ++l) {name}[l] = {combined(which, integral, f'{name}[l]', f'{name}[l + width]')};")
    w.close()


class Writer:
    def __init__(self, depth: int = 1) -> None:
        self.lines: list[str] = []
        self.depth = depth

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def open(self, text: str) -> None:
        self.line(text + " {")
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        self.line("}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _lane_arrays(accumulators: Sequence[tuple[str, str, bool]]) -> list[tuple[str, str, str, str, bool]]:
    """The `lane_loops` arrays `lanes<j>` of a reduction's accumulators ((C type, sum/max/min, integral))."""
    return [(f"lanes{j}", vt, reduction_identity(which, integral), which, integral)
            for j, (vt, which, integral) in enumerate(accumulators)]

def _decompose(w: Writer, flat: str, axes: Sequence[int], domain: Sequence[int], prefix: str) -> None:
    """Declare `i<axis>` for `axes` (row-major) from the linear index `flat`."""
    if not axes:
        return
    if len(axes) == 1:
        w.line(f"const long long i{axes[0]} = {flat};")
        return
    w.line(f"long long {prefix}rest = {flat};")
    for a in reversed(axes[1:]):
        w.line(f"const long long i{a} = {prefix}rest % {domain[a]}LL;")
        w.line(f"{prefix}rest /= {domain[a]}LL;")
    w.line(f"const long long i{axes[0]} = {prefix}rest;")


def _row_major(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


# -- fused groups -----------------------------------------------------------------------------------

class FusedKernel:
    """The C body of a kernel `fuse` generated (pointwise, reduction, multi-tensor update) or a copy."""

    def __init__(self, kernel: Operation) -> None:
        attrs = kernel.attributes
        self.symbol: str = attrs["sym_name"]
        self.kind: str = attrs["kind"]
        self.domain: tuple[int, ...] = tuple(attrs["domain"])
        self.inputs: list[TensorType] = list(attrs["inputs"])
        self.outputs: list[TensorType] = list(attrs["outputs"])
        self.maps = [Expr.from_attribute(self.domain, m) for m in attrs["maps"]]
        self.map_attributes = list(attrs["maps"])
        self.reduce_axes: tuple[int, ...] = tuple(attrs.get("reduce", {}).get("axes", ()))
        if self.kind == "copy":
            self.body: list[Operation] = []
            self.args: dict[Value, int] = {}
            self.yielded: list[Value | int] = [0]
        else:
            block = kernel.regions[0].blocks[0]
            self.args = {arg: k for k, arg in enumerate(block.args)}
            self.body = [op for op in block.ops if op.name != "kern.yield"]
            self.yielded = list(block.last_op.operands)
        self.names: dict[Value, str] = {}
        self.count = 0
        #: Inputs whose guards hold (True) or fail (False) in the whole loop segment being written.
        self.known_guards: dict[int, bool] = {}
        #: The flat index the loop being written decomposes into domain indices, where it has one.
        self.flat: Flat | None = None

    def code(self) -> str:
        w = Writer()
        if self.reduce_axes:
            self._reduction(w)
        else:
            self._flat(w)
        return w.text()

    # -- pieces ---------------------------------------------------------------------------------------

    def _load(self, w: Writer, k: int) -> None:
        """Declare `a<k>`: input k's element at the current index (NaN, or the pad's fill, outside)."""
        t = self.inputs[k]
        attribute = self.map_attributes[k]
        gathered = {g.source: f"g{k}_{g.source}" for g in self.maps[k].gathers}
        checks = []
        for g in self.maps[k].gathers:
            name = gathered[g.source]
            w.line(f"long long {name} = (long long)a{g.source};")
            w.line(f"if ({name} < 0) {name} += {g.dim}LL;")
            checks.append(f"({name} >= 0 && {name} < {g.dim}LL)")
        known = self.known_guards.get(k)
        vt = VALUE[t.dtype]
        if known is False:  # outside the pad's or concat's range in this whole loop segment
            w.line(f"const {vt} a{k} = {literal(attribute['fill'], t.dtype)};")
            return
        for guard_attribute, size in attribute.get("guards", ()) if known is None else ():
            guard = index_code(Expr.from_attribute(self.domain, guard_attribute), flat=self.flat)
            checks.append(f"((unsigned long long)({guard}) < {size}ULL)")
        read = load(t.dtype, f"in{k}", index_code(self.maps[k], gathered, self.flat))
        if not checks:
            w.line(f"const {vt} a{k} = {read};")
            return
        if "guards" in attribute and known is None:
            missing = literal(attribute["fill"], t.dtype)
        else:
            missing = "NAN" if t.dtype in FLOATS else "0"
        w.line(f"const {vt} a{k} = ({' && '.join(checks)}) ? {read} : {missing};")

    def _inputs_of(self, ops: Iterable[Operation], values: Iterable[Value | int] = ()) -> list[int]:
        """The inputs `ops` and `values` read, with the index inputs their gathers need, in order."""
        found = {self.args[v] for op in ops for v in op.operands if v in self.args}
        found |= {v if isinstance(v, int) else self.args[v] for v in values if isinstance(v, int) or v in self.args}
        for k in list(found):
            found |= {g.source for g in self.maps[k].gathers}
        return sorted(found)

    def _ops(self, w: Writer, ops: Iterable[Operation]) -> None:
        for op in ops:
            if op.name == "kern.reduce":
                continue
            name = f"v{self.count}"
            self.count += 1
            self.names[op.results[0]] = name
            w.line(f"const {VALUE[op.results[0].type.dtype]} {name} = {self._expr(op)};")

    def _arg(self, v: Value | int) -> str:
        if isinstance(v, int):
            return f"a{v}"
        return self.names[v] if v in self.names else f"a{self.args[v]}"

    def _expr(self, op: Operation) -> str:
        args = [self._arg(v) for v in op.operands]
        name = op.name
        dtype = op.results[0].type.dtype
        integral = dtype in INTEGERS or dtype == "i1"
        if name == "graph.const":
            return literal(op.attributes["value"], dtype)
        if name == "kern.index":
            return f"(int32_t)({index_code(Expr.from_attribute(self.domain, op.attributes['expr']))})"
        if name in ("graph.maximum", "graph.minimum"):
            which = "max" if name == "graph.maximum" else "min"
            return f"sx_{'i' if integral else 'f'}{which}({args[0]}, {args[1]})"
        if integral and name == "graph.neg":
            return f"(-{args[0]})"
        if integral and name == "graph.abs":
            return f"({args[0]} < 0 ? -{args[0]} : {args[0]})"
        if name in _UNARY:
            return _UNARY[name].format(*args)
        if name in _BINARY:
            return _BINARY[name].format(*args)
        if name == "graph.where":
            return f"({args[0]} ? {args[1]} : {args[2]})"
        if name == "graph.cast":
            source = op.operands[0].type.dtype
            value = args[0]
            if source == "bf16" and dtype != "bf16":
                value = f"sx_round_bf16({value})"  # the operand is a bf16 value: what it is stored as
            if dtype == "i1":
                return f"({value} != 0)"
            if dtype == "bf16" and source != "bf16":
                return f"sx_round_bf16((float){value})"
            return f"({VALUE[dtype]}){value}"
        raise UnsupportedKernel(f"kernel {self.symbol}: no C for '{name}'")

    def _store(self, w: Writer, k: int, value: str, at: str) -> None:
        w.line(store(self.outputs[k].dtype, f"out{k}", at, value))

    def _full_index(self) -> str:
        """C of the current element's row-major index in the whole domain (an output stored over it)."""
        return index_code(row_major_expr(self.domain), flat=self.flat)

    # -- element-wise -----------------------------------------------------------------------------------

    def _flat(self, w: Writer) -> None:
        domain = self.domain
        total = math.prod(domain)
        if not domain:
            w.open("")
            self._element(w, "0", self.body, self._inputs_of(self.body, self.yielded))
            w.close()
            return
        last = len(domain) - 1
        outer = math.prod(domain[:-1])
        # What does not change along the domain is computed once, and what does not change along its
        # innermost axis once per outer index (a step's learning rate, a row's statistic): a loop-invariant
        # call of cosf or powf per element would cost more than the rest of the kernel.
        load_levels, op_levels = self._levels_along(last)
        ops_at = [[op for op in self.body if op_levels[op] == level] for level in range(3)]
        loads_at = [[k for k in self._inputs_of(self.body, self.yielded) if load_levels[k] == level] for level in range(3)]
        for k in loads_at[0]:
            self._load(w, k)
        self._ops(w, ops_at[0])
        chunks = -(-domain[last] // INNER_CHUNK) if outer < CHUNKED_BELOW and total >= PARALLEL_FROM else 1
        w.line(parallel_for(outer * chunks, total))
        if chunks == 1:
            w.open(f"for (long long o = 0; o < {outer}LL; ++o)")
        else:
            w.open(f"for (long long oc = 0; oc < {outer * chunks}LL; ++oc)")
            w.line(f"const long long o = oc / {chunks}LL, c0 = oc % {chunks}LL * {INNER_CHUNK}LL;")
        _decompose(w, "o", list(range(last)), domain, "o_")
        for k in loads_at[1]:
            self._load(w, k)
        self._ops(w, ops_at[1])
        for low, high, known in self._segments(last, loads_at[2]):
            self.known_guards = known
            w.line("#pragma omp simd")
            if chunks == 1:
                w.open(f"for (long long i{last} = {low}; i{last} < {high}LL; ++i{last})")
            else:
                w.open(f"for (long long i{last} = sx_imax({low}LL, c0); i{last} < sx_imin({high}LL, c0 + {INNER_CHUNK}LL); "
                       f"++i{last})")
            self._element(w, f"o * {domain[last]}LL + i{last}", ops_at[2], loads_at[2])
            w.close()
        self.known_guards = {}
        w.close()

    def _segments(self, axis: int, loaded: Iterable[int]) -> list[tuple[int, int, dict[int, bool]]]:
        """The loop over `axis` cut where the guards of the `loaded` inputs change, when each guard is a
        range of that axis alone (a concat's or pad's operand along it): (start, end, input -> whether its
        guards hold) per segment, so a segment reads each operand unguarded or not at all and its inner
        loop vectorizes. One segment with nothing known otherwise."""
        size = self.domain[axis]
        ranges: dict[int, tuple[int, int]] = {}
        for k in loaded:
            low, high = 0, size
            for guard_attribute, extent in self.map_attributes[k].get("guards", ()):
                expr = Expr.from_attribute(self.domain, guard_attribute)
                if expr.gathers or [(t.axis, t.div, t.mod, t.coeff) for t in expr.terms] != [(axis, 1, 0, 1)]:
                    return [(0, size, {})]
                low, high = max(low, -expr.const), min(high, extent - expr.const)
            if "guards" in self.map_attributes[k]:
                ranges[k] = (low, max(low, high))
        points = sorted({0, size, *(min(max(b, 0), size) for r in ranges.values() for b in r)})
        return [(a, b, {k: low <= a and b <= high for k, (low, high) in ranges.items()})
                for a, b in zip(points, points[1:])]

    def _levels_along(self, last: int) -> tuple[dict[int, int], dict[Operation, int]]:
        """How often each input's load and each body op must be made: 0 once, 1 once per outer index (it
        does not depend on axis `last`), 2 for every element."""

        def expr_level(expr: Expr, gathered: Iterable[int] = ()) -> int:
            level = 0 if not expr.terms else (2 if any(t.axis == last for t in expr.terms) else 1)
            return max([level, *(loads.get(k, 2) for k in gathered)])

        loads: dict[int, int] = {}
        for k in sorted(range(len(self.inputs)), key=lambda k: bool(self.maps[k].gathers)):
            expr = self.maps[k]
            level = expr_level(expr, [g.source for g in expr.gathers])
            for guard_attribute, _ in self.map_attributes[k].get("guards", ()):
                level = max(level, expr_level(Expr.from_attribute(self.domain, guard_attribute)))
            loads[k] = level
        ops: dict[Operation, int] = {}
        for op in self.body:
            if op.name == "kern.index":
                ops[op] = expr_level(Expr.from_attribute(self.domain, op.attributes["expr"]))
            else:
                ops[op] = max([0, *(loads[self.args[v]] if v in self.args else ops[v.op] for v in op.operands)])
        return loads, ops

    def _element(self, w: Writer, flat: str, ops: list[Operation], loads: list[int]) -> None:
        for k in loads:
            self._load(w, k)
        self._ops(w, ops)
        for k, v in enumerate(self.yielded):
            self._store(w, k, self._arg(v), flat)

    # -- reductions ---------------------------------------------------------------------------------------

    def _levels(self) -> tuple[list[Operation], list[Operation], set[Value]]:
        """The body's prologue and epilogue ops (those reading a kern.reduce result, directly or not), and
        the values computed after the reduction."""
        after: set[Value] = set()
        prologue, epilogue = [], []
        for op in self.body:
            if op.name == "kern.reduce":
                after.add(op.result)
            elif any(v in after for v in op.operands):
                after.update(op.results)
                epilogue.append(op)
            else:
                prologue.append(op)
        return prologue, epilogue, after

    def _needed_before(self, epilogue: list[Operation], prologue: list[Operation]) -> list[Operation]:
        """The prologue ops the epilogue reads (recomputed after the reduction, at reduced index 0)."""
        wanted: set[Value] = {v for op in epilogue for v in op.operands}
        chosen: list[Operation] = []
        for op in reversed(prologue):
            if any(r in wanted for r in op.results):
                chosen.append(op)
                wanted.update(op.operands)
        return list(reversed(chosen))

    def _reduction(self, w: Writer) -> None:
        domain = self.domain
        kept = [d for d in range(len(domain)) if d not in self.reduce_axes]
        reduced = list(self.reduce_axes)
        kept_count = math.prod(domain[d] for d in kept)
        reduced_count = math.prod(domain[d] for d in reduced)
        prologue, epilogue, after = self._levels()
        reductions = [op for op in self.body if op.name == "kern.reduce"]
        accumulators = []
        for op in reductions:
            integral = op.operands[0].type.dtype not in FLOATS
            accumulators.append(("long long" if integral else "float", op.attributes["op"], integral))
        full_outputs = [v for v in self.yielded if v not in after]
        chunked = kept_count == 1 and reduced_count > SCALAR_CHUNK and not full_outputs
        column_wise = bool(kept) and max(kept) == len(domain) - 1 and kept_count > 1
        work = kept_count * reduced_count
        runs = row_runs(reduced_count) if column_wise and work >= PARALLEL_FROM else 1
        if column_wise:
            self._partial_rows(w, accumulators, reductions, prologue, reduced, kept, full_outputs, after, runs)
            block, blocks = f"{kept_count}LL", "1LL"
        else:
            block, blocks = "1LL", f"{kept_count}LL"
            if not chunked:  # a chunked sum is parallel inside (OpenMP does not nest)
                w.line(parallel_for(blocks, work))
        w.open(f"for (long long kb = 0; kb < {blocks}; ++kb)")
        w.line(f"const long long k0 = kb * {block};")
        w.line(f"const long long k1 = k0 + {block} < {kept_count}LL ? k0 + {block} : {kept_count}LL;")
        for j, (vt, op, integral) in enumerate(accumulators):
            if column_wise:
                w.line(f"{vt}* acc{j} = part{j};")
                w.open(f"for (long long run = 1; run < {runs}LL; ++run)")
                w.line("#pragma omp simd")
                w.line(f"for (long long k = 0; k < {kept_count}LL; ++k) "
                       f"acc{j}[k] = {combined(op, integral, f'acc{j}[k]', f'part{j}[run * {kept_count}LL + k]')};")
                w.close()
            else:
                w.line(f"{vt} acc{j}[1];")
                w.line(f"for (long long b = 0; b < {block}; ++b) acc{j}[b] = {reduction_identity(op, integral)};")
        if chunked:
            self._chunked_sums(w, accumulators, reductions, prologue, reduced, reduced_count)
        elif not column_wise and reduced_count >= LANES:
            self._lane_sums(w, accumulators, reductions, prologue, reduced, kept, full_outputs, after)
        elif not column_wise:
            self._walk_rows(w, "0LL", f"{reduced_count}LL", accumulators, reductions, prologue, reduced, kept,
                            full_outputs, after, False)
        w.open("for (long long k = k0; k < k1; ++k)")
        _decompose(w, "k", kept, domain, "k_")
        for d in reduced:
            w.line(f"const long long i{d} = 0;")
        saved = dict(self.names)
        for j, op in enumerate(reductions):
            self.names[op.results[0]] = f"acc{j}[k - k0]"
        kept_outputs = [v for v in self.yielded if v in after]
        recompute = self._needed_before(epilogue, prologue)
        for k in self._inputs_of(recompute + epilogue, [v for v in kept_outputs if v in self.args]):
            self._load(w, k)
        self._ops(w, recompute + epilogue)
        for k, v in enumerate(self.yielded):
            if v in after:
                self._store(w, k, self._arg(v), "k")
        self.names = saved
        w.close()
        w.close()
        if column_wise:
            for j in range(len(accumulators)):
                w.line(f"free(part{j});")

    def _partial_rows(self, w: Writer, accumulators: list[tuple[str, str, bool]], reductions: list[Operation],
                      prologue: list[Operation], reduced: list[int], kept: list[int],
                      full_outputs: list[Value | int], after: set[Value], runs: int) -> None:
        """A column sum's rows in `runs` fixed runs, one an OpenMP iteration, each reduced in order into its
        partial row `part<j>[run][kept]` (the full outputs stored on the way)."""
        kept_count = math.prod(self.domain[d] for d in kept)
        reduced_count = math.prod(self.domain[d] for d in reduced)
        rows = -(-reduced_count // runs)
        for j, (vt, _, _) in enumerate(accumulators):
            w.line(f"{vt}* part{j} = ({vt}*)malloc({runs * kept_count}LL * sizeof({vt}));")
        w.line(parallel_for(runs, kept_count * reduced_count))
        w.open(f"for (long long run = 0; run < {runs}LL; ++run)")
        w.line(f"const long long k0 = 0, k1 = {kept_count}LL;")
        for j, (vt, op, integral) in enumerate(accumulators):
            w.line(f"{vt}* acc{j} = part{j} + run * {kept_count}LL;")
            w.line(f"for (long long k = 0; k < {kept_count}LL; ++k) acc{j}[k] = "
                   f"{reduction_identity(op, integral)};")
        self._walk_rows(w, f"run * {rows}LL", f"sx_imin((run + 1) * {rows}LL, {reduced_count}LL)", accumulators,
                        reductions, prologue, reduced, kept, full_outputs, after, True)
        w.close()

    def _walk_rows(self, w: Writer, start: str, end: str, accumulators: list[tuple[str, str, bool]],
                   reductions: list[Operation], prologue: list[Operation], reduced: list[int], kept: list[int],
                   full_outputs: list[Value | int], after: set[Value], column_wise: bool) -> None:
        """The reduced indices from `start` to `end` in order, each adding its kept indices k0 .. k1 into
        `acc<j>[k - k0]`; a column sum's inner loop over contiguous kept indices is vectorized, cut into
        segments where a concat's or pad's operand is read."""
        domain = self.domain
        kept_count = math.prod(domain[d] for d in kept)
        w.open(f"for (long long r = {start}; r < {end}; ++r)")
        _decompose(w, "r", reduced, domain, "r_")
        loaded = self._inputs_of(prologue + reductions, full_outputs)
        segments = self._segments(kept[0], loaded) if column_wise and len(kept) == 1 else [(0, kept_count, {})]
        for low, high, known in segments:
            self.known_guards = known
            if column_wise:
                w.line("#pragma omp simd")
            if len(segments) == 1:
                w.open("for (long long k = k0; k < k1; ++k)")
            else:
                w.open(f"for (long long k = k0 > {low}LL ? k0 : {low}LL; k < (k1 < {high}LL ? k1 : {high}LL); ++k)")
            _decompose(w, "k", kept, domain, "k_")
            self.flat = ("k", kept)
            for k in loaded:
                self._load(w, k)
            self._ops(w, prologue)
            for j, op in enumerate(reductions):
                self._accumulate(w, j, accumulators[j], op, "k - k0")
            for k, v in enumerate(self.yielded):
                if v not in after:
                    self._store(w, k, self._arg(v), self._full_index())
            self.flat = None
            w.close()
        self.known_guards = {}
        w.close()

    def _accumulate(self, w: Writer, j: int, accumulator: tuple[str, str, bool], op: Operation, at: str,
                    array: str = "acc") -> None:
        vt, which, integral = accumulator
        w.line(f"{array}{j}[{at}] = {combined(which, integral, f'{array}{j}[{at}]', f'({vt}){self._arg(op.operands[0])}')};")

    def _lane_sums(self, w: Writer, accumulators: list[tuple[str, str, bool]], reductions: list[Operation],
                   prologue: list[Operation], reduced: list[int], kept: list[int], full_outputs: list[Value | int],
                   after: set[Value]) -> None:
        """One kept index, its reduced ones in `LANES` lanes (`lane_reduction`), into `acc<j>[0]`."""
        domain = self.domain

        def element(w: Writer) -> None:
            _decompose(w, "r", reduced, domain, "r_")
            _decompose(w, "k0", kept, domain, "k_")
            self.flat = ("r", reduced)
            for k in self._inputs_of(prologue + reductions, full_outputs):
                self._load(w, k)
            self._ops(w, prologue)
            for j, op in enumerate(reductions):
                self._accumulate(w, j, accumulators[j], op, "l", "lanes")
            for k, v in enumerate(self.yielded):
                if v not in after:
                    self._store(w, k, self._arg(v), self._full_index())
            self.flat = None

        count = math.prod(domain[d] for d in reduced)
        lane_loops(w, "r", count, _lane_arrays(accumulators), element)
        for j in range(len(accumulators)):
            w.line(f"acc{j}[0] = lanes{j}[0];")

    def _chunked_sums(self, w: Writer, accumulators: list[tuple[str, str, bool]], reductions: list[Operation],
                      prologue: list[Operation], reduced: list[int], count: int) -> None:
        """One kept index, many reduced ones: fixed chunks of `SCALAR_CHUNK`, each reduced in `LANES` lanes
        (`lane_loops`) in parallel, then the chunks' results combined in order."""
        chunks = -(-count // SCALAR_CHUNK)
        for j, (vt, _, _) in enumerate(accumulators):
            w.line(f"{vt}* part{j} = ({vt}*)malloc({chunks} * sizeof({vt}));")
        w.line(parallel_for(chunks, count))
        w.open(f"for (long long c = 0; c < {chunks}LL; ++c)")
        w.line(f"const long long start = c * {SCALAR_CHUNK}LL;")

        def element(w: Writer) -> None:
            w.line("const long long r = start + j;")
            _decompose(w, "r", reduced, self.domain, "r_")
            self.flat = ("r", reduced)
            for k in self._inputs_of(prologue + reductions):
                self._load(w, k)
            self._ops(w, prologue)
            for j, op in enumerate(reductions):
                self._accumulate(w, j, accumulators[j], op, "l", "lanes")
            self.flat = None

        saved = dict(self.names)
        lane_loops(w, "j", f"(start + {SCALAR_CHUNK}LL < {count}LL ? {SCALAR_CHUNK}LL : {count}LL - start)",
                   _lane_arrays(accumulators), element)
        self.names = saved
        for j in range(len(accumulators)):
            w.line(f"part{j}[c] = lanes{j}[0];")
        w.close()
        for j, (_, which, integral) in enumerate(accumulators):
            w.open(f"for (long long c = 0; c < {chunks}LL; ++c)")
            w.line(f"acc{j}[0] = {combined(which, integral, f'acc{j}[0]', f'part{j}[c]')};")
            w.close()
            w.line(f"free(part{j});")
