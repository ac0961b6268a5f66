"""The roofline estimate of a lowered step: what each launch moves and computes, and how long a GPU takes.

Two halves, so a cached lowering document serves every GPU:

- `launch_costs(func, kernels)`: every launch one call of a lowered graph makes (after `CUDA_LOWERING`),
  with the bytes of device memory it reads and writes and the FLOPs it computes. It reads the `kern`
  ops alone, so `lowering_document` records it for each row (`launch_costs`).
- `estimate(document, gpu)`: those launches timed on one GPU of `GPUS`, and the step they add up to
  (docs/cuda.md, "The step estimate"); `explain --gpu` and `benchmarks/step_estimate.py` call it.

The model of one launch: `time = max(bytes / bandwidth, FLOPs / peak) + launch cost`. Bytes are what the
launch touches in device memory: every output written once; an input of a fused kernel read once per
distinct element its index map reaches (a broadcast reads its source, a gather the rows the indices
name, never more than the tensor holds); a template kernel reads its inputs whole (a gather or copy
template at most one output's worth of its source; a scatter-add into the gradient so far, which the step
runs in place, reads and writes the rows its indices can name); a GEMM reads A, B (a rank-2 operand shared
by the batch once), the bias and C when it has them; a reduction split across blocks also writes its partials
and reads them back, and bumps a counter a block. FLOPs: a GEMM 2·m·n·k·batch; a fused kernel each arithmetic op of its body once per
element of its domain (after a `kern.reduce`, once per kept element); a row or cross-entropy program a
fixed count per element of its input (`ROW_FLOPS`, `CROSS_ENTROPY_FLOPS`); copies, fills and gathers
none. The peak is the GPU's dense tensor-core peak of the GEMM's operand dtype times its achievable
fraction (`gemm_fraction`); f32 GEMMs run at the f32 CUDA-core peak, since cuBLASLt is called with
`CUBLAS_COMPUTE_32F` and no TF32; any other kernel computes at the f32 CUDA-core peak.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import frozen

from ..dialects.core import DTYPE_BYTES, Operation, TensorType
from ..dialects.kern import BODY_KINDS, gemm_dims

#: FLOPs per element of a row program's input (step 0; a later step, a column sum, adds its input once):
#: the arithmetic of llm.c's kernels for the same families, counted per element of x (or dy).
ROW_FLOPS = {
    "softmax": 5,               # max, subtract, exp, sum, divide
    "log_softmax": 6,           # max, subtract, exp, sum, subtract the log (amortised), subtract
    "layernorm": 8,             # sum, subtract the mean, square, sum, scale by rstd, weight, bias
    "rmsnorm": 4,               # square, sum, scale, weight
    "softmax_backward": 4,      # dy·y, sum, subtract, multiply
    "log_softmax_backward": 4,  # exp, sum of dy, multiply, subtract
    "layernorm_backward": 14,   # x̂, dy·w, two row sums, dx, dweight and dbias partials
    "rmsnorm_backward": 9,
}
#: FLOPs per logit of the cross-entropy tail (step 0; the loss's sum step adds its input once).
CROSS_ENTROPY_FLOPS = {"forward": 4, "backward": 4}
#: Block products (each 2·d FLOPs per query-key pair of a head) an `attention` launch computes, by what it
#: writes: the forward's scores and value product; the CUDA backward's row sums D (none), its dK/dV step
#: (scores, dP, dV, dK) and its dQ step (scores, dP, dQ) — the scores and dP recomputed, never stored — and
#: cpu-c's one backward step (scores, dP, dV, dK, dQ).
ATTENTION_PRODUCTS = {("lse", "o"): 2, ("delta",): 0, ("dk", "dv"): 4, ("dq",): 3, ("dk", "dq", "dv"): 5}
#: The products of the math itself (what MFU counts, as the lowered GEMMs of a materialised attention were
#: counted, and as PaLM's 12·L·H·d·T a token does: no recomputation, the masked half included).
ATTENTION_MATH_PRODUCTS = {("lse", "o"): 2, ("delta",): 0, ("dk", "dv"): 2, ("dq",): 2, ("dk", "dq", "dv"): 4}
#: Attention operands of one head-dimension row per token of a head; the others (lse, delta) one f32 per row.
ATTENTION_ROWS = frozenset(("q", "k", "v", "o", "do", "dq", "dk", "dv"))
#: Kernel kinds whose FLOPs the model counts; a kind added to the `kern` dialect later is counted by its
#: bytes alone until it is added here, and the estimate names it (`unmodelled`).
MODELLED_KINDS = frozenset((*BODY_KINDS, "row", "cross_entropy", "attention", "gather", "scatter_add", "copy",
                            "fill"))
#: Body ops that cost no arithmetic: constants, index expressions, conversions and the yield.
FREE_BODY_OPS = frozenset({"graph.const", "kern.index", "graph.cast", "kern.yield"})
#: The CUDA executor captures a graph launching at least this many kernels a call, once warm
#: (backends/cuda/executable.py `CAPTURE_MIN_KERNELS`; a unit test keeps the two equal).
CAPTURE_MIN_KERNELS = 16
#: Device memory the executor leaves free when it chooses the stacking degree (backends/cuda/executor.py
#: `RESERVED_BYTES`; the same unit test keeps them equal).
RESERVED_BYTES = 256 << 20
#: Row kinds a training step runs, each once unless the stacking says otherwise; evaluation, diagnosed
#: and sampling graphs run on their own cadence and are not a step's.
STEP_KINDS = ("train", "train_accumulating", "train_stacked", "clip", "update")


@frozen
class Gpu:
    """One GPU of the estimate's table: datasheet figures (SXM boards, dense: without 2:4 sparsity)."""

    #: The `--gpu` name.
    key: str
    name: str
    #: Device memory (bytes) and its bandwidth (bytes a second).
    memory: int
    bandwidth: float
    #: Dense FLOP/s: tensor cores on bf16 operands (f16 the same), on TF32, and the CUDA cores' f32.
    bf16_peak: float
    tf32_peak: float
    f32_peak: float
    #: The share of the tensor-core peak cuBLAS GEMMs of training shapes reach.
    gemm_fraction: float
    #: Seconds a launch adds: replayed from a captured CUDA graph, and submitted one by one.
    launch_captured: float
    launch_uncaptured: float
    #: Where the figures come from.
    source: str

    def peak(self, math_dtype: str | None) -> float:
        """FLOP/s a launch computing in `math_dtype` reaches: a GEMM's share of its peak, else the f32 cores."""
        if math_dtype in ("bf16", "f16"):
            return self.bf16_peak * self.gemm_fraction
        if math_dtype == "f32":
            return self.f32_peak * self.gemm_fraction
        return self.f32_peak


