"""The kernel families `emit-cuda` instantiates for pattern kernels, as parameterised CUDA templates.

Each family is a function of its specialisation — the dtype of each operand
(`dtype` for the data operands, `dtypes` to set any operand by name), the
row length (`cols`; None makes it a runtime size), the presence of optional
operands, compile-time scalars (eps, scale, a fill value), and optionally the
layout and block size — returning a `KernelProgram`: its operands and sizes
and the kernels it launches. Values are computed in f32 whatever the storage;
per-row statistics (mean, rstd, log-sum-exp, losses) are f32 unless `dtypes`
says otherwise. Every reduction is deterministic: a result depends on the
sizes alone, never on the order threads or blocks run in, and no float is
added atomically. docs/cuda.md, section "Kernel families", describes each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .kernel_source import (
    FLOAT_STORAGE,
    INDEX_DTYPES,
    PACKED_ALIGNMENT,
    KernelProgram,
    KernelSource,
    LaunchShape,
    Step,
    c_type,
    check_dtype,
    finish,
    float_literal,
    itemsize,
    kernel_head,
    pointer_param,
    single,
    size_param,
    vector_width,
)
from .rows import Phase, Reduce, RowOperand, RowSpec, SoftmaxStats, choose_layout, partial_rows, row_kernel

#: Threads a block for the element-wise kernels (fill, copy, gather) and their largest grid (grid-stride loops).
FLAT_THREADS = 256
MAX_FLAT_BLOCKS = 8192
#: sum_reduce runs one block of this many threads, so its result depends on the count alone.
SUM_THREADS = 1024
#: column_sum: 32 column groups by this many slices of the partial rows a block.
COLUMN_SUM_SLICES = 8
#: scatter_add stages this many indices in shared memory at a time, and aims at about this many threads.
SCATTER_TILE = 1024
SCATTER_THREADS_TARGET = 32768

Dtypes = Mapping[str, str] | None


def _operand_dtypes(family: str, roles: Mapping[str, str], dtype: str, dtypes: Dtypes) -> dict[str, str]:
    """Each operand's dtype: `data` operands take `dtype`, `stat` ones f32, `index` ones i32; `dtypes` overrides."""
    check_dtype(f"{family} dtype", dtype, FLOAT_STORAGE)
    chosen = {name: {"data": dtype, "stat": "f32", "index": "i32"}[role] for name, role in roles.items()}
    for name, value in (dtypes or {}).items():
        if name not in roles:
            raise ValueError(f"{family} has no operand {name!r}; its operands are {', '.join(roles)}")
        chosen[name] = value
    for name, value in chosen.items():
        check_dtype(f"{family} operand {name}", value, INDEX_DTYPES if roles[name] == "index" else FLOAT_STORAGE)
    return chosen


#: One letter per operand dtype in kernel names: `layernorm_bbbbff` has bf16 data and f32 statistics.
_DTYPE_LETTERS = {"f32": "f", "bf16": "b", "i32": "i", "i64": "l"}


def _stem(family: str, chosen: Mapping[str, str], *flags: str) -> str:
    return "_".join([family, "".join(_DTYPE_LETTERS[d] for d in chosen.values()), *(f for f in flags if f)])


def _row_program(spec: RowSpec, layout: str | None, threads: int | None) -> KernelProgram:
    return single(row_kernel(spec, choose_layout(spec, layout, threads)))


def _check_cols(family: str, cols: int | None) -> None:
    if cols is not None and cols < 1:
        raise ValueError(f"{family}: a row of {cols} elements")


# --- row programs, forward --------------------------------------------------------------------------------

def softmax(cols: int | None, *, dtype: str = "f32", dtypes: Dtypes = None, layout: str | None = None,
            threads: int | None = None) -> KernelProgram:
    """y = exp(x - max(x)) / sum(exp(x - max(x))) along each row of x [rows, cols]."""
    _check_cols("softmax", cols)
    d = _operand_dtypes("softmax", {"x": "data", "y": "data"}, dtype, dtypes)
    spec = RowSpec(
        "softmax", _stem("softmax", d), (RowOperand("x", d["x"], "row", "input"), RowOperand("y", d["y"], "row", "output")),
        cols, phases=(Phase((SoftmaxStats("m", "s", "x"),), (("inverse", "1.0f / s"),)),),
        outputs=(("y", "expf(x - m) * inverse"),))
    return _row_program(spec, layout, threads)


def log_softmax(cols: int | None, *, dtype: str = "f32", dtypes: Dtypes = None, layout: str | None = None,
                threads: int | None = None) -> KernelProgram:
    """y = (x - max(x)) - log(sum(exp(x - max(x)))) along each row of x [rows, cols]."""
    _check_cols("log_softmax", cols)
    d = _operand_dtypes("log_softmax", {"x": "data", "y": "data"}, dtype, dtypes)
    spec = RowSpec(
        "log_softmax", _stem("log_softmax", d),
        (RowOperand("x", d["x"], "row", "input"), RowOperand("y", d["y"], "row", "output")),
        cols, phases=(Phase((SoftmaxStats("m", "s", "x"),), (("log_s", "logf(s)"),)),),
        outputs=(("y", "(x - m) - log_s"),))
    return _row_program(spec, layout, threads)


