"""`insert-casts{policy=bf16}`: the mixed-precision policy as explicit `graph.cast` ops.

Option `policy`: `f32`, `bf16`, or `auto` (the default: the `precision` of
the module's exp.run, `f32` when there is none). `f32` adds no cast.

`bf16` rewrites the graphs of kind train, train_accumulating, train_stacked,
train_diagnosed, evaluation and inference (update and clip graphs are untouched). Walking
each graph in block order, a value is *f32-kept* when it is a gradient input
(`role = "grad"`: the sum of the earlier microbatches' gradients that
`train_accumulating` adds to, so gradients accumulate in f32), the result of
a reduction (`sum`, `max`, `min`), of a pointwise op with an f32-kept
operand, or of a shape or index op whose data operand is f32-kept. Then:

- `matmul` runs in bf16: f32 operands are cast to bf16;
- a pointwise op (unary, binary, `where`) with an f32-kept float operand runs
  in f32 (bf16 operands cast to f32), any other pointwise op runs in bf16;
  this keeps the `exp`/`sub`/`div` around softmax and normalization
  reductions, log-softmax, the loss and whatever reduced values feed, in f32;
- a pointwise op that would run in bf16 but has a constant operand bf16
  cannot hold exactly (a splat `graph.const`, possibly broadcast or reshaped:
  GELU's 1/√2, its derivative's 2/√π) runs in f32 with the constant as it is
  and its result is cast to bf16 right after: the constants of a kernel's
  arithmetic keep their f32 value, as autocast and llm.c keep them, and the
  value rounds to bf16 once, where the bf16 op would have rounded it (no
  `kept_f32` site: the result is bf16);
- a reduction runs in f32 (a bf16 operand is cast to f32 first);
- compare and concat ops with mixed operands promote them to f32;
- metric, counter and observe operands are cast to f32;
- every float output is returned f32, so a graph's signature is unchanged:
  parameters (master weights, role param) stay f32 inputs and gradients
  `grad/<path>` are returned f32.

A value is cast to a dtype at most once per graph (the cast is placed before
its first user and reused) and carries its user's `path` attribute. Facts:
`unit.facts.casts = {graph: casts added}` for every rewritten graph,
`unit.facts.kept_f32 = [{"graph", "op", "path"}]`, one entry per distinct
(graph, op kind such as "reduce sum" or "unary exp", model path) that runs in
f32, and `unit.facts.cast_policy`.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from attrs import define

from ..diagnostics import SxError
from ..dialects.core import FLOAT_DTYPES, Builder, Operation, Value
from ..dialects.exp import MODEL_GRAPH_KINDS, PRECISIONS
from ..dialects.graph import data_operand, func_kind
from ..dialects.traits import SPLAT_PRESERVING_OPS, Trait, has_trait, ops_with
from .manager import CompilationUnit, Pass, register_pass

POLICIES = ("auto", *PRECISIONS)
#: Ops that compute in the precision the policy picks for them.
POINTWISE = ops_with(Trait.UNARY) | ops_with(Trait.BINARY) | ops_with(Trait.SELECT)
#: Ops whose result is f32-kept when their data operand is.
PASSTHROUGH = ops_with(Trait.SHAPE) | ops_with(Trait.INDEX)


@define
class GraphCaster:
    """Applies the bf16 policy to one graph (see the module docstring)."""

    func: Operation
    casts: dict[tuple[int, str], Value]
    kept: set[int]
    added: int = 0

    @classmethod
    def of(cls, func: Operation) -> GraphCaster:
        return cls(func, {}, set())

    def cast(self, user: Operation, index: int, dtype: str) -> None:
        value = user.operands[index]
        if value.type.dtype not in FLOAT_DTYPES or value.type.dtype == dtype:
            return
        key = (id(value), dtype)
        if key not in self.casts:
            attrs: dict[str, Any] = {"dtype": dtype}
            if "path" in user.attributes:
                attrs["path"] = user.attributes["path"]
            self.casts[key] = (
                Builder(self.func.body, anchor=user).create("graph.cast", [value], attrs, loc=user.loc).result
            )
            self.added += 1
        user.set_operand(index, self.casts[key])

    def round_result(self, op: Operation) -> None:
        """`op` computing in f32 (its result type inferred again), its users reading the result through one
        cast to bf16 placed right after it."""
        opdef = op.opdef
        assert opdef is not None and op.next_op is not None
        op.result.type = opdef.infer([v.type for v in op.operands], op.attributes)[0]
        attrs: dict[str, Any] = {"dtype": "bf16"}
        if "path" in op.attributes:
            attrs["path"] = op.attributes["path"]
        cast = Builder(self.func.body, anchor=op.next_op).create("graph.cast", [op.result], attrs, loc=op.loc)
        # Every reader of the result, the new cast included, reads the cast; the cast then reads the result.
        op.result.replace_all_uses_with(cast.result)
        cast.set_operand(0, op.result)
        self.added += 1

    def is_kept(self, value: Value) -> bool:
        return id(value) in self.kept

    def float_operands(self, op: Operation) -> list[int]:
        return [i for i, v in enumerate(op.operands) if v.type.dtype in FLOAT_DTYPES]

    def rewrite(self, op: Operation) -> bool:
        """Cast the operands of `op` per the policy; True when it runs in f32 by the keep rule."""
        if op.name == "graph.input" and op.attributes.get("role") == "grad":
            # The gradients of the microbatches before: their sum is accumulated in f32.
            self.kept.update(id(r) for r in op.results)
            return False
        floats = self.float_operands(op)
        kept = False
        if has_trait(op, Trait.CONTRACTION):
            for i in floats:
                self.cast(op, i, "bf16")
        elif op.name in POINTWISE and floats:
            kept = any(self.is_kept(op.operands[i]) for i in floats)
            exact = not kept and any(not bf16_exact(op.operands[i]) for i in floats)
            for i in floats:
                self.cast(op, i, "f32" if kept or exact else "bf16")
            if exact:
                self.round_result(op)
        elif has_trait(op, Trait.REDUCTION):
            kept = True
            self.cast(op, 0, "f32")
        elif has_trait(op, Trait.COMPARE) or op.name == "graph.concat":
            if len({op.operands[i].type.dtype for i in floats}) > 1:
                for i in floats:
                    self.cast(op, i, "f32")
        elif has_trait(op, Trait.EMIT) or op.name == "graph.return":
            for i in floats:
                self.cast(op, i, "f32")
        if op.name in PASSTHROUGH and op.operands and self.is_kept(data_operand(op)):
            self.kept.update(id(r) for r in op.results)
        if kept:
            self.kept.update(id(r) for r in op.results)
        opdef = op.opdef
        inferred = opdef.infer([v.type for v in op.operands], op.attributes) if opdef is not None else None
        if inferred is not None:
            for result, type_ in zip(op.results, inferred):
                result.type = type_
        return kept


def bf16_exact(value: Value) -> bool:
    """False for a splat constant (through views) whose f32 value bf16 cannot hold; True for anything else."""
    op = value.op
    while op is not None and op.name in SPLAT_PRESERVING_OPS and op.operands:
        op = op.operands[0].op
    if op is None or op.name != "graph.const":
        return True
    constant = op.attributes["value"]
    if isinstance(constant, bool) or not isinstance(constant, (int, float)) or not math.isfinite(constant):
        return True
    try:
        bits = struct.unpack("<I", struct.pack("<f", constant))[0]
    except OverflowError:  # beyond f32: the f32 constant is infinite, which bf16 holds
        return True
    return bits & 0xFFFF == 0


def op_kind(op: Operation) -> str:
    """`reduce sum`, `unary exp`, ...: an op's family and short name."""
    return f"{op.family} {op.name.removeprefix('graph.')}"


