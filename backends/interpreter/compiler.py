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
  its register after its last use, by the next step before it computes (no
  step of its own).

Outputs and emitted values never live in reused buffers, so what a call
returns stays valid after later calls and is the caller's to update in place;
an output that is a view, an input or a constant is copied.

A call may name arrays to write outputs into (`graph(inputs, out={name:
array})`): an output computed by a kernel taking `out=` is written there
directly (no fresh array, no copy), others are copied there at the end. Such
an array may even be an input of the call (an optimizer state updated in
place) when that input is not read after the output is computed (known at
compile time); otherwise the output goes through a fresh array and is copied.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from attrs import define, frozen

from ...diagnostics import SxError
from ...dialects.core import Operation, TensorType, Value
from ..memory import format_bytes, out_of_memory
from .dtypes import DtypePolicy
from .kernels import batch_summed_matmul, constant_value, kernel_for

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
        direct: list[tuple[str, int, tuple[int, ...], np.dtype, tuple[int, ...]]] = (),
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
        #: Outputs whose kernel writes into an array given at call time: (name, the register
        #: holding that array, shape, dtype, registers of inputs still read after it is written).
        self._direct = list(direct)
        #: The op each step runs, for `profile`.
        self.step_ops: list[Operation] = []
        #: Steps that run several ops: the step's op (as in `step_ops`) -> all the ops it runs.
        self.fused_ops: dict[Operation, list[Operation]] = {}

    @property
    def output_names(self) -> list[str]:
        return [name for name, _, _ in self._outputs]

    def __call__(self, inputs: Mapping[str, Any], out: Mapping[str, np.ndarray] | None = None) -> GraphResult:
        """Run the graph. `out` maps output names to arrays (of the output's shape and storage
        dtype, not overlapping each other) that receive them; `outputs` then holds those arrays."""
        regs = self._start(inputs, out)
        for step in self._steps:
            step(regs)
        result = GraphResult({}, {}, {}, {})
        for name, register, copy in self._outputs:
            value = regs[register]
            target = out.get(name) if out else None
            if target is not None:
                if value is not target:
                    np.copyto(target, value)
                result.outputs[name] = target
            else:
                result.outputs[name] = np.array(value) if copy else np.asarray(value)
        for kind, name, register in self._emits:
            getattr(result, kind)[name] = regs[register]
        return result


    def profile(self, inputs: Mapping[str, Any],
                clock: Callable[[], float] = time.perf_counter) -> list[tuple[Operation, float]]:
        """Run once as `__call__` does (same kernels, buffers and fusions), timing each step by
        `clock` (`time.process_time` counts this process's CPU time: steadier on a shared machine
        when BLAS runs one thread): (op, seconds) in step order. A fused matmul-and-sum is timed as
        its matmul, a fused sum of pads as its root add (`fused_ops` lists what such a step runs)."""
        regs = self._start(inputs, None)
        times = []
        for step, op in zip(self._steps, self.step_ops):
            started = clock()
            step(regs)
            times.append((op, clock() - started))
        return times


    def _start(self, inputs: Mapping[str, Any], out: Mapping[str, np.ndarray] | None) -> Registers:
        """The register file at the start of a call: inputs, constants, output arrays."""
        regs: Registers = [None] * self._register_count
        for spec in self.inputs:
            regs[spec.register] = _checked_input(spec, inputs)
        for register, value in self._constants:
            regs[register] = value
        for name, register, shape, dtype, still_read in self._direct:
            target = out.get(name) if out else None
            if (target is None or target.shape != shape or target.dtype != dtype
                    or any(np.may_share_memory(target, regs[i]) for i in still_read)):
                target = np.empty(shape, dtype)
            regs[register] = target
        return regs


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


