"""The C of a lowered module: every kernel once, and one C function per graph, in several translation units.

After `CPU_C_LOWERING` (`match-patterns`, `fuse`, `plan-buffers`: the CUDA lowering's target-independent
passes) a `graph.func` holds inputs, dense constants, free views, `kern.launch`es, `kern.gemm`s, its
return and its emits. `render_module` writes

- each `kern.kernel` as a hidden `void` function (`kernels.py`, `templates.py`), the kernels spread over
  units of about `KERNEL_UNIT_LINES` lines that the compiler builds in parallel;
- each graph as `void sxg_<n>(char* const* base)`, the graph's launches and GEMMs in order, every operand a
  typed pointer `base[b] + offset` (`GraphLayout`: base 0 the activation arena `plan-buffers` laid out,
  1 the GEMM workspace, then the graph's inputs, its constants and the values it returns or emits). One
  call of a graph is one call into C, as one replay of a captured graph is on the GPU. The graph functions,
  the GEMM calls and the kernels' prototypes are the first unit;
- GEMMs as calls of the BLAS `cblas_sgemm` the executor hands over at load time (`sx_set_sgemm`: numpy's
  OpenBLAS), bf16 operands widened to f32 in the workspace, the bias added and the result rounded once.

`Rendered.kernel_at(line)` tells which kernel a compiler error's line is in.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from attrs import define, frozen

from ...dialects.core import Operation, TensorType, Value
from ...dialects.graph import emit_collection, emit_name, graph_funcs, input_name, input_role, return_names
from ...dialects.graph_semantics import numpy_dtypes
from ...dialects.index_maps import Expr
from ...dialects.kern import BODY_KINDS, adds_into, find_kernel, gemm_dims
from .attention import ATTENTION_PRELUDE, attention_code
from .kernels import PRELUDE, STORAGE, FusedKernel, UnsupportedKernel, parameters
from .templates import template_code

#: Views that cost nothing: the same bytes read as another shape.
FREE_VIEWS = ("graph.reshape", "graph.squeeze", "graph.expand_dims")
EMIT_OPS = ("graph.metric", "graph.counter", "graph.observe")
#: Kernels that read each operand element and then write the result element of the same index, so an
#: output may be the caller's array of an input they read through the identity map (plan-buffers' rule).
ELEMENTWISE_KINDS = ("pointwise", "multi_tensor_update")
#: Bases of a graph's operands: the arena, the workspace, then inputs, constants and externals.
ARENA, WORKSPACE, FIRST_INPUT = 0, 1, 2
ALIGNMENT = 64
#: The dtype codes `sx_gemm_step` takes.
DTYPE_CODES = {"f32": 0, "bf16": 1, "f16": 2}
#: About how many lines of kernels one translation unit holds (each unit is one compiler process).
KERNEL_UNIT_LINES = 800
_BASE = re.compile(r"<(arena|input|const|external) (\d+)>")

GEMM_PRELUDE = r"""
typedef void (*sx_sgemm_fn)(int, int, int, long long, long long, long long, float, const float*, long long,
                            const float*, long long, float, float*, long long);
static sx_sgemm_fn sx_sgemm;
static int (*sx_blas_threads)(void);
static void (*sx_set_blas_threads)(int);
void sx_set_blas(void* sgemm, void* get_threads, void* set_threads) {
    sx_sgemm = (sx_sgemm_fn)sgemm;
    sx_blas_threads = (int (*)(void))get_threads;
    sx_set_blas_threads = (void (*)(int))set_threads;
}
void sx_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
}