def layernorm(cols: int | None, *, eps: float = 1e-5, weight: bool = True, bias: bool = True, stats: bool = True,
              dtype: str = "f32", dtypes: Dtypes = None, layout: str | None = None,
              threads: int | None = None) -> KernelProgram:
    """y = (x - mean) * rstd * weight + bias per row, rstd = 1/sqrt(var + eps) (biased variance, two passes).

    `weight` [cols] and `bias` [cols] are optional; with `stats` the kernel
    also writes each row's `mean` and `rstd` [rows] for the backward.
    """
    _check_cols("layernorm", cols)
    roles = {"x": "data"} | ({"weight": "data"} if weight else {}) | ({"bias": "data"} if bias else {})
    roles |= {"y": "data"} | ({"mean": "stat", "rstd": "stat"} if stats else {})
    d = _operand_dtypes("layernorm", roles, dtype, dtypes)
    operands = [RowOperand("x", d["x"], "row", "input")]
    operands += [RowOperand(n, d[n], "column", "input") for n in ("weight", "bias") if n in d]
    operands += [RowOperand("y", d["y"], "row", "output")]
    operands += [RowOperand(n, d[n], "per_row", "output") for n in ("mean", "rstd") if n in d]
    value = "(x - mu) * rs" + (" * weight" if weight else "") + (" + bias" if bias else "")
    spec = RowSpec(
        "layernorm", _stem("layernorm", d, f"eps{eps:g}"), tuple(operands), cols,
        phases=(Phase((Reduce("sum_x", "sum", "x"),), (("mu", "sum_x / C"),)),
                Phase((Reduce("sum_d2", "sum", "(x - mu) * (x - mu)"),),
                      (("rs", f"rsqrtf(sum_d2 / C + {float_literal(eps)})"),))),
        outputs=(("y", value),),
        row_outputs=(("mean", "mu"), ("rstd", "rs")) if stats else ())
    return _row_program(spec, layout, threads)


def rmsnorm(cols: int | None, *, eps: float = 1e-5, weight: bool = True, stats: bool = True, dtype: str = "f32",
            dtypes: Dtypes = None, layout: str | None = None, threads: int | None = None) -> KernelProgram:
    """y = x * rstd * weight per row, rstd = 1/sqrt(mean(x^2) + eps); with `stats` also rstd [rows]."""
    _check_cols("rmsnorm", cols)
    roles = {"x": "data"} | ({"weight": "data"} if weight else {}) | {"y": "data"} | ({"rstd": "stat"} if stats else {})
    d = _operand_dtypes("rmsnorm", roles, dtype, dtypes)
    operands = [RowOperand("x", d["x"], "row", "input")]
    operands += [RowOperand("weight", d["weight"], "column", "input")] if weight else []
    operands += [RowOperand("y", d["y"], "row", "output")]
    operands += [RowOperand("rstd", d["rstd"], "per_row", "output")] if stats else []
    spec = RowSpec(
        "rmsnorm", _stem("rmsnorm", d, f"eps{eps:g}"), tuple(operands), cols,
        phases=(Phase((Reduce("sum_x2", "sum", "x * x"),), (("rs", f"rsqrtf(sum_x2 / C + {float_literal(eps)})"),)),),
        outputs=(("y", "x * rs" + (" * weight" if weight else "")),),
        row_outputs=(("rstd", "rs"),) if stats else ())
    return _row_program(spec, layout, threads)


# --- row programs, backward -------------------------------------------------------------------------------

def softmax_backward(cols: int | None, *, dtype: str = "f32", dtypes: Dtypes = None, layout: str | None = None,
                     threads: int | None = None) -> KernelProgram:
    """dx = y * (dy - sum(dy * y)) per row, from the softmax output y and its gradient dy."""
    _check_cols("softmax_backward", cols)
    d = _operand_dtypes("softmax_backward", {"y": "data", "dy": "data", "dx": "data"}, dtype, dtypes)
    spec = RowSpec(
        "softmax_backward", _stem("softmax_backward", d),
        (RowOperand("y", d["y"], "row", "input"), RowOperand("dy", d["dy"], "row", "input"),
         RowOperand("dx", d["dx"], "row", "output")),
        cols, phases=(Phase((Reduce("dot", "sum", "dy * y"),)),), outputs=(("dx", "y * (dy - dot)"),))
    return _row_program(spec, layout, threads)


