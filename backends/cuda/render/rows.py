"""Row programs: CUDA kernels that walk the rows of `[rows, C]` operands along the last axis.

A family is written once as a `RowSpec` — its operands, the reductions it
makes over a row, the per-row values it derives, what it writes per element
and per row — and `row_kernel` writes it out for a `RowLayout`:

- `warp`: one warp per row (llm.c's layernorm), rows given to warps by a
  grid-stride loop. With the row length known at compile time and the row
  small enough, the row's inputs are loaded once into registers (`cached`) and
  every pass over the row reads them there; otherwise each pass reads memory.
  Reductions are warp shuffles.
- `block`: one block per row (llm.c's classifier), for long rows such as a
  vocabulary; reductions go through shared memory (`sx_block_sum`).

Elements are moved `vec` at a time (16 bytes when the row length allows:
x128 for bf16 rows of a multiple of 8) and computed in f32. A thread owns the
same elements in every pass, so an output may overwrite an input of its dtype
(the kernel's `in_place`). Per-column sums across rows (the weight gradients
of the norms) are made deterministically: each warp adds its rows in order
into its own partial row of a scratch buffer (`[partials, C]`, f32), and a
second kernel (`templates.column_sum`) adds the partial rows in order.

Expressions are C with the operands' names standing for their values: an
element of a row or column operand, the value of a per-row operand, the
value of a scalar operand; `col` is the element's column, `C` the row length.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from attrs import frozen

from .kernel_source import (
    PACKED_ALIGNMENT,
    KernelParam,
    KernelSource,
    LaunchShape,
    c_type,
    finish,
    kernel_head,
    pointer_param,
    size_param,
    vector_width,
)

WARP = 32
#: f32 registers per thread a warp-per-row kernel may spend on cached row elements and column sums.
REGISTER_BUDGET = 64
#: Rows longer than this get a block per row unless the caller says otherwise.
BLOCK_LAYOUT_FROM = 4096
#: A column-summing kernel gives each warp about this many rows, with at most MAX_PARTIAL_BLOCKS blocks.
ROWS_PER_WARP = 8
MAX_PARTIAL_BLOCKS = 256
#: ... and at least this many blocks where its rows give every warp one: a block per SM of the largest
#: device the targets name (an H100 or H200 has 132), so a norm's backward fills the device (llm.c launches
#: its layernorm backward on every SM).
MIN_PARTIAL_BLOCKS = 132

#: How far a strided pass over the row (not one over register arrays) is unrolled.
STRIDED_UNROLL = 4


@frozen
class RowOperand:
    """An operand of a row program: `row` [rows, C], `column` [C], `per_row` [rows] or `scalar` (one element)."""

    name: str
    dtype: str
    kind: str
    role: str  # "input" or "output"


@frozen
class Reduce:
    """`var` = the sum or max over the row of `expr`."""

    var: str
    op: str
    expr: str


@frozen
class SoftmaxStats:
    """`max_var` = max over the row of `expr`, `sum_var` = sum of exp(expr - max_var), in one pass."""

    max_var: str
    sum_var: str
    expr: str


@frozen
class Phase:
    """One pass over the row making its reductions, then per-row values `(name, expr)` from them."""

    reductions: tuple[Reduce | SoftmaxStats, ...]
    then: tuple[tuple[str, str], ...] = ()


@frozen
class RowSpec:
    """A row program. Names in expressions: operands, earlier per-row values, `element` values, `col`, `C`.

    `setup` holds per-row values `(C type, name, expr)` computed before the
    first pass (`<operand>_row` points at the row of a row operand there);
    `element` per-element values `(name, expr)`; `outputs` what each row
    output gets per element; `row_outputs` what each per-row output gets;
    `column_sums` the per-element expressions summed over rows into the
    scratch partial rows of that name.
    """

    family: str
    stem: str
    operands: tuple[RowOperand, ...]
    cols: int | None
    setup: tuple[tuple[str, str, str], ...] = ()
    element: tuple[tuple[str, str], ...] = ()
    phases: tuple[Phase, ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()
    row_outputs: tuple[tuple[str, str], ...] = ()
    column_sums: tuple[tuple[str, str], ...] = ()

    def of_kind(self, kind: str, role: str | None = None) -> list[RowOperand]:
        return [o for o in self.operands if o.kind == kind and (role is None or o.role == role)]


@frozen
class RowLayout:
    """How a row program runs: a warp or a block per row, threads per block, elements per access,
    the row inputs kept in registers, and whether column sums are kept in registers."""

    kind: str
    threads: int
    vec: int
    cached: tuple[str, ...] = ()
    sums_in_registers: bool = False

    @property
    def unrolled(self) -> bool:
        """Passes over the row are unrolled loops indexed by register arrays."""
        return bool(self.cached) or self.sums_in_registers


def choose_layout(spec: RowSpec, kind: str | None = None, threads: int | None = None) -> RowLayout:
    """The layout for `spec`: a warp per row unless the row is long (or `kind` says), 256 threads a block
    for warps and 512 or 1024 for blocks (or `threads`), and registers where the budget allows."""
    if kind is None:
        kind = "block" if spec.cols is not None and spec.cols > BLOCK_LAYOUT_FROM and not spec.column_sums else "warp"
    if kind not in ("warp", "block"):
        raise ValueError(f"{spec.family}: layout {kind!r} is not warp or block")
    if kind == "block" and spec.column_sums:
        raise ValueError(f"{spec.family}: column sums need the warp layout")
    if threads is None:
        threads = 256 if kind == "warp" else (1024 if (spec.cols or 0) >= 16384 else 512)
    if threads % WARP or not WARP <= threads <= 1024:
        raise ValueError(f"{spec.family}: {threads} threads a block; it must be a multiple of 32 up to 1024")
    vec = vector_width(spec.cols, [o.dtype for o in spec.operands if o.kind in ("row", "column")])
    if kind == "block" or spec.cols is None:
        return RowLayout(kind, threads, vec)
    per_lane = -(-spec.cols // (vec * WARP)) * vec  # f32 registers one cached row operand takes per lane
    sums = len(spec.column_sums) * per_lane <= REGISTER_BUDGET and bool(spec.column_sums)
    budget = REGISTER_BUDGET - (len(spec.column_sums) * per_lane if sums else 0)
    reread = [o.name for o in spec.of_kind("row", "input") if _passes_reading(spec, o.name) > 1]
    cached = tuple(reread) if reread and len(reread) * per_lane <= budget else ()
    return RowLayout(kind, threads, vec, cached, sums)


def _identifiers(text: str) -> set[str]:
    return set(_IDENT.findall(text))


_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def _rename(text: str, names: Mapping[str, str]) -> str:
    return _IDENT.sub(lambda m: names.get(m.group(0), m.group(0)), text)


def _closure(spec: RowSpec, exprs: Iterable[str]) -> tuple[set[str], list[tuple[str, str]]]:
    """The identifiers `exprs` read, through the element values they use, and those values in order."""
    used: set[str] = set()
    for text in exprs:
        used |= _identifiers(text)
    needed = []
    for name, text in reversed(spec.element):
        if name in used:
            used |= _identifiers(text)
            needed.append((name, text))
    return used, needed[::-1]


def _pass_exprs(spec: RowSpec) -> list[list[str]]:
    """The per-element expressions of each pass over the row: one per phase, then the outputs' pass."""
    passes = [[r.expr for r in phase.reductions] for phase in spec.phases]
    final = [e for _, e in spec.outputs] + [e for _, e in spec.column_sums]
    return passes + ([final] if final else [])