/* d[i] = alpha * op(a[i]) @ op(b[i]) + beta * d[i], row-major, for each of `batch` matrices. OpenBLAS runs
   single-threaded; a large product is cut along the longer side of d into 2, 4 or 8 blocks of rows (or of
   columns) of a size fixed by the shape alone, which OpenMP threads take: each element is the same BLAS
   computation whatever the thread count. A power of two of blocks shares evenly among 2, 4 or 8 threads (a
   weight gradient, 128 rows by 384 columns, is two blocks of columns). A block is at least
   SX_GEMM_MIN_BLOCK rows or columns where the side allows, as each repacks the other operand (128-row blocks
   of a 1024x128x512 product run about 8% slower than 256-row ones at one thread); a shorter side of at
   least twice SX_GEMM_SMALL_BLOCK is still cut in two, as a microbatch's 256-row products would otherwise
   leave every thread but one idle (measured on 2 cores: the spec GPT's smoke step 60 ms with them whole,
   46 ms halved; at one thread a halved 256-row product costs 0-10%), and so is a 128 x 128 weight gradient
   (tiny-gpt's attention projection: its 2-thread step 2% faster, its 1-thread one unchanged). */
#define SX_GEMM_PARALLEL (1LL << 21)
#define SX_GEMM_MIN_BLOCK 192
#define SX_GEMM_SMALL_BLOCK 64
static long long sx_gemm_block(long long size) {
    long long count = 1;
    while (count < 8 && size / (2 * count) >= SX_GEMM_MIN_BLOCK) count *= 2;
    if (count == 1 && size / 2 >= SX_GEMM_SMALL_BLOCK) count = 2;
    return ((size + count - 1) / count + 15) / 16 * 16;
}
static void sx_gemm(int ta, int tb, long long m, long long n, long long k, long long batch, float alpha,
                    const float* a, long long stride_a, const float* b, long long stride_b, float beta, float* d) {
    const long long lda = ta ? m : k, ldb = tb ? k : n;
    const long long work = batch * m * n * k;
    long long rows = m, cols = n;
    if (work >= SX_GEMM_PARALLEL && m >= n) rows = sx_gemm_block(m);
    else if (work >= SX_GEMM_PARALLEL) cols = sx_gemm_block(n);
    const long long row_blocks = (m + rows - 1) / rows, col_blocks = (n + cols - 1) / cols;
    const long long blocks = row_blocks * col_blocks;
    #pragma omp parallel for schedule(static) if(work >= SX_GEMM_PARALLEL)
    for (long long job = 0; job < batch * blocks; ++job) {
        const long long i = job / blocks, block = job % blocks;
        const long long r0 = block / col_blocks * rows, c0 = block % col_blocks * cols;
        const long long mm = m - r0 < rows ? m - r0 : rows, nn = n - c0 < cols ? n - c0 : cols;
        const float* ai = a + i * stride_a + (ta ? r0 : r0 * lda);
        const float* bi = b + i * stride_b + (tb ? c0 * ldb : c0);
        sx_sgemm(101, ta ? 112 : 111, tb ? 112 : 111, mm, nn, k, alpha, ai, lda, bi, ldb, beta,
                 d + i * m * n + r0 * n + c0, n);
    }
}

/* Element i of an array of dtype code `dtype` (0 f32, 1 bf16, 2 f16) as f32, and the store back. */
static inline float sx_get(int dtype, const void* p, long long i) {
    return dtype == 0 ? ((const float*)p)[i] : dtype == 1 ? sx_bf16_f32(((const uint16_t*)p)[i])
                                                          : (float)((const _Float16*)p)[i];
}
static void sx_widen(float* out, int dtype, const void* in, long long count) {
    #pragma omp parallel for schedule(static) if(count >= 32768)
    for (long long i = 0; i < count; ++i) out[i] = sx_get(dtype, in, i);
}

/* A kern.gemm: d = alpha op(a) op(b) + (c when given + bias, a row vector, when given), computed in f32
   (16-bit operands widened into `work` first) and rounded once into d's dtype. */