def _check_shapes(ops: list[Operation]) -> None:
    """A negative dimension (a shape the frontend let through) is an error at the form that made it,
    not numpy's failure in the middle of a step."""
    for op in ops:
        for result in op.results:
            if any(d < 0 for d in result.type.shape):
                raise SxError(f"the result of {op.name} has a negative dimension: {list(result.type.shape)}", op.loc)


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
    _check_shapes(ops)
    users: dict[Value, list[Operation]] = {}
    for op in ops:
        for v in op.operands:
            users.setdefault(v, []).append(op)
    pad_sums = _pad_sums(ops, users, policy)
    pad_members = {member for members in pad_sums.values() for member in members}
    # A fused pad-sum runs at its root add: its pads' operands are read there.
    position_of = {op: i for i, op in enumerate(ops)}
    runs_at = {member: position_of[root] for root, members in pad_sums.items() for member in members}
    plan = _MemoryPlan(ops, runs_at)
    scalars = _scalar_splats(ops, users)
    implicit = _implicit_broadcasts(ops, users, scalars)
    summed = _batch_summed_matmuls(ops, users, policy)
    transposed_stores = _transposed_matmuls(ops, users, policy)
    registers: dict[Any, int] = {}
    direct_outputs = _direct_outputs(ops, plan, policy)
    direct: list[tuple[str, int, tuple[int, ...], np.dtype, tuple[int, ...]]] = []

    def direct_register(value: Value, position: int, in_place: bool) -> int | None:
        """The register of the caller's array for this output (None if it has none), and what
        that array must not overlap: the inputs whose storage is read after `position`."""
        name = direct_outputs.get(value)
        if name is None:
            return None
        slot = registers.setdefault(("out", name), len(registers))
        still_read = tuple(spec.register for spec in inputs
                           if plan.storage_end[spec.op.result] > position
                           or (plan.storage_end[spec.op.result] == position and not in_place))
        direct.append((name, slot, value.type.shape, policy.storage(value.type.dtype), still_read))
        return slot

    def register(value: Value) -> int:
        return registers.setdefault(value, len(registers))

    inputs: list[InputSpec] = []
    constants: list[tuple[int, np.ndarray]] = []
    steps: list[Step] = []
    #: The op each step runs, for `CompiledGraph.profile`.
    step_ops: list[Operation] = []
    outputs: list[tuple[str, int, bool]] = []
    emits: list[tuple[str, str, int]] = []
    emit_registers = 0
    # Registers to drop (set to None) at the start of the next step: releases are no steps of
    # their own. An implicit broadcast shares its operand's register, so a register is dropped
    # after the last use of every value it holds.
    releases = _register_releases(plan, implicit)
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
            constants.append((register(op.result), constant_value(op, policy, scalar=op in scalars)))
        elif op.name == "graph.return":
            for name, value in zip(op.attributes["names"], op.operands):
                outputs.append((name, registers[value], plan.is_shared(value)))
        elif op.name in EMIT_KINDS:
            slot = -1 - emit_registers
            emit_registers += 1
            emits.append((EMIT_KINDS[op.name], op.attributes["name"], slot))
            steps.append(_emit_step(op.name, registers[op.operands[0]], slot, plan.is_shared(op.operands[0]), drop()))
            step_ops.append(op)
        elif op in summed:
            # sum(matmul(a, b), axis 0) as one contraction, run here in the matmul's place (the sum
            # is the next op, and the product's only user).
            total = summed[op]
            args = tuple(registers[v] for v in op.operands)
            dst = register(total.result)
            buffer = plan.buffer_for(total.result, policy)
            slot = direct_register(total.result, position, False)
            steps.append(_compute_step(batch_summed_matmul, args, dst, buffer, slot, drop()))
            step_ops.append(op)
        elif op in summed.values() or op in pad_members:
            pass
        elif op in pad_sums:
            # add(…add(pad(a), pad(b))…, pad(c)) over disjoint ranges: each operand written into its
            # range of one buffer (plus zero, as the adds did), the rest zeroed; no padded copies.
            pads = [member for member in pad_sums[op] if member.name == "graph.pad"]
            fn = pad_sum_kernel(pads, op.result.type.shape, policy.storage(op.result.type.dtype))
            args = tuple(registers[p.operands[0]] for p in pads)
            dst = register(op.result)
            buffer = plan.buffer_for(op.result, policy, in_place=False)
            slot = direct_register(op.result, position, False)
            steps.append(_variadic_into_step(fn, args, dst, buffer, slot, drop()))
            step_ops.append(op)
        elif op in implicit:
            # Its readers broadcast the operand themselves: they read the operand's register.
            registers[op.result] = registers[op.operands[0]]
        else:
            kernel = kernel_for(op, policy)
            args = tuple(registers[v] for v in op.operands)
            dst = register(op.result)
            buffer = None
            if op in transposed_stores:
                # Stored in the layout of its transpose (the next reader): that transpose, and a
                # reshape merging its axes (attention's merge of heads), are views, not copies.
                perm = transposed_stores[op]
                stored = plan.buffer_for(op.result, policy, shape=tuple(op.result.type.shape[i] for i in perm))
                if stored is not None:
                    buffer = stored.transpose(np.argsort(perm))
            elif kernel.takes_out:
                buffer = plan.buffer_for(op.result, policy)
            slot = (direct_register(op.result, position, op.family in IN_PLACE_FAMILIES)
                    if kernel.takes_out and len(args) <= 2 else None)
            steps.append(_compute_step(kernel.fn, args, dst, buffer, slot, drop()))
            step_ops.append(op)
        pending.extend(releases.get(position, ()))
    # Emit slots live past the value registers (negative indices count from the end).
    graph = CompiledGraph(_func_name(func), inputs, constants, steps, outputs,
                          [(kind, name, len(registers) + emit_registers + slot) for kind, name, slot in emits],
                          len(registers) + emit_registers, (plan.buffered_values, plan.buffer_bytes), direct)
    graph.step_ops = step_ops
    graph.fused_ops = {root: [*members, root] for root, members in pad_sums.items()}
    return graph


