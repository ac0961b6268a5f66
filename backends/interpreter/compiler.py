"""Compiles a `graph.func` into a flat list of steps over a register file.

Every value gets a register (an index into a list). Compiling resolves each
op to a numpy kernel once, so a call runs a list of closures with no lookups
by op name. Two memory plans keep repeated calls cheap:

- Buffer reuse: results of kernels that take `out=` (native-precision
  elementwise ops, reductions, matmul) are written into buffers allocated once
  per compiled graph. A buffer is shared by values whose lifetimes do not
  overlap (by liveness over the op order; a view such as a reshape keeps its
  source's buffer alive). An elementwise op may take the buffer of an operand
  that dies at that op, which makes it an in-place update.
- Early release: a large array that is not in a reused buffer is dropped from
  its register after its last use.

Outputs and emitted values never live in reused buffers, so what a call
returns stays valid after later calls and is the caller's to update in place;
an output that is a view, an input or a constant is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from attrs import define, frozen
from sexpgpu.backends.interpreter.dtypes import DtypePolicy
from sexpgpu.backends.interpreter.kernels import constant_value, kernel_for
from sexpgpu.dialects.core import Operation, TensorType, Value

from sexpgpu.diagnostics import SxError

#: Ops whose result is a view of their operand's storage.
VIEW_OPS = frozenset(
    {"graph.reshape", "graph.transpose", "graph.broadcast", "graph.slice", "graph.squeeze", "graph.expand_dims"}
)
#: Families whose kernels may write their result over an operand that dies there.
IN_PLACE_FAMILIES = frozenset({"unary", "binary", "compare"})
EMIT_KINDS = {"graph.metric": "metrics", "graph.counter": "counters", "graph.observe": "observed"}
#: Arrays smaller than this are not worth an extra store to release early.
RELEASE_BYTES = 1 << 16

Registers = list[Any]
Step = Callable[[Registers], None]


class GraphInputError(SxError):
    """An input missing from a call, or one of the wrong shape or dtype kind."""


@define
class GraphResult:
    """What one call of a compiled graph produced."""

    #: By the names of `graph.return`.
    outputs: dict[str, np.ndarray]
    #: `graph.metric` values as floats, by their `name`.
    metrics: dict[str, float]
    #: `graph.counter` values, by their `name`.
    counters: dict[str, np.ndarray]
    #: `graph.observe` values, by their `name` (the observation path).
    observed: dict[str, np.ndarray]


@frozen
class InputSpec:
    """One `graph.input`: what a call must provide under `name`."""

    name: str
    role: str
    type: TensorType
    register: int
    storage: np.dtype
    op: Operation


class CompiledGraph:
    """A graph ready to run: `graph(inputs) -> GraphResult`."""

    def __init__(
        self,
        name: str,
        inputs: list[InputSpec],
        constants: list[tuple[int, np.ndarray]],
        steps: list[Step],
        outputs: list[tuple[str, int, bool]],
        emits: list[tuple[str, str, int]],
        register_count: int,
        buffer_stats: tuple[int, int],
    ) -> None:
        self.name = name
        #: How many values live in reused buffers, and the bytes those buffers take.
        self.buffered_values, self.buffer_bytes = buffer_stats
        self.inputs = inputs
        self._constants = constants
        self._steps = steps
        self._outputs = outputs
        self._emits = emits
        self._register_count = register_count

    @property
    def output_names(self) -> list[str]:
        return [name for name, _, _ in self._outputs]

    def __call__(self, inputs: Mapping[str, Any]) -> GraphResult:
        regs: Registers = [None] * self._register_count
        for spec in self.inputs:
            regs[spec.register] = _checked_input(spec, inputs)
        for register, value in self._constants:
            regs[register] = value
        for step in self._steps:
            step(regs)
        result = GraphResult({}, {}, {}, {})
        for name, register, copy in self._outputs:
            value = regs[register]
            result.outputs[name] = np.array(value) if copy else np.asarray(value)
        for kind, name, register in self._emits:
            getattr(result, kind)[name] = regs[register]
        return result


def _checked_input(spec: InputSpec, inputs: Mapping[str, Any]) -> np.ndarray:
    if spec.name not in inputs:
        raise GraphInputError(f"graph input '{spec.name}' ({spec.role}, {spec.type}) is missing", spec.op.loc)
    value = np.asarray(inputs[spec.name])
    if value.shape != spec.type.shape:
        raise GraphInputError(
            f"graph input '{spec.name}' must have shape {list(spec.type.shape)}, got {list(value.shape)}", spec.op.loc
        )
    if _kind(value.dtype) != _kind(spec.storage):
        raise GraphInputError(
            f"graph input '{spec.name}' must be {spec.type.dtype}, got numpy {value.dtype}", spec.op.loc
        )
    return value.astype(spec.storage, copy=False)


def _kind(dtype: np.dtype) -> str:
    """'float', 'int' or 'bool' (ml_dtypes floats report numpy kind 'V')."""
    if dtype.kind == "b":
        return "bool"
    if dtype.kind in "iu":
        return "int"
    return "float"


def compile_graph(func: Operation, float_mode: str = "native") -> CompiledGraph:
    """Compile a `graph.func` for the numpy interpreter.

    `float_mode` is "native" (each float dtype as itself; bf16 through
    ml_dtypes, computed in float32 and rounded per op) or "f64" (every float
    dtype in float64, for gradient checks).
    """
    if func.name != "graph.func":
        raise ValueError(f"compile_graph needs a graph.func, got {func.name}")
    policy = DtypePolicy(float_mode)
    ops = list(func.body.ops)
    plan = _MemoryPlan(ops)
    registers: dict[Value, int] = {}

    def register(value: Value) -> int:
        return registers.setdefault(value, len(registers))

    inputs: list[InputSpec] = []
    constants: list[tuple[int, np.ndarray]] = []
    steps: list[Step] = []
    outputs: list[tuple[str, int, bool]] = []
    emits: list[tuple[str, str, int]] = []
    emit_registers = 0
    for position, op in enumerate(ops):
        if op.name == "graph.input":
            t = op.result.type
            inputs.append(InputSpec(op.attributes["name"], op.attributes["role"], t, register(op.result),
                                    policy.storage(t.dtype), op))
        elif op.name in ("graph.const", "graph.iota"):
            constants.append((register(op.result), constant_value(op, policy)))
        elif op.name == "graph.return":
            for name, value in zip(op.attributes["names"], op.operands):
                outputs.append((name, registers[value], plan.is_shared(value)))
        elif op.name in EMIT_KINDS:
            slot = -1 - emit_registers
            emit_registers += 1
            emits.append((EMIT_KINDS[op.name], op.attributes["name"], slot))
            steps.append(_emit_step(op.name, registers[op.operands[0]], slot, plan.is_shared(op.operands[0])))
        else:
            kernel = kernel_for(op, policy)
            args = tuple(registers[v] for v in op.operands)
            dst = register(op.result)
            buffer = plan.buffer_for(op.result, policy) if kernel.takes_out else None
            steps.append(_compute_step(kernel.fn, args, dst, buffer))
        released = [registers[v] for v in plan.released_after(position) if v in registers]
        if released:
            steps.append(_release_step(released))
    # Emit slots live past the value registers (negative indices count from the end).
    return CompiledGraph(_func_name(func), inputs, constants, steps, outputs,
                         [(kind, name, len(registers) + emit_registers + slot) for kind, name, slot in emits],
                         len(registers) + emit_registers, (plan.buffered_values, plan.buffer_bytes))


def _func_name(func: Operation) -> str:
    name = func.attributes["sym_name"]
    return getattr(name, "name", name)


def _compute_step(fn: Callable[..., Any], args: tuple[int, ...], dst: int, out: np.ndarray | None) -> Step:
    if out is not None:
        if len(args) == 1:
            (a,) = args

            def unary_into(regs: Registers) -> None:
                regs[dst] = fn(regs[a], out=out)

            return unary_into
        a, b = args

        def binary_into(regs: Registers) -> None:
            regs[dst] = fn(regs[a], regs[b], out=out)

        return binary_into
    if len(args) == 1:
        (a,) = args

        def unary(regs: Registers) -> None:
            regs[dst] = fn(regs[a])

        return unary
    if len(args) == 2:
        a, b = args

        def binary(regs: Registers) -> None:
            regs[dst] = fn(regs[a], regs[b])

        return binary

    def variadic(regs: Registers) -> None:
        regs[dst] = fn(*[regs[i] for i in args])

    return variadic


def _emit_step(name: str, src: int, slot: int, shared: bool) -> Step:
    if name == "graph.metric":

        def metric(regs: Registers) -> None:
            regs[slot] = float(regs[src])

        return metric

    def record(regs: Registers) -> None:
        regs[slot] = np.array(regs[src]) if shared else np.asarray(regs[src])

    return record


def _release_step(released: list[int]) -> Step:
    def release(regs: Registers) -> None:
        for i in released:
            regs[i] = None

    return release


class _MemoryPlan:
    """Liveness of every value over the op order, and the reused buffers it allows."""

    def __init__(self, ops: list[Operation]) -> None:
        self.position = {op: i for i, op in enumerate(ops)}
        self.root: dict[Value, Value] = {}
        #: Last position at which the storage of each root is read (through any view of it).
        self.storage_end: dict[Value, int] = {}
        self.last_use: dict[Value, int] = {}
        #: Roots whose storage escapes a call (outputs, emits) or outlives it (inputs, constants).
        self.escaping: set[Value] = set()
        self.fixed: set[Value] = set()
        for i, op in enumerate(ops):
            for v in op.operands:
                self.last_use[v] = i
            for r in op.results:
                self.root[r] = self.root[op.operands[0]] if op.name in VIEW_OPS else r
                self.last_use[r] = i
            if op.name in ("graph.input", "graph.const", "graph.iota"):
                self.fixed.add(op.result)
            if op.name == "graph.return" or op.name in EMIT_KINDS:
                self.escaping.update(self.root[v] for v in op.operands)
        for v, end in self.last_use.items():
            root = self.root[v]
            self.storage_end[root] = max(self.storage_end.get(root, end), end)
        self._releases: dict[int, list[Value]] = {}
        for v, end in self.last_use.items():
            if v.type.nbytes >= RELEASE_BYTES and self.root[v] not in self.escaping:
                self._releases.setdefault(end, []).append(v)
        self._free: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}
        self._held: dict[int, list[tuple[Value, np.ndarray]]] = {}
        self.buffered_values = 0
        self.buffer_bytes = 0

    def is_shared(self, value: Value) -> bool:
        """Whether a caller must get a copy: the storage outlives a call (an input, a constant) or
        the value is a view (read-only for a broadcast, and aliasing whatever else sees its root)."""
        return self.root[value] is not value or value in self.fixed

    def released_after(self, position: int) -> list[Value]:
        return self._releases.get(position, [])

    def buffer_for(self, value: Value, policy: DtypePolicy) -> np.ndarray | None:
        """A reused buffer for the result of an op taking `out=`, or None when it must be fresh.

        Called in op order. Buffers of storage that dies at this op are freed
        first when the op is elementwise (so it may update in place), after
        otherwise (a matmul or reduction must not read what it writes).
        """
        op = value.op
        position = self.position[op]
        in_place = op.family in IN_PLACE_FAMILIES
        if in_place:
            self._free_dying(position)
        buffer = None
        if value not in self.escaping:
            key = (value.type.shape, policy.storage(value.type.dtype))
            pool = self._free.get(key)
            buffer = pool.pop() if pool else self._allocate(*key)
            self.buffered_values += 1
            self._held.setdefault(self.storage_end[value], []).append((value, buffer))
        if not in_place:
            self._free_dying(position)
        return buffer

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buffer = np.empty(shape, dtype)
        self.buffer_bytes += buffer.nbytes
        return buffer

    def _free_dying(self, position: int) -> None:
        for ended in [p for p in self._held if p <= position]:
            for value, buffer in self._held.pop(ended):
                self._free.setdefault((value.type.shape, buffer.dtype), []).append(buffer)