static __attribute__((noinline)) void sx_gemm_step(int ta, int tb, long long m, long long n, long long k, long long batch, float alpha,
                         int a_dtype, const void* a, long long a_count, long long stride_a,
                         int b_dtype, const void* b, long long b_count, long long stride_b,
                         int c_dtype, const void* c, int bias_dtype, const void* bias,
                         int d_dtype, void* d, char* work) {
    const long long total = batch * m * n;
    const float* fa = (const float*)a;
    const float* fb = (const float*)b;
    if (a_dtype != 0) {
        float* wa = (float*)work;
        float* wb = (float*)(work + (a_count * 4 + 63) / 64 * 64);
        sx_widen(wa, a_dtype, a, a_count);
        sx_widen(wb, b_dtype, b, b_count);
        work += (a_count * 4 + 63) / 64 * 64 + (b_count * 4 + 63) / 64 * 64;
        fa = wa;
        fb = wb;
    }
    float* dd = d_dtype == 0 ? (float*)d : (float*)work;
    if (bias != 0) {
        /* d starts as the bias (plus c) and the BLAS adds the product to it: one pass over d, where adding the
           bias after the product took a second and the BLAS zeroed d first (beta 0). */
        #pragma omp parallel for schedule(static) if(total >= 32768)
        for (long long r = 0; r < total / n; ++r) {
            float* row = dd + r * n;
            if (c == 0) {
                for (long long j = 0; j < n; ++j) row[j] = sx_get(bias_dtype, bias, j);
            } else {
                for (long long j = 0; j < n; ++j) row[j] = sx_get(c_dtype, c, r * n + j) + sx_get(bias_dtype, bias, j);
            }
        }
    } else if (c != 0 && (const void*)c != (const void*)dd) {
        sx_widen(dd, c_dtype, c, total);
    }
    sx_gemm(ta, tb, m, n, k, batch, alpha, fa, stride_a, fb, stride_b, c != 0 || bias != 0 ? 1.0f : 0.0f, dd);
    if (d_dtype == 1) {
        #pragma omp parallel for schedule(static) if(total >= 32768)
        for (long long i = 0; i < total; ++i) ((uint16_t*)d)[i] = sx_f32_bf16(dd[i]);
    } else if (d_dtype == 2) {
        for (long long i = 0; i < total; ++i) ((_Float16*)d)[i] = (_Float16)dd[i];
    }
}
"""


def numpy_dtype(dtype: str) -> np.dtype:
    """The host numpy dtype of an IR dtype (bf16 through ml_dtypes)."""
    return np.dtype(numpy_dtypes()[dtype])


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def identifier(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]+", "_", name).strip("_") or "x"


@frozen
class Place:
    """Where a value's bytes are during a call: `kind` ("arena", "input", "const", "external"), which input,
    constant or external value (`index`), and a byte offset from its start."""

    kind: str
    index: int
    offset: int = 0


@define
class ExternalValue:
    """A value the graph returns or emits, written by one step (`producer`, its index)."""

    type: TensorType
    producer: int
    #: input index -> whether the producer reads it in a way that allows writing this value over it (an
    #: elementwise kernel through the identity map, the C of an accumulating GEMM, what a scatter adds into).
    reads_in_place: dict[int, bool]


@frozen
class Named:
    """An output or emit of the graph by name: where its value is after a call."""

    name: str
    place: Place
    type: TensorType
    collection: str = "output"


class GraphLayout:
    """The steps of one lowered `graph.func` as C statements, and where its inputs, outputs and emits live."""

    def __init__(self, func: Operation, function: str) -> None:
        self.name = str(func.attributes["sym_name"])
        self.function = function
        self.arena_bytes = aligned(int(func.attributes.get("arena_bytes", 0)))
        self.workspace_bytes = 0
        self.inputs: list[Operation] = []
        self.constants: list[np.ndarray] = []
        self.externals: list[ExternalValue] = []
        self.statements: list[str] = []
        #: What each statement runs ("<kind> <kernel symbol>", "gemm <batch>x<m>x<n>x<k> ..."), for profiles.
        self.labels: list[str] = []
        #: Where this graph's step times start in the module's profile counters (when profiled).
        self.profile_start = 0
        self.outputs: list[Named] = []
        self.emits: list[Named] = []
        #: input index -> the index of the last step that reads it.
        self.last_read: dict[int, int] = {}
        #: The kernels (symbol, model path) the graph launches, for the report and for errors.
        self.launched: list[tuple[str, str]] = []
        self.gemms = 0
        self._places: dict[Value, Place] = {}
        for op in func.body.ops:
            self._add(op)

    @property
    def steps(self) -> int:
        return len(self.statements)

    def input_types(self) -> list[tuple[str, str, TensorType]]:
        return [(input_name(op), input_role(op), op.result.type) for op in self.inputs]

    def base_index(self, kind: str, index: int) -> int:
        first = {"input": FIRST_INPUT, "const": FIRST_INPUT + len(self.inputs),
                 "external": FIRST_INPUT + len(self.inputs) + len(self.constants)}
        return ARENA if kind == "arena" else first[kind] + index

    def pointer(self, value: Value, const: bool = False) -> str:
        """C for a typed pointer to `value`'s first element during a call. Its base is written `<kind index>`
        until `code` numbers the bases (inputs, constants and externals are known once the graph is read)."""
        place = self._places[value]
        ctype = STORAGE[value.type.dtype]
        offset = f" + {place.offset}" if place.offset else ""
        return f"({'const ' if const else ''}{ctype}*)(base[<{place.kind} {place.index}>]{offset})"

    # -- reading the IR ------------------------------------------------------------------------------

    def _add(self, op: Operation) -> None:
        name = op.name
        if name == "graph.input":
            self._places[op.result] = Place("input", len(self.inputs))
            self.inputs.append(op)
        elif name == "graph.const":
            t = op.result.type
            value = np.broadcast_to(np.asarray(op.attributes["value"], numpy_dtype(t.dtype)), t.shape)
            self._places[op.result] = Place("const", len(self.constants))
            self.constants.append(np.ascontiguousarray(value))
        elif name in FREE_VIEWS:
            self._places[op.result] = self._places[op.operands[0]]
        elif name == "kern.launch":
            self._launch(op)
        elif name == "kern.gemm":
            self._gemm(op)
        elif name == "graph.return":
            for out_name, value in zip(return_names(op), op.operands):
                self.outputs.append(Named(out_name, self._places[value], value.type))
        elif name in EMIT_OPS:
            value = op.operands[0]
            self.emits.append(Named(emit_name(op), self._places[value], value.type, emit_collection(op)))
        else:
            raise UnsupportedKernel(f"a lowered graph holds '{name}', which the cpu-c executor does not run")

    def _result_places(self, op: Operation) -> list[Place]:
        places = []
        for result, offset in zip(op.results, op.attributes["offsets"]):
            if offset is None:
                place = Place("external", len(self.externals))
                self.externals.append(ExternalValue(result.type, self.steps, {}))
            else:
                place = Place("arena", 0, int(offset))
            self._places[result] = place
            places.append(place)
        return places

    def _reads(self, op: Operation, in_place: Sequence[bool], results: Sequence[Place]) -> None:
        """Record that the step about to be added reads its operands' inputs, and for each result it writes
        outside the arena whether it may overwrite each of them."""
        for value, allowed in zip(op.operands, in_place):
            place = self._places[value]
            if place.kind != "input":
                continue
            self.last_read[place.index] = self.steps
            for result in results:
                if result.kind == "external":
                    reads = self.externals[result.index].reads_in_place
                    reads[place.index] = reads.get(place.index, True) and allowed

    def _launch(self, op: Operation) -> None:
        kernel = find_kernel(op)
        if kernel is None:
            raise UnsupportedKernel(f"kern.launch of an undefined kernel in @{self.name}")
        attrs = kernel.attributes
        elementwise = attrs["kind"] in ELEMENTWISE_KINDS
        results = self._result_places(op)
        self._reads(op, [(elementwise and _identity_read(kernel, k)) or adds_into(kernel, k)
                         for k in range(len(op.operands))], results)
        arguments = [self.pointer(v, const=True) for v in op.operands] + [self.pointer(r) for r in op.results]
        self.statements.append(f"{kernel_function(attrs['sym_name'])}({', '.join(arguments)});")
        self.labels.append(f"{attrs['kind']} {attrs['sym_name']}")
        self.launched.append((attrs["sym_name"], str(op.attributes.get("path") or attrs.get("path") or "")))

    def _gemm(self, op: Operation) -> None:
        attrs = op.attributes
        has_bias = attrs["epilogue"] == "bias"
        if attrs["epilogue"] not in ("none", "bias"):
            raise UnsupportedKernel(f"a GEMM with the {attrs['epilogue']} epilogue, which the cpu-c executor does not run")
        accumulate = attrs["beta"] != 0
        (d_place,) = self._result_places(op)
        self._reads(op, [False, False] + ([False] if has_bias else []) + ([True] if accumulate else []), [d_place])
        self.statements.append(self._gemm_code(op, has_bias, accumulate))
        m, n, k = gemm_dims(op)
        self.labels.append(f"gemm {attrs['batch']}x{m}x{n}x{k} {op.results[0].type.dtype} {attrs.get('path', '')}")
        self.gemms += 1

    def _gemm_code(self, op: Operation, has_bias: bool, accumulate: bool) -> str:
        """One call of `sx_gemm_step`: operand dtypes as codes, bf16 operands widened into the workspace."""
        attrs = op.attributes
        m, n, k = gemm_dims(op)
        a, b = op.operands[0], op.operands[1]
        d = op.results[0]
        batch = int(attrs["batch"])
        total = batch * m * n
        widened = a.type.dtype != "f32"
        workspace = (aligned(a.type.numel * 4) + aligned(b.type.numel * 4) if widened else 0)
        workspace += aligned(total * 4) if d.type.dtype != "f32" else 0
        self.workspace_bytes = max(self.workspace_bytes, workspace)
        c = op.operands[-1] if accumulate else None
        bias = op.operands[2] if has_bias else None

        def operand(value: Value | None) -> str:
            if value is None:
                return "0, 0"
            return f"{DTYPE_CODES[value.type.dtype]}, {self.pointer(value, const=True)}"

        return (f"sx_gemm_step({int(bool(attrs['transpose_a']))}, {int(bool(attrs['transpose_b']))}, {m}, {n}, {k}, "
                f"{batch}, {float(attrs['alpha'])!r}f, {operand(a)}, {a.type.numel}, {0 if a.type.rank == 2 else m * k}, "
                f"{operand(b)}, {b.type.numel}, {0 if b.type.rank == 2 else k * n}, {operand(c)}, {operand(bias)}, "
                f"{DTYPE_CODES[d.type.dtype]}, {self.pointer(d)}, base[{WORKSPACE}]);")

    def code(self, profiled: bool = False) -> str:
        statements = self.statements
        if profiled:  # each step's process CPU seconds added into the module's counters (`sx_profile`)
            statements = [f"{{ const double t0 = sx_cpu_seconds(); {text} sx_seconds[{self.profile_start + i}] += "
                          "sx_cpu_seconds() - t0; }" for i, text in enumerate(statements)]
        body = _BASE.sub(lambda m: str(self.base_index(m.group(1), int(m.group(2)))), "\n    ".join(statements))
        if not self.gemms:
            return f"void {self.function}(char* const* base) {{\n    {body}\n}}\n"
        return (f"void {self.function}(char* const* base) {{\n"
                "    const int blas_threads = sx_blas_threads();\n"
                "    sx_set_blas_threads(1);\n"
                f"    {body}\n"
                "    sx_set_blas_threads(blas_threads);\n}\n")


def _identity_read(kernel: Operation, operand: int) -> bool:
    attribute = kernel.attributes["maps"][operand]
    domain = list(kernel.attributes["domain"])
    return set(attribute) == {"offset", "strides"} and Expr.from_attribute(domain, attribute) == Expr.flat(domain)


def kernel_function(symbol: str) -> str:
    return f"k_{identifier(symbol)}"


@define
class Rendered:
    """A module's C: its translation units, each graph's layout, and where each kernel's code starts."""

    #: The translation units: the graph functions' first, then the kernels' (`KERNEL_UNIT_LINES` apiece).
    units: list[str]
    graphs: dict[str, GraphLayout]
    #: Per unit, (first line, kernel symbol, model path) in source order.
    kernel_lines: list[list[tuple[int, str, str]]]
    kernels: int

    @property
    def lines(self) -> int:
        return sum(unit.count("\n") for unit in self.units)

    def kernel_at(self, unit: int, line: int) -> tuple[str, str] | None:
        """(symbol, model path) of the kernel whose function holds line `line` (1-based) of unit `unit`."""
        found = None
        for start, symbol, path in self.kernel_lines[unit]:
            if start > line:
                break
            found = (symbol, path)
        return found