def log_softmax_backward(cols: int | None, *, dtype: str = "f32", dtypes: Dtypes = None, layout: str | None = None,
                         threads: int | None = None) -> KernelProgram:
    """dx = dy - exp(y) * sum(dy) per row, from the log-softmax output y and its gradient dy."""
    _check_cols("log_softmax_backward", cols)
    d = _operand_dtypes("log_softmax_backward", {"y": "data", "dy": "data", "dx": "data"}, dtype, dtypes)
    spec = RowSpec(
        "log_softmax_backward", _stem("log_softmax_backward", d),
        (RowOperand("y", d["y"], "row", "input"), RowOperand("dy", d["dy"], "row", "input"),
         RowOperand("dx", d["dx"], "row", "output")),
        cols, phases=(Phase((Reduce("total", "sum", "dy"),)),), outputs=(("dx", "dy - expf(y) * total"),))
    return _row_program(spec, layout, threads)


def layernorm_backward(cols: int | None, *, weight: bool = True, bias: bool = True, dtype: str = "f32",
                       dtypes: Dtypes = None, threads: int | None = None) -> KernelProgram:
    """The layernorm's gradients from dy, x, weight and the forward's mean and rstd [rows].

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with xhat = (x - mean) * rstd and
    g = dy * weight; dweight = sum over rows of dy * xhat and dbias = sum of dy, each
    made in two deterministic steps (partial rows per warp, then `column_sum`).
    """
    roles = {"dy": "data", "x": "data"} | ({"weight": "data"} if weight else {}) | {"mean": "stat", "rstd": "stat"}
    roles |= {"dx": "data"} | ({"dweight": "data"} if weight else {}) | ({"dbias": "data"} if bias else {})
    d = _operand_dtypes("layernorm_backward", roles, dtype, dtypes)
    g = "dy * weight" if weight else "dy"
    spec = RowSpec(
        "layernorm_backward", _stem("layernorm_backward", d), _backward_operands(d, ("mean", "rstd")), cols,
        element=(("xhat", "(x - mean) * rstd"), ("g", g)),
        phases=(Phase((Reduce("sum_g", "sum", "g"), Reduce("sum_gx", "sum", "g * xhat")),
                      (("mean_g", "sum_g / C"), ("mean_gx", "sum_gx / C"))),),
        outputs=(("dx", "(g - mean_g - xhat * mean_gx) * rstd"),),
        column_sums=(() if not weight else (("dweight_partials", "dy * xhat"),))
        + (() if not bias else (("dbias_partials", "dy"),)))
    return _column_summing(spec, d, threads)


def rmsnorm_backward(cols: int | None, *, weight: bool = True, dtype: str = "f32", dtypes: Dtypes = None,
                     threads: int | None = None) -> KernelProgram:
    """The rmsnorm's gradients from dy, x, weight and the forward's rstd [rows].

    dx = rstd * (g - xhat * mean(g * xhat)) with xhat = x * rstd and g = dy * weight;
    dweight = sum over rows of dy * xhat, in two deterministic steps.
    """
    roles = {"dy": "data", "x": "data"} | ({"weight": "data"} if weight else {}) | {"rstd": "stat", "dx": "data"}
    roles |= {"dweight": "data"} if weight else {}
    d = _operand_dtypes("rmsnorm_backward", roles, dtype, dtypes)
    spec = RowSpec(
        "rmsnorm_backward", _stem("rmsnorm_backward", d), _backward_operands(d, ("rstd",)), cols,
        element=(("xhat", "x * rstd"), ("g", "dy * weight" if weight else "dy")),
        phases=(Phase((Reduce("sum_gx", "sum", "g * xhat"),), (("mean_gx", "sum_gx / C"),)),),
        outputs=(("dx", "(g - xhat * mean_gx) * rstd"),),
        column_sums=(("dweight_partials", "dy * xhat"),) if weight else ())
    return _column_summing(spec, d, threads)


def _backward_operands(d: Mapping[str, str], stats: Sequence[str]) -> tuple[RowOperand, ...]:
    operands = [RowOperand("dy", d["dy"], "row", "input"), RowOperand("x", d["x"], "row", "input")]
    operands += [RowOperand("weight", d["weight"], "column", "input")] if "weight" in d else []
    operands += [RowOperand(n, d[n], "per_row", "input") for n in stats]
    operands += [RowOperand("dx", d["dx"], "row", "output")]
    return tuple(operands)


def _column_summing(spec: RowSpec, d: Mapping[str, str], threads: int | None) -> KernelProgram:
    """The row kernel of `spec`, then one `column_sum` of each partial-row scratch into its output."""
    _check_cols(spec.family, spec.cols)
    layout = choose_layout(spec, "warp", threads)
    kernel = row_kernel(spec, layout)
    outputs = [(partials, partials.removesuffix("_partials")) for partials, _ in spec.column_sums]
    runtime_cols = ("cols",) if spec.cols is None else ()
    steps = [Step(kernel, tuple(p.name for p in kernel.params))]
    if outputs:
        # Every sum's partial rows in one more launch (llm.c's layernorm backward adds its two in one kernel).
        reduce = column_sum(spec.cols, dtypes=[d[output] for _, output in outputs])
        steps.append(Step(reduce.kernels[0], (*[p for p, _ in outputs], *[o for _, o in outputs], "partials",
                                              *runtime_cols)))
    inputs = [p for p in kernel.params if p.role == "input"]
    scratch = [p for p in kernel.params if p.role == "scratch"]
    sizes = [p for p in kernel.params if p.role == "scalar"]
    params = (*inputs, *[p for p in kernel.params if p.role == "output"],
              *[pointer_param(output, d[output], "output") for _, output in outputs], *scratch, *sizes)

    def derived(given: Mapping[str, int]) -> dict[str, int]:
        return {"partials": partial_rows(given["rows"], layout.threads)}

    def scratch_bytes(all_sizes: Mapping[str, int]) -> dict[str, int]:
        cols = spec.cols if spec.cols is not None else all_sizes["cols"]
        return {p.name: all_sizes["partials"] * cols * 4 for p in scratch}

    return KernelProgram(spec.family, params, tuple(steps), derived, scratch_bytes)


