"""A compiled graph: what a call of it does with its steps, registers and the caller's arrays.

`CompiledGraph(inputs)` puts the inputs, the constants and the arrays the
caller gave for outputs into a register file, runs the steps (one closure
per op of the lowered graph, built by `steps.py`) and collects the outputs
and the emitted values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from attrs import define, frozen

from ...diagnostics import SxError
from ...dialects.core import Operation, TensorType

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
        direct: list[tuple[str, int, tuple[int, ...], np.dtype, tuple[int, ...]]],
        step_ops: list[Operation],
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
        #: The op each step runs, for `profile`: an op of the graph as `lower-cpu` rewrote it (a
        #: `cpu.pad_sum` where adds of pads were, located at the outermost add).
        self.step_ops = step_ops

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
            # A copy: the register's buffer may be reused by the next call, and a driver may read a
            # step's emitted values after its later calls.
            value = regs[register]
            getattr(result, kind)[name] = np.array(value) if isinstance(value, np.ndarray) else value
        return result

    def profile(self, inputs: Mapping[str, Any],
                clock: Callable[[], float] = time.perf_counter) -> list[tuple[Operation, float]]:
        """Run once as `__call__` does (same kernels and buffers), timing each step by `clock`
        (`time.process_time` counts this process's CPU time: steadier on a shared machine when
        BLAS runs one thread): (op, seconds) in step order, the ops being `step_ops`."""
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