#: The achievable GEMM fraction: cuBLAS reaches 60-80% of the dense bf16 peak on GPT-2 small's GEMM
#: shapes (llm.c's measured 44% MFU on an H100 includes every non-GEMM kernel); 0.7 is the middle.
_GEMM_FRACTION = 0.7
#: Launch costs are no datasheet figure: a kernel replayed from a CUDA graph costs about 1 µs of device
#: idle between dependent kernels, one submitted by the host through cuLaunchKernel about 4 µs (NVIDIA
#: Technical Blog, "Getting Started with CUDA Graphs", 2019: graph launch cut a short kernel's per-launch
#: overhead to a few µs; the executor submits from Python, which adds host time). The device check replaces
#: them with measured figures when a GPU is lent.
_LAUNCH_CAPTURED = 1.0e-6
_LAUNCH_UNCAPTURED = 4.0e-6

GPUS: dict[str, Gpu] = {gpu.key: gpu for gpu in (
    Gpu("h200", "NVIDIA H200 SXM 141GB", 141 * 10**9, 4.8e12, 989e12, 494e12, 67e12, _GEMM_FRACTION,
        _LAUNCH_CAPTURED, _LAUNCH_UNCAPTURED,
        "NVIDIA H200 Tensor Core GPU datasheet (2024): 4.8 TB/s HBM3e; BF16 1,979 and TF32 989 TFLOPS with "
        "sparsity, halved for dense; FP32 67 TFLOPS"),
    Gpu("h100", "NVIDIA H100 SXM5 80GB", 80 * 10**9, 3.35e12, 989e12, 494e12, 67e12, _GEMM_FRACTION,
        _LAUNCH_CAPTURED, _LAUNCH_UNCAPTURED,
        "NVIDIA H100 Tensor Core GPU datasheet (2023): 3.35 TB/s HBM3; BF16 1,979 and TF32 989 TFLOPS with "
        "sparsity, halved for dense; FP32 67 TFLOPS"),
    Gpu("a100", "NVIDIA A100 SXM4 80GB", 80 * 10**9, 2.039e12, 312e12, 156e12, 19.5e12, _GEMM_FRACTION,
        _LAUNCH_CAPTURED, _LAUNCH_UNCAPTURED,
        "NVIDIA A100 Tensor Core GPU datasheet (2021): 2,039 GB/s HBM2e (80GB SXM); BF16 312 and TF32 156 "
        "TFLOPS dense; FP32 19.5 TFLOPS"),
)}