# --- the cross-entropy tail ------------------------------------------------------------------------------

def cross_entropy_forward(vocab: int | None, *, reduction: str | None = None, dtype: str = "f32",
                          dtypes: Dtypes = None, layout: str | None = None,
                          threads: int | None = None) -> KernelProgram:
    """Per row of logits [rows, vocab] and targets [rows]: lse = log(sum(exp(logits))) and
    losses = lse - logits[target], in one pass over the row (a running max and sum), never
    forming probabilities. A negative target counts from the end; one out of range gives NaN.

    With `reduction` "sum" or "mean" a second kernel (`sum_reduce`) adds the losses in a fixed
    order into `loss` [1].
    """
    _check_cols("cross_entropy_forward", vocab)
    if reduction not in (None, "sum", "mean"):
        raise ValueError(f"cross_entropy_forward: reduction {reduction!r} is not sum or mean")
    roles = {"logits": "data", "targets": "index", "losses": "stat", "lse": "stat"}
    d = _operand_dtypes("cross_entropy_forward", roles | ({"loss": "stat"} if reduction else {}), dtype, dtypes)
    spec = RowSpec(
        "cross_entropy_forward", _stem("cross_entropy_forward", {n: d[n] for n in roles}),
        (RowOperand("logits", d["logits"], "row", "input"), RowOperand("targets", d["targets"], "per_row", "input"),
         RowOperand("losses", d["losses"], "per_row", "output"), RowOperand("lse", d["lse"], "per_row", "output")),
        vocab,
        setup=(("long long", "target", "targets < 0 ? targets + C : targets"),
               ("float", "picked", "target >= 0 && target < C ? sx_ld(logits_row + target) : SX_NAN")),
        phases=(Phase((SoftmaxStats("m", "s", "logits"),), (("log_s", "logf(s)"),)),),
        row_outputs=(("losses", "(m - picked) + log_s"), ("lse", "m + log_s")))
    rows = _row_program(spec, layout, threads)
    if reduction is None:
        return rows
    total = sum_reduce(mean=reduction == "mean", dtypes={"x": d["losses"], "out": d["loss"]}).kernels[0]
    kernel = rows.steps[0].kernel
    params = (*[p for p in kernel.params if p.role != "scalar"], pointer_param("loss", d["loss"], "output"),
              *[p for p in kernel.params if p.role == "scalar"])
    return KernelProgram("cross_entropy_forward", params, (rows.steps[0], Step(total, ("losses", "loss", "rows"))))


def cross_entropy_backward(vocab: int | None, *, grad: str = "scalar", scale: float = 1.0, mean: bool = False,
                           dtype: str = "f32", dtypes: Dtypes = None, layout: str | None = None,
                           threads: int | None = None) -> KernelProgram:
    """dlogits = (exp(logits - lse) - onehot(target)) * dloss * scale, in one pass over each row.

    `dloss` is the upstream gradient of the losses: one value (`grad="scalar"`)
    or one per row (`grad="row"`); `mean` divides it by the rows (the gradient
    of the losses' mean).
    """
    _check_cols("cross_entropy_backward", vocab)
    if grad not in ("scalar", "row"):
        raise ValueError(f"cross_entropy_backward: grad {grad!r} is not scalar or row")
    roles = {"logits": "data", "targets": "index", "lse": "stat", "dloss": "stat", "dlogits": "data"}
    d = _operand_dtypes("cross_entropy_backward", roles, dtype, dtypes)
    spec = RowSpec(
        "cross_entropy_backward", _stem("cross_entropy_backward", d, grad, f"scale{scale:g}", "mean" if mean else ""),
        (RowOperand("logits", d["logits"], "row", "input"), RowOperand("targets", d["targets"], "per_row", "input"),
         RowOperand("lse", d["lse"], "per_row", "input"),
         RowOperand("dloss", d["dloss"], "scalar" if grad == "scalar" else "per_row", "input"),
         RowOperand("dlogits", d["dlogits"], "row", "output")),
        vocab,
        setup=(("long long", "target", "targets < 0 ? targets + C : targets"),
               ("float", "upstream", f"dloss * {float_literal(scale)}" + (" / rows" if mean else ""))),
        outputs=(("dlogits", "(expf(logits - lse) - (col == target ? 1.0f : 0.0f)) * upstream"),))
    return _row_program(spec, layout, threads)