def _pad_sums(ops: list[Operation], users: dict[Value, list[Operation]],
              policy: DtypePolicy) -> dict[Operation, list[Operation]]:
    """Trees of adds whose leaves are pads along one axis into disjoint ranges (the gradient of
    slicing a tensor into pieces, e.g. q, k and v out of one projection), each pad and inner add
    read only by its parent in the tree, in a natively computed dtype: root add -> the pads and
    inner adds."""
    fused: dict[Operation, list[Operation]] = {}
    taken: set[Operation] = set()
    for root in reversed(ops):
        if root.name != "graph.add" or root in taken or policy.rounds(root.result.type.dtype):
            continue
        members: list[Operation] = []
        ranges: list[tuple[int, int]] = []
        axes: set[int] = set()
        if not _collect_pad_sum(root, root, users, members, ranges, axes) or len(axes) != 1 or len(ranges) < 2:
            continue
        ordered = sorted(ranges)
        if any(end > start for (_, end), (start, _) in zip(ordered, ordered[1:])):
            continue
        fused[root] = members
        taken.update(members)
    return fused


def _collect_pad_sum(root: Operation, parent: Operation, users: dict[Value, list[Operation]],
                     members: list[Operation], ranges: list[tuple[int, int]], axes: set[int]) -> bool:
    """Whether `parent`'s operands are pads and adds of a pad-sum under `root`, collecting them."""
    for v in parent.operands:
        child = v.op
        if (child is None or users.get(v) != [parent] or v.type.shape != root.result.type.shape
                or child.name not in ("graph.add", "graph.pad")):
            return False
        members.append(child)
        if child.name == "graph.add":
            if not _collect_pad_sum(root, child, users, members, ranges, axes):
                return False
        else:
            axis = child.attributes["axis"]
            before = child.attributes["before"]
            axes.add(axis)
            ranges.append((before, before + child.operands[0].type.shape[axis]))
    return True


def pad_sum_kernel(pads: list[Operation], shape: tuple[int, ...], storage: np.dtype) -> Callable[..., Any]:
    """The sum of `pads` (along one axis, into disjoint ranges) as one array: each pad's operand
    plus zero in its range (what the adds computed there: x + 0 + … + 0 is x + 0, which only turns
    -0 into +0), zeros elsewhere."""
    axis = pads[0].attributes["axis"]
    ranges = []
    for pad in pads:
        before = pad.attributes["before"]
        ranges.append((before, before + pad.operands[0].type.shape[axis]))
    pieces = [(slice(None),) * axis + (slice(start, end),) for start, end in ranges]
    margins, covered = [], 0
    for start, end in sorted(ranges) + [(shape[axis], shape[axis])]:
        if start > covered:
            margins.append((slice(None),) * axis + (slice(covered, start),))
        covered = end
    zero = np.zeros((), storage)

    def pad_sum(*xs: Any, out: Any = None) -> Any:
        if out is None:
            out = np.empty(shape, storage)
        for margin in margins:
            out[margin] = 0
        for x, piece in zip(xs, pieces):
            np.add(x, zero, out=out[piece])
        return out

    return pad_sum


