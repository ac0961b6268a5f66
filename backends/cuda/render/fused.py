"""CUDA C for the kernels `fuse` generates: pointwise, reduction and multi-tensor update bodies.

A body kernel is written from its `kern.kernel` op alone: the domain, each
input's index map (`dialects/index_maps.py`), the body's scalar ops and the
launch plan (`launches.plan_generated`, the one `fuse` gave the kernel its
launch shape from). Storage is f32, bf16, integers or booleans; every float
is loaded into f32, computed in f32 and rounded once when stored; an explicit
`graph.cast` to or from bf16 rounds where it stands (a value cast from bf16
is the bf16 value it would have been stored as). Math is the C library's
single-precision functions without fast-math approximations (`rsqrt` is
`1/sqrtf`, as the interpreter computes it).

- `flat` kernels walk the domain with a grid-stride loop, `vector` elements
  of the innermost axis per thread: inputs that walk that axis contiguously
  are read with packed 16-byte loads, inputs constant along it once, and the
  outputs written with packed stores.
- reductions accumulate in f32 (integers in 64 bits) in a fixed order and
  combine partial results by warp shuffles in a butterfly and, across warps
  or column parts, through shared memory in index order; `max`/`min`
  propagate NaN as numpy's do. What follows a `kern.reduce` (the epilogue)
  runs once per kept element, after the reduction, reading inputs at reduced
  index 0 (their maps do not depend on the reduced axes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ....dialects.core import Operation, TensorType, Value
from ....dialects.index_maps import Expr
from ....dialects.kern import body_plan_facts
from .kernel_source import (
    KernelParam,
    KernelSource,
    LaunchShape,
    c_type,
    finish,
    float_literal,
    pointer_param,
)
from .launches import COLUMN_LANES, COLUMN_PARTS, ROWS_PER_BLOCK, chunk_rows, plan_generated

#: Helpers the generated kernels share, after the prelude in a translation unit.
FUSED_HELPERS = r"""
// ---- generated kernels: NaN-propagating max/min (numpy's), reductions over a warp -------------

template <class T> __device__ __forceinline__ T sxg_max(T a, T b) { return (a > b || a != a) ? a : b; }
template <class T> __device__ __forceinline__ T sxg_min(T a, T b) { return (a < b || a != a) ? a : b; }
template <class T> __device__ __forceinline__ T sxg_sum(T a, T b) { return a + b; }

#define SXG_WARP_REDUCE(OP)                                                              \
    template <class T> __device__ __forceinline__ T sxg_warp_##OP(T v) {                 \
        _Pragma("unroll") for (int offset = 16; offset > 0; offset >>= 1)               \
            v = sxg_##OP(v, __shfl_xor_sync(SX_FULL_MASK, v, offset));                   \
        return v;                                                                        \
    }
SXG_WARP_REDUCE(sum)
SXG_WARP_REDUCE(max)
SXG_WARP_REDUCE(min)