# --- deterministic reductions -----------------------------------------------------------------------------

def sum_reduce(*, scale: float = 1.0, mean: bool = False, dtype: str = "f32", dtypes: Dtypes = None) -> KernelProgram:
    """out[0] = scale * sum(x[0:count]), divided by count with `mean` (a loss's sum or mean over rows),
    by one block in a fixed order."""
    d = _operand_dtypes("sum_reduce", {"x": "data", "out": "stat"}, dtype, dtypes)
    params = (pointer_param("x", d["x"], "input"), pointer_param("out", d["out"], "output"), size_param("count"))
    value = "total / count" if mean else "total"
    template = (
        kernel_head(SUM_THREADS, params) +
        "    float total = 0.0f;\n"
        f"    for (int i = threadIdx.x; i < count; i += {SUM_THREADS}) total += sx_ld(x + i);\n"
        "    total = sx_block_sum(total);\n"
        f"    if (threadIdx.x == 0) sx_st(out, {value} * {float_literal(scale)});\n"
        "}\n")
    name, code = finish(_stem("sum_reduce", d, f"scale{scale:g}", "mean" if mean else ""), template)
    shape = LaunchShape((1, 1, 1), (SUM_THREADS, 1, 1))
    return single(KernelSource(name, "sum_reduce", code, params, lambda sizes: shape))


