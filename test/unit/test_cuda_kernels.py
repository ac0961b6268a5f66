"""emit-cuda's kernel templates on cuda-sim and on a GPU, against float64 numpy references.

Every family, forward and backward, runs on random inputs of awkward sizes
(rows that are not a multiple of 32, a single row, rows of 1, 7, 33, 768,
50257 and 50304 elements), f32 and bf16 storage and mixes of the two. Every
launch runs under both of cuda-sim's schedules (`compare_schedules`), so a
missing barrier shows as a difference, and the device checks every buffer's
canaries after each launch. All the kernels are one translation unit,
compiled once into the simulator's own cache.

Where there is a GPU, every test that takes the `device` fixture runs again
on it (marked `gpu`; `gpu_device.GpuDevice` answers the simulator's calls
through the device runtime, the unit compiled by NVRTC): the same cases, the
same references and tolerances, outputs poisoned before each launch.

Tolerances, per element with an absolute floor: |got - want| <= tol * (|want|
+ max|want|), tol = 1e-5 for f32 results and 2e-2 for bf16 ones; the floor
(the tolerance times the result's largest magnitude) keeps elements near
zero in results made by cancellation (a layernorm's dx) from failing on
rounding that is small against the result. References are computed in
float64 from the stored (already rounded) inputs.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np
import pytest
from attrs import frozen
from gpu_device import (
    GpuDevice,
    sim_or_gpu_device,  # noqa: F401 (the `device` fixture)
)
from sexpgpu.backends.cuda.driver_sim import SimRuntime
from sexpgpu.backends.cuda.nvrtc import compile_cubin, cubin_arch
from sexpgpu.backends.cuda.render import templates as t
from sexpgpu.backends.cuda.render.kernel_source import KernelProgram
from sexpgpu.backends.cuda.render.prelude import translation_unit

NUMPY_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "i32": np.int32, "i64": np.int64}
TOLERANCE = {"f32": 1e-5, "bf16": 2e-2}


@frozen
class Case:
    """A program, its sizes, how to make its inputs (float64 or integer arrays) and their references."""

    id: str
    program: KernelProgram
    sizes: Mapping[str, int]
    inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def stored(program: KernelProgram, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs as the device holds them (rounded to each operand's dtype)."""
    dtypes = {p.name: p.dtype for p in program.params}
    return {name: np.asarray(a).astype(NUMPY_DTYPES[dtypes[name]]) for name, a in arrays.items()}


def as_stored(program: KernelProgram, name: str, array: np.ndarray) -> np.ndarray:
    """`array` rounded to the dtype operand `name` has, back in float64 (to derive consistent inputs from)."""
    return stored(program, {name: array})[name].astype(np.float64)


def widened(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: a.astype(np.float64) if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16 else a
            for n, a in arrays.items()}


# --- float64 references -------------------------------------------------------------------------------------