# -- what each launch moves and computes ----------------------------------------------------------


def launch_costs(func: Operation, kernels: Mapping[str, Operation]) -> list[dict[str, Any]]:
    """Every launch one call of the lowered `func` makes, in execution order: its kernel (`gemm` for
    cuBLASLt), model path, bytes of device memory read and written, FLOPs, whether it is a GEMM and the
    dtype its math runs in (a GEMM's operands; None for the f32 arithmetic of any other kernel)."""
    costs = []
    for op in func.body.ops:
        if op.name == "kern.gemm":
            costs.append(_gemm_cost(op))
        elif op.name == "kern.launch":
            kernel = kernels[op.attributes["kernel"].name]
            if kernel.attributes["kind"] == "attention":
                costs.append({**_attention_cost(kernel), "path": op.attributes.get("path") or None})
                continue
            read, flops = _kernel_reads_and_flops(kernel)
            written = _written(kernel)
            costs.append({"kernel": kernel.attributes["sym_name"], "kind": kernel.attributes["kind"],
                          "path": op.attributes.get("path") or None, "bytes": read + written, "flops": flops,
                          "gemm": False, "math": None, "model_flops": 0})
    return costs


def _gemm_cost(op: Operation) -> dict[str, Any]:
    m, n, k = gemm_dims(op)
    batch = op.attributes["batch"]
    moved = sum(v.type.nbytes for v in op.operands) + sum(r.type.nbytes for r in op.results)
    return {"kernel": "gemm", "kind": "gemm", "path": op.attributes.get("path") or None, "bytes": moved,
            "flops": 2 * m * n * k * batch, "gemm": True, "math": op.operands[0].type.dtype,
            "model_flops": 2 * m * n * k * batch}


def _attention_cost(kernel: Operation) -> dict[str, Any]:
    """A fused attention step: its operands read and written once each (K and V re-read by each query
    block come from L2, as FlashAttention-2's analysis assumes), the block products it computes (the
    causal ones up to the diagonal) and those of the math (`model_flops`, what MFU counts). Tensor-core
    kernels (bf16, head dimensions a multiple of 16) run at the bf16 GEMM peak, the others at the f32 one."""
    attrs = kernel.attributes
    sizes, d, dtype = attrs["sizes"], attrs["head_dim"], attrs["inputs"][0].dtype
    rows = sizes["batch"] * sizes["heads"] * sizes["seq"]
    moved = sum(rows * (d * DTYPE_BYTES[dtype] if name in ATTENTION_ROWS else 4) for name in attrs["operands"])
    key = tuple(sorted(attrs["operands"][len(attrs["inputs"]):]))
    pairs = sizes["batch"] * sizes["heads"] * sizes["seq"] ** 2
    computed = pairs * (sizes["seq"] + 1) // (2 * sizes["seq"]) if attrs["causal"] else pairs
    return {"kernel": attrs["sym_name"], "kind": "attention", "bytes": moved,
            "flops": 2 * d * computed * ATTENTION_PRODUCTS[key], "gemm": False,
            "math": "bf16" if dtype == "bf16" and d % 16 == 0 else None,
            "model_flops": 2 * d * pairs * ATTENTION_MATH_PRODUCTS[key]}


