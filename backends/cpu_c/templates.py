"""C for the template kernels (`row`, `cross_entropy`, `scatter_add`, `fill`): what each family computes, per row.

A pattern kernel's symbol names its family, row length, options and operands (`match-patterns`, see
`dialects/kern.py`); a family the lowering splits into steps (a norm's backward and its column sums, the
cross-entropy losses and their sum) is one symbol a step, told apart by `step`. Each row is one iteration of
an OpenMP loop (static schedule) whose reductions run over the row in f32 in 16 lanes combined in a fixed
tree (`kernels.lane_loops`: vectorized, in an order set by the row length), so a result does not depend on
the thread count. The column sums of a norm's backward (its weight and bias gradients) go, as on
the GPU, through the partial rows the lowering planned: partial row p sums a fixed chunk of rows, and the
column-sum step adds the partial rows in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...dialects.core import Operation
from .kernels import (
    FLOAT_IDENTITY,
    STORAGE,
    UnsupportedKernel,
    Writer,
    combined,
    float_literal,
    lane_loops,
    literal,
    load,
    parallel_for,
    store,
)


class _Operands:
    """A template kernel's operands by name: typed local pointers, loads and stores through their dtypes."""

    def __init__(self, kernel: Operation) -> None:
        attrs = kernel.attributes
        self.inputs = list(attrs["inputs"])
        self.outputs = list(attrs["outputs"])
        names = list(attrs.get("operands") or [])
        self.names = names
        self.dtype: dict[str, str] = {}
        self.lines: list[str] = []
        for k, t in enumerate(self.inputs):
            if k < len(names):
                self._alias(names[k], f"in{k}", t.dtype, const=True)
        for k, t in enumerate(self.outputs):
            if len(self.inputs) + k < len(names):
                self._alias(names[len(self.inputs) + k], f"out{k}", t.dtype, const=False)

    def _alias(self, name: str, parameter: str, dtype: str, const: bool) -> None:
        self.dtype[name] = dtype
        self.lines.append(f"    {'const ' if const else ''}{STORAGE[dtype]}* {name} = {parameter};")

    def has(self, name: str) -> bool:
        return name in self.dtype

    def ld(self, name: str, index: str) -> str:
        return load(self.dtype[name], name, index)

    def st(self, name: str, index: str, value: str) -> str:
        return store(self.dtype[name], name, index, value)

    def head(self) -> str:
        return "\n".join(self.lines) + "\n"


def _rows_loop(rows: int, cols: int, body: str) -> str:
    """A parallel loop over rows, `body` (C using `row` and `base = row * C`) once a row."""
    return (f"    {parallel_for(rows, rows * cols)}\n"
            f"    for (long long row = 0; row < {rows}LL; ++row) {{\n"
            f"        const long long base = row * {cols}LL;\n"
            f"{body}"
            "    }\n")


def _row_reduction(cols: int, reductions: Sequence[tuple[str, str, str]], setup: Sequence[str] = (),
                   depth: int = 2) -> str:
    """`const float var` for each (var, "sum" or "max", value): the value's sum or maximum over the row's
    columns (`c`, the element `base + c`), in lanes (`kernels.lane_loops`), after the C lines `setup` of
    each column."""
    w = Writer(depth)
    lanes = [(f"{var}_lanes", "float", FLOAT_IDENTITY[which], which, False) for var, which, _ in reductions]

    def element(w: Writer) -> None:
        for line in setup:
            w.line(line)
        for var, which, value in reductions:
            w.line(f"{var}_lanes[l] = {combined(which, False, f'{var}_lanes[l]', value)};")

    lane_loops(w, "c", cols, lanes, element)
    for var, _, _ in reductions:
        w.line(f"const float {var} = {var}_lanes[0];")
    return w.text()


def _sum(o: _Operands, var: str, expr: Callable[[str], str], cols: int) -> str:
    """`float var` = the sum over the row of `expr(element index)`."""
    return _row_reduction(cols, [(var, "sum", expr("base + c"))])


def _softmax_stats(o: _Operands, x: str, cols: int) -> str:
    """`m` the row maximum of `x`, `s` the sum of exp(x - m)."""
    return (_row_reduction(cols, [("m", "max", o.ld(x, "base + c"))])
            + _row_reduction(cols, [("s", "sum", f"sx_expf({o.ld(x, 'base + c')} - m)")]))


def _each(o: _Operands, cols: int, statements: str, indent: str = "        ") -> str:
    """`statements` for each column c of a row, vectorized: the elements are independent, and a row
    program's outputs never overlap its inputs (`plan-buffers`), which the compiler cannot prove."""
    return f"{indent}#pragma omp simd\n{indent}for (long long c = 0; c < {cols}LL; ++c) {{\n{statements}{indent}}}\n"