def softmax_ref(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax_ref(x):
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def softmax_backward_ref(y, dy):
    return y * (dy - (dy * y).sum(-1, keepdims=True))


def log_softmax_backward_ref(y, dy):
    return dy - np.exp(y) * dy.sum(-1, keepdims=True)


def layernorm_ref(x, weight=None, bias=None, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    y = (x - mean) * rstd
    y = y * weight if weight is not None else y
    y = y + bias if bias is not None else y
    return y, mean[:, 0], rstd[:, 0]


def rmsnorm_ref(x, weight=None, eps=1e-5):
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = x * rstd
    return (y * weight if weight is not None else y), rstd[:, 0]


def layernorm_backward_ref(dy, x, weight=None, eps=1e-5):
    """Gradients of sum(y * dy) through the layernorm, by the chain rule on mean and variance."""
    n = x.shape[-1]
    mean = x.mean(-1, keepdims=True)
    centered = x - mean
    var = (centered**2).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = centered * rstd
    dxhat = dy * weight if weight is not None else dy
    dvar = (dxhat * centered).sum(-1, keepdims=True) * -0.5 * rstd**3
    dmean = -(dxhat * rstd).sum(-1, keepdims=True) + dvar * (-2.0 * centered).mean(-1, keepdims=True)
    dx = dxhat * rstd + dvar * 2.0 * centered / n + dmean / n
    return dx, (dy * xhat).sum(0), dy.sum(0)


def rmsnorm_backward_ref(dy, x, weight=None, eps=1e-5):
    n = x.shape[-1]
    ms = (x * x).mean(-1, keepdims=True) + eps
    rstd = ms**-0.5
    g = dy * weight if weight is not None else dy
    dms = (g * x).sum(-1, keepdims=True) * -0.5 * ms**-1.5
    return g * rstd + dms * 2.0 * x / n, (dy * x * rstd).sum(0)


def cross_entropy_ref(logits, targets):
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
    rows = np.arange(len(targets))
    vocab = logits.shape[1]
    wrapped = np.where(targets < 0, targets + vocab, targets)
    valid = (wrapped >= 0) & (wrapped < vocab)
    picked = np.where(valid, logits[rows, np.clip(wrapped, 0, vocab - 1)], np.nan)
    return lse - picked, lse


def cross_entropy_backward_ref(logits, targets, upstream):
    probabilities = softmax_ref(logits)
    onehot = np.zeros_like(logits)
    onehot[np.arange(len(targets)), np.where(targets < 0, targets + logits.shape[1], targets)] = 1.0
    return (probabilities - onehot) * upstream


# --- cases -------------------------------------------------------------------------------------------------

def normal(name, shape, scale=1.0, shift=0.0):
    return lambda rng: {name: rng.standard_normal(shape) * scale + shift}


def row_case(id, program, rows, cols, make, reference):
    return Case(id, program, {"rows": rows} | ({"cols": cols} if "cols" in program.sizes else {}), make, reference)


def softmax_case(id, program, rows, cols, scale=3.0):
    return row_case(id, program, rows, cols, lambda rng: {"x": rng.standard_normal((rows, cols)) * scale},
                    lambda a: {"y": softmax_ref(a["x"])})


def log_softmax_case(id, program, rows, cols):
    return row_case(id, program, rows, cols, lambda rng: {"x": rng.standard_normal((rows, cols)) * 3.0},
                    lambda a: {"y": log_softmax_ref(a["x"])})


def layernorm_case(id, program, rows, cols, weight=True, bias=True, stats=True, eps=1e-5):
    def make(rng):
        arrays = {"x": rng.standard_normal((rows, cols)) * 2.0 + 0.5}
        arrays |= {"weight": rng.standard_normal(cols)} if weight else {}
        return arrays | ({"bias": rng.standard_normal(cols)} if bias else {})

    def reference(a):
        y, mean, rstd = layernorm_ref(a["x"], a.get("weight"), a.get("bias"), eps)
        return {"y": y} | ({"mean": mean, "rstd": rstd} if stats else {})

    return row_case(id, program, rows, cols, make, reference)


def rmsnorm_case(id, program, rows, cols, weight=True, eps=1e-5):
    def make(rng):
        return {"x": rng.standard_normal((rows, cols)) + 0.3} | ({"weight": rng.standard_normal(cols)} if weight else {})

    def reference(a):
        y, rstd = rmsnorm_ref(a["x"], a.get("weight"), eps)
        return {"y": y, "rstd": rstd}

    return row_case(id, program, rows, cols, make, reference)


def softmax_backward_case(id, program, rows, cols):
    def make(rng):
        return {"y": softmax_ref(rng.standard_normal((rows, cols)) * 2.0), "dy": rng.standard_normal((rows, cols))}


    return row_case(id, program, rows, cols, make, lambda a: {"dx": softmax_backward_ref(a["y"], a["dy"])})


def log_softmax_backward_case(id, program, rows, cols):
    def make(rng):
        return {"y": log_softmax_ref(rng.standard_normal((rows, cols)) * 2.0), "dy": rng.standard_normal((rows, cols))}

    return row_case(id, program, rows, cols, make, lambda a: {"dx": log_softmax_backward_ref(a["y"], a["dy"])})


def layernorm_backward_case(id, program, rows, cols, weight=True, bias=True):
    def make(rng):
        x = as_stored(program, "x", rng.standard_normal((rows, cols)) * 1.5 + 0.25)
        _, mean, rstd = layernorm_ref(x)
        arrays = {"dy": rng.standard_normal((rows, cols)), "x": x, "mean": mean, "rstd": rstd}
        return arrays | ({"weight": rng.standard_normal(cols)} if weight else {})

    def reference(a):
        dx, dweight, dbias = layernorm_backward_ref(a["dy"], a["x"], a.get("weight"))
        return {"dx": dx} | ({"dweight": dweight} if weight else {}) | ({"dbias": dbias} if bias else {})

    return row_case(id, program, rows, cols, make, reference)


def rmsnorm_backward_case(id, program, rows, cols, weight=True):
    def make(rng):
        x = as_stored(program, "x", rng.standard_normal((rows, cols)) + 0.3)
        arrays = {"dy": rng.standard_normal((rows, cols)), "x": x, "rstd": rmsnorm_ref(x)[1]}
        return arrays | ({"weight": rng.standard_normal(cols)} if weight else {})

    def reference(a):
        dx, dweight = rmsnorm_backward_ref(a["dy"], a["x"], a.get("weight"))
        return {"dx": dx} | ({"dweight": dweight} if weight else {})

    return row_case(id, program, rows, cols, make, reference)


def targets_for(rows, vocab, awkward=False):
    def make(rng):
        targets = rng.integers(0, vocab, rows)
        if awkward:  # one counted from the end, one out of range
            targets[0], targets[-1] = -1, vocab
        return targets

    return make


def cross_entropy_case(id, program, rows, vocab, awkward=False, shift=0.0, reduction=None):
    def make(rng):
        return {"logits": rng.standard_normal((rows, vocab)) * 2.0 + shift, "targets": targets_for(rows, vocab, awkward)(rng)}

    def reference(a):
        losses, lse = cross_entropy_ref(a["logits"], a["targets"])
        reduced = {"sum": losses.sum(keepdims=True), "mean": losses.mean(keepdims=True), None: None}[reduction]
        return {"losses": losses, "lse": lse} | ({"loss": reduced} if reduction else {})

    return row_case(id, program, rows, vocab, make, reference)


def cross_entropy_backward_case(id, program, rows, vocab, grad, scale, mean=False):
    def make(rng):
        logits = as_stored(program, "logits", rng.standard_normal((rows, vocab)) * 2.0)
        targets = targets_for(rows, vocab)(rng)
        targets[0] = -2  # counted from the end
        dloss = rng.standard_normal(1 if grad == "scalar" else rows) + 1.5
        return {"logits": logits, "targets": targets, "lse": cross_entropy_ref(logits, targets)[1], "dloss": dloss}

    def reference(a):
        upstream = (a["dloss"][0] if grad == "scalar" else a["dloss"][:, None]) * scale / (rows if mean else 1)
        return {"dlogits": cross_entropy_backward_ref(a["logits"], a["targets"], upstream)}

    return row_case(id, program, rows, vocab, make, reference)


def scatter_reference(indices, src, out_rows):
    out = np.zeros((out_rows, src.shape[1]))
    for n, index in enumerate(indices):
        if -out_rows <= index < out_rows:
            out[index] += src[n]
    return out


def gather_reference(table, indices):
    rows = table.shape[0]
    wrapped = np.where(indices < 0, indices + rows, indices)
    valid = (wrapped >= 0) & (wrapped < rows)
    return np.where(valid[:, None], table[np.clip(wrapped, 0, rows - 1)], np.nan)


def scatter_case(id, program, positions, out_rows, cols, awkward=False, accumulate=False):
    def make(rng):
        indices = rng.integers(0, min(out_rows, 5 + positions // 4), positions)  # many repeats
        if awkward:
            indices[1], indices[2] = -1, out_rows + 3
        initial = {"initial": rng.standard_normal((out_rows, cols))} if accumulate else {}
        return {"indices": indices, "src": rng.standard_normal((positions, cols)), **initial}

    def reference(a):
        fresh = scatter_reference(a["indices"], a["src"], out_rows)
        return {"out": fresh + a["initial"] if accumulate else fresh}

    return Case(id, program, {"positions": positions, "out_rows": out_rows}, make, reference)


def copy_case(id, program, src_shape, view):
    return Case(id, program, {}, lambda rng: {"src": rng.standard_normal(src_shape)}, lambda a: {"out": view(a["src"])})


F32, BF16 = {"dtype": "f32"}, {"dtype": "bf16"}

CASES = [
    softmax_case("softmax f32 37x1", t.softmax(1), 37, 1),
    softmax_case("softmax f32 37x7", t.softmax(7), 37, 7),
    softmax_case("softmax f32 37x33", t.softmax(33), 37, 33),
    softmax_case("softmax f32 1x768", t.softmax(768), 1, 768),
    softmax_case("softmax f32 37x768", t.softmax(768), 37, 768),
    softmax_case("softmax f32 5x3000 warp re-reading", t.softmax(3000, layout="warp"), 5, 3000),
    softmax_case("softmax f32 2x50257", t.softmax(50257), 2, 50257),
    softmax_case("softmax f32 2x50304", t.softmax(50304), 2, 50304, scale=8.0),
    softmax_case("softmax f32 5x33 block", t.softmax(33, layout="block", threads=64), 5, 33),
    softmax_case("softmax f32 runtime cols 37x33", t.softmax(None), 37, 33),
    softmax_case("softmax bf16 37x768", t.softmax(768, **BF16), 37, 768),
    softmax_case("softmax bf16 2x50304", t.softmax(50304, **BF16), 2, 50304),
    softmax_case("softmax bf16 to f32 37x33", t.softmax(33, dtype="bf16", dtypes={"y": "f32"}), 37, 33),
    log_softmax_case("log_softmax f32 37x7", t.log_softmax(7), 37, 7),
    log_softmax_case("log_softmax f32 37x768", t.log_softmax(768), 37, 768),
    log_softmax_case("log_softmax f32 2x50257", t.log_softmax(50257), 2, 50257),
    log_softmax_case("log_softmax bf16 2x50304", t.log_softmax(50304, **BF16), 2, 50304),
    log_softmax_case("log_softmax f32 runtime cols 1x33", t.log_softmax(None), 1, 33),
    layernorm_case("layernorm f32 37x768", t.layernorm(768), 37, 768),
    layernorm_case("layernorm f32 1x768", t.layernorm(768), 1, 768),
    layernorm_case("layernorm f32 37x7", t.layernorm(7), 37, 7),
    layernorm_case("layernorm f32 37x33 no affine", t.layernorm(33, weight=False, bias=False), 37, 33,
                   weight=False, bias=False),
    layernorm_case("layernorm f32 37x768 no stats eps 1e-6", t.layernorm(768, stats=False, eps=1e-6), 37, 768,
                   stats=False, eps=1e-6),
    layernorm_case("layernorm f32 5x3000 warp re-reading", t.layernorm(3000), 5, 3000),
    layernorm_case("layernorm f32 2x50304 block", t.layernorm(50304), 2, 50304),
    layernorm_case("layernorm f32 runtime cols 37x33", t.layernorm(None), 37, 33),
    layernorm_case("layernorm bf16 37x768", t.layernorm(768, **BF16), 37, 768),
    layernorm_case("layernorm bf16 to f32 37x33 weight only", t.layernorm(33, bias=False, dtype="bf16",
                                                                            dtypes={"y": "f32"}), 37, 33, bias=False),
    rmsnorm_case("rmsnorm f32 37x768", t.rmsnorm(768), 37, 768),
    rmsnorm_case("rmsnorm f32 37x7 no weight", t.rmsnorm(7, weight=False), 37, 7, weight=False),
    rmsnorm_case("rmsnorm f32 2x50257 block", t.rmsnorm(50257), 2, 50257),
    rmsnorm_case("rmsnorm bf16 37x768", t.rmsnorm(768, **BF16), 37, 768),
    softmax_backward_case("softmax_backward f32 37x7", t.softmax_backward(7), 37, 7),
    softmax_backward_case("softmax_backward f32 37x768", t.softmax_backward(768), 37, 768),
    softmax_backward_case("softmax_backward f32 2x50304", t.softmax_backward(50304), 2, 50304),
    softmax_backward_case("softmax_backward f32 runtime cols 37x33", t.softmax_backward(None), 37, 33),
    softmax_backward_case("softmax_backward bf16 37x33", t.softmax_backward(33, **BF16), 37, 33),
    log_softmax_backward_case("log_softmax_backward f32 37x768", t.log_softmax_backward(768), 37, 768),
    log_softmax_backward_case("log_softmax_backward f32 2x50257", t.log_softmax_backward(50257), 2, 50257),
    log_softmax_backward_case("log_softmax_backward bf16 37x7", t.log_softmax_backward(7, **BF16), 37, 7),
    layernorm_backward_case("layernorm_backward f32 37x768", t.layernorm_backward(768), 37, 768),
    layernorm_backward_case("layernorm_backward f32 300x768", t.layernorm_backward(768), 300, 768),
    layernorm_backward_case("layernorm_backward f32 37x7 no affine", t.layernorm_backward(7, weight=False, bias=False),
                            37, 7, weight=False, bias=False),
    layernorm_backward_case("layernorm_backward f32 37x33 weight only", t.layernorm_backward(33, bias=False),
                            37, 33, bias=False),
    layernorm_backward_case("layernorm_backward f32 5x3000 sums in scratch", t.layernorm_backward(3000), 5, 3000),
    layernorm_backward_case("layernorm_backward f32 runtime cols 70x33", t.layernorm_backward(None), 70, 33),
    layernorm_backward_case("layernorm_backward bf16 37x768", t.layernorm_backward(768, **BF16), 37, 768),
    layernorm_backward_case("layernorm_backward bf16 1x1", t.layernorm_backward(1, **BF16), 1, 1),
    rmsnorm_backward_case("rmsnorm_backward f32 37x768", t.rmsnorm_backward(768), 37, 768),
    rmsnorm_backward_case("rmsnorm_backward f32 37x7 no weight", t.rmsnorm_backward(7, weight=False), 37, 7,
                          weight=False),
    rmsnorm_backward_case("rmsnorm_backward bf16 37x768", t.rmsnorm_backward(768, **BF16), 37, 768),
    cross_entropy_case("cross_entropy f32 3x50257", t.cross_entropy_forward(50257), 3, 50257),
    cross_entropy_case("cross_entropy f32 3x50304 large logits", t.cross_entropy_forward(50304), 3, 50304, shift=40.0),
    cross_entropy_case("cross_entropy f32 37x33 i64 targets wrapped and out of range",
                       t.cross_entropy_forward(33, dtypes={"targets": "i64"}), 37, 33, awkward=True),
    cross_entropy_case("cross_entropy bf16 3x50304", t.cross_entropy_forward(50304, **BF16), 3, 50304),
    cross_entropy_case("cross_entropy f32 runtime vocab 37x7", t.cross_entropy_forward(None), 37, 7),
    cross_entropy_case("cross_entropy f32 37x33 mean", t.cross_entropy_forward(33, reduction="mean"), 37, 33,
                       reduction="mean"),
    cross_entropy_case("cross_entropy bf16 2x50257 sum", t.cross_entropy_forward(50257, reduction="sum", **BF16), 2,
                       50257, reduction="sum"),
    cross_entropy_backward_case("cross_entropy_backward f32 3x50257 mean", t.cross_entropy_backward(50257, scale=1 / 3),
                                3, 50257, "scalar", 1 / 3),
    cross_entropy_backward_case("cross_entropy_backward f32 37x33 per row", t.cross_entropy_backward(33, grad="row"),
                                37, 33, "row", 1.0),
    cross_entropy_backward_case("cross_entropy_backward f32 37x7 mean runtime", t.cross_entropy_backward(7, mean=True),
                                37, 7, "scalar", 1.0, mean=True),
    cross_entropy_backward_case("cross_entropy_backward bf16 3x50304 mean",
                                t.cross_entropy_backward(50304, scale=1 / 3, **BF16), 3, 50304, "scalar", 1 / 3),
    Case("sum_reduce f32 1", t.sum_reduce(), {"count": 1}, normal("x", 1), lambda a: {"out": a["x"].sum(keepdims=True)}),
    Case("sum_reduce f32 5000 scaled", t.sum_reduce(scale=1 / 5000), {"count": 5000}, normal("x", 5000, shift=2.0),
         lambda a: {"out": a["x"].mean(keepdims=True)}),
    Case("sum_reduce f32 1031 mean scaled", t.sum_reduce(mean=True, scale=-2.0), {"count": 1031},
         normal("x", 1031, shift=0.5), lambda a: {"out": -2.0 * a["x"].mean(keepdims=True)}),
    Case("sum_reduce bf16 37 to f32", t.sum_reduce(dtype="bf16", dtypes={"out": "f32"}), {"count": 37}, normal("x", 37),
         lambda a: {"out": a["x"].sum(keepdims=True)}),
    Case("column_sum f32 13x768", t.column_sum(768), {"count": 13}, lambda rng: {"partials": rng.standard_normal((13, 768))},
         lambda a: {"out": a["partials"].sum(0)}),
    Case("column_sum bf16 runtime cols 9x7", t.column_sum(None, dtype="bf16"), {"count": 9, "cols": 7},
         lambda rng: {"partials": rng.standard_normal((9, 7))}, lambda a: {"out": a["partials"].sum(0)}),
    Case("column_sum two arrays f32 and bf16 in one launch 13x768", t.column_sum(768, dtypes=["f32", "bf16"]),
         {"count": 13}, lambda rng: {"partials_0": rng.standard_normal((13, 768)),
                                     "partials_1": rng.standard_normal((13, 768)) + 1.0},
         lambda a: {"out_0": a["partials_0"].sum(0), "out_1": a["partials_1"].sum(0)}),
    Case("column_sum two arrays runtime cols 9x7", t.column_sum(None, dtypes=["f32", "f32"]), {"count": 9, "cols": 7},
         lambda rng: {"partials_0": rng.standard_normal((9, 7)), "partials_1": rng.standard_normal((9, 7))},
         lambda a: {"out_0": a["partials_0"].sum(0), "out_1": a["partials_1"].sum(0)}),
    Case("gather f32 37 of 50x768", t.gather(768), {"positions": 37, "table_rows": 50},
         lambda rng: {"table": rng.standard_normal((50, 768)), "indices": rng.integers(-50, 50, 37)},
         lambda a: {"out": gather_reference(a["table"], a["indices"])}),
    Case("gather bf16 i64 5 of 9x7 out of range", t.gather(7, dtype="bf16", dtypes={"indices": "i64"}),
         {"positions": 5, "table_rows": 9},
         lambda rng: {"table": rng.standard_normal((9, 7)), "indices": np.array([3, -1, 9, 0, -10])},
         lambda a: {"out": gather_reference(a["table"], a["indices"])}),
    scatter_case("scatter_add f32 300 into 50x768", t.scatter_add(768), 300, 50, 768),
    scatter_case("scatter_add bf16 37 into 11x7 awkward", t.scatter_add(7, **BF16), 37, 11, 7, awkward=True),
    scatter_case("scatter_add bf16 to f32 i64 40 into 50304x8",
                 t.scatter_add(8, dtype="bf16", dtypes={"out": "f32", "indices": "i64"}), 40, 50304, 8),
    scatter_case("scatter_add f32 37 added into 11x7 awkward", t.scatter_add(7, accumulate=True), 37, 11, 7,
                 awkward=True, accumulate=True),
    scatter_case("scatter_add f32 300 added into 50x768", t.scatter_add(768, accumulate=True), 300, 50, 768,
                 accumulate=True),
    Case("fill f32 7 -inf", t.fill(value=-np.inf), {"count": 7}, lambda rng: {}, lambda a: {"out": np.full(7, -np.inf)}),
    Case("fill bf16 1001 0.1", t.fill(value=0.1, dtype="bf16"), {"count": 1001}, lambda rng: {},
         lambda a: {"out": np.full(1001, 0.1)}),
    Case("fill i32 9 -1", t.fill(value=-1, dtype="i32"), {"count": 9}, lambda rng: {}, lambda a: {"out": np.full(9, -1)}),
    copy_case("copy f32 transpose 7x33", t.copy((33, 7), strides=(1, 33)), (7, 33), lambda s: s.T),
    copy_case("copy f32 slice", t.copy((5, 4), strides=(10, 1), offset=3), (6, 10), lambda s: s[0:5, 3:7]),
    copy_case("copy f32 broadcast", t.copy((3, 4, 8), strides=(0, 8, 1), offset=0), (4, 8),
              lambda s: np.broadcast_to(s, (3, 4, 8))),
    copy_case("copy f32 to bf16 contiguous 4x250", t.copy((4, 250), dtypes={"out": "bf16"}), (4, 250), lambda s: s),
    copy_case("copy bf16 to f32 slice of rows", t.copy((3, 16), strides=(32, 1), offset=64, dtype="bf16",
                                                       dtypes={"out": "f32"}), (6, 32), lambda s: s[2:5, 0:16]),
    Case("copy i64 transpose", t.copy((3, 2), strides=(1, 3), dtype="i64"), {},
         lambda rng: {"src": rng.integers(-2**62, 2**62, (2, 3))}, lambda a: {"out": a["src"].T}),
]

PROGRAMS = [case.program for case in CASES]


@pytest.fixture(scope="module")
def module(device):
    """Every kernel of every case in one translation unit, compiled once (the simulator's or NVRTC's disk cache)."""
    return device.compile(translation_unit(k for p in PROGRAMS for k in p.kernels), "emit_cuda_templates.cu")


def run(device, module, program: KernelProgram, inputs: Mapping[str, np.ndarray], sizes: Mapping[str, int],
        output_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Run every launch of `program` (on cuda-sim under both schedules, which must agree); the outputs as
    float64 (or ints)."""
    values: dict[str, object] = dict(sizes)
    scratch = program.scratch_bytes(sizes)
    dtypes = {}
    for p in program.params:
        dtypes[p.name] = p.dtype
        if p.role == "input":
            values[p.name] = device.upload(inputs[p.name], p.name)
        elif p.role == "output":
            shape = output_shapes[p.name]
            values[p.name] = device.alloc(int(np.prod(shape)) * np.dtype(NUMPY_DTYPES[p.dtype]).itemsize, p.name)
        elif p.role == "scratch":
            values[p.name] = device.alloc(scratch[p.name], p.name)
    buffers = [v for v in values.values() if not isinstance(v, int)]
    try:
        for launch in program.launches(values):
            device.compare_schedules(module.kernel(launch.kernel.name), launch.shape.grid, launch.shape.block,
                                     launch.shape.shared_bytes, launch.arguments)
        device.check_canaries()
        return {name: device.download(values[name], NUMPY_DTYPES[dtypes[name]], shape)
                for name, shape in output_shapes.items()}
    finally:
        for buf in buffers:
            device.free(buf)


def assert_close(name: str, got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    if dtype in ("i32", "i64"):
        np.testing.assert_array_equal(got, want, err_msg=name)
        return
    got = got.astype(np.float64)
    tol = TOLERANCE[dtype]
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name}: NaN where the reference has none")
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)], err_msg=name)
    floor = np.abs(want[finite]).max(initial=0.0)
    error = np.abs(got[finite] - want[finite])
    bound = tol * (np.abs(want[finite]) + floor)
    worst = int(np.argmax(error - bound)) if error.size else 0
    assert np.all(error <= bound), (f"{name}: {int((error > bound).sum())} of {error.size} elements off; worst "
                                    f"got {got[finite][worst]!r}, want {want[finite][worst]!r}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_template_against_reference(case: Case, device, module):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    inputs = stored(case.program, case.inputs(rng))
    want = case.reference(widened(inputs))
    dtypes = {p.name: p.dtype for p in case.program.params}
    got = run(device, module, case.program, inputs, case.sizes, {n: np.shape(w) for n, w in want.items()})
    for name, value in want.items():
        assert_close(f"{case.id}: {name}", got[name], value, dtypes[name])


ADAPTED = ["layernorm_backward f32 300x768", "softmax bf16 37x768", "cross_entropy f32 37x33 mean",
           "scatter_add bf16 37 into 11x7 awkward"]


def test_the_gpu_device_through_the_simulated_runtime(tmp_path):
    """GpuDevice's own code (compile, poisoned allocations, launches, downloads, frees) over the runtime interface,
    proven without a GPU on cuda-sim's runtime: cases with scratch, several launches, bf16, integer operands."""
    gpu = GpuDevice(SimRuntime(memory_bytes=64 << 20, cache_dir=tmp_path))
    cases = [c for c in CASES if c.id in ADAPTED]
    module = gpu.compile(translation_unit(k for c in cases for k in c.program.kernels), "adapted.cu")
    for case in cases:
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))
        inputs = stored(case.program, case.inputs(rng))
        want = case.reference(widened(inputs))
        dtypes = {p.name: p.dtype for p in case.program.params}
        got = run(gpu, module, case.program, inputs, case.sizes, {n: np.shape(w) for n, w in want.items()})
        for name, value in want.items():
            assert_close(f"{case.id}: {name}", got[name], value, dtypes[name])
    unwritten = gpu.alloc(8, "never written")
    assert np.isnan(gpu.download(unwritten, np.float32, 2)).all()
    assert gpu.download(unwritten, np.int32).tolist() == [-1, -1]
    gpu.free(unwritten)
    gpu.close()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_specialisation_compiles_with_nvrtc_without_spills(arch):
    """The same translation unit NVRTC compiles to CUBIN for the architecture: every kernel there, none spilling."""
    source = translation_unit(k for p in PROGRAMS for k in p.kernels)
    cubin = compile_cubin(source, arch, name="emit_cuda_templates")
    assert cubin_arch(cubin.image) == arch
    names = {k.name for p in PROGRAMS for k in p.kernels}
    assert set(cubin.kernels) == names
    assert not cubin.spilling(), "\n".join(
        f"{k.name}: {k.spill_stores} bytes of spill stores, {k.spill_loads} of spill loads" for k in cubin.spilling())
    assert all(k.stack_frame == 0 for k in cubin.kernels.values())


def launch(device, module, program: KernelProgram, values: Mapping[str, object], grid=None) -> None:
    for bound in program.launches(values):
        device.launch(module.kernel(bound.kernel.name), grid or bound.shape.grid, bound.shape.block,
                      bound.shape.shared_bytes, bound.arguments)


def test_scatter_add_f32_is_the_interpreters_sum_bit_for_bit_whatever_the_grid(device, module):
    """Each element adds its positions in index order from zero, as np.add.at (the interpreter) does."""
    program = t.scatter_add(768)
    rng = np.random.default_rng(7)
    indices = rng.integers(0, 13, 300).astype(np.int32)
    src = (rng.standard_normal((300, 768)) * np.exp(rng.uniform(-8, 8, (300, 1)))).astype(np.float32)
    want = np.zeros((50, 768), np.float32)
    np.add.at(want, indices, src)
    buffers = {"indices": device.upload(indices), "src": device.upload(src), "out": device.alloc(want.nbytes)}
    values = buffers | {"positions": 300, "out_rows": 50}
    for parts in (None, 1, 7, 50):  # the grid's y size splits the rows among threads differently
        grid = None if parts is None else (program.launches(values)[0].shape.grid[0], parts, 1)
        launch(device, module, program, values, grid)
        assert device.download(buffers["out"], np.float32, want.shape).tobytes() == want.tobytes(), parts
    for buf in buffers.values():
        device.free(buf)


def test_scatter_add_into_a_buffer_in_place_touches_only_the_rows_named(device, module):
    """Accumulating in place (`out` is `initial`, as train_accumulating runs it): each named row is its
    value plus its positions added in index order, as np.add.at from that value; every other row is left
    alone (a NaN row stays NaN: never read or written); the same bits whatever the grid."""
    program = t.scatter_add(768, accumulate=True)
    rng = np.random.default_rng(11)
    indices = rng.integers(0, 13, 300).astype(np.int32)
    src = (rng.standard_normal((300, 768)) * np.exp(rng.uniform(-8, 8, (300, 1)))).astype(np.float32)
    initial = rng.standard_normal((50, 768)).astype(np.float32)
    initial[40] = np.nan  # a row no index names
    table = device.upload(initial)
    buffers = {"indices": device.upload(indices), "src": device.upload(src)}
    want = initial.copy()
    for parts in (None, 1, 7, 50):  # the grid's y size splits the rows among threads differently
        np.add.at(want, indices, src)
        values = buffers | {"initial": table, "out": table, "positions": 300, "out_rows": 50}
        grid = None if parts is None else (program.launches(values)[0].shape.grid[0], parts, 1)
        launch(device, module, program, values, grid)
        assert device.download(table, np.float32, want.shape).tobytes() == want.tobytes(), parts
    for buf in [table, *buffers.values()]:
        device.free(buf)


FILLS = {"f32": t.fill(value=-np.inf), "bf16": t.fill(value=0.1, dtype="bf16"), "i32": t.fill(value=-1, dtype="i32")}


@pytest.mark.parametrize("dtype", list(FILLS))
def test_fill_writes_exactly_its_elements_at_every_offset(dtype, device, module):
    """`fill` into a view starting at every element offset from a 16-byte boundary (a zero gradient inside the
    flat gradient array), of counts shorter and longer than a vector: its elements set, no byte around them."""
    program = FILLS[dtype]
    numpy_dtype = np.dtype(NUMPY_DTYPES[dtype])
    vec = 16 // numpy_dtype.itemsize
    value = {"f32": -np.inf, "bf16": 0.1, "i32": -1}[dtype]
    buffer = device.alloc(64 * numpy_dtype.itemsize, "fill target")
    for offset in range(vec + 1):
        for count in (1, vec - 1, vec, vec + 1, 2 * vec + 3, 33):
            before = device.download(buffer, numpy_dtype, 64)
            launch(device, module, program, {"out": int(buffer) + offset * numpy_dtype.itemsize, "count": count})
            got = device.download(buffer, numpy_dtype, 64)
            want = before.copy()
            want[offset:offset + count] = value
            assert got.tobytes() == want.tobytes(), (offset, count)
    device.check_canaries()
    device.free(buffer)


@pytest.mark.parametrize(("program", "output", "input"), [
    (t.softmax(768), "y", "x"),
    (t.layernorm_backward(768), "dx", "dy"),
    (t.cross_entropy_backward(50304, scale=1 / 3, dtype="bf16"), "dlogits", "logits"),
], ids=["softmax", "layernorm_backward", "cross_entropy_backward"])
def test_outputs_declared_in_place_may_overwrite_their_input(program, output, input, device, module):
    case = next(c for c in CASES if c.program.kernels[0].name == program.kernels[0].name)
    assert (output, input) in program.kernels[0].in_place
    assert "__restrict__" not in next(p.ctype for p in program.kernels[0].params if p.name == input)
    rng = np.random.default_rng(11)
    inputs = stored(program, case.inputs(rng))
    results = case.reference(widened(inputs))
    want = results[output]
    dtypes = {p.name: p.dtype for p in program.params}
    values: dict[str, object] = dict(case.sizes)
    for p in program.params:
        if p.role == "input":
            values[p.name] = device.upload(inputs[p.name], p.name)
        elif p.role == "output" and p.name != output:
            values[p.name] = device.alloc(results[p.name].size * np.dtype(NUMPY_DTYPES[p.dtype]).itemsize, p.name)
        elif p.role == "scratch":
            values[p.name] = device.alloc(program.scratch_bytes(case.sizes)[p.name], p.name)
    values[output] = values[input]
    launch(device, module, program, values)
    got = device.download(values[output], NUMPY_DTYPES[dtypes[output]], want.shape)
    for buf in {id(v): v for v in values.values() if not isinstance(v, int)}.values():
        device.free(buf)
    assert_close(output, got, want, dtypes[output])


def test_launch_shapes_scratch_and_sizes():
    rows37 = t.softmax(768).launches({"x": 0, "y": 0, "rows": 37})
    assert (rows37[0].shape.grid, rows37[0].shape.block) == ((5, 1, 1), (256, 1, 1))  # a warp per row, 8 a block
    vocab = t.softmax(50304).launches({"x": 0, "y": 0, "rows": 37})
    assert (vocab[0].shape.grid, vocab[0].shape.block) == ((37, 1, 1), (1024, 1, 1))  # a block per row
    backward = t.layernorm_backward(768)
    # 300 rows fill 38 blocks of 8 warps (a warp a row: fewer rows than 132 blocks' worth), a partial row a warp.
    assert backward.scratch_bytes({"rows": 300}) == {"dweight_partials": 304 * 768 * 4, "dbias_partials": 304 * 768 * 4}
    steps = backward.launches({p.name: 0 for p in backward.params} | {"rows": 300})
    assert [s.shape.grid for s in steps] == [(38, 1, 1), (6, 2, 1)]  # one column_sum for dweight and dbias
    assert steps[1].arguments == (0, 0, 0, 0, 304)  # both partial-row arrays, both sums, their count
    with pytest.raises(ValueError, match="size rows is 0"):
        t.softmax(7).launches({"x": 0, "y": 0, "rows": 0})
    with pytest.raises(ValueError, match="no value for cols"):
        t.softmax(None).launches({"x": 0, "y": 0, "rows": 3})


def test_names_tell_specialisations_apart_and_repeat_for_equal_ones():
    assert t.layernorm(768).kernels[0].name == t.layernorm(768).kernels[0].name
    names = {t.layernorm(768, eps=e).kernels[0].name for e in (1e-5, 1e-6)}
    names |= {t.layernorm(768, dtype="bf16").kernels[0].name, t.layernorm(768, bias=False).kernels[0].name}
    assert len(names) == 4
    one = t.softmax(33).kernels[0]
    assert translation_unit([one, one]).count(f" {one.name}(") == 1
    impostor = t.log_softmax(33).kernels[0]
    with pytest.raises(ValueError, match="two different kernels"):
        translation_unit([one, type(one)(one.name, impostor.family, impostor.code, impostor.params, impostor.shape)])


@pytest.mark.parametrize(("make", "message"), [
    (lambda: t.softmax(33, dtypes={"z": "f32"}), "softmax has no operand 'z'; its operands are x, y"),
    (lambda: t.softmax(33, dtype="f16"), "dtype 'f16' is not one of f32, bf16"),
    (lambda: t.cross_entropy_forward(33, dtypes={"targets": "f32"}), "operand targets: dtype 'f32' is not one of i32"),
    (lambda: t.softmax(33, layout="grid"), "layout 'grid' is not warp or block"),
    (lambda: t.softmax(33, threads=100), "100 threads a block; it must be a multiple of 32"),
    (lambda: t.softmax(0), "a row of 0 elements"),
    (lambda: t.cross_entropy_backward(33, grad="column"), "grad 'column' is not scalar or row"),
    (lambda: t.cross_entropy_forward(33, reduction="max"), "reduction 'max' is not sum or mean"),
    (lambda: t.fill(value=0.5, dtype="i32"), "0.5 is not a value of i32"),
    (lambda: t.copy((2, 3), strides=(1,)), "1 strides for a shape of rank 2"),
    (lambda: t.copy((2, 3), dtype="i32", dtypes={"out": "i64"}), "integers are copied, not converted"),
])
def test_bad_specialisations_are_refused(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_the_float64_references_agree_with_torch_autograd():
    """The hand-derived backward references used above, against PyTorch's autograd in float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x, dy, w, b = rng.standard_normal((5, 33)), rng.standard_normal((5, 33)), rng.standard_normal(33), rng.standard_normal(33)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    torch.nn.functional.layer_norm(tx, (33,), tw, tb, 1e-5).backward(torch.tensor(dy))
    dx, dw, db = layernorm_backward_ref(dy, x, w)
    for mine, theirs in ((dx, tx), (dw, tw), (db, tb)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-10, atol=1e-12)
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    (tx * torch.rsqrt((tx * tx).mean(-1, keepdim=True) + 1e-5) * tw).backward(torch.tensor(dy))
    dx, dw = rmsnorm_backward_ref(dy, x, w)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-10, atol=1e-12)
    targets = rng.integers(0, 33, 5)
    tx = torch.tensor(x, requires_grad=True)
    torch.nn.functional.cross_entropy(tx, torch.tensor(targets), reduction="sum").backward()
    np.testing.assert_allclose(cross_entropy_backward_ref(x, targets, 1.0), tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(cross_entropy_ref(x, targets)[0],
                               torch.nn.functional.cross_entropy(torch.tensor(x), torch.tensor(targets), reduction="none"),
                               rtol=1e-12)
    for forward, backward in ((torch.softmax, softmax_backward_ref), (torch.log_softmax, log_softmax_backward_ref)):
        tx = torch.tensor(x, requires_grad=True)
        y = forward(tx, -1)
        y.backward(torch.tensor(dy))
        np.testing.assert_allclose(backward(y.detach().numpy(), dy), tx.grad.numpy(), rtol=1e-10, atol=1e-12)
