"""What one call of a lowered graph does on the device, read off the `kern` IR once.

After `CUDA_LOWERING` a `graph.func` holds inputs, dense constants, free
views, `kern.launch`es, `kern.gemm`s, its return and its emits
(`docs/cuda.md`, "The lowering"). `GraphPlan(func)` turns that into steps a
launcher runs in order, each operand a `Place` — where its bytes are during
a call, relative to a base the call supplies:

- `arena`: an offset in the activation arena (`plan-buffers`' `offsets`;
  a pattern kernel's scratch is a value like any other);
- `input`: an offset in the array the caller passed for input k;
- `const`: a dense `graph.const`, uploaded once;
- `external`: a value the graph returns or emits (`plan-buffers` leaves
  those without an offset): the caller's `out` array where that is safe, else
  a slot the executable keeps.

A free view (reshape, squeeze, expand_dims) is the place of what it views.
Nothing here touches a device: `backends/cuda/executable.py` binds the bases
and launches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from attrs import define, frozen

from ...dialects.core import Operation, TensorType, Value
from ...dialects.graph import emit_collection, emit_name, input_name, input_role, return_names
from ...dialects.graph_semantics import numpy_dtypes
from ...dialects.index_maps import Expr
from ...dialects.kern import adds_into, find_kernel, gemm_dims
from .cublaslt import GemmSpec

#: Views that cost nothing: the same bytes read as another shape.
FREE_VIEWS = ("graph.reshape", "graph.squeeze", "graph.expand_dims")
#: Kinds of `kern.kernel` each of whose threads reads an operand element and then writes the
#: result element of the same index, so an output may be the caller's array of an input it reads
#: through the identity map (plan-buffers' in-place rule).
ELEMENTWISE_KINDS = ("pointwise", "multi_tensor_update")
EMIT_OPS = ("graph.metric", "graph.counter", "graph.observe")
ALIGNMENT = 256


def numpy_dtype(dtype: str) -> np.dtype:
    """The host numpy dtype of an IR dtype (bf16 through ml_dtypes)."""
    return np.dtype(numpy_dtypes()[dtype])


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@frozen
class Place:
    """Where a value's bytes are during a call: `kind` ("arena", "input", "const", "external"), which
    input, constant or external value (`index`), and a byte offset from its start."""

    kind: str
    index: int
    offset: int = 0


@frozen
class LaunchStep:
    """One kernel launch: its function, launch shape and arguments (places and sizes by value)."""

    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    arguments: tuple[Place | int | float, ...]
    #: The `kern.kernel` symbol and the model path of the launch, for errors and listings.
    symbol: str
    path: str
    #: The byte alignment the kernel's vector accesses assume of every pointer argument (emit-cuda's).
    alignment: int = 4


@frozen
class GemmStep:
    """One cuBLASLt GEMM: `d = alpha · op(a) @ op(b) (+ bias) + beta · c`."""

    spec: GemmSpec
    alpha: float
    beta: float
    a: Place
    b: Place
    d: Place
    c: Place | None
    bias: Place | None
    path: str


@frozen
class Emit:
    """A `graph.metric`, `graph.counter` or `graph.observe`: where its value is after a call."""

    collection: str
    name: str
    place: Place
    type: TensorType


@frozen
class Output:
    """An output of the graph by name: where its value is after a call."""

    name: str
    place: Place
    type: TensorType


@define
class ExternalValue:
    """A value the graph returns or emits, written by one launch or GEMM (`producer`, its step index)."""

    type: TensorType
    producer: int
    #: input index -> whether the producer reads it in a way that allows writing this value over it
    #: (an elementwise kernel through the identity map, the C of an accumulating GEMM, what a scatter adds into).
    reads_in_place: dict[int, bool]


def gemm_spec(op: Operation) -> tuple[GemmSpec, float, float]:
    """The cuBLASLt problem of a `kern.gemm`: its GemmSpec (rank-2 operands shared by every batch),
    alpha and beta."""
    m, n, k = gemm_dims(op)
    a, b = op.operands[0].type, op.operands[1].type
    out = op.results[0].type
    batch = int(op.attributes["batch"])
    spec = GemmSpec(m, n, k, transpose_a=bool(op.attributes["transpose_a"]),
                    transpose_b=bool(op.attributes["transpose_b"]), dtype=a.dtype,
                    out_dtype=out.dtype if out.dtype != a.dtype else None, batch=batch,
                    stride_a=0 if batch > 1 and a.rank == 2 else None,
                    stride_b=0 if batch > 1 and b.rank == 2 else None,
                    epilogue=str(op.attributes["epilogue"]).replace("_", "-"))
    return spec, float(op.attributes["alpha"]), float(op.attributes["beta"])


def _identity_read(kernel: Operation, operand: int) -> bool:
    """Whether a kernel reads operand `operand` at each domain index's own row-major position."""
    attribute = kernel.attributes["maps"][operand]
    domain = list(kernel.attributes["domain"])
    return set(attribute) == {"offset", "strides"} and Expr.from_attribute(domain, attribute) == Expr.flat(domain)