# -- row families ---------------------------------------------------------------------------------------

def _softmax(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    body = _softmax_stats(o, "x", cols) + "        const float inverse = 1.0f / s;\n"
    body += _each(o, cols, "            " + o.st("y", "base + c", f"sx_expf({o.ld('x', 'base + c')} - m) * inverse") + "\n")
    return _rows_loop(rows, cols, body)


def _log_softmax(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    body = _softmax_stats(o, "x", cols) + "        const float log_s = logf(s);\n"
    body += _each(o, cols, "            " + o.st("y", "base + c", f"({o.ld('x', 'base + c')} - m) - log_s") + "\n")
    return _rows_loop(rows, cols, body)


def _layernorm(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    eps = float_literal(attrs.get("eps", 1e-5))
    body = _sum(o, "sum_x", lambda i: o.ld("x", i), cols)
    body += f"        const float mu = sum_x / {cols};\n"
    body += _sum(o, "sum_d2", lambda i: f"({o.ld('x', i)} - mu) * ({o.ld('x', i)} - mu)", cols)
    body += f"        const float rs = 1.0f / sqrtf(sum_d2 / {cols} + {eps});\n"
    value = f"({o.ld('x', 'base + c')} - mu) * rs"
    value += f" * {o.ld('weight', 'c')}" if o.has("weight") else ""
    value += f" + {o.ld('bias', 'c')}" if o.has("bias") else ""
    body += _each(o, cols, "            " + o.st("y", "base + c", value) + "\n")
    if o.has("mean"):
        body += "        " + o.st("mean", "row", "mu") + "\n"
    if o.has("rstd"):
        body += "        " + o.st("rstd", "row", "rs") + "\n"
    return _rows_loop(rows, cols, body)


def _rmsnorm(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    eps = float_literal(attrs.get("eps", 1e-5))
    body = _sum(o, "sum_x2", lambda i: f"{o.ld('x', i)} * {o.ld('x', i)}", cols)
    body += f"        const float rs = 1.0f / sqrtf(sum_x2 / {cols} + {eps});\n"
    value = f"{o.ld('x', 'base + c')} * rs" + (f" * {o.ld('weight', 'c')}" if o.has("weight") else "")
    body += _each(o, cols, "            " + o.st("y", "base + c", value) + "\n")
    if o.has("rstd"):
        body += "        " + o.st("rstd", "row", "rs") + "\n"
    return _rows_loop(rows, cols, body)


def _softmax_backward(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    body = _sum(o, "dot", lambda i: f"{o.ld('dy', i)} * {o.ld('y', i)}", cols)
    value = f"{o.ld('y', 'base + c')} * ({o.ld('dy', 'base + c')} - dot)"
    body += _each(o, cols, "            " + o.st("dx", "base + c", value) + "\n")
    return _rows_loop(rows, cols, body)


def _log_softmax_backward(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    body = _sum(o, "total", lambda i: o.ld("dy", i), cols)
    value = f"{o.ld('dy', 'base + c')} - sx_expf({o.ld('y', 'base + c')}) * total"
    body += _each(o, cols, "            " + o.st("dx", "base + c", value) + "\n")
    return _rows_loop(rows, cols, body)


def _norm_backward(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    """A layernorm's or rmsnorm's dx per row, and its column sums into the planned partial rows."""
    layer = attrs["family"] == "layernorm_backward"
    sums = [name for name in ("dweight_partials", "dbias_partials") if o.has(name)]
    partials = o.outputs[1].numel // cols if sums else 1
    chunk = -(-rows // partials)
    w = "* " + o.ld("weight", "c") if o.has("weight") else ""
    xhat = f"({o.ld('x', 'base + c')} - mean_r) * rstd_r" if layer else f"{o.ld('x', 'base + c')} * rstd_r"
    lines = [f"    {parallel_for(partials, rows * cols)}",
             f"    for (long long p = 0; p < {partials}LL; ++p) {{"]
    lines.append(f"        const long long end = (p + 1) * {chunk}LL < {rows}LL ? (p + 1) * {chunk}LL : {rows}LL;")
    for name in sums:
        # A partial row starts from its chunk's first row (0 + that row's value: the bits of a zeroed row
        # added to, without zeroing it first); one no row falls in is zero.
        lines.append(f"        float* {name}_row = {name} + p * {cols}LL;")
        lines.append(f"        if (p * {chunk}LL >= end) for (long long c = 0; c < {cols}LL; ++c) {name}_row[c] = 0.0f;")
    lines += [f"        for (long long row = p * {chunk}LL; row < end; ++row) {{",
              f"            const long long base = row * {cols}LL;",
              f"            const int first = row == p * {chunk}LL;",
              f"            const float rstd_r = {o.ld('rstd', 'row')};"]
    if layer:
        lines.append(f"            const float mean_r = {o.ld('mean', 'row')};")
    lines.append(_row_reduction(cols, [("sum_g", "sum", "g"), ("sum_gx", "sum", "g * xhat")],
                                [f"const float xhat = {xhat};", f"const float g = {o.ld('dy', 'base + c')} {w};"],
                                depth=3).rstrip("\n"))
    lines += [f"            const float mean_g = {'sum_g / ' + str(cols) if layer else '0.0f'};",
              f"            const float mean_gx = sum_gx / {cols};",
              "            #pragma omp simd",
              f"            for (long long c = 0; c < {cols}LL; ++c) {{",
              f"                const float dy_c = {o.ld('dy', 'base + c')};",
              f"                const float xhat = {xhat};",
              f"                const float g = dy_c {w};",
              "                " + o.st("dx", "base + c", "(g - mean_g - xhat * mean_gx) * rstd_r")]
    for name, value in (("dweight_partials", "dy_c * xhat"), ("dbias_partials", "dy_c")):
        if name in sums:
            lines.append(f"                {name}_row[c] = (first ? 0.0f : {name}_row[c]) + {value};")
    lines += ["            }", "        }", "    }"]
    return "\n".join(lines) + "\n"


def _column_sum(o: _Operands, rows: int, cols: int, attrs: dict) -> str:
    """out_j[c] = the sum of partials_j's rows' column c, in partial-row order, for each array j (the
    CUDA step sums every array of a norm's backward in one launch: inputs the partials, outputs the sums)."""
    arrays = len(o.inputs)
    code = f"    float* total = (float*)malloc({cols} * sizeof(float));\n"
    for partials_name, out, partials_type in zip(o.names[:arrays], o.names[arrays:], o.inputs):
        code += (f"    for (long long c = 0; c < {cols}LL; ++c) total[c] = 0.0f;\n"
                 f"    for (long long p = 0; p < {partials_type.numel // cols}LL; ++p) {{\n"
                 "        #pragma omp simd\n"
                 f"        for (long long c = 0; c < {cols}LL; ++c) total[c] += "
                 f"{o.ld(partials_name, f'p * {cols}LL + c')};\n"
                 "    }\n"
                 f"    for (long long c = 0; c < {cols}LL; ++c) {o.st(out, 'c', 'total[c]')}\n")
    return code + "    free(total);\n"


ROW_FAMILIES: dict[str, Callable[[_Operands, int, int, dict], str]] = {
    "softmax": _softmax,
    "log_softmax": _log_softmax,
    "layernorm": _layernorm,
    "rmsnorm": _rmsnorm,
    "softmax_backward": _softmax_backward,
    "log_softmax_backward": _log_softmax_backward,
    "layernorm_backward": _norm_backward,
    "rmsnorm_backward": _norm_backward,
}


# -- the cross-entropy tail --------------------------------------------------------------------------------

def _target(o: _Operands, vocab: int) -> str:
    return (f"        long long target = (long long){o.ld('targets', 'row')};\n"
            f"        if (target < 0) target += {vocab}LL;\n")


def _cross_entropy_forward(o: _Operands, rows: int, vocab: int, attrs: dict) -> str:
    body = _target(o, vocab)
    body += (f"        const float picked = target >= 0 && target < {vocab}LL ? "
             f"{o.ld('logits', 'base + target')} : NAN;\n")
    body += _softmax_stats(o, "logits", vocab) + "        const float log_s = logf(s);\n"
    body += "        " + o.st("losses", "row", "(m - picked) + log_s") + "\n"
    body += "        " + o.st("lse", "row", "m + log_s") + "\n"
    return _rows_loop(rows, vocab, body)


def _sum_reduce(o: _Operands, rows: int, vocab: int, attrs: dict) -> str:
    """The losses' sum (or mean) in row order."""
    value = f"total / {rows}" if attrs.get("reduction") == "mean" else "total"
    return ("    float total = 0.0f;\n"
            f"    for (long long row = 0; row < {rows}LL; ++row) total += {o.ld('losses', 'row')};\n"
            f"    {o.st('loss', '0', value)}\n")


def _cross_entropy_backward(o: _Operands, rows: int, vocab: int, attrs: dict) -> str:
    dloss = o.ld("dloss", "row" if attrs.get("grad") == "row" else "0")
    upstream = f"{dloss} * {float_literal(attrs.get('scale', 1.0))}" + (f" / {rows}" if attrs.get("mean") else "")
    body = _target(o, vocab) + f"        const float upstream = {upstream};\n"
    body += f"        const float lse_r = {o.ld('lse', 'row')};\n"
    value = f"(sx_expf({o.ld('logits', 'base + c')} - lse_r) - (c == target ? 1.0f : 0.0f)) * upstream"
    body += _each(o, vocab, "            " + o.st("dlogits", "base + c", value) + "\n")
    return _rows_loop(rows, vocab, body)


# -- data movement -------------------------------------------------------------------------------------------

def _scatter_add(kernel: Operation) -> str:
    """out = zeros, then out[indices[n], :] += src[n, :] for n in order, in f32 (a bf16 `out` through its f32
    scratch, rounded once); a negative index counts from the end, one out of range is skipped. Each
    iteration owns a block of columns. With `accumulate`, out starts as the third input (an f32 gradient
    so far), copied only when `out` is not that array itself."""
    attrs = kernel.attributes
    indices, src = attrs["inputs"][:2]
    out = attrs["outputs"][0]
    positions, cols, out_rows = indices.numel, src.shape[-1], out.shape[0]
    sums = "out0" if out.dtype == "f32" else "out1"
    block = 64
    blocks = -(-cols // block)
    rounding = "" if out.dtype == "f32" else (
        f"        for (long long v = 0; v < {out_rows}LL; ++v)\n"
        f"            for (long long c = c0; c < c1; ++c) {store(out.dtype, 'out0', f'v * {cols}LL + c', f'out1[v * {cols}LL + c]')}\n")
    if attrs.get("accumulate"):
        start = (f"        if ((const float*)out0 != in2)\n"
                 f"            for (long long v = 0; v < {out_rows}LL; ++v)\n"
                 f"                for (long long c = c0; c < c1; ++c) out0[v * {cols}LL + c] = in2[v * {cols}LL + c];\n")
    else:
        start = (f"        for (long long v = 0; v < {out_rows}LL; ++v)\n"
                 f"            for (long long c = c0; c < c1; ++c) {sums}[v * {cols}LL + c] = 0.0f;\n")
    return (f"    {parallel_for(blocks, positions * cols)}\n"
            f"    for (long long cb = 0; cb < {blocks}LL; ++cb) {{\n"
            f"        const long long c0 = cb * {block}LL, c1 = c0 + {block}LL < {cols}LL ? c0 + {block}LL : {cols}LL;\n"
            f"{start}"
            f"        for (long long n = 0; n < {positions}LL; ++n) {{\n"
            f"            long long v = (long long)in0[n];\n"
            f"            if (v < 0) v += {out_rows}LL;\n"
            f"            if (v < 0 || v >= {out_rows}LL) continue;\n"
            f"            for (long long c = c0; c < c1; ++c) {sums}[v * {cols}LL + c] += {load(src.dtype, 'in1', f'n * {cols}LL + c')};\n"
            "        }\n"
            f"{rounding}"
            "    }\n")


def _fill(kernel: Operation) -> str:
    out = kernel.attributes["outputs"][0]
    value = literal(kernel.attributes["value"], out.dtype)
    return (f"    {parallel_for(out.numel, out.numel)}\n"
            f"    for (long long i = 0; i < {out.numel}LL; ++i) {store(out.dtype, 'out0', 'i', value)}\n")


def template_code(kernel: Operation) -> str:
    """The body of a template kernel's C function."""
    attrs = kernel.attributes
    kind = attrs["kind"]
    if kind == "scatter_add":
        return _scatter_add(kernel)
    if kind == "fill":
        return _fill(kernel)
    o = _Operands(kernel)
    rows = int(attrs.get("rows", 0))
    if kind == "row":
        cols = int(attrs["cols"])
        family = ROW_FAMILIES[attrs["family"]] if attrs.get("step", 0) == 0 else _column_sum
        return o.head() + family(o, rows, cols, attrs)
    if kind == "cross_entropy":
        vocab = int(attrs["vocab"])
        if attrs["direction"] == "forward":
            family = _cross_entropy_forward if attrs.get("step", 0) == 0 else _sum_reduce
        else:
            family = _cross_entropy_backward
        return o.head() + family(o, rows, vocab, attrs)
    raise UnsupportedKernel(f"kernel {attrs['sym_name']}: no C for a {kind} kernel")