def _variadic_into_step(fn: Callable[..., Any], args: tuple[int, ...], dst: int, out: np.ndarray | None,
                        out_register: int | None, drop: tuple[int, ...] = ()) -> Step:
    if drop:
        return _after_dropping(_variadic_into_step(fn, args, dst, out, out_register), drop)
    if out_register is not None:
        def variadic_to_output(regs: Registers) -> None:
            regs[dst] = fn(*[regs[i] for i in args], out=regs[out_register])

        return variadic_to_output

    def variadic_into(regs: Registers) -> None:
        regs[dst] = fn(*[regs[i] for i in args], out=out)

    return variadic_into


#: Families whose kernels broadcast a 0-d operand against a full one (numpy binary ufuncs).
BROADCASTING_FAMILIES = frozenset({"binary", "compare"})


def _scalar_splats(ops: list[Operation], users: dict[Value, list[Operation]]) -> set[Operation]:
    """Splat constants that may be 0-d arrays instead of arrays of their full shape.

    A splat read only by binary and compare ops, each of which has a non-constant
    other operand (so numpy's broadcasting gives the result its full shape),
    never needs its full shape: the ops read one number instead of a whole array.
    """
    scalars = set()
    for op in ops:
        if op.name != "graph.const" or isinstance(op.attributes["value"], list) or op.result.type.rank == 0:
            continue
        readers = users.get(op.result, [])
        if readers and all(
            reader.family in BROADCASTING_FAMILIES
            and len(reader.operands) == 2
            and all(v is not op.result and v.op.name not in ("graph.const", "graph.iota")
                    for v in reader.operands if v is not op.result)
            and sum(v is op.result for v in reader.operands) == 1
            for reader in readers
        ):
            scalars.add(op)
    return scalars


def _implicit_broadcasts(ops: list[Operation], users: dict[Value, list[Operation]],
                         scalars: set[Operation]) -> set[Operation]:
    """`graph.broadcast` ops whose readers may broadcast the operand themselves.

    Each reader must be a binary or compare op whose other operand has the full
    shape (neither such a broadcast nor a 0-d splat), so numpy's broadcasting
    (aligned on the trailing axes, as `graph.broadcast` is) makes the same
    result without the strided view.
    """
    implicit: set[Operation] = set()
    # Values that may stand in with a smaller shape: 0-d splats and (below) implicit broadcasts.
    partial = {op.result for op in scalars}
    for op in ops:
        if op.name != "graph.broadcast":
            continue
        readers = users.get(op.result, [])
        if readers and all(
            reader.family in BROADCASTING_FAMILIES
            and len(reader.operands) == 2
            and sum(v is op.result for v in reader.operands) == 1
            and all(v not in partial and v.op.name != "graph.broadcast" and v.op.name not in ("graph.const", "graph.iota")
                    for v in reader.operands if v is not op.result)
            for reader in readers
        ):
            implicit.add(op)
            partial.add(op.result)
    return implicit


def _batch_summed_matmuls(ops: list[Operation], users: dict[Value, list[Operation]],
                          policy: DtypePolicy) -> dict[Operation, Operation]:
    """Each [B M K] @ [B K N] matmul whose only user is the next op, a sum over axis 0 (the weight
    gradient of a linear layer over a batch), mapped to that sum."""
    fused = {}
    for op, following in zip(ops, ops[1:]):
        if op.name != "graph.matmul" or following.name != "graph.sum":
            continue
        a, b = (v.type for v in op.operands)
        if (
            users.get(op.result) == [following]
            and list(following.attributes["axes"]) == [0]
            and not following.attributes["keep"]
            and a.rank == 3 and b.rank == 3 and a.shape[0] == b.shape[0]
            and not policy.rounds(a.dtype) and not policy.rounds(op.result.type.dtype)
        ):
            fused[op] = following
    return fused


def _transposed_matmuls(ops: list[Operation], users: dict[Value, list[Operation]],
                        policy: DtypePolicy) -> dict[Operation, tuple[int, ...]]:
    """Batched matmuls (both operands with batch axes: numpy runs one gemm per batch element)
    whose only reader is a transpose keeping the last axis last, mapped to its permutation: each
    gemm may write its rows into that transpose's layout, as BLAS writes rows at any stride."""
    stores = {}
    for op in ops:
        if op.name != "graph.matmul" or any(v.type.rank < 3 for v in op.operands):
            continue
        readers = users.get(op.result, [])
        if len(readers) != 1 or readers[0].name != "graph.transpose" or policy.rounds(op.result.type.dtype):
            continue
        perm = tuple(readers[0].attributes["perm"])
        if perm[-1] == len(perm) - 1 and perm != tuple(range(len(perm))):
            stores[op] = perm
    return stores