def _kernel_reads_and_flops(kernel: Operation) -> tuple[int, int]:
    """Bytes a launch of `kernel` reads and the FLOPs it computes (see the module docstring)."""
    attrs = kernel.attributes
    inputs: list[TensorType] = attrs["inputs"]
    kind = attrs["kind"]
    if kind in BODY_KINDS:
        domain, maps = attrs["domain"], attrs["maps"]
        read = sum(_touched(t, _reached(m, maps, domain)) for t, m in zip(inputs, maps))
        if attrs.get("split", 1) > 1:
            # The last block of each strip reads the partials back; every block bumps its strip's counter.
            read += attrs["outputs"][-1].nbytes + math.prod(attrs["grid"]) * DTYPE_BYTES["i32"]
        return read, _body_flops(kernel)
    if kind in ("gather", "copy"):
        # Indices are read whole; a table or a strided source at most one output's worth (what is taken).
        out = sum(t.numel for t in attrs["outputs"])
        return sum(t.nbytes if t.dtype.startswith("i") else _touched(t, out) for t in inputs), 0
    read = sum(t.nbytes for t in inputs)
    if kind in ("row", "cross_entropy"):
        if attrs.get("step", 0) > 0:  # a later step (column sums, the loss's sum) adds its inputs once
            return read, sum(t.numel for t in inputs)
        per_element = ROW_FLOPS[attrs["family"]] if kind == "row" else CROSS_ENTROPY_FLOPS[attrs["direction"]]
        return read, per_element * inputs[0].numel
    if kind == "scatter_add":
        flops = max(t.numel for t in inputs if not t.dtype.startswith("i"))
        if attrs.get("accumulate"):  # the indices and updates whole, of what it adds into the rows named
            return sum(t.nbytes for t in inputs[:2]) + _rows_added(kernel), flops
        return read, flops
    return read, 0  # fill: data movement only; a kind outside MODELLED_KINDS: its bytes alone


def _written(kernel: Operation) -> int:
    """Bytes a launch of `kernel` writes: every output whole, but a scatter-add into the gradient so far,
    which the step's driver runs in place, writes the rows its indices name."""
    attrs = kernel.attributes
    if attrs["kind"] == "scatter_add" and attrs.get("accumulate"):
        return _rows_added(kernel)
    return sum(t.nbytes for t in attrs["outputs"])


def _rows_added(kernel: Operation) -> int:
    """Bytes of the rows an accumulating scatter-add's indices can name: at most one per position."""
    indices, _, initial = kernel.attributes["inputs"]
    return _touched(initial, min(indices.numel, initial.shape[0]) * initial.shape[1])


def _touched(tensor: TensorType, elements: int) -> int:
    """Bytes of `tensor` a launch reaching `elements` of its elements reads: never more than it holds."""
    return min(tensor.numel, elements) * DTYPE_BYTES[tensor.dtype]


def _reached(index_map: Mapping[str, Any], maps: Sequence[Mapping[str, Any]], domain: Sequence[int]) -> int:
    """How many distinct elements an index map reaches over the domain, at most: the product of the
    domain axes it depends on (a gather's through its index input's map)."""
    return math.prod(domain[axis] for axis in _axes(index_map, maps))


def _axes(index_map: Mapping[str, Any], maps: Sequence[Mapping[str, Any]]) -> set[int]:
    axes = {axis for axis, stride in enumerate(index_map["strides"]) if stride}
    axes |= {term[0] for term in index_map.get("terms", [])}
    gather = index_map.get("gather")
    if gather is not None:
        axes |= _axes(maps[gather[0]], maps)
    return axes


