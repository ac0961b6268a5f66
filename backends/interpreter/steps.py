"""The step builder: a lowered `graph.func` as a flat list of closures over a register file.

Every value gets a register (an index into a list). Each op is resolved to
its numpy kernel once (`kernels.py`), so a call runs a list of closures with
no lookups by op name. The graph is the one `lower-cpu` made, so the steps
are its ops one for one, inputs, constants and the return aside.

Buffers come from the shared buffer plan (`dialects/liveness.py`): results
of kernels taking `out=` are written into arrays allocated once per compiled
graph, one per buffer of an exact-reuse `ArenaPlan` (a buffer is reused only
by a value of the same shape and storage dtype, after the last read of the
storage of the value before; an elementwise op may take the buffer of an
operand it reads last, i.e. update in place). A large array in no buffer is
dropped from its register after its last use, by the next step before it
computes (no step of its own).

Outputs and emitted values never live in reused buffers, so what a call
returns stays valid after later calls and is the caller's to update in place;
an output that is a view, an input or a constant is copied. An output a
kernel computes with `out=` may be written straight into an array the caller
gives (see `CompiledGraph`), unless that array is an input still read after
the output is written (known here: the storage ends of the inputs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...byte_text import show_bytes
from ...dialects.core import Operation, Value
from ...dialects.graph import emit_collection
from ...dialects.liveness import ArenaPlan, StorageLiveness
from ...dialects.traits import Trait, ops_with
from ..memory import out_of_memory
from .compiled_graph import CompiledGraph, InputSpec, Registers, Step
from .dtypes import DtypePolicy
from .kernels import constant_value, kernel_for

#: Families whose kernels may write their result over an operand that dies there.
IN_PLACE_FAMILIES = frozenset(kind.value for kind in (Trait.UNARY, Trait.BINARY, Trait.COMPARE))
EMIT_KINDS = {name: emit_collection(name) for name in ops_with(Trait.EMIT)}
#: Arrays smaller than this are not worth an extra store to release early.
RELEASE_BYTES = 1 << 16


class _Buffers:
    """The arrays of an exact-reuse `ArenaPlan` over a graph: one per buffer, made on first use."""

    def __init__(self, liveness: StorageLiveness, policy: DtypePolicy) -> None:
        self.plan = ArenaPlan(liveness)
        self.policy = policy
        self.arrays: dict[int, np.ndarray] = {}

    def array_for(self, value: Value, in_place: bool, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        """The array to write `value` into (None when it escapes: then a fresh one each call).
        `shape`: the array's, when the op writes a view of it (the value's shape, permuted)."""
        storage = self.policy.storage(value.type.dtype)
        shape = shape or value.type.shape
        buffer = self.plan.assign(value, in_place, key=(shape, storage), nbytes=math.prod(shape) * storage.itemsize)
        if buffer is None:
            return None
        array = self.arrays.get(buffer.index)
        if array is None:
            array = self.arrays[buffer.index] = self._allocate(shape, storage, value)
        return array

    def _allocate(self, shape: tuple[int, ...], storage: np.dtype, value: Value) -> np.ndarray:
        try:
            return np.empty(shape, storage)
        except (MemoryError, ValueError):  # ValueError: more bytes than an array may have
            held = sum(array.nbytes for array in self.arrays.values())
            raise out_of_memory(
                f"the {list(shape)} {storage.name} result of {value.op.name}", math.prod(shape) * storage.itemsize,
                value.op.loc, f", after {show_bytes(held)} of the graph's other buffers",
            ) from None


def build_steps(func: Operation, policy: DtypePolicy) -> CompiledGraph:
    """The compiled form of a lowered `graph.func` (see the module docstring)."""
    ops = list(func.body.ops)
    liveness = StorageLiveness(func.body)
    buffers = _Buffers(liveness, policy)
    registers: dict[Any, int] = {}
    direct_outputs = _direct_outputs(ops, liveness, policy)
    direct: list[tuple[str, int, tuple[int, ...], np.dtype, tuple[int, ...]]] = []

    def direct_register(value: Value, position: int, in_place: bool) -> int | None:
        """The register of the caller's array for this output (None if it has none), and what
        that array must not overlap: the inputs whose storage is read after `position`."""
        name = direct_outputs.get(value)
        if name is None:
            return None
        slot = registers.setdefault(("out", name), len(registers))
        still_read = tuple(spec.register for spec in inputs
                           if liveness.storage_end[spec.op.result] > position
                           or (liveness.storage_end[spec.op.result] == position and not in_place))
        direct.append((name, slot, value.type.shape, policy.storage(value.type.dtype), still_read))
        return slot

    def register(value: Value) -> int:
        return registers.setdefault(value, len(registers))

    inputs: list[InputSpec] = []
    constants: list[tuple[int, np.ndarray]] = []
    steps: list[Step] = []
    step_ops: list[Operation] = []
    outputs: list[tuple[str, int, bool]] = []
    emits: list[tuple[str, str, int]] = []
    emit_registers = 0
    # Registers to drop (set to None) at the start of the next step: releases are no steps of their own.
    releases = _releases(liveness)
    pending: list[Value] = []

    def drop() -> tuple[int, ...]:
        dropped = tuple(registers[v] for v in pending if v in registers)
        pending.clear()
        return dropped

    for position, op in enumerate(ops):
        if op.name == "graph.input":
            t = op.result.type
            inputs.append(InputSpec(op.attributes["name"], op.attributes["role"], t, register(op.result),
                                    policy.storage(t.dtype), op))
        elif op.name in ("graph.const", "graph.iota"):
            constants.append((register(op.result), constant_value(op, policy)))
        elif op.name == "graph.return":
            for name, value in zip(op.attributes["names"], op.operands):
                outputs.append((name, registers[value], _is_shared(liveness, value)))
        elif op.name in EMIT_KINDS:
            slot = -1 - emit_registers
            emit_registers += 1
            emits.append((EMIT_KINDS[op.name], op.attributes["name"], slot))
            src = op.operands[0]
            steps.append(_emit_step(op.name, registers[src], slot, _is_shared(liveness, src), drop()))
            step_ops.append(op)
        else:
            kernel = kernel_for(op, policy)
            args = tuple(registers[v] for v in op.operands)
            dst = register(op.result)
            in_place = op.family in IN_PLACE_FAMILIES
            buffer = slot = None
            if kernel.takes_out:
                if "layout" in op.attributes:
                    # `cpu.matmul`: stored in the layout of the transpose reading it, a view of the buffer.
                    perm = op.attributes["layout"]
                    stored = buffers.array_for(op.result, in_place, tuple(op.result.type.shape[i] for i in perm))
                    buffer = None if stored is None else stored.transpose(np.argsort(perm))
                else:
                    buffer = buffers.array_for(op.result, in_place)
                slot = direct_register(op.result, position, in_place)
            steps.append(_compute_step(kernel.fn, args, dst, buffer, slot, drop()))
            step_ops.append(op)
        pending.extend(releases.get(position, ()))
    # Emit slots live past the value registers (negative indices count from the end).
    return CompiledGraph(_func_name(func), inputs, constants, steps, outputs,
                         [(kind, name, len(registers) + emit_registers + slot) for kind, name, slot in emits],
                         len(registers) + emit_registers, (len(buffers.plan.buffers), buffers.plan.size), direct,
                         step_ops)


def _is_shared(liveness: StorageLiveness, value: Value) -> bool:
    """Whether a caller must get a copy: the storage outlives a call (an input, a constant) or
    the value is a view (read-only for a broadcast, and aliasing whatever else sees its root)."""
    return liveness.is_view(value) or value in liveness.fixed


def _releases(liveness: StorageLiveness) -> dict[int, list[Value]]:
    """Position -> the large values whose registers may be dropped after the op there (their last
    use), unless their storage escapes the call."""
    releases: dict[int, list[Value]] = {}
    for v, end in liveness.last_use.items():
        if v.type.nbytes >= RELEASE_BYTES and liveness.root[v] not in liveness.escaping:
            releases.setdefault(end, []).append(v)
    return releases


def _direct_outputs(ops: list[Operation], liveness: StorageLiveness, policy: DtypePolicy) -> dict[Value, str]:
    """Outputs a kernel may write straight into a caller's array: returned once, emitted never,
    neither a view nor an input or constant, in a dtype computed natively."""
    returned: dict[Value, list[str]] = {}
    emitted: set[Value] = set()
    for op in ops:
        if op.name == "graph.return":
            for name, value in zip(op.attributes["names"], op.operands):
                returned.setdefault(value, []).append(name)
        elif op.name in EMIT_KINDS:
            emitted.add(op.operands[0])
    return {value: names[0] for value, names in returned.items()
            if len(names) == 1 and value not in emitted and not _is_shared(liveness, value)
            and not policy.rounds(value.type.dtype)}


def _func_name(func: Operation) -> str:
    name = func.attributes["sym_name"]
    return getattr(name, "name", name)


def _compute_step(fn: Callable[..., Any], args: tuple[int, ...], dst: int, out: np.ndarray | None,
                  out_register: int | None = None, drop: tuple[int, ...] = ()) -> Step:
    """`regs[dst] = fn(*args)`, into `out` or the array in `out_register` if given, after setting
    the registers in `drop` to None (values no longer read: their arrays may be freed)."""
    if drop:
        return _dropping_compute_step(fn, args, dst, out, out_register, drop)
    if out_register is not None:
        # An output: into the array the call put in `out_register` (the caller's, or a fresh one).
        o = out_register
        if len(args) == 1:
            (a,) = args

            def unary_to_output(regs: Registers) -> None:
                regs[dst] = fn(regs[a], out=regs[o])

            return unary_to_output
        if len(args) == 2:
            a, b = args

            def binary_to_output(regs: Registers) -> None:
                regs[dst] = fn(regs[a], regs[b], out=regs[o])

            return binary_to_output

        def variadic_to_output(regs: Registers) -> None:
            regs[dst] = fn(*[regs[i] for i in args], out=regs[o])

        return variadic_to_output
    if out is not None:
        if len(args) == 1:
            (a,) = args

            def unary_into(regs: Registers) -> None:
                regs[dst] = fn(regs[a], out=out)

            return unary_into
        if len(args) == 2:
            a, b = args

            def binary_into(regs: Registers) -> None:
                regs[dst] = fn(regs[a], regs[b], out=out)

            return binary_into

        def variadic_into(regs: Registers) -> None:
            regs[dst] = fn(*[regs[i] for i in args], out=out)

        return variadic_into
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


def _dropping_compute_step(fn: Callable[..., Any], args: tuple[int, ...], dst: int, out: np.ndarray | None,
                           out_register: int | None, drop: tuple[int, ...]) -> Step:
    """`_compute_step` with registers to drop first (the common kinds written out: a call of an
    inner step would cost what a separate release step did)."""
    if out_register is None and len(args) <= 2:
        if len(args) == 1:
            (a,) = args
            if out is not None:
                def unary_into_dropping(regs: Registers) -> None:
                    for i in drop:
                        regs[i] = None
                    regs[dst] = fn(regs[a], out=out)

                return unary_into_dropping

            def unary_dropping(regs: Registers) -> None:
                for i in drop:
                    regs[i] = None
                regs[dst] = fn(regs[a])

            return unary_dropping
        a, b = args
        if out is not None:
            def binary_into_dropping(regs: Registers) -> None:
                for i in drop:
                    regs[i] = None
                regs[dst] = fn(regs[a], regs[b], out=out)

            return binary_into_dropping

        def binary_dropping(regs: Registers) -> None:
            for i in drop:
                regs[i] = None
            regs[dst] = fn(regs[a], regs[b])

        return binary_dropping
    return _after_dropping(_compute_step(fn, args, dst, out, out_register), drop)


def _after_dropping(step: Step, drop: tuple[int, ...]) -> Step:
    """`step`, after setting the registers in `drop` to None."""
    if not drop:
        return step

    def dropping(regs: Registers) -> None:
        for i in drop:
            regs[i] = None
        step(regs)

    return dropping


def _emit_step(name: str, src: int, slot: int, shared: bool, drop: tuple[int, ...] = ()) -> Step:
    if drop:
        return _after_dropping(_emit_step(name, src, slot, shared), drop)
    if name == "graph.metric":

        def metric(regs: Registers) -> None:
            regs[slot] = float(regs[src])

        return metric

    def record(regs: Registers) -> None:
        regs[slot] = np.array(regs[src]) if shared else np.asarray(regs[src])

    return record