@define
class InsertCasts(Pass):
    """Makes the precision policy explicit with casts; records counts and where f32 is kept.

    Guarantees: graphs verify, keep their input and output types, and under
    bf16 every matmul takes bf16 operands and every reduction f32 ones.
    """

    name = "insert-casts"
    summary = "the precision policy (f32 or bf16 compute with f32 master weights) as explicit casts"

    policy: str = "auto"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        if self.policy not in POLICIES:
            raise SxError(f"insert-casts: unknown policy '{self.policy}' (known: {', '.join(POLICIES)})")
        policy = self.policy
        if policy == "auto":
            runs = [op for op in module.body.ops if op.name == "exp.run"]
            policy = runs[0].attributes["precision"] if runs else "f32"
        counts = unit.facts.casts
        kept_f32 = unit.facts.kept_f32
        unit.facts.cast_policy = policy
        for func in module.body.ops:
            if func.name != "graph.func" or func_kind(func) not in MODEL_GRAPH_KINDS:
                continue
            name = func.attributes["sym_name"]
            if policy == "f32":
                counts[name] = 0
                continue
            caster = GraphCaster.of(func)
            seen: set[tuple[str, Any]] = set()
            for op in list(func.body.ops):
                if caster.rewrite(op):
                    key = (op_kind(op), op.attributes.get("path"))
                    if key not in seen:
                        seen.add(key)
                        kept_f32.append({"graph": name, "op": key[0], "path": key[1]})
            counts[name] = caster.added


register_pass(InsertCasts)