def _passes_reading(spec: RowSpec, name: str) -> int:
    return sum(name in _closure(spec, exprs)[0] for exprs in _pass_exprs(spec))


def row_kernel(spec: RowSpec, layout: RowLayout) -> KernelSource:
    """The kernel of `spec` in `layout`, its parameters (inputs, outputs, partial rows, sizes) and launch shape."""
    writer = _RowWriter(spec, layout)
    params = writer.params()
    body = writer.body()
    template = f"{kernel_head(layout.threads, params)}{body}}}\n"
    shape_stem = f"c{spec.cols}" if spec.cols is not None else "cN"
    name, code = finish(f"{spec.stem}_{shape_stem}_{layout.kind}{layout.threads}", template)
    return KernelSource(name, spec.family, code, tuple(params), _launch_shape(spec, layout),
                        PACKED_ALIGNMENT if layout.vec > 1 else 4, writer.in_place)


def partial_rows(rows: int, threads: int) -> int:
    """The partial rows a column-summing kernel of `threads` a block writes for `rows` rows (one per warp)."""
    warps = threads // WARP
    blocks = max(-(-rows // (ROWS_PER_WARP * warps)), min(MIN_PARTIAL_BLOCKS, -(-rows // warps)))
    return warps * min(blocks, MAX_PARTIAL_BLOCKS)


def _launch_shape(spec: RowSpec, layout: RowLayout):
    warps = layout.threads // WARP
    block = (layout.threads, 1, 1)

    def shape(sizes: Mapping[str, int]) -> LaunchShape:
        rows = sizes["rows"]
        if layout.kind == "block":
            return LaunchShape((rows, 1, 1), block)
        if spec.column_sums:
            return LaunchShape((partial_rows(rows, layout.threads) // warps, 1, 1), block)
        return LaunchShape((-(-rows // warps), 1, 1), block)

    return shape


class _RowWriter:
    def __init__(self, spec: RowSpec, layout: RowLayout) -> None:
        self.spec = spec
        self.layout = layout
        self.lines: list[str] = []
        self.depth = 1
        rows_in = [o for o in spec.of_kind("row", "input")]
        rows_out = [o for o in spec.of_kind("row", "output")]
        self.in_place = tuple((o.name, i.name) for o in rows_out for i in rows_in if o.dtype == i.dtype)
        self.aliased = {n for pair in self.in_place for n in pair}

    # --- parameters ---------------------------------------------------------------------------------

    def params(self) -> list[KernelParam]:
        spec = self.spec
        ordered = [o for o in spec.operands if o.role == "input"] + [o for o in spec.operands if o.role == "output"]
        params = [pointer_param(o.name, o.dtype, o.role, restrict=o.name not in self.aliased) for o in ordered]
        params += [pointer_param(name, "f32", "scratch") for name, _ in spec.column_sums]
        params.append(size_param("rows"))
        if spec.cols is None:
            params.append(size_param("cols"))
        return params

    # --- code ---------------------------------------------------------------------------------------

    def emit(self, text: str = "") -> None:
        self.lines.append("    " * self.depth + text if text else "")

    def open(self, text: str) -> None:
        self.emit(text + " {")
        self.depth += 1

    def close(self, text: str = "}") -> None:
        self.depth -= 1
        self.emit(text)

    def body(self) -> str:
        spec, layout = self.spec, self.layout
        qualifier = "constexpr" if spec.cols is not None else "const"
        self.emit(f"{qualifier} int C = {spec.cols if spec.cols is not None else 'cols'};")
        self.emit(f"constexpr int VEC = {layout.vec};")
        self.emit(f"{qualifier} int NV = C / VEC;")
        if layout.unrolled:
            self.emit("constexpr int KV = CEIL_DIV(NV, SX_WARP);")
        for o in spec.of_kind("scalar"):
            self.emit(f"const float {o.name}_s = sx_ld({o.name});")
        if layout.kind == "warp":
            warps = layout.threads // WARP
            self.emit("const int lane = threadIdx.x % SX_WARP;")
            self.emit(f"const int warp_in_grid = blockIdx.x * {warps} + threadIdx.x / SX_WARP;")
            self.open_partials()
            self.open(f"for (int row = warp_in_grid; row < rows; row += gridDim.x * {warps})")
        else:
            self.open("for (int row = blockIdx.x; row < rows; row += gridDim.x)")
        self.row_body()
        self.close()
        if layout.sums_in_registers:
            scopes = self.element_loop_header()
            for name, _ in spec.column_sums:
                self.emit(f"sx_st_vec({name}_part + i * VEC, {name}_a[k]);")
            self.close_element_loop(scopes)
        return "\n".join(self.lines) + "\n"

    def open_partials(self) -> None:
        """Each warp's partial rows of the column sums: registers, or its row of the scratch zeroed first."""
        if not self.spec.column_sums:
            return
        for name, _ in self.spec.column_sums:
            self.emit(f"float* {name}_part = {name} + (size_t)warp_in_grid * C;")
        if self.layout.sums_in_registers:
            for name, _ in self.spec.column_sums:
                self.emit(f"float {name}_a[KV][VEC] = {{}};")
            return
        self.emit("const float zeros[VEC] = {};")
        self.open("for (int i = lane; i < NV; i += SX_WARP)")
        for name, _ in self.spec.column_sums:
            self.emit(f"sx_st_vec({name}_part + i * VEC, zeros);")
        self.close()

    def row_body(self) -> None:
        spec, layout = self.spec, self.layout
        self.emit("const size_t offset = (size_t)row * C;")
        for o in spec.of_kind("row"):
            const = "const " if o.role == "input" else ""
            self.emit(f"{const}{c_type(o.dtype)}* {o.name}_row = {o.name} + offset;")
        for o in spec.of_kind("per_row", "input"):
            if o.dtype in ("i32", "i64"):
                self.emit(f"const long long {o.name}_r = {o.name}[row];")
            else:
                self.emit(f"const float {o.name}_r = sx_ld({o.name} + row);")
        for ctype, name, text in spec.setup:
            self.emit(f"const {ctype} {name} = {self.row_level(text)};")
        if layout.cached:
            for name in layout.cached:
                self.emit(f"float {name}_c[KV][VEC];")
            scopes = self.element_loop_header()
            for name in layout.cached:
                self.emit(f"sx_ld_vec({name}_c[k], {name}_row + i * VEC);")
            self.close_element_loop(scopes)
        for phase in spec.phases:
            self.phase(phase)
        if spec.outputs or spec.column_sums:
            self.element_pass([], spec.outputs, spec.column_sums)
        if spec.row_outputs:
            self.open("if (lane == 0)" if layout.kind == "warp" else "if (threadIdx.x == 0)")
            for name, text in spec.row_outputs:
                self.emit(f"sx_st({name} + row, {self.row_level(text)});")
            self.close()

    def row_level(self, text: str) -> str:
        names = {o.name: f"{o.name}_r" for o in self.spec.of_kind("per_row", "input")}
        names |= {o.name: f"{o.name}_s" for o in self.spec.of_kind("scalar")}
        return _rename(text, names)

    def phase(self, phase: Phase) -> None:
        block = self.layout.kind == "block"
        for r in phase.reductions:
            if isinstance(r, SoftmaxStats):
                self.emit(f"float {r.max_var} = -SX_INF, {r.sum_var} = 0.0f;")
            else:
                self.emit(f"float {r.var} = {'0.0f' if r.op == 'sum' else '-SX_INF'};")
        self.element_pass(phase.reductions, (), ())
        for r in phase.reductions:
            if isinstance(r, SoftmaxStats):
                self.emit(f"sx_{'block' if block else 'warp'}_softmax({r.max_var}, {r.sum_var});")
            else:
                self.emit(f"{r.var} = sx_{'block' if block else 'warp'}_{r.op}({r.var});")
        for name, text in phase.then:
            self.emit(f"const float {name} = {self.row_level(text)};")

    # --- one pass over the row ----------------------------------------------------------------------

    def element_loop_header(self, uses_index: bool = True) -> int:
        """Open a loop over this thread's element groups `i` (VEC elements each); the scopes it opened.

        An unrolled loop (over register arrays, by `k`) names `i` only when its body uses it.
        """
        layout = self.layout
        if not layout.unrolled:
            start, stride = ("lane", "SX_WARP") if layout.kind == "warp" else ("threadIdx.x", str(layout.threads))
            # Four groups in flight a thread: left to itself, the compiler unrolls a loop of known trip
            # count until it spills (sm_90, a block per vocabulary row).
            self.emit(f"#pragma unroll {STRIDED_UNROLL}")
            self.open(f"for (int i = {start}; i < NV; i += {stride})")
            return 1
        self.emit("#pragma unroll")
        self.open("for (int k = 0; k < KV; ++k)")
        if uses_index:
            self.emit("const int i = lane + SX_WARP * k;")
        if (self.spec.cols // layout.vec) % WARP == 0:
            return 1
        self.open("if (i < NV)" if uses_index else "if (lane + SX_WARP * k < NV)")
        return 2

    def close_element_loop(self, scopes: int) -> None:
        for _ in range(scopes):
            self.close()

    def element_pass(self, reductions, outputs, sums) -> None:
        spec, layout = self.spec, self.layout
        exprs = [r.expr for r in reductions] + [e for _, e in outputs] + [e for _, e in sums]
        used, defs = _closure(spec, exprs)
        loaded = [o for o in spec.operands if o.name in used and o.role == "input"
                  and (o.kind == "column" or (o.kind == "row" and o.name not in layout.cached))]
        scopes = self.element_loop_header(
            bool(loaded or outputs or "col" in used or (sums and not layout.sums_in_registers)))
        names: dict[str, str] = {"col": "(i * VEC + j)"}
        for o in spec.operands:
            if o.kind == "row" and o.role == "input" and o.name in used:
                if o.name in layout.cached:
                    names[o.name] = f"{o.name}_c[k][j]"
                else:
                    self.emit(f"float {o.name}_v[VEC];")
                    self.emit(f"sx_ld_vec({o.name}_v, {o.name}_row + i * VEC);")
                    names[o.name] = f"{o.name}_v[j]"
            elif o.kind == "column" and o.name in used:
                self.emit(f"float {o.name}_v[VEC];")
                self.emit(f"sx_ld_vec({o.name}_v, {o.name} + i * VEC);")
                names[o.name] = f"{o.name}_v[j]"
            elif o.kind == "per_row" and o.role == "input":
                names[o.name] = f"{o.name}_r"
            elif o.kind == "scalar":
                names[o.name] = f"{o.name}_s"
        for name, _ in outputs:
            self.emit(f"float {name}_v[VEC];")
        for name, _ in sums:
            if layout.sums_in_registers:
                names[f"@{name}"] = f"{name}_a[k][j]"
            else:
                self.emit(f"float {name}_v[VEC];")
                self.emit(f"sx_ld_vec({name}_v, {name}_part + i * VEC);")
                names[f"@{name}"] = f"{name}_v[j]"
        self.emit("#pragma unroll")
        self.open("for (int j = 0; j < VEC; ++j)")
        for name, text in defs:
            self.emit(f"const float {name} = {_rename(text, names)};")
        for r in reductions:
            value = _rename(r.expr, names)
            if isinstance(r, SoftmaxStats):
                self.emit(f"sx_softmax_add({r.max_var}, {r.sum_var}, {value});")
            elif r.op == "sum":
                self.emit(f"{r.var} += {value};")
            else:
                self.emit(f"{r.var} = fmaxf({r.var}, {value});")
        for name, text in outputs:
            self.emit(f"{name}_v[j] = {_rename(text, names)};")
        for name, text in sums:
            self.emit(f"{names['@' + name]} += {_rename(text, names)};")
        self.close()
        for name, _ in outputs:
            self.emit(f"sx_st_vec({name}_row + i * VEC, {name}_v);")
        if not layout.sums_in_registers:
            for name, _ in sums:
                self.emit(f"sx_st_vec({name}_part + i * VEC, {name}_v);")
        self.close_element_loop(scopes)