def column_sum(cols: int | None, *, dtype: str = "f32", dtypes: Sequence[str] | None = None) -> KernelProgram:
    """out[c] = sum over p of partials[p, c] (f32 partial rows [partials, cols]) in the order of p.

    A block takes 32 groups of columns; its 8 slices of threads each add every
    8th partial row in order, and the first slice adds the 8 slice sums in order.
    With `dtypes` (one output dtype per array) it sums several arrays of partial
    rows in one launch, `partials_j` into `out_j`, the grid's y the array: a
    norm's backward adds its dweight and dbias partials in one launch.
    """
    _check_cols("column_sum", cols)
    arrays = list(dtypes) if dtypes is not None else [dtype]
    for out_dtype in arrays:
        check_dtype("column_sum out", out_dtype, FLOAT_STORAGE)
    vec = vector_width(cols, ["f32", *arrays])
    names = [("partials", "out")] if dtypes is None else [(f"partials_{j}", f"out_{j}") for j in range(len(arrays))]
    params = [pointer_param(partials, "f32", "input") for partials, _ in names]
    params += [pointer_param(out, out_dtype, "output") for (_, out), out_dtype in zip(names, arrays)]
    params.append(size_param("count"))
    if cols is None:
        params.append(size_param("cols"))
    slices = COLUMN_SUM_SLICES
    qualifier = "constexpr" if cols is not None else "const"
    selects = "".join(f"    {'if' if j == 0 else 'else if'} (blockIdx.y == {j}) "
                      f"{{NAME}}_array{j}(partials_{j}, out_{j}, count, C, slice_sums);\n" for j in range(len(arrays)))
    body = (
        "    const int i = blockIdx.x * 32 + threadIdx.x;\n"
        "    float total[VEC] = {};\n"
        "    if (i < NV) {\n"
        f"        for (int p = threadIdx.y; p < count; p += {slices}) {{\n"
        "            float v[VEC];\n"
        "            sx_ld_vec(v, partials + (size_t)p * C + i * VEC);\n"
        "            #pragma unroll\n"
        "            for (int j = 0; j < VEC; ++j) total[j] += v[j];\n"
        "        }\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < VEC; ++j) slice_sums[threadIdx.y][threadIdx.x][j] = total[j];\n"
        "    __syncthreads();\n"
        "    if (threadIdx.y == 0 && i < NV) {\n"
        f"        for (int s = 1; s < {slices}; ++s) {{\n"
        "            #pragma unroll\n"
        "            for (int j = 0; j < VEC; ++j) total[j] += slice_sums[s][threadIdx.x][j];\n"
        "        }\n"
        "        sx_st_vec(out + i * VEC, total);\n"
        "    }\n")
    head = kernel_head(32 * slices, params)
    columns = f"    {qualifier} int C = {cols if cols is not None else 'cols'};\n    constexpr int VEC = {vec};\n"
    shared = f"    __shared__ float slice_sums[{slices}][32][VEC];\n"
    if dtypes is None:
        template = head + columns + f"    {qualifier} int NV = C / VEC;\n" + shared + body + "}\n"
    else:
        # One device function per array (its output dtype), the block's y choosing which it sums.
        functions = "".join(
            f"static __device__ __forceinline__ void {{NAME}}_array{j}(const float* __restrict__ partials, "
            f"{c_type(out_dtype)}* __restrict__ out, int count, int C, float (*slice_sums)[32][{vec}]) {{\n"
            f"    constexpr int VEC = {vec};\n    const int NV = C / VEC;\n" + body + "}\n"
            for j, out_dtype in enumerate(arrays))
        template = functions + head + columns + shared + selects + "}\n"
    stem = "_".join(arrays) if dtypes is not None else dtype
    name, code = finish(f"column_sum_{stem}_c{cols if cols is not None else 'N'}", template)

    def shape(sizes: Mapping[str, int]) -> LaunchShape:
        groups = (cols if cols is not None else sizes["cols"]) // vec
        return LaunchShape((-(-groups // 32), len(arrays), 1), (32, slices, 1))

    kernel = KernelSource(name, "column_sum", code, tuple(params), shape, PACKED_ALIGNMENT if vec > 1 else 4)
    return single(kernel)


# --- indexing and data movement ---------------------------------------------------------------------------

def _flat_grid(groups: int) -> LaunchShape:
    return LaunchShape((max(1, min(-(-groups // FLAT_THREADS), MAX_FLAT_BLOCKS)), 1, 1), (FLAT_THREADS, 1, 1))


def gather(cols: int, *, dtype: str = "f32", dtypes: Dtypes = None) -> KernelProgram:
    """out[n, :] = table[indices[n], :] for table [table_rows, cols] and indices [positions] (an embedding).

    A negative index counts from the end; an index out of range gives a row of NaN.
    """
    _check_cols("gather", cols)
    d = _operand_dtypes("gather", {"table": "data", "indices": "index", "out": "data"}, dtype, dtypes)
    vec = vector_width(cols, [d["table"], d["out"]])
    params = (pointer_param("table", d["table"], "input"), pointer_param("indices", d["indices"], "input"),
              pointer_param("out", d["out"], "output"), size_param("positions"), size_param("table_rows"))
    template = (
        kernel_head(FLAT_THREADS, params) +
        f"    constexpr int C = {cols};\n"
        f"    constexpr int VEC = {vec};\n"
        "    constexpr int NV = C / VEC;\n"
        "    const long long groups = (long long)positions * NV;\n"
        f"    for (long long g = (long long)blockIdx.x * {FLAT_THREADS} + threadIdx.x; g < groups;\n"
        f"         g += (long long)gridDim.x * {FLAT_THREADS}) {{\n"
        "        const long long n = g / NV;\n"
        "        const int i = (int)(g % NV);\n"
        "        long long row = indices[n];\n"
        "        if (row < 0) row += table_rows;\n"
        "        float v[VEC];\n"
        "        if (row >= 0 && row < table_rows) {\n"
        "            sx_ld_vec(v, table + row * C + i * VEC);\n"
        "        } else {\n"
        "            #pragma unroll\n"
        "            for (int j = 0; j < VEC; ++j) v[j] = SX_NAN;\n"
        "        }\n"
        "        sx_st_vec(out + n * C + i * VEC, v);\n"
        "    }\n"
        "}\n")
    name, code = finish(_stem("gather", d, f"c{cols}"), template)
    kernel = KernelSource(name, "gather", code, params, lambda sizes: _flat_grid(sizes["positions"] * (cols // vec)),
                          PACKED_ALIGNMENT if vec > 1 else 4)
    return single(kernel)


def scatter_add(cols: int, *, dtype: str = "f32", dtypes: Dtypes = None, accumulate: bool = False) -> KernelProgram:
    """out = zeros [out_rows, cols], then out[indices[n], :] += src[n, :] for n in order (an embedding's gradient).

    With `accumulate` (an f32 `out` only), out starts as the input `initial` instead of zeros (the
    gradient so far of `train_accumulating`): copied row by row when `out` is another array, nothing
    at all when it is `initial` itself (in place), so only the rows the indices name are touched.

    Deterministic without atomics: each element of `out` belongs to one
    thread (its column group, and its row modulo the grid's y size), which
    reads every index in order from shared memory and adds the positions of
    its rows in index order, in f32. Sums go straight into an f32 `out`;
    for a bf16 `out` they go into the f32 scratch `accumulator` [out_rows,
    cols], rounded once at the end. The result does not depend on the grid.
    A negative index counts from the end; one out of range is skipped.
    """
    _check_cols("scatter_add", cols)
    d = _operand_dtypes("scatter_add", {"indices": "index", "src": "data", "out": "data"}, dtype, dtypes)
    vec = vector_width(cols, [d["src"], d["out"], "f32"])
    groups = cols // vec
    threads = min(256, -(-groups // 32) * 32)
    direct = d["out"] == "f32"
    if accumulate and not direct:
        raise ValueError(f"scatter_add accumulates into an f32 out, not {d['out']}")
    params = [pointer_param("indices", d["indices"], "input"), pointer_param("src", d["src"], "input")]
    # `out` may be `initial` itself: neither is restrict then.
    params += [pointer_param("initial", "f32", "input", restrict=False)] if accumulate else []
    params += [pointer_param("out", d["out"], "output", restrict=not accumulate)]
    params += [] if direct else [pointer_param("accumulator", "f32", "scratch")]
    params += [size_param("positions"), size_param("out_rows")]
    sums = "out" if direct else "accumulator"
    rounding = "" if direct else (
        "    if (active) {\n"
        "        for (long long v = part; v < out_rows; v += parts) {\n"
        "            float a[VEC];\n"
        "            sx_ld_vec(a, accumulator + v * C + i * VEC);\n"
        "            sx_st_vec(out + v * C + i * VEC, a);\n"
        "        }\n"
        "    }\n")
    if accumulate:  # each thread's elements of `initial`, copied by the thread that adds into them
        start = ("    if (active && (const float*)out != initial) {\n"
                 "        for (long long v = part; v < out_rows; v += parts) {\n"
                 "            float a[VEC];\n"
                 "            sx_ld_vec(a, initial + v * C + i * VEC);\n"
                 "            sx_st_vec(out + v * C + i * VEC, a);\n"
                 "        }\n"
                 "    }\n")
    else:
        start = ("    const float zeros[VEC] = {};\n"
                 "    if (active) {\n"
                 f"        for (long long v = part; v < out_rows; v += parts) sx_st_vec({sums} + v * C + i * VEC, zeros);\n"
                 "    }\n")
    template = (
        kernel_head(threads, params) +
        f"    constexpr int C = {cols};\n"
        f"    constexpr int VEC = {vec};\n"
        "    constexpr int NV = C / VEC;\n"
        f"    __shared__ int owned[{SCATTER_TILE}];  // the tile's indices of rows this block owns, else -1\n"
        f"    const int i = blockIdx.x * {threads} + threadIdx.x;\n"
        "    const bool active = i < NV;\n"
        "    const int part = blockIdx.y, parts = gridDim.y;\n"
        f"{start}"
        f"    for (int base = 0; base < positions; base += {SCATTER_TILE}) {{\n"
        f"        const int count = min({SCATTER_TILE}, positions - base);\n"
        "        __syncthreads();  // the last tile is read by every thread before it is replaced\n"
        f"        for (int t = threadIdx.x; t < count; t += {threads}) {{\n"
        "            long long v = indices[base + t];\n"
        "            if (v < 0) v += out_rows;\n"
        "            owned[t] = v >= 0 && v < out_rows && v % parts == part ? (int)v : -1;\n"
        "        }\n"
        "        __syncthreads();\n"
        "        if (!active) continue;\n"
        "        for (int t = 0; t < count; ++t) {\n"
        "            const int v = owned[t];\n"
        "            if (v < 0) continue;\n"
        "            float s[VEC], a[VEC];\n"
        "            sx_ld_vec(s, src + (size_t)(base + t) * C + i * VEC);\n"
        f"            sx_ld_vec(a, {sums} + (size_t)v * C + i * VEC);\n"
        "            #pragma unroll\n"
        "            for (int j = 0; j < VEC; ++j) a[j] += s[j];\n"
        f"            sx_st_vec({sums} + (size_t)v * C + i * VEC, a);\n"
        "        }\n"
        "    }\n"
        f"{rounding}"
        "}\n")
    name, code = finish(_stem("scatter_add_into" if accumulate else "scatter_add", d, f"c{cols}"), template)
    blocks_x = -(-groups // threads)

    def shape(sizes: Mapping[str, int]) -> LaunchShape:
        parts = max(1, min(sizes["out_rows"], 65535, SCATTER_THREADS_TARGET // (blocks_x * threads)))
        return LaunchShape((blocks_x, parts, 1), (threads, 1, 1))

    kernel = KernelSource(name, "scatter_add", code, tuple(params), shape, PACKED_ALIGNMENT if vec > 1 else 4)
    scratch = (lambda sizes: {}) if direct else (lambda sizes: {"accumulator": sizes["out_rows"] * cols * 4})
    return single(kernel, scratch=scratch)


def fill(*, value: float, dtype: str = "f32") -> KernelProgram:
    """out[0:count] = value (rounded to the dtype once); integer dtypes take an integral value."""
    check_dtype("fill", dtype, FLOAT_STORAGE + INDEX_DTYPES)
    if dtype in INDEX_DTYPES:
        if value != int(value):
            raise ValueError(f"fill: {value} is not a value of {dtype}")
        literal = f"({c_type(dtype)}){int(value)}"
    else:
        literal = f"sx_round<{c_type(dtype)}>({float_literal(value)})"
    vec = 16 // itemsize(dtype)
    params = (pointer_param("out", dtype, "output"), size_param("count"))
    # `out` may be any element of a larger array (a gradient inside the flat gradient array), so the
    # elements before its first 16-byte boundary are peeled off and stored one by one.
    template = (
        kernel_head(FLAT_THREADS, params) +
        f"    constexpr int VEC = {vec};\n"
        f"    const {c_type(dtype)} value = {literal};\n"
        f"    const long long misaligned = (long long)(reinterpret_cast<unsigned long long>(out) % "
        f"{PACKED_ALIGNMENT}) / (long long)sizeof(*out);\n"
        "    const long long head = misaligned ? min((long long)VEC - misaligned, (long long)count) : 0;\n"
        "    const long long groups = (count - head) / VEC;\n"
        f"    const long long first = (long long)blockIdx.x * {FLAT_THREADS} + threadIdx.x;\n"
        f"    for (long long g = first; g < groups; g += (long long)gridDim.x * {FLAT_THREADS}) {{\n"
        "        sx_st_same<VEC>(out + head + g * VEC, value);\n"
        "    }\n"
        "    if (first < head) out[first] = value;\n"
        "    if (first < count - head - groups * VEC) out[head + groups * VEC + first] = value;\n"
        "}\n")
    name, code = finish(f"fill_{dtype}_{value:g}", template)
    return single(KernelSource(name, "fill", code, params, lambda sizes: _flat_grid(sizes["count"] // vec),
                               itemsize(dtype)))


def copy(shape: Sequence[int], *, strides: Sequence[int] | None = None, offset: int = 0, dtype: str = "f32",
         dtypes: Dtypes = None) -> KernelProgram:
    """out = src read through a view, made contiguous: out[idx] = src[offset + sum(idx[d] * strides[d])].

    `shape` is the view's and `out`'s shape, `strides` (elements; default
    row-major, a plain copy) and `offset` place it in `src` (a transpose,
    a slice, a broadcast with stride 0). Dimensions the view walks
    contiguously are merged first, so a contiguous copy is one flat loop.
    Equal dtypes copy bits; f32 <-> bf16 converts, rounding to nearest even.
    """
    shape = tuple(int(n) for n in shape)
    if any(n < 1 for n in shape):
        raise ValueError(f"copy: shape {shape} has an empty dimension")
    strides = tuple(int(s) for s in strides) if strides is not None else _row_major(shape)
    if len(strides) != len(shape):
        raise ValueError(f"copy: {len(strides)} strides for a shape of rank {len(shape)}")
    if dtype in INDEX_DTYPES:
        d = _index_copy_dtypes(dtype, dtypes)
    else:
        d = _operand_dtypes("copy", {"src": "data", "out": "data"}, dtype, dtypes)
    dims, steps = _merged_dims(shape, strides)
    total = 1
    for n in shape:
        total *= n
    widest = max(itemsize(d["src"]), itemsize(d["out"]))
    vec = 16 // widest
    while vec > 1 and not (steps[-1] == 1 and dims[-1] % vec == 0 and offset % vec == 0
                           and all(s % vec == 0 for s in steps[:-1])):
        vec //= 2
    params = (pointer_param("src", d["src"], "input"), pointer_param("out", d["out"], "output"))
    index = [f"        long long rest = g * VEC, at = {offset};"]
    for n, step in zip(reversed(dims[1:]), reversed(steps[1:])):
        index.append(f"        at += rest % {n} * {step};")
        index.append(f"        rest /= {n};")
    index.append(f"        at += rest * {steps[0]};")
    move = ("        sx_move<VEC>(out + g * VEC, src + at);\n" if d["src"] == d["out"] else
            "        float v[VEC];\n        sx_ld_vec(v, src + at);\n        sx_st_vec(out + g * VEC, v);\n")
    template = (
        kernel_head(FLAT_THREADS, params) +
        f"    constexpr int VEC = {vec};\n"
        f"    constexpr long long GROUPS = {total // vec}LL;\n"
        f"    for (long long g = (long long)blockIdx.x * {FLAT_THREADS} + threadIdx.x; g < GROUPS;\n"
        f"         g += (long long)gridDim.x * {FLAT_THREADS}) {{\n"
        + "\n".join(index) + "\n" + move +
        "    }\n"
        "}\n")
    stem = f"copy_{d['src']}_{d['out']}_{'x'.join(map(str, dims))}"
    name, code = finish(stem, template)
    grid = _flat_grid(total // vec)
    return single(KernelSource(name, "copy", code, params, lambda sizes: grid, PACKED_ALIGNMENT if vec > 1 else 4))


def _index_copy_dtypes(dtype: str, dtypes: Dtypes) -> dict[str, str]:
    check_dtype("copy", dtype, INDEX_DTYPES)
    chosen = {"src": dtype, "out": dtype} | dict(dtypes or {})
    if chosen["src"] != chosen["out"]:
        raise ValueError(f"copy: integers are copied, not converted ({chosen['src']} to {chosen['out']})")
    return chosen


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _merged_dims(shape: Sequence[int], strides: Sequence[int]) -> tuple[list[int], list[int]]:
    """The view's dimensions with size-1 ones dropped and each one it walks contiguously into the next merged."""
    dims: list[int] = []
    steps: list[int] = []
    for n, step in zip(shape, strides):
        if n == 1:
            continue
        if dims and steps[-1] == step * n:
            dims[-1] *= n
            steps[-1] = step
        else:
            dims.append(n)
            steps.append(step)
    return (dims, steps) if dims else ([1], [1])
