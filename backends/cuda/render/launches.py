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
  When those blocks (one per 32 kept elements) would not fill the device
  (`column_split`: fewer than the target's SMs can hold at once, a bias
  gradient's 24 blocks on a 132-SM H200) and the reduced extent is long
  enough, the reduced rows are split into `split` chunks down the grid's y:
  each block writes its 32 partial results to the `partials` scratch, and
  the last block of a column strip to finish (a per-strip counter bumped
  atomically after a `__threadfence`) combines the strip's partials in
  chunk order 0..split-1, runs the epilogue and sets the counter back to
  zero (llm.c's bias gradient in one launch instead of its two).
Every reduction combines partial sums in a fixed order (warp shuffles in a
butterfly, then warps or rows in index order, then chunks in index order),
so its result depends only on the sizes and the target, never on the order
threads or blocks run in.
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
#: Resident threads one SM holds (sm_80 to sm_90): a split column reduction launches enough blocks of
#: `COLUMN_LANES * COLUMN_PARTS` threads to fill every SM with them, as llm.c sizes its bias-gradient grid.
THREADS_PER_SM = 2048
#: The fewest reduced rows a chunk of a split column reduction walks (each of its 16 row lanes at least 4):
#: shorter chunks would spend more on the partials and the combine than the split gains.
MIN_CHUNK_ROWS = 64
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
                   index_exprs: Sequence[Mapping[str, Any]] = (), multiprocessors: int = 0,
                   accumulators: Sequence[str] = (), split: int | None = None) -> LaunchPlan:
    """The launch of a generated kernel of `kind` over `domain` reading through `maps`, on a device of
    `multiprocessors` SMs (0: unknown, no reduction is split). `accumulators` are the dtypes a reduction's
    `kern.reduce`s reduce; `split` (a kernel's recorded one) replaces the choice of `column_split`."""
    if kind != "reduction":
        vector = vector_width(domain, maps, inputs, outputs, index_exprs)
        blocks = _flat_blocks(math.prod(domain) // vector)
        return LaunchPlan("flat", (blocks, 1, 1), (FLAT_THREADS, 1, 1), 0, vector)
    reduced = math.prod(domain[a] for a in reduce_axes)
    kept = math.prod(domain) // reduced
    if domain and (len(domain) - 1) not in reduce_axes:
        strips = -(-kept // COLUMN_LANES)
        if split is None:
            split = column_split(strips, reduced, multiprocessors, accumulators)
        if split == 1:
            return LaunchPlan("columns", (strips, 1, 1), (COLUMN_LANES, COLUMN_PARTS, 1))
        partials, counters = split_scratch(kept, split, len(accumulators), max(strips, multiprocessors))
        return LaunchPlan("columns", (strips, split, 1), (COLUMN_LANES, COLUMN_PARTS, 1), split=split,
                          scratch=partials, counters=counters)
    if reduced <= WARP_ROW_LIMIT:
        return LaunchPlan("rows", (-(-kept // ROWS_PER_BLOCK), 1, 1), (32 * ROWS_PER_BLOCK, 1, 1))
    threads = 256 if reduced <= 32 * 1024 else 1024
    return LaunchPlan("blocks", (kept, 1, 1), (threads, 1, 1))


def column_split(strips: int, reduced: int, multiprocessors: int, accumulators: Sequence[str] = ()) -> int:
    """Chunks the reduced rows of a column reduction of `strips` blocks are split into (1: none): enough for
    `strips * chunks` blocks to fill `multiprocessors` SMs at full occupancy, each chunk at least
    `MIN_CHUNK_ROWS` rows, every chunk non-empty. Float accumulators only (the partials are f32)."""
    blocks_wanted = multiprocessors * THREADS_PER_SM // (COLUMN_LANES * COLUMN_PARTS)
    if strips >= multiprocessors or not accumulators or any(d not in PACKED_DTYPES for d in accumulators):
        return 1
    chunks = min(-(-blocks_wanted // strips), reduced // MIN_CHUNK_ROWS)
    if chunks < 2:
        return 1
    return -(-reduced // chunk_rows(reduced, chunks))


def chunk_rows(reduced: int, split: int) -> int:
    """Reduced rows each chunk of a column reduction split `split` ways walks (the last one the rest)."""
    return -(-reduced // split)


def split_scratch(kept: int, split: int, reductions: int, counters: int) -> tuple[TensorType, TensorType]:
    """The scratch of a split column reduction: its partials (f32, `[reductions, split, kept]` flat) and
    its `counters` (i32; strip x uses counter x). A reduction splits only while its strips are fewer than
    the SMs, so counters as many as the SMs serve every split launch of a graph: one buffer, one fill."""
    return TensorType((reductions * split * kept,), "f32"), TensorType((counters,), "i32")


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
