"""How each kernel `fuse` makes is launched: the shape a generated kernel runs in, and the template
program behind each template kind.

`fuse` asks here, through the CUDA target (`backends/cuda/target.py`), for
every kernel's `grid`, `block` and `shared` when it creates the kernel, and
`emit-cuda` writes the code for the same plan, so the
launch shape a kernel carries is always the one its code was written for.

Generated kernels (`pointwise`, `multi_tensor_update`, `reduction`):
- `flat`: grid-stride over the domain, 256 threads a block, each thread
  `vector` consecutive elements of the innermost axis (128-bit accesses where
  every map walks that axis contiguously, or not at all, from an aligned
  offset);
- `rows`: a reduction over the innermost axis, one warp per kept element
  (eight a block) when the reduced extent is at most 1024, `blocks` one block
  per kept element otherwise;
- `columns`: a reduction whose innermost axis is kept, 32 kept elements
  across a block's x and 16 partial sums down its y, combined in order.
Every reduction combines partial sums in a fixed order (warp shuffles in a
butterfly, then warps or rows in index order), so its result depends only on
the sizes, never on the order threads run in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ....dialects.core import DTYPE_BYTES, TensorType
from ....dialects.index_maps import Expr
from ....passes.targets import LaunchPlan
from . import templates
from .kernel_source import KernelProgram

FLAT_THREADS = 256
#: Grid-stride loops cover the rest; more blocks than this only add scheduling work.
MAX_FLAT_BLOCKS = 8192
ROWS_PER_BLOCK = 8
WARP_ROW_LIMIT = 1024
COLUMN_LANES = 32
COLUMN_PARTS = 16
#: Dtypes a generated kernel stores packed (others are read and written one element at a time).
PACKED_DTYPES = ("f32", "bf16")


def _flat_blocks(items: int) -> int:
    return max(1, min(-(-items // FLAT_THREADS), MAX_FLAT_BLOCKS))


def vector_width(domain: Sequence[int], maps: Sequence[Mapping[str, Any]], inputs: Sequence[TensorType],
                 outputs: Sequence[TensorType], index_exprs: Sequence[Mapping[str, Any]] = ()) -> int:
    """Elements of the innermost axis one thread handles with packed accesses (1: none)."""
    if not domain:
        return 1
    last = len(domain) - 1
    packed: list[str] = [t.dtype for t in outputs]
    for attribute, t in zip(maps, inputs):
        expr = Expr.from_attribute(domain, attribute)
        stride = expr.stride_of(last)
        if stride is None or "guards" in attribute:
            return 1
        if "gather" in attribute and Expr.from_attribute(domain, maps[attribute["gather"][0]]).stride_of(last) != 0:
            return 1  # the gathered row must be the same for every element of a packed access
        if stride:
            if stride != 1:
                return 1
            packed.append(t.dtype)
    if any(d not in PACKED_DTYPES for d in packed):
        return 1
    width = 16 // max(DTYPE_BYTES[d] for d in packed)
    while width > 1:
        aligned = domain[last] % width == 0 and all(
            _multiple_off_last(Expr.from_attribute(domain, a), last, width)
            for a, t in zip(maps, inputs) if Expr.from_attribute(domain, a).stride_of(last))
        if aligned and all(_index_ok(Expr.from_attribute(domain, e), last, width) for e in index_exprs):
            return width
        width //= 2
    return 1


def _multiple_off_last(expr: Expr, last: int, width: int) -> bool:
    """Whether everything but the innermost axis's unit stride moves the offset by multiples of `width`."""
    return expr.const % width == 0 and all(t.coeff % width == 0 for t in expr.terms if t.axis != last) and all(
        g.coeff % width == 0 for g in expr.gathers)


def _index_ok(expr: Expr, last: int, width: int) -> bool:
    return all(t.axis != last or (t.div == 1 and not t.mod) for t in expr.terms)


def plan_generated(kind: str, domain: Sequence[int], reduce_axes: Sequence[int], maps: Sequence[Mapping[str, Any]],
                   inputs: Sequence[TensorType], outputs: Sequence[TensorType],
                   index_exprs: Sequence[Mapping[str, Any]] = ()) -> LaunchPlan:
    """The launch of a generated kernel of `kind` over `domain` reading through `maps`."""
    if kind != "reduction":
        vector = vector_width(domain, maps, inputs, outputs, index_exprs)
        blocks = _flat_blocks(math.prod(domain) // vector)
        return LaunchPlan("flat", (blocks, 1, 1), (FLAT_THREADS, 1, 1), 0, vector)
    reduced = math.prod(domain[a] for a in reduce_axes)
    kept = math.prod(domain) // reduced
    if domain and (len(domain) - 1) not in reduce_axes:
        return LaunchPlan("columns", (-(-kept // COLUMN_LANES), 1, 1), (COLUMN_LANES, COLUMN_PARTS, 1))
    if reduced <= WARP_ROW_LIMIT:
        return LaunchPlan("rows", (-(-kept // ROWS_PER_BLOCK), 1, 1), (32 * ROWS_PER_BLOCK, 1, 1))
    threads = 256 if reduced <= 32 * 1024 else 1024
    return LaunchPlan("blocks", (kept, 1, 1), (threads, 1, 1))


# -- template kinds -------------------------------------------------------------------------------


def template_program(kind: str, attributes: Mapping[str, Any]) -> KernelProgram:
    """The template program a `fill`, `copy` or `scatter_add` kernel runs."""
    inputs, outputs = attributes["inputs"], attributes["outputs"]
    if kind == "fill":
        return templates.fill(value=attributes["value"], dtype=outputs[0].dtype)
    if kind == "copy":
        domain = attributes["domain"]
        strides = Expr.from_attribute(domain, attributes["maps"][0]).strides()
        assert strides is not None, "a copy kernel reads through plain strides"
        return templates.copy(domain, strides=strides, offset=attributes["maps"][0]["offset"],
                              dtype=outputs[0].dtype, dtypes={"src": inputs[0].dtype, "out": outputs[0].dtype})
    if kind == "scatter_add":
        indices, src = inputs[:2]
        return templates.scatter_add(src.shape[1], dtype=outputs[0].dtype,
                                     dtypes={"indices": indices.dtype, "src": src.dtype, "out": outputs[0].dtype},
                                     accumulate=bool(attributes.get("accumulate", False)))
    raise ValueError(f"no template for kernel kind {kind!r}")


def template_sizes(kind: str, attributes: Mapping[str, Any]) -> dict[str, int]:
    """The size arguments a template kernel takes, fixed by its operand shapes."""
    outputs = attributes["outputs"]
    if kind == "fill":
        return {"count": outputs[0].numel}
    if kind == "scatter_add":
        return {"positions": attributes["inputs"][0].numel, "out_rows": outputs[0].shape[0]}
    return {}


def plan_template(kind: str, attributes: Mapping[str, Any]) -> tuple[LaunchPlan, dict[str, int], list[int]]:
    """The launch of a template kernel, its size arguments and the bytes of each scratch buffer."""
    program = template_program(kind, attributes)
    if len(program.steps) != 1:
        raise ValueError(f"a {kind} kernel is one launch; its template has {len(program.steps)}")
    sizes = template_sizes(kind, attributes)
    shape = program.steps[0].kernel.launch(program.all_sizes(sizes))
    scratch = list(program.scratch_bytes(sizes).values())
    return LaunchPlan("template", shape.grid, shape.block, shape.shared_bytes), sizes, scratch
