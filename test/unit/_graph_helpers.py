"""Builds small graph.func ops from Python functions, for the interpreter and pass tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sexpgpu.dialects import graph  # noqa: F401  (registers the graph ops)
from sexpgpu.dialects.core import Builder, Operation, Region, TensorType, Value

from sexpgpu.diagnostics import Location

#: An input declaration: (shape, dtype) or (shape, dtype, role).
InputDecl = tuple[Any, ...]
Body = Callable[["GraphBuilder"], dict[str, Value]]


class GraphBuilder(Builder):
    """A Builder with shorthands for inputs and constants; `g.inputs["x"]` holds the inputs."""

    inputs: dict[str, Value]

    def const(self, value: Any, shape: Sequence[int] = (), dtype: str = "f32") -> Value:
        return self.create("graph.const", [], {"value": value}, result_types=[TensorType(tuple(shape), dtype)]).result

    def __getattr__(self, op: str) -> Callable[..., Value]:
        return lambda *operands, **attrs: self.value(f"graph.{op}", *operands, **attrs)


def make_func(inputs: dict[str, InputDecl], body: Body, name: str = "g", kind: str | None = None) -> Operation:
    """A graph.func whose inputs are declared by name and whose outputs `body` returns by name."""
    func = Operation.create("graph.func", attributes={"sym_name": name, **({"kind": kind} if kind else {})},
                            regions=[Region.with_block()])
    g = GraphBuilder(func.body, loc=Location("test.sx", 1, 1))
    g.inputs = {}
    for line, (input_name, decl) in enumerate(inputs.items(), start=2):
        shape, dtype, *role = decl
        g.inputs[input_name] = g.create(
            "graph.input", [], {"name": input_name, "role": role[0] if role else "value"},
            result_types=[TensorType(tuple(shape), dtype)], loc=Location("test.sx", line, 1),
        ).result
    outputs = body(g)
    g.create("graph.return", list(outputs.values()), {"names": list(outputs)})
    func.verify()
    return func


def make_module(*funcs: Operation) -> Operation:
    module = Operation.create("builtin.module", regions=[Region.with_block()])
    for func in funcs:
        module.body.append(func)
    return module


def random_inputs(func: Operation, rng: np.random.Generator, int_high: int = 3) -> dict[str, np.ndarray]:
    """Random float64 normals for float inputs, integers in [0, int_high) for integer ones."""
    values = {}
    for op in func.body.ops:
        if op.name != "graph.input":
            continue
        t = op.result.type
        if t.dtype in ("i32", "i64"):
            values[op.attributes["name"]] = rng.integers(0, int_high, t.shape).astype(t.dtype.replace("i", "int"))
        elif t.dtype == "i1":
            values[op.attributes["name"]] = rng.random(t.shape) < 0.5
        else:
            values[op.attributes["name"]] = rng.standard_normal(t.shape)
    return values