def _body_flops(kernel: Operation) -> int:
    """The arithmetic of a fused kernel's body over its domain: each op once per domain element, an op
    that reads a reduction's result once per kept element."""
    attrs = kernel.attributes
    domain = attrs["domain"]
    elements = math.prod(domain)
    reduced_axes = attrs.get("reduce", {}).get("axes", []) if attrs["kind"] == "reduction" else []
    kept = elements // math.prod(domain[a] for a in reduced_axes) if reduced_axes else elements
    after_reduce: set[int] = set()
    flops = 0
    for op in kernel.regions[0].blocks[0].ops:
        if op.name == "kern.reduce":
            after_reduce.update(id(r) for r in op.results)
            flops += elements
            continue
        late = any(id(v) in after_reduce for v in op.operands)
        if late:
            after_reduce.update(id(r) for r in op.results)
        if op.name not in FREE_BODY_OPS:
            flops += kept if late else elements
    return flops


# -- the step on one GPU --------------------------------------------------------------------------


#: A board named with one of these has other clocks, memory and bandwidth than the SXM board of the same
#: chip that `GPUS` describes (H100 PCIe: 756 dense bf16 TFLOP/s against the SXM's 989).
OTHER_BOARDS = ("pcie", "nvl")


def gpu_named(device_name: str | None) -> Gpu | None:
    """The GPU of `GPUS` a device reports itself as (its CUDA name: "NVIDIA H100 80GB HBM3", "NVIDIA
    A100-SXM4-80GB"); None for one the table lacks, the PCIe and NVL boards of its chips included."""
    name = (device_name or "").lower()
    if not name or any(board in name for board in OTHER_BOARDS):
        return None
    return next((gpu for gpu in GPUS.values() if gpu.key in name), None)


def unknown_gpu_message(name: str) -> str:
    """The one line `--gpu NAME` prints for a GPU not in the table."""
    return f"--gpu must be one of {', '.join(GPUS)}, not {name}"


def stacking_on(gpu: Gpu, degrees: Sequence[int], persistent_bytes: int, microbatch_bytes: int) -> int:
    """The stacking degree a run on `gpu` would choose, as the CUDA executor does: the largest of `degrees`
    whose k microbatches' activations (k times `microbatch_bytes`, a microbatch's share of a lowered arena)
    fit in the memory the persistent arrays and the executor's reserve leave; 1 when none does."""
    room = gpu.memory - persistent_bytes - RESERVED_BYTES
    return next((k for k in sorted(degrees, reverse=True) if k * microbatch_bytes <= room), 1)