def render_module(module: Operation, profiled: bool = False) -> Rendered:
    """The C of every kernel and graph of a lowered module (see the module docstring); `profiled` adds up
    each step's process CPU seconds in counters `sx_profile()` returns (`GraphLayout.profile_start`, `labels`).

    The kernels are spread over units of about `KERNEL_UNIT_LINES` lines, in module order, so the compiler
    builds them in parallel (`compiler.compile_shared`); the split depends on the module alone."""
    kernel_units: list[list[str]] = []
    kernel_lines: list[list[tuple[int, str, str]]] = [[]]
    prototypes: list[str] = []
    unit_prelude = PRELUDE + ATTENTION_PRELUDE
    prelude_lines = unit_prelude.count("\n") + 1
    line = 0
    kernels = 0
    for op in module.body.ops:
        if op.name != "kern.kernel":
            continue
        if not kernel_units or line >= KERNEL_UNIT_LINES:
            kernel_units.append([unit_prelude])
            kernel_lines.append([])
            line = prelude_lines
        code = kernel_code(op)
        kernel_lines[-1].append((line, op.attributes["sym_name"], str(op.attributes.get("path") or "")))
        kernel_units[-1].append(code)
        prototypes.append(code[:code.index(" {\n")] + ";")
        line += code.count("\n")
        kernels += 1
    graphs: dict[str, GraphLayout] = {}
    steps = 0
    for number, func in enumerate(graph_funcs(module)):
        layout = GraphLayout(func, f"sxg_{number}_{identifier(str(func.attributes['sym_name']))}")
        layout.profile_start = steps
        steps += layout.steps
        graphs[layout.name] = layout
    parts = [PRELUDE, GEMM_PRELUDE, *prototypes]
    if profiled:
        parts.append(f"#include <time.h>\nstatic double sx_seconds[{max(steps, 1)}];\n"
                     "double* sx_profile(void) { return sx_seconds; }\n"
                     "static double sx_cpu_seconds(void) {\n"
                     "    struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec;\n}\n")
    parts += [layout.code(profiled) for layout in graphs.values()]
    units = ["\n".join(parts), *("\n".join(unit) for unit in kernel_units)]
    return Rendered(units, graphs, kernel_lines, kernels)


def kernel_code(kernel: Operation) -> str:
    """One kernel's C function."""
    attrs = kernel.attributes
    # In a unit of kernels, called from the unit of graph functions (hidden: not exported from the object).
    head = f"__attribute__((visibility(\"hidden\"), noinline)) void {kernel_function(attrs['sym_name'])}({', '.join(parameters(kernel))}) {{\n"
    if attrs["kind"] in BODY_KINDS or attrs["kind"] == "copy":
        body = FusedKernel(kernel).code()
    elif attrs["kind"] == "attention":
        body = attention_code(kernel)
    else:
        body = template_code(kernel)
    return head + body + "}\n"