class GraphPlan:
    """The steps of one lowered `graph.func` and where its inputs, outputs and emits live."""

    def __init__(self, func: Operation) -> None:
        self.name = str(func.attributes["sym_name"])
        self.arena_bytes = int(func.attributes.get("arena_bytes", 0))
        self.inputs: list[Operation] = []
        self.constants: list[np.ndarray] = []
        self.externals: list[ExternalValue] = []
        self.steps: list[LaunchStep | GemmStep] = []
        self.outputs: list[Output] = []
        self.emits: list[Emit] = []
        #: input index -> the index of the last step that reads it (-1: none does).
        self.last_read: dict[int, int] = {}
        self._places: dict[Value, Place] = {}
        self._pending: dict[Value, int] = {}
        for op in func.body.ops:
            self._add(op)

    @property
    def arena_need(self) -> int:
        """Bytes of activation arena one call uses: the buffers `plan-buffers` placed."""
        return aligned(self.arena_bytes)

    @property
    def kernels_per_call(self) -> int:
        return len(self.steps)

    def input_types(self) -> Iterator[tuple[str, str, TensorType]]:
        for op in self.inputs:
            yield input_name(op), input_role(op), op.result.type

    # -- reading the IR ----------------------------------------------------------------------------

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
                self.outputs.append(Output(out_name, self._places[value], value.type))
        elif name in EMIT_OPS:
            value = op.operands[0]
            self.emits.append(Emit(emit_collection(op), emit_name(op), self._places[value], value.type))
        else:
            raise ValueError(f"a lowered graph holds '{name}', which the CUDA executor does not run")

    def _result_places(self, op: Operation) -> list[Place]:
        places = []
        for result, offset in zip(op.results, op.attributes["offsets"]):
            if offset is None:
                place = Place("external", len(self.externals))
                self.externals.append(ExternalValue(result.type, len(self.steps), {}))
            else:
                place = Place("arena", 0, int(offset))
            self._places[result] = place
            places.append(place)
        return places

    def _reads(self, op: Operation, in_place: Sequence[bool], results: Sequence[Place]) -> None:
        """Record that the step about to be added reads its operands' inputs, and for each result it
        writes outside the arena whether it may overwrite each of them (`in_place`, per operand)."""
        step = len(self.steps)
        for value, allowed in zip(op.operands, in_place):
            place = self._places[value]
            if place.kind != "input":
                continue
            self.last_read[place.index] = step
            for result in results:
                if result.kind == "external":
                    reads = self.externals[result.index].reads_in_place
                    reads[place.index] = reads.get(place.index, True) and allowed

    def _launch(self, op: Operation) -> None:
        kernel = find_kernel(op)
        if kernel is None:
            raise ValueError(f"kern.launch of an undefined kernel in @{self.name}")
        attrs = kernel.attributes
        kind = attrs["kind"]
        elementwise = kind in ELEMENTWISE_KINDS
        results = self._result_places(op)
        self._reads(op, [(elementwise and _identity_read(kernel, k)) or adds_into(kernel, k)
                         for k in range(len(op.operands))], results)
        operands = [self._places[v] for v in op.operands]
        path = str(op.attributes.get("path") or attrs.get("path") or "")
        symbol = str(attrs["sym_name"])
        bound = {**{f"in{k}": p for k, p in enumerate(operands)}, **{f"out{k}": p for k, p in enumerate(results)}}
        arguments = tuple(bound[a] if isinstance(a, str) else a for a in attrs["arguments"])
        self.steps.append(LaunchStep(str(attrs["function"]), tuple(attrs["grid"]), tuple(attrs["block"]),
                                     int(attrs["shared"]), arguments, symbol, path, int(attrs.get("alignment", 4))))

    def _gemm(self, op: Operation) -> None:
        spec, alpha, beta = gemm_spec(op)
        has_bias = op.attributes["epilogue"] in ("bias", "gelu_bias")
        accumulate = beta != 0
        in_place = [False, False] + ([False] if has_bias else []) + ([True] if accumulate else [])
        (d,) = self._result_places(op)
        self._reads(op, in_place, [d])
        operands = [self._places[v] for v in op.operands]
        bias = operands[2] if has_bias else None
        c = operands[-1] if accumulate else None
        self.steps.append(GemmStep(spec, alpha, beta, operands[0], operands[1], d, c, bias,
                                   str(op.attributes.get("path") or "")))
