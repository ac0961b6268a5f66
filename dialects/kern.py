"""The `kern` dialect: what a device runs — kernel symbols and the launches a graph makes of them.

The CUDA lowering (`match-patterns`, `fuse`, `plan-buffers`, `emit-cuda`)
turns a `graph.func` into launches: every op that computes is inside a kernel
or a GEMM, and what is left of the graph dialect is its inputs, its return,
its emits and views that cost nothing. Kernels are module-level symbols, so
the twelve identical layernorms of a twelve-layer model are one kernel
launched twelve times:

    kern.kernel @layernorm_f32_768 {kind = "row", family = "layernorm", form = "mean and variance",
        inputs = [tensor<8192x768xf32>, tensor<768xf32>, tensor<768xf32>],
        outputs = [tensor<8192x768xf32>, tensor<8192xf32>, tensor<8192xf32>],
        grid = [1024, 1, 1], block = [256, 1, 1], shared = 0, path = "model.blocks.0.norm1"}
    kern.kernel @fused_3 {kind = "pointwise", domain = [8192, 768], maps = [...], ...} {
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %0 = graph.add %a, %b : (tensor<f32>, tensor<f32>) -> tensor<f32>
      kern.yield %0 : (tensor<f32>) -> ()
    }
    graph.func @train {kind = "train"} {
      ...
      %7, %8, %9 = kern.launch %5, %6, %4 {kernel = @layernorm_f32_768, path = "model.blocks.3.norm1"} : (...) -> (...)
      %10 = kern.gemm %7, %w {transpose_a = false, transpose_b = false, batch = 1, epilogue = "none",
                              alpha = 1.0, beta = 0.0, path = "model.blocks.3.attn.qkv"} : (...) -> ...
    }

Kernel kinds (`KERNEL_KINDS`): `pointwise` and `reduction` (fused groups whose
body is `graph` ops on rank-0 tensors, one block argument per operand
element, ending in `kern.yield`; each operand reaches the body through an
index map from the iteration domain), `multi_tensor_update` (an optimizer
group's per-element update, body alike), and the template kinds without a
body: `row` (a row program `{family, form}`), `cross_entropy` (the tail
`{direction, form}`), `attention` (fused causal or full attention
`{direction, head_dim, causal, scale, placements, sizes, form}`: a
FlashAttention-2-style forward writing O and the log-sum-exp, or the
backward's three steps; `placements` say where each of q, k, v, o, do and
the gradients lives in the buffer bound to it, so a packed QKV projection is
read in place; no sequence×sequence tensor exists), `gather`, `scatter_add`, `copy`, `fill`. Every kernel
carries its signature (`inputs`, `outputs`: tensor types, so shapes and
dtypes), its launch shape (`grid`, `block`: three ints each; `shared`: dynamic
shared-memory bytes) and the model path of the region it came from (`path`).

A body kernel runs over `domain = [d0, d1, ...]` and reads input k through
`maps[k]` (`dialects/index_maps.py`: the element's storage offset as an
expression of the domain index, with a gather through another input, guards
and a fill value for pads); its results are stored contiguously, one element
per domain index (a reduction's kept results, one per kept index). Two ops
exist only in bodies: `kern.index {expr}` (an index expression of the domain
index, i32: `graph.iota`, `graph.one_hot`) and `kern.reduce %v {op}` (the
reduction of `v` over the kernel's `reduce = {axes}`; what uses its result
runs once per kept index, after the reduction).

A reduction split across blocks (`split = S`: its reduced extent in S
chunks down the grid's y, a column sum that would not fill the device
otherwise) has one more input, its counters (i32 zeros it leaves zero), and
one more output, its partial results (f32), outside its body.

`kern.copy` (a value made contiguous) and `kern.fill {value}` (a splat
constant made a buffer) say where `fuse` must materialise a value; `fuse`
turns each into a kernel launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .core import OpDef, Operation, SymbolRef, TensorType, VerifyError, register_op

#: Kernels generated from a body of scalar `graph` ops.
BODY_KINDS = ("pointwise", "reduction", "multi_tensor_update")
#: Kernels written from a parameterised template; no body.
TEMPLATE_KINDS = ("row", "cross_entropy", "attention", "gather", "scatter_add", "copy", "fill")
KERNEL_KINDS = BODY_KINDS + TEMPLATE_KINDS
#: Row-program families (`kern.kernel {kind = "row", family = ...}`).
ROW_FAMILIES = ("softmax", "log_softmax", "layernorm", "rmsnorm", "softmax_backward", "log_softmax_backward",
                "layernorm_backward", "rmsnorm_backward")
CROSS_ENTROPY_DIRECTIONS = ("forward", "backward")
#: What an `attention` kernel's symbol must say besides its signature and launch.
ATTENTION_ATTRS = ("direction", "head_dim", "causal", "scale", "placements", "sizes")
#: The ops a `kern.reduce` in a reduction body applies.
REDUCE_OPS = ("sum", "max", "min")
#: GEMM epilogues cuBLASLt fuses (`bias_grad_*` reduce the GEMM's output into a bias gradient).
GEMM_EPILOGUES = ("none", "bias", "gelu", "gelu_bias", "bias_grad_a", "bias_grad_b")


def _types(op: Operation, key: str) -> list[TensorType]:
    value = op.attributes.get(key)
    if not isinstance(value, list) or not all(isinstance(t, TensorType) for t in value):
        raise VerifyError(f"'{op.name}' attribute '{key}' must be a list of tensor types", op)
    return value


def _dim3(op: Operation, key: str) -> None:
    value = op.attributes.get(key)
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(d, int) and d >= 1 for d in value)):
        raise VerifyError(f"'{op.name}' attribute '{key}' must be three positive ints, got {value}", op)


@register_op
class KernelOp(OpDef):
    """`kern.kernel @sym {kind, inputs, outputs, grid, block, shared, path, ...}`, with a body for body kinds."""

    name = "kern.kernel"
    family = "kernel"
    num_operands = 0
    num_results = 0
    #: Body kinds have one region, template kinds none: checked in `verify`.
    num_regions = 0
    required_attrs = ("sym_name", "kind", "inputs", "outputs", "grid", "block", "shared", "path")
    pure = False

    @classmethod
    def verify(cls, op: Operation) -> None:
        kind = op.attributes.get("kind")
        if kind not in KERNEL_KINDS:
            raise VerifyError(f"'kern.kernel' kind must be one of {', '.join(KERNEL_KINDS)}, got {kind!r}", op)
        expected_regions = 1 if kind in BODY_KINDS else 0
        if len(op.regions) != expected_regions:
            raise VerifyError(f"a '{kind}' kernel has {expected_regions} regions, got {len(op.regions)}", op)
        for attr in cls.required_attrs:
            if attr not in op.attributes:
                raise VerifyError(f"'kern.kernel' requires attribute '{attr}'", op)
        if op.operands or op.results:
            raise VerifyError("'kern.kernel' has no operands or results", op)
        inputs, outputs = _types(op, "inputs"), _types(op, "outputs")
        _dim3(op, "grid")
        _dim3(op, "block")
        if not isinstance(op.attributes["shared"], int) or op.attributes["shared"] < 0:
            raise VerifyError("'kern.kernel' shared must be a non-negative int (bytes)", op)
        if kind == "row" and op.attributes.get("family") not in ROW_FAMILIES:
            raise VerifyError(f"a row kernel's family must be one of {', '.join(ROW_FAMILIES)}", op)
        if kind == "cross_entropy" and op.attributes.get("direction") not in CROSS_ENTROPY_DIRECTIONS:
            raise VerifyError("a cross_entropy kernel's direction must be forward or backward", op)
        if kind == "attention":
            missing = [name for name in ATTENTION_ATTRS if name not in op.attributes]
            if missing:
                raise VerifyError(f"an attention kernel requires attribute '{missing[0]}'", op)
            if op.attributes["direction"] not in CROSS_ENTROPY_DIRECTIONS:
                raise VerifyError("an attention kernel's direction must be forward or backward", op)
        if kind in BODY_KINDS:
            split = op.attributes.get("split", 1)
            if split != 1:
                _verify_split(op, split, inputs, outputs)
                inputs, outputs = inputs[:-1], outputs[:-1]
            _verify_body(op, inputs, outputs)


def _verify_split(op: Operation, split: Any, inputs: Sequence[TensorType], outputs: Sequence[TensorType]) -> None:
    """A reduction split into `split` chunks reads its counters (i32, its last input) and writes its partials
    (f32, its last output), neither of them in its body."""
    if op.attributes["kind"] != "reduction" or not isinstance(split, int) or split < 2:
        raise VerifyError(f"'split' is a reduction's count of chunks, at least 2, got {split!r}", op)
    if not inputs or inputs[-1].dtype != "i32" or not outputs or outputs[-1].dtype != "f32":
        raise VerifyError("a split reduction's last input is its i32 counters and its last output its f32 partials",
                          op)
    grid = op.attributes["grid"]
    if grid[1] != split or inputs[-1].numel < grid[0]:
        raise VerifyError(f"a reduction split {split} ways launches {split} blocks down the grid's y and has a "
                          f"counter for each of its {grid[0]} column strips", op)


def _verify_body(op: Operation, inputs: Sequence[TensorType], outputs: Sequence[TensorType]) -> None:
    """A body takes one rank-0 argument per input and yields one rank-0 value per output, dtypes matching."""
    region = op.regions[0]
    if len(region.blocks) != 1:
        raise VerifyError("a kernel body must have exactly one block", op)
    block = region.blocks[0]
    if len(block.args) != len(inputs):
        raise VerifyError(f"a kernel body takes {len(inputs)} arguments (one per input), got {len(block.args)}", op)
    for arg, t in zip(block.args, inputs):
        if arg.type != TensorType((), t.dtype):
            raise VerifyError(f"body argument {arg.type} does not match the element of input {t}", op)
    last = block.last_op
    if last is None or last.name != "kern.yield":
        raise VerifyError("a kernel body must end with 'kern.yield'", op)
    if len(last.operands) != len(outputs):
        raise VerifyError(f"the body yields {len(last.operands)} values for {len(outputs)} outputs", op)
    for value, t in zip(last.operands, outputs):
        if value.type.rank != 0:
            raise VerifyError(f"the body yields a {value.type}, not a scalar", op)
        if op.attributes["kind"] != "reduction" and value.type.dtype != t.dtype:
            raise VerifyError(f"the body yields {value.type.dtype} for an output of {t.dtype}", op)
    for inner in block.ops:
        if inner is not last and any(r.type.rank != 0 for r in inner.results):
            raise VerifyError(f"'{inner.name}' in a kernel body must compute a scalar", inner)


@register_op
class IndexOp(OpDef):
    """`%i = kern.index {expr = {offset, strides, ...}} : () -> tensor<i32>`: an index expression of
    the domain index of the element a body computes (`index_maps.Expr` in attribute form)."""

    name = "kern.index"
    family = "kernel"
    num_operands = 0
    num_results = 1
    required_attrs = ("expr",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        return [TensorType((), "i32")]

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        expr = op.attributes["expr"]
        if not (isinstance(expr, dict) and "offset" in expr and "strides" in expr):
            raise VerifyError("'kern.index' expr must be a dict with offset and strides", op)


@register_op
class ReduceOp(OpDef):
    """`%s = kern.reduce %v {op = "sum" | "max" | "min"}`: `v` reduced over the kernel's reduced axes."""

    name = "kern.reduce"
    family = "kernel"
    num_operands = 1
    num_results = 1
    required_attrs = ("op",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        return [operands[0]]

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        if op.attributes["op"] not in REDUCE_OPS:
            raise VerifyError(f"'kern.reduce' op must be one of {', '.join(REDUCE_OPS)}", op)
        if op.operands[0].type.rank != 0:
            raise VerifyError("'kern.reduce' reduces a scalar (an element of its kernel's domain)", op)


@register_op
class CopyOp(OpDef):
    """`%y = kern.copy %x`: `x` (often a view) stored contiguously; `fuse` makes it part of a kernel."""

    name = "kern.copy"
    family = "kernel"
    num_operands = 1
    num_results = 1

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        return [operands[0]]


@register_op
class FillOp(OpDef):
    """`%y = kern.fill {value}`: a buffer of the result type holding `value` everywhere."""

    name = "kern.fill"
    family = "kernel"
    num_operands = 0
    num_results = 1
    required_attrs = ("value",)


@register_op
class SourceOp(OpDef):
    """`kern.source {text, kernels}`: the CUDA translation unit `emit-cuda` wrote for the module's kernels."""

    name = "kern.source"
    family = "kernel"
    num_operands = 0
    num_results = 0
    required_attrs = ("text",)
    pure = False


@register_op
class YieldOp(OpDef):
    """`kern.yield %a, %b`: the scalar results of one element of a kernel body."""

    name = "kern.yield"
    family = "kernel"
    num_results = 0
    pure = False
    is_terminator = True


def kernel_symbol(op: Operation) -> str:
    """The kernel a `kern.launch` runs."""
    ref = op.attributes.get("kernel")
    if not isinstance(ref, SymbolRef):
        raise VerifyError("'kern.launch' needs a symbol attribute 'kernel'", op)
    return ref.name


def body_plan_facts(ops: Iterable[Operation]) -> tuple[list[Any], list[str]]:
    """What a kernel body tells its launch plan (`KernelTarget.plan_generated`): the expressions of its
    `kern.index` ops (whether packed accesses stay aligned) and the dtypes its `kern.reduce`s reduce."""
    ops = list(ops)
    return ([op.attributes["expr"] for op in ops if op.name == "kern.index"],
            [op.operands[0].type.dtype for op in ops if op.name == "kern.reduce"])


def adds_into(kernel: Operation, operand: int) -> bool:
    """Whether a launch of `kernel` adds into its operand `operand` (a scatter-add's `accumulate` input):
    each element is read before the same element of the output is written, by the same thread, so the
    output may be written over that operand's array, as over an accumulating GEMM's C."""
    return kernel.attributes["kind"] == "scatter_add" and bool(kernel.attributes.get("accumulate")) and operand == 2


def find_kernel(op: Operation) -> Operation | None:
    """The `kern.kernel` a launch names, looked up in the module holding the launch's graph."""
    name = kernel_symbol(op)
    block = op.parent
    while block is not None and block.parent is not None and block.parent.parent is not None:
        owner = block.parent.parent
        if owner.name == "builtin.module":
            for candidate in owner.body.ops:
                if candidate.name == "kern.kernel" and candidate.attributes.get("sym_name") == name:
                    return candidate
            return None
        block = owner.parent
    return None


@register_op
class LaunchOp(OpDef):
    """`%r = kern.launch %a, %b {kernel = @sym, path}`: one launch; operand and result types are the kernel's."""

    name = "kern.launch"
    family = "kernel"
    num_results = None
    required_attrs = ("kernel", "path")
    pure = False

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        kernel = find_kernel(op)
        if kernel is None:
            raise VerifyError(f"'kern.launch' names an undefined kernel @{kernel_symbol(op)}", op)
        inputs, outputs = kernel.attributes["inputs"], kernel.attributes["outputs"]
        if [v.type for v in op.operands] != list(inputs):
            raise VerifyError(
                f"'kern.launch' operands ({', '.join(str(v.type) for v in op.operands)}) do not match "
                f"@{kernel_symbol(op)}'s inputs ({', '.join(map(str, inputs))})", op)
        if [r.type for r in op.results] != list(outputs):
            raise VerifyError(
                f"'kern.launch' results ({', '.join(str(r.type) for r in op.results)}) do not match "
                f"@{kernel_symbol(op)}'s outputs ({', '.join(map(str, outputs))})", op)


@register_op
class GemmOp(OpDef):
    """`%d = kern.gemm %a, %b[, %bias][, %c] {transpose_a, transpose_b, batch, epilogue, alpha, beta, path}`.

    Row-major `D = alpha · op(A) · op(B) (+ bias) + beta · C` over `batch`
    matrices (operands of rank 3 carry the batch first; a rank-2 operand is
    shared by every batch); `op` transposes the last two axes when asked. The
    bias is an operand when the epilogue names one (a [n] row of the result's
    dtype, as cuBLASLt reads it), `C` when `beta` is not 0. The result dtype
    may differ from the inputs' (f32 compute, output rounded).
    """

    name = "kern.gemm"
    family = "kernel"
    num_results = 1
    required_attrs = ("transpose_a", "transpose_b", "batch", "epilogue", "alpha", "beta", "path")

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        attrs = op.attributes
        if attrs["epilogue"] not in GEMM_EPILOGUES:
            raise VerifyError(f"'kern.gemm' epilogue must be one of {', '.join(GEMM_EPILOGUES)}", op)
        expected = 2 + (attrs["epilogue"] in ("bias", "gelu_bias")) + (attrs["beta"] != 0)
        if len(op.operands) != expected:
            raise VerifyError(f"'kern.gemm' with this epilogue and beta takes {expected} operands, "
                              f"got {len(op.operands)}", op)
        m, n, k = gemm_dims(op)
        a, b = op.operands[0].type, op.operands[1].type
        if a.dtype != b.dtype:
            raise VerifyError(f"'kern.gemm' operands have dtypes {a.dtype} and {b.dtype}", op)
        batch = attrs["batch"]
        out = op.results[0].type
        if out.shape[-2:] != (m, n) or (out.rank == 3 and out.shape[0] != batch) or out.rank not in (2, 3):
            raise VerifyError(f"'kern.gemm' result {out} is not [{batch}, {m}, {n}]", op)
        for t in (a, b):
            if t.rank == 3 and t.shape[0] != batch:
                raise VerifyError(f"'kern.gemm' operand {t} does not have {batch} batches", op)
        if attrs["epilogue"] in ("bias", "gelu_bias") and op.operands[2].type != TensorType((n,), out.dtype):
            raise VerifyError(f"'kern.gemm' bias {op.operands[2].type} is not the result's [{n}] {out.dtype} row", op)
        del k


def gemm_dims(op: Operation) -> tuple[int, int, int]:
    """(m, n, k) of a `kern.gemm` after its transposes; a VerifyError when the operands do not contract."""
    a, b = op.operands[0].type, op.operands[1].type
    if a.rank not in (2, 3) or b.rank not in (2, 3):
        raise VerifyError(f"'kern.gemm' takes rank 2 or 3 operands, got {a} and {b}", op)
    m, ka = (a.shape[-1], a.shape[-2]) if op.attributes["transpose_a"] else a.shape[-2:]
    kb, n = (b.shape[-1], b.shape[-2]) if op.attributes["transpose_b"] else b.shape[-2:]
    if ka != kb:
        raise VerifyError(f"'kern.gemm' operands {a} and {b} do not contract", op)
    return m, n, ka


def kernel_attributes(op: Operation) -> dict[str, Any]:
    """A kernel's attributes without its symbol name (what makes two kernels the same code)."""
    return {k: v for k, v in op.attributes.items() if k not in ("sym_name", "path")}