def step_calls(document: Mapping[str, Any]) -> dict[str, int]:
    """How many times a training step calls each row (by name): with stacking degree k (the degree a
    device chose, else the one `train stacked` was lowered for) the m microbatches run as m/k calls of
    `train stacked` (its accumulating twin launches the same kernels), without stacking one `train` and
    m - 1 `train accumulating`; then each clip graph and each optimizer group's update once."""
    stacking = document["stacking"]
    microbatches = max(1, stacking["microbatches"] // stacking["ranks"])
    degree = stacking["chosen"] or stacking["planned"] or 1
    calls = {}
    for row in document["rows"]:
        kind = row["kind"]
        if kind == "train_stacked":
            calls[row["name"]] = microbatches // degree if degree > 1 else 0
        elif kind == "train":
            calls[row["name"]] = 1 if degree == 1 else 0
        elif kind == "train_accumulating":
            calls[row["name"]] = microbatches - 1 if degree == 1 else 0
        elif kind in STEP_KINDS:
            calls[row["name"]] = 1
    return calls


def row_captured(row: Mapping[str, Any]) -> bool:
    """Whether the executor runs the row's calls from a captured CUDA graph once warm: as a device said, or
    else by the executor's rule (capture on, at least `CAPTURE_MIN_KERNELS` launches a call)."""
    if row["captured"] is not None:
        return bool(row["captured"])
    return row["kernels"] >= CAPTURE_MIN_KERNELS


def launch_time(cost: Mapping[str, Any], gpu: Gpu, captured: bool) -> dict[str, float]:
    """One launch's modelled seconds: `memory` (bytes over bandwidth), `compute` (FLOPs over its peak),
    `launch` (its launch cost) and `total` = max(memory, compute) + launch."""
    memory = cost["bytes"] / gpu.bandwidth
    compute = cost["flops"] / gpu.peak(cost["math"])
    launch = gpu.launch_captured if captured else gpu.launch_uncaptured
    return {"memory": memory, "compute": compute, "launch": launch, "total": max(memory, compute) + launch}


def estimate(document: Mapping[str, Any], gpu: Gpu, tokens_per_step: int | None) -> dict[str, Any]:
    """The lowering document's rows and step on `gpu`: each row's modelled milliseconds a call (its `rows`
    entries, by name), and the step's time, tokens a second, MFU, device-memory traffic, launches and the
    shares of GEMMs, memory-bound kernels and launch costs; the top launches by modelled time. Each row
    needs its `launch_costs` (`lowering_document` records them)."""
    calls = step_calls(document)
    rows = {}
    step = {"seconds": 0.0, "gemm": 0.0, "memory_bound": 0.0, "compute_bound": 0.0, "launch": 0.0,
            "bytes": 0, "flops": 0, "gemm_flops": 0, "launches": 0}
    math_flops: dict[str, int] = {}
    timed = []
    for row in document["rows"]:
        captured = row_captured(row)
        seconds = 0.0
        per_call = {"gemm": 0.0, "memory_bound": 0.0, "compute_bound": 0.0, "launch": 0.0}
        for cost in row["launch_costs"]:
            time = launch_time(cost, gpu, captured)
            seconds += time["total"]
            bound = "gemm" if cost["gemm"] else "memory_bound" if time["memory"] >= time["compute"] else "compute_bound"
            per_call[bound] += max(time["memory"], time["compute"])
            per_call["launch"] += time["launch"]
            if calls.get(row["name"]):
                timed.append((time["total"] * calls[row["name"]], row["name"], cost))
        count = calls.get(row["name"], 0)
        rows[row["name"]] = {"ms": seconds * 1e3, "calls": count, "captured": captured}
        if not count:
            continue
        step["seconds"] += seconds * count
        for key, value in per_call.items():
            step[key] += value * count
        step["bytes"] += count * sum(c["bytes"] for c in row["launch_costs"])
        step["flops"] += count * sum(c["flops"] for c in row["launch_costs"])
        step["launches"] += count * len(row["launch_costs"])
        for cost in row["launch_costs"]:
            if cost["model_flops"]:
                step["gemm_flops"] += count * cost["model_flops"]
                math = cost["math"] or "f32"
                math_flops[math] = math_flops.get(math, 0) + count * cost["model_flops"]
    seconds = step["seconds"]
    # MFU counts the launches' GEMM FLOPs and a fused attention's products (the model's matmuls: 6·N a
    # token for the weights, the attention's score and value products, no recomputation) against the
    # peak of their dtype.
    gemm_math = max(math_flops, key=lambda m: math_flops[m]) if math_flops else "bf16"
    peak = gpu.bf16_peak if gemm_math in ("bf16", "f16") else gpu.f32_peak
    timed.sort(key=lambda t: -t[0])
    unmodelled = sorted({c["kind"] for _, _, c in timed if c["kind"] != "gemm" and c["kind"] not in MODELLED_KINDS})
    return {
        "gpu": gpu.key,
        "gpu_name": gpu.name,
        "source": gpu.source,
        "stacking": document["stacking"]["chosen"] or document["stacking"]["planned"] or 1,
        "rows": rows,
        "step_ms": seconds * 1e3,
        "tokens_per_step": tokens_per_step,
        "tokens_per_second": tokens_per_step / seconds if tokens_per_step and seconds else None,
        "mfu": step["gemm_flops"] / (seconds * peak) if seconds else None,
        "mfu_dtype": gemm_math,
        "flops_per_token": step["gemm_flops"] / tokens_per_step if tokens_per_step else None,
        "bytes": step["bytes"],
        "flops": step["flops"],
        "gemm_flops": step["gemm_flops"],
        "launches": step["launches"],
        "shares": {key: step[key] / seconds if seconds else 0.0
                   for key in ("gemm", "memory_bound", "compute_bound", "launch")},
        "unmodelled": unmodelled,
        "top": [{"row": name, "kernel": cost["kernel"], "path": cost["path"], "ms_per_step": total * 1e3,
                 "bytes": cost["bytes"], "flops": cost["flops"]} for total, name, cost in timed[:10]],
    }