__device__ __forceinline__ float sxg_round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
"""

#: A split column reduction after its partials are stored: the last block of the strip to finish goes on
#: (to combine them); it sets the strip's counter back to zero for the next launch (and graph replays).
_LAST_CHUNK = """}}
// Every partial is written before the counter says so (llm.c's and CUDA's threadFenceReduction).
__threadfence();
__shared__ bool last_chunk;
__syncthreads();
if (threadIdx.x == 0 && threadIdx.y == 0) {{
    last_chunk = atomicAdd({counters} + blockIdx.x, 1) == {last};
    if (last_chunk) {counters}[blockIdx.x] = 0;
}}
__syncthreads();
if (!last_chunk) return;
__threadfence();
if (threadIdx.y == 0 && active) {{"""

_FLOAT = ("f32", "bf16", "f16")
_INT = ("i32", "i64")
_UNARY = {"graph.neg": "(-{0})", "graph.exp": "expf({0})", "graph.log": "logf({0})", "graph.sqrt": "sqrtf({0})",
          "graph.rsqrt": "(1.0f / sqrtf({0}))", "graph.tanh": "tanhf({0})", "graph.erf": "erff({0})",
          "graph.abs": "fabsf({0})", "graph.recip": "(1.0f / {0})", "graph.sin": "sinf({0})",
          "graph.cos": "cosf({0})"}
_BINARY = {"graph.add": "({0} + {1})", "graph.sub": "({0} - {1})", "graph.mul": "({0} * {1})",
           "graph.div": "({0} / {1})", "graph.pow": "powf({0}, {1})", "graph.maximum": "sxg_max({0}, {1})",
           "graph.minimum": "sxg_min({0}, {1})", "graph.eq": "({0} == {1})", "graph.ne": "({0} != {1})",
           "graph.lt": "({0} < {1})", "graph.le": "({0} <= {1})", "graph.gt": "({0} > {1})",
           "graph.ge": "({0} >= {1})"}
_IDENTITY = {"sum": "0", "max": "-SX_INF", "min": "SX_INF"}
_INT_IDENTITY = {"sum": "0", "max": "(-0x7fffffffffffffffLL - 1)", "min": "0x7fffffffffffffffLL"}


def value_type(dtype: str) -> str:
    """The C type a value of `dtype` is computed in."""
    if dtype in _FLOAT:
        return "float"
    return {"i32": "int", "i64": "long long", "i1": "bool"}[dtype]


def storage_type(dtype: str) -> str:
    return "bool" if dtype == "i1" else c_type(dtype)


def literal(value: Any, dtype: str) -> str:
    if dtype == "i1":
        return "true" if value else "false"
    if dtype in _INT:
        return f"{int(value)}LL" if dtype == "i64" else str(int(value))
    import ml_dtypes
    import numpy as np

    rounded = float(np.asarray(value, dtype=ml_dtypes.bfloat16 if dtype == "bf16" else np.float32))
    return float_literal(rounded)


def index_code(expr: Expr, inputs: Mapping[int, str] | None = None) -> str:
    """C for an index expression of the domain variables `i0, i1, ...` (64-bit)."""
    parts = [f"{expr.const}LL"] if expr.const or not (expr.terms or expr.gathers) else []
    for t in expr.terms:
        var = f"i{t.axis}" if t.div == 1 else f"(i{t.axis} / {t.div}LL)"
        if t.mod:
            var = f"({var} % {t.mod}LL)"
        parts.append(var if t.coeff == 1 else f"{var} * {t.coeff}LL")
    for g in expr.gathers:
        assert inputs is not None
        name = inputs[g.source]
        parts.append(name if g.coeff == 1 else f"{name} * {g.coeff}LL")
    return " + ".join(parts)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str, depth: int) -> None:
        self.lines.append("    " * depth + text)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class FusedKernel:
    """The CUDA function of one body kernel (`kern.kernel` of kind pointwise, reduction or
    multi_tensor_update)."""

    def __init__(self, kernel: Operation) -> None:
        attrs = kernel.attributes
        self.kernel = kernel
        self.symbol: str = attrs["sym_name"]
        self.kind: str = attrs["kind"]
        self.domain: tuple[int, ...] = tuple(attrs["domain"])
        self.split: int = attrs.get("split", 1)
        # A split reduction's last input is its counters and its last output its partials, outside the body.
        scratch = 1 if self.split > 1 else 0
        self.inputs: list[TensorType] = list(attrs["inputs"])[:len(attrs["inputs"]) - scratch]
        self.outputs: list[TensorType] = list(attrs["outputs"])[:len(attrs["outputs"]) - scratch]
        self.maps = [Expr.from_attribute(self.domain, m) for m in attrs["maps"]]
        self.map_attributes = list(attrs["maps"])
        self.reduce_axes: tuple[int, ...] = tuple(attrs.get("reduce", {}).get("axes", ()))
        self.block = kernel.regions[0].blocks[0]
        self.args = {arg: k for k, arg in enumerate(self.block.args)}
        self.body = list(self.block.ops)
        index_exprs, accumulators = body_plan_facts(self.body)
        self.plan = plan_generated(self.kind, self.domain, self.reduce_axes, self.map_attributes, self.inputs,
                                   self.outputs, index_exprs, accumulators=accumulators, split=self.split)
        if (list(self.plan.grid), list(self.plan.block)) != (attrs["grid"], attrs["block"]):
            raise ValueError(f"kernel {self.symbol}'s launch shape is not its plan's")
        self.names: dict[Value, str] = {}
        self.count = 0

    # -- the source ---------------------------------------------------------------------------

    def source(self) -> KernelSource:
        params = [pointer_param(f"in{k}", t.dtype, "input") if t.dtype != "i1" else
                  KernelParam(f"in{k}", "const bool* __restrict__", "input", "i1") for k, t in enumerate(self.inputs)]
        if self.split > 1:
            # Written (bumped, then set back to zero) though the launch reads it: not const.
            params.append(KernelParam(f"in{len(self.inputs)}", "int*", "input", "i32"))
        params += [pointer_param(f"out{k}", t.dtype, "output", restrict=False) if t.dtype != "i1" else
                   KernelParam(f"out{k}", "bool*", "output", "i1") for k, t in enumerate(self.outputs)]
        if self.split > 1:
            params.append(pointer_param(f"out{len(self.outputs)}", "f32", "output"))
        threads = math.prod(self.plan.block)
        head = (f'extern "C" __global__ void __launch_bounds__({threads}, 1) {{NAME}}('
                + ", ".join(f"{p.ctype} {p.name}" for p in params) + ") {\n")
        writer = _Writer()
        if self.plan.strategy == "flat":
            self._flat(writer)
        else:
            self._reduction(writer)
        name, code = finish(self.symbol, head + writer.text() + "}\n")
        grid, block, shared = self.plan.grid, self.plan.block, self.plan.shared
        alignment = 16 if self.plan.vector > 1 else 8
        return KernelSource(name, self.kind, code, tuple(params), lambda sizes: LaunchShape(grid, block, shared),
                            alignment)

    # -- pieces ----------------------------------------------------------------------------------

    def _decompose(self, w: _Writer, depth: int, flat: str, axes: Sequence[int], prefix: str = "") -> None:
        """Declare `i{axis}` for `axes` (row-major) from the linear index `flat`."""
        if not axes:
            return
        if len(axes) == 1:
            w.line(f"const long long i{axes[0]} = {flat};", depth)
            return
        w.line(f"long long {prefix}rest = {flat};", depth)
        for a in reversed(axes[1:]):
            w.line(f"const long long i{a} = {prefix}rest % {self.domain[a]}LL;", depth)
            w.line(f"{prefix}rest /= {self.domain[a]}LL;", depth)
        w.line(f"const long long i{axes[0]} = {prefix}rest;", depth)

    def _load(self, w: _Writer, depth: int, k: int, lanes: int = 1) -> None:
        """Declare `a{k}`: input k's element at the current index (an array of `lanes` when packed)."""
        t = self.inputs[k]
        attribute = self.map_attributes[k]
        vt = value_type(t.dtype)
        numbered = {g.source: f"g{g.source}" for g in self.maps[k].gathers}
        for g in self.maps[k].gathers:
            w.line(f"long long g{g.source} = (long long)a{g.source};", depth)
            w.line(f"if (g{g.source} < 0) g{g.source} += {g.dim}LL;", depth)
        offset = index_code(self.maps[k], numbered)
        checks = [f"(g{g.source} >= 0 && g{g.source} < {g.dim}LL)" for g in self.maps[k].gathers]
        for guard_attribute, size in attribute.get("guards", ()):
            guard = index_code(Expr.from_attribute(self.domain, guard_attribute))
            checks.append(f"((unsigned long long)({guard}) < {size}ULL)")
        if lanes > 1:
            # Packed accesses never read through guards, and every lane gathers from the same row
            # (`launches.vector_width`), so one check covers the access.
            w.line(f"float a{k}[{lanes}];", depth)
            if checks:
                w.line(f"if ({' && '.join(checks)}) sx_ld_vec(a{k}, in{k} + ({offset}));", depth)
                w.line(f"else for (int lane = 0; lane < {lanes}; ++lane) a{k}[lane] = SX_NAN;", depth)
            else:
                w.line(f"sx_ld_vec(a{k}, in{k} + ({offset}));", depth)
            return
        read = f"sx_ld(in{k} + ({offset}))" if t.dtype in _FLOAT else f"in{k}[{offset}]"
        if not checks:
            w.line(f"const {vt} a{k} = {read};", depth)
            return
        if "guards" in attribute:
            missing = literal(attribute["fill"], t.dtype)
        else:
            missing = "SX_NAN" if t.dtype in _FLOAT else "0"
        w.line(f"const {vt} a{k} = ({' && '.join(checks)}) ? {read} : {missing};", depth)

    def _ops(self, w: _Writer, depth: int, ops: Iterable[Operation], lane: str | None = None) -> None:
        """Statements for body ops (kern.reduce and kern.yield aside)."""
        for op in ops:
            if op.name in ("kern.reduce", "kern.yield"):
                continue
            r = op.results[0]
            name = f"v{self.count}"
            self.count += 1
            self.names[r] = name
            vt = value_type(r.type.dtype)
            w.line(f"const {vt} {name} = {self._expr(op, lane)};", depth)

    def _arg(self, v: Value, lane: str | None) -> str:
        if v in self.names:
            return self.names[v]
        k = self.args[v]
        if lane is not None and self._packed(k):
            return f"a{k}[{lane}]"
        return f"a{k}"

    def _expr(self, op: Operation, lane: str | None) -> str:
        args = [self._arg(v, lane) for v in op.operands]
        name = op.name
        dtype = op.results[0].type.dtype
        if name == "graph.const":
            return literal(op.attributes["value"], dtype)
        if name == "kern.index":
            return f"(int)({index_code(Expr.from_attribute(self.domain, op.attributes['expr']))})"
        if name in _UNARY:
            if dtype in _INT and name in ("graph.neg", "graph.abs"):
                return f"(-{args[0]})" if name == "graph.neg" else f"({args[0]} < 0 ? -{args[0]} : {args[0]})"
            return _UNARY[name].format(*args)
        if name in _BINARY:
            return _BINARY[name].format(*args)
        if name == "graph.where":
            return f"({args[0]} ? {args[1]} : {args[2]})"
        if name == "graph.cast":
            source = op.operands[0].type.dtype
            value = args[0]
            if source == "bf16" and dtype != "bf16":
                value = f"sxg_round_bf16({value})"  # the operand is a bf16 value: what it is stored as
            if dtype == "i1":
                return f"({value} != 0)"
            if dtype == "bf16" and source != "bf16":
                return f"sxg_round_bf16((float){value})"
            return f"({value_type(dtype)}){value}"
        raise ValueError(f"kernel {self.symbol}: no CUDA for '{name}'")

    def _store(self, w: _Writer, depth: int, k: int, value: str, at: str) -> None:
        t = self.outputs[k]
        if t.dtype in _FLOAT:
            w.line(f"sx_st(out{k} + ({at}), {value});", depth)
        else:
            w.line(f"out{k}[{at}] = ({storage_type(t.dtype)}){value};", depth)

    def _packed(self, k: int) -> bool:
        return self.plan.vector > 1 and bool(self.maps[k].stride_of(len(self.domain) - 1))

    # -- flat kernels ------------------------------------------------------------------------------

    def _flat(self, w: _Writer) -> None:
        vec = self.plan.vector
        total = math.prod(self.domain)
        axes = list(range(len(self.domain)))
        threads = self.plan.block[0]
        w.line(f"for (long long item = (long long)blockIdx.x * {threads} + threadIdx.x; item < {total // vec}LL;", 1)
        w.line(f"     item += (long long)gridDim.x * {threads}) {{", 1)
        w.line(f"const long long flat = item * {vec};", 2)
        self._decompose(w, 2, "flat", axes)
        for k in range(len(self.inputs)):
            self._load(w, 2, k, vec if self._packed(k) else 1)
        yielded = self.block.last_op.operands
        if vec == 1:
            self._ops(w, 2, self.body)
            for k, v in enumerate(yielded):
                self._store(w, 2, k, self._arg(v, None), "flat")
        else:
            last = axes[-1]
            for k in range(len(self.outputs)):
                w.line(f"float o{k}[{vec}];", 2)
            w.line(f"const long long i{last}_base = i{last};", 2)
            w.line("#pragma unroll", 2)
            w.line(f"for (int lane = 0; lane < {vec}; ++lane) {{", 2)
            w.line(f"const long long i{last} = i{last}_base + lane;  // this lane's index (kern.index reads it)", 3)
            self._ops(w, 3, self.body, lane="lane")
            for k, v in enumerate(yielded):
                w.line(f"o{k}[lane] = {self._arg(v, 'lane')};", 3)
            w.line("}", 2)
            for k in range(len(self.outputs)):
                w.line(f"sx_st_vec(out{k} + flat, o{k});", 2)
        w.line("}", 1)

    # -- reductions ---------------------------------------------------------------------------------

    def _levels(self) -> tuple[list[Operation], list[Operation], set[Value]]:
        """The body's prologue and epilogue ops (those reading a kern.reduce result, directly or not),
        and the values computed after the reduction."""
        after: set[Value] = set()
        prologue, epilogue = [], []
        for op in self.body:
            if op.name == "kern.yield":
                continue
            if op.name == "kern.reduce":
                after.add(op.result)
            elif any(v in after for v in op.operands):
                after.update(op.results)
                epilogue.append(op)
            else:
                prologue.append(op)
        return prologue, epilogue, after

    def _reduction(self, w: _Writer) -> None:
        strategy = self.plan.strategy
        kept = [d for d in range(len(self.domain)) if d not in self.reduce_axes]
        reduced = list(self.reduce_axes)
        kept_count = math.prod(self.domain[d] for d in kept)
        reduced_count = math.prod(self.domain[d] for d in reduced)
        prologue, epilogue, after = self._levels()
        reductions = [op for op in self.body if op.name == "kern.reduce"]
        yielded = list(self.block.last_op.operands)
        strides = _row_major(self.domain)
        full_flat = " + ".join(f"i{d} * {strides[d]}LL" for d in range(len(self.domain))) or "0"
        threads = math.prod(self.plan.block)
        end = f"{reduced_count}LL"
        if strategy == "columns":
            w.line(f"const long long k = (long long)blockIdx.x * {COLUMN_LANES} + threadIdx.x;", 1)
            w.line(f"const bool active = k < {kept_count}LL;", 1)
            start, step = "threadIdx.y", COLUMN_PARTS
            if self.split > 1:
                chunk = chunk_rows(reduced_count, self.split)
                w.line(f"// This block's chunk of the reduced rows: chunk blockIdx.y of {self.split}.", 1)
                w.line(f"const long long first_row = (long long)blockIdx.y * {chunk}LL;", 1)
                w.line(f"const long long end_row = min(first_row + {chunk}LL, {reduced_count}LL);", 1)
                start, end = "first_row + threadIdx.y", "end_row"
        elif strategy == "rows":
            w.line("const int lane = threadIdx.x % 32;", 1)
            w.line(f"const long long k = (long long)blockIdx.x * {ROWS_PER_BLOCK} + threadIdx.x / 32;", 1)
            w.line(f"if (k >= {kept_count}LL) return;", 1)
            start, step = "lane", 32
        else:
            w.line("const long long k = blockIdx.x;", 1)
            start, step = "threadIdx.x", threads
        self._decompose(w, 1, "k", kept, "k_")
        accumulators = []
        for j, op in enumerate(reductions):
            vt = "long long" if op.operands[0].type.dtype in _INT else "float"
            identity = (_INT_IDENTITY if vt == "long long" else _IDENTITY)[op.attributes["op"]]
            w.line(f"{vt} acc{j} = {identity};", 1)
            accumulators.append((vt, op.attributes["op"]))
        guard = "if (active) " if strategy == "columns" else ""
        w.line(f"{guard}for (long long r = {start}; r < {end}; r += {step}) {{", 1)
        self._decompose(w, 2, "r", reduced, "r_")
        full_outputs = [v for v in yielded if v not in after]
        needed = self._inputs_of(prologue + reductions) | {self.args[v] for v in full_outputs if v in self.args}
        for k in sorted(needed):
            self._load(w, 2, k)
        self._ops(w, 2, prologue)
        for j, op in enumerate(reductions):
            w.line(f"acc{j} = sxg_{op.attributes['op']}(acc{j}, ({accumulators[j][0]}){self._arg(op.operands[0], None)});", 2)
        for k, v in enumerate(yielded):
            if v not in after:
                self._store(w, 2, k, self._arg(v, None), full_flat)
        w.line("}", 1)
        self._combine(w, strategy, accumulators, threads)
        for j, op in enumerate(reductions):
            self.names[op.results[0]] = f"acc{j}"
        w.line("{", 2)
        for d in reduced:
            w.line(f"const long long i{d} = 0;", 3)
        kept_outputs = [v for v in yielded if v in after]
        recompute = self._needed_before(epilogue, prologue)
        for k in sorted(self._inputs_of(recompute + epilogue) | {self.args[v] for v in kept_outputs if v in self.args}):
            self._load(w, 3, k)
        saved = dict(self.names)
        self._ops(w, 3, recompute + epilogue)
        for k, v in enumerate(yielded):
            if v in after:
                self._store(w, 3, k, self._arg(v, None), "k")
        self.names = saved
        w.line("}", 2)
        w.line("}", 1)

    def _combine(self, w: _Writer, strategy: str, accumulators: list[tuple[str, str]], threads: int) -> None:
        """Combine each thread's partial results in a fixed order; opens the block that runs the epilogue."""
        if strategy == "rows":
            for j, (_, op) in enumerate(accumulators):
                w.line(f"acc{j} = sxg_warp_{op}(acc{j});", 1)
            w.line("if (lane == 0) {", 1)
            return
        if strategy == "columns":
            for j, (vt, _) in enumerate(accumulators):
                w.line(f"__shared__ {vt} part{j}[{COLUMN_PARTS}][{COLUMN_LANES + 1}];", 1)
                w.line(f"part{j}[threadIdx.y][threadIdx.x] = acc{j};", 1)
            w.line("__syncthreads();", 1)
            w.line("if (threadIdx.y == 0 && active) {", 1)
            for j, (_, op) in enumerate(accumulators):
                w.line(f"for (int y = 1; y < {COLUMN_PARTS}; ++y) acc{j} = sxg_{op}(acc{j}, part{j}[y][threadIdx.x]);", 2)
            if self.split > 1:
                self._combine_chunks(w, accumulators)
            return
        warps = threads // 32
        for j, (vt, op) in enumerate(accumulators):
            w.line(f"__shared__ {vt} part{j}[{warps}];", 1)
            w.line(f"acc{j} = sxg_warp_{op}(acc{j});", 1)
            w.line(f"if (threadIdx.x % 32 == 0) part{j}[threadIdx.x / 32] = acc{j};", 1)
        w.line("__syncthreads();", 1)
        w.line("if (threadIdx.x < 32) {", 1)
        for j, (vt, op) in enumerate(accumulators):
            identity = (_INT_IDENTITY if vt == "long long" else _IDENTITY)[op]
            w.line(f"acc{j} = sxg_warp_{op}(threadIdx.x < {warps} ? part{j}[threadIdx.x] : ({vt}){identity});", 2)
        w.line("}", 1)
        w.line("if (threadIdx.x == 0) {", 1)

    def _combine_chunks(self, w: _Writer, accumulators: list[tuple[str, str]]) -> None:
        """A split column reduction, after its block's partial results (thread row 0 holds them): they go to
        the partials; the last block of the strip to finish (its counter, bumped after a fence, says so) sets
        the counter back to zero and combines the strip's partials in chunk order; opens the block that runs
        the epilogue (in that last block)."""
        kept = math.prod(n for d, n in enumerate(self.domain) if d not in self.reduce_axes)
        partials, counters = f"out{len(self.outputs)}", f"in{len(self.inputs)}"
        for j in range(len(accumulators)):
            w.line(f"{partials}[({j}LL * {self.split} + blockIdx.y) * {kept}LL + k] = acc{j};", 2)
        for line in _LAST_CHUNK.format(counters=counters, last=self.split - 1).splitlines():
            w.line(line, 1)
        for j, (_, op) in enumerate(accumulators):
            # Volatile: other blocks wrote them, so they are read from memory (L2), never a stale cache line.
            w.line(f"const volatile float* chunks{j} = {partials} + {j}LL * {self.split} * {kept}LL + k;", 2)
            w.line(f"acc{j} = chunks{j}[0];", 2)
            w.line(f"for (int c = 1; c < {self.split}; ++c) acc{j} = sxg_{op}(acc{j}, (float)chunks{j}[c * {kept}LL]);", 2)

    def _inputs_of(self, ops: Sequence[Operation]) -> set[int]:
        """The inputs `ops` read (and the index inputs their gathers need)."""
        found = {self.args[v] for op in ops for v in op.operands if v in self.args}
        for k in list(found):
            found |= {g.source for g in self.maps[k].gathers}
        return found

    def _needed_before(self, epilogue: list[Operation], prologue: list[Operation]) -> list[Operation]:
        """The prologue ops the epilogue reads (recomputed after the reduction, at reduced index 0)."""
        wanted: set[Value] = {v for op in epilogue for v in op.operands}
        chosen: list[Operation] = []
        for op in reversed(prologue):
            if any(r in wanted for r in op.results):
                chosen.append(op)
                wanted.update(op.operands)
        return list(reversed(chosen))


def _row_major(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]