def _direct_outputs(ops: list[Operation], plan: _MemoryPlan, policy: DtypePolicy) -> dict[Value, str]:
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
            if len(names) == 1 and value not in emitted and not plan.is_shared(value)
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
        a, b = args

        def binary_to_output(regs: Registers) -> None:
            regs[dst] = fn(regs[a], regs[b], out=regs[o])

        return binary_to_output
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


def _register_releases(plan: _MemoryPlan, implicit: set[Operation]) -> dict[int, list[Value]]:
    """Position -> values whose registers may be dropped after the op there: `plan`'s releases,
    where an implicit broadcast shares its operand's register (so the register is named by the
    operand, and dropped after the last use of both)."""
    holder = {op.result: op.operands[0] for op in implicit}
    sharers: dict[Value, list[Value]] = {}
    for value in plan.last_use:
        sharers.setdefault(_holder(value, holder), []).append(value)
    releases: dict[int, list[Value]] = {}
    for source in {_holder(v, holder) for v in plan.released_values()}:
        releases.setdefault(max(plan.last_use[v] for v in sharers[source]), []).append(source)
    return releases


def _holder(value: Value, holder: Mapping[Value, Value]) -> Value:
    """The value whose register `value` is in (itself, unless it is an implicit broadcast)."""
    while value in holder:
        value = holder[value]
    return value


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


class _MemoryPlan:
    """Liveness of every value over the op order, and the reused buffers it allows."""

    def __init__(self, ops: list[Operation], runs_at: Mapping[Operation, int] | None = None) -> None:
        """`runs_at`: ops fused into a later step, by the position of that step (they read their
        operands there)."""
        runs_at = runs_at or {}
        self.position = {op: i for i, op in enumerate(ops)}
        self.root: dict[Value, Value] = {}
        #: Last position at which the storage of each root is read (through any view of it).
        self.storage_end: dict[Value, int] = {}
        self.last_use: dict[Value, int] = {}
        #: Roots whose storage escapes a call (outputs, emits) or outlives it (inputs, constants).
        self.escaping: set[Value] = set()
        self.fixed: set[Value] = set()
        for i, op in enumerate(ops):
            read = runs_at.get(op, i)
            for v in op.operands:
                self.last_use[v] = max(self.last_use.get(v, read), read)
            for r in op.results:
                self.root[r] = self.root[op.operands[0]] if op.name in VIEW_OPS else r
                self.last_use[r] = max(self.last_use.get(r, read), read)
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

    def released_values(self) -> list[Value]:
        """Large values not in reused buffers nor escaping: their registers may be dropped after
        their last use (`last_use`)."""
        return [v for values in self._releases.values() for v in values]

    def buffer_for(self, value: Value, policy: DtypePolicy, in_place: bool | None = None,
                   shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        """A reused buffer for the result of an op taking `out=`, or None when it must be fresh.
        `shape`: the buffer's, when the op writes a view of it (of the value's shape, permuted).

        Called in op order. Buffers of storage that dies at this op are freed
        first when the op is elementwise (so it may update in place), after
        otherwise (a matmul or reduction must not read what it writes).
        """
        op = value.op
        position = self.position[op]
        if in_place is None:
            in_place = op.family in IN_PLACE_FAMILIES
        if in_place:
            self._free_dying(position)
        buffer = None
        if value not in self.escaping:
            key = (shape or value.type.shape, policy.storage(value.type.dtype))
            pool = self._free.get(key)
            buffer = pool.pop() if pool else self._allocate(*key, value)
            self.buffered_values += 1
            self._held.setdefault(self.storage_end[value], []).append((value, buffer))
        if not in_place:
            self._free_dying(position)
        return buffer

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype, value: Value) -> np.ndarray:
        try:
            buffer = np.empty(shape, dtype)
        except (MemoryError, ValueError):  # ValueError: more bytes than an array may have
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            raise out_of_memory(
                f"the {list(shape)} {np.dtype(dtype).name} result of {value.op.name}", nbytes, value.op.loc,
                f", after {format_bytes(self.buffer_bytes)} of the graph's other buffers",
            ) from None
        self.buffer_bytes += buffer.nbytes
        return buffer

    def _free_dying(self, position: int) -> None:
        for ended in [p for p in self._held if p <= position]:
            for _value, buffer in self._held.pop(ended):
                self._free.setdefault((buffer.shape, buffer.dtype), []).append(buffer)
