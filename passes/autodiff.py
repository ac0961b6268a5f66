"""`autodiff`: reverse-mode differentiation of the train graph, written as graph ops.

For each `graph.func` with `kind = "train"` (or the one named by the option
`func`), the pass appends to `graph.return` the gradient of the output named
`loss` (a float scalar) with respect to every float `graph.input` of role
"param": output `grad/<path>`, in the param's shape and dtype. A param the
loss does not depend on gets zeros. Integer params get no gradient.

How it works: the values on a path from a param to the loss are *active*.
Walking the forward ops in reverse, each op with an active operand and a
cotangent on its result applies its rule (below), which builds the cotangents
of its active operands out of graph ops stamped with the op's own `loc`;
several contributions to one value are summed with `graph.add`. They also
copy the forward op's `path` attribute (the model path the tracer stamps),
so reports and the bf16 policy see backward ops where their forward op is.
Emits
(metric, counter, observe) are sinks and are not differentiated; compares,
`one_hot`, `iota` and casts to integers carry no gradient (`NO_GRADIENT`
lists the ops that have no rule on purpose).

Choices worth knowing:

- Ties split the gradient evenly. `maximum`/`minimum` give half to each
  operand where they are equal (what a central difference measures); the `max`
  and `min` reductions share it equally among the elements equal to the
  extreme (as JAX does).
- `abs` has gradient 0 at 0; `pow`'s gradient in its exponent is
  `g · a^b · log a`, defined for a > 0.
- Broadcasting is always an explicit `graph.broadcast` (or a batch-broadcast
  matmul); its rule sums the cotangent over the broadcast dimensions.

After differentiating, the pass cleans its output by running `canonicalize`,
`cse` and `dce` (imported, not looked up by name): the rules build what those
remove (identities, duplicates, unused values), and what `-p autodiff` prints,
which its lit tests check, is the cleaned graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from attrs import define

from ..diagnostics import SxError
from ..dialects.core import FLOAT_DTYPES, Builder, Operation, TensorType, Value
from ..dialects.traits import Trait, ops_with
from .canonicalize import Canonicalize
from .cse import CommonSubexpressionElimination
from .dce import DeadCodeElimination
from .manager import CompilationUnit, Pass, register_pass

GRAD_PREFIX = "grad/"


@register_pass
@define
class Autodiff(Pass):
    """Adds `grad/<path>` outputs (the loss gradient per param) to the train graph.

    Guarantees: every float param of each selected graph gets one `grad/<path>`
    output in its shape and dtype (zeros where the loss does not depend on it);
    the existing outputs are unchanged.
    """

    name = "autodiff"
    summary = "reverse-mode gradients of the loss for every param of the train graph"
    #: The graph to differentiate by symbol name; empty means every graph.func with kind = "train".
    func: str = ""

    def run(self, unit: CompilationUnit) -> None:
        targets = [op for op in unit.require_module(self.name).body.ops if op.name == "graph.func" and self._selects(op)]
        if self.func and not targets:
            raise SxError(f"autodiff: no graph.func named @{self.func}")
        for func in targets:
            differentiate(func)
        run_cleanup(unit)

    def _selects(self, func: Operation) -> bool:
        if self.func:
            return func_name(func) == self.func
        return func.attributes.get("kind") == "train"


def run_cleanup(unit: CompilationUnit) -> None:
    """Canonicalize, then merge equal ops, then erase the dead ones."""
    for cleanup in (Canonicalize(), CommonSubexpressionElimination(), DeadCodeElimination()):
        cleanup.run(unit)


def func_name(func: Operation) -> str:
    name = func.attributes["sym_name"]
    return getattr(name, "name", name)


def is_float(value: Value) -> bool:
    return value.type.dtype in FLOAT_DTYPES


def differentiate(func: Operation) -> None:
    """Append `grad/<path>` outputs for every float param of `func` to its graph.return."""
    block = func.body
    ret = block.last_op
    names = list(ret.attributes["names"])
    if any(n.startswith(GRAD_PREFIX) for n in names):
        raise SxError(f"@{func_name(func)} already has gradient outputs", func.diagnostic_loc)
    if "loss" not in names:
        raise SxError(f"@{func_name(func)} has no output named 'loss' to differentiate", func.diagnostic_loc)
    loss = ret.operands[names.index("loss")]
    if loss.type.rank != 0 or not is_float(loss):
        raise SxError(f"the loss of @{func_name(func)} must be a float scalar, got {loss.type}", ret.diagnostic_loc)
    params = [op for op in block.ops if op.name == "graph.input" and op.attributes["role"] == "param"
              and is_float(op.result)]
    forward = [op for op in block.ops if op is not ret]
    adjoints = _Adjoints(Builder(block, anchor=ret), _active_values(forward, [p.result for p in params], loss))
    adjoints.seed(loss, loss.op.loc if loss.op is not None else ret.loc)
    for op in reversed(forward):
        adjoints.propagate(op)
    grads = [adjoints.gradient(p.result, p.loc) for p in params]
    new_return = Operation.create(
        "graph.return", list(ret.operands) + grads,
        attributes={**ret.attributes, "names": names + [GRAD_PREFIX + p.attributes["name"] for p in params]},
        loc=ret.loc,
    )
    block.insert_before(new_return, ret)
    ret.erase()


def _active_values(ops: Sequence[Operation], params: Sequence[Value], loss: Value) -> set[Value]:
    """Float values that depend on a param and that the loss depends on."""
    varying = set(params)
    for op in ops:
        if op.name not in NO_GRADIENT and any(v in varying for v in op.operands):
            varying.update(r for r in op.results if is_float(r))
    useful = {loss}
    for op in reversed(ops):
        if any(r in useful for r in op.results):
            useful.update(op.operands)
    return varying & useful


class _Adjoints:
    """The cotangent of each active value, built as graph ops before the return."""

    def __init__(self, builder: Builder, active: set[Value]) -> None:
        self.b = builder
        self.active = active
        self.cotangent: dict[Value, Value] = {}
        #: The model path stamped on the ops being built (the forward op's `path`), if any.
        self.path: str | None = None

    def seed(self, loss: Value, loc) -> None:
        self.at(loss.op, loc)
        self.cotangent[loss] = self.const(1.0, loss.type)

    def at(self, forward: Operation | None, loc) -> None:
        """Build the next ops as the backward of `forward`: its loc and model path."""
        self.b.loc = loc
        self.path = forward.attributes.get("path") if forward is not None else None

    def propagate(self, op: Operation) -> None:
        wants = [v in self.active for v in op.operands]
        if not any(wants) or not op.results or op.results[0] not in self.cotangent:
            return
        rule = RULES.get(op.name)
        if rule is None:
            raise SxError(f"autodiff has no rule for '{op.name}'", op.diagnostic_loc)
        self.at(op, op.loc)
        contributions = rule(self, op, self.cotangent[op.results[0]], wants)
        for operand, wanted, contribution in zip(op.operands, wants, contributions):
            if wanted and contribution is not None:
                self.accumulate(operand, contribution)

    def accumulate(self, value: Value, contribution: Value) -> None:
        if contribution.type != value.type:
            raise AssertionError(f"cotangent {contribution.type} for a value of type {value.type}")
        previous = self.cotangent.get(value)
        self.cotangent[value] = contribution if previous is None else self.op("add", previous, contribution)

    def gradient(self, param: Value, loc) -> Value:
        if param in self.cotangent:
            return self.cotangent[param]
        self.at(None, loc)
        return self.const(0.0, param.type)

    # -- building ops at the current loc -------------------------------------------------------

    def op(self, name: str, *operands: Value, **attributes) -> Value:
        return self.b.create(f"graph.{name}", operands, self._stamped(attributes)).result

    def const(self, value: float, type_: TensorType) -> Value:
        return self.b.create("graph.const", [], self._stamped({"value": value}), result_types=[type_]).result

    def _stamped(self, attributes: dict) -> dict:
        return attributes if self.path is None else {**attributes, "path": self.path}

    def like(self, value: float, like: Value) -> Value:
        """A splat constant of `like`'s type."""
        return self.const(value, like.type)

    def unbroadcast(self, g: Value, shape: tuple[int, ...]) -> Value:
        """Sum `g` over the dimensions numpy broadcasting added to reach it from `shape`."""
        lead = g.type.rank - len(shape)
        axes = list(range(lead)) + [lead + i for i, d in enumerate(shape) if d == 1 and g.type.shape[lead + i] != 1]
        if axes:
            g = self.op("sum", g, axes=axes, keep=False)
        if g.type.shape != tuple(shape):
            g = self.op("reshape", g, shape=list(shape))
        return g

    def kept(self, g: Value, op: Operation) -> Value:
        """A reduction's cotangent with its reduced axes present as size 1."""
        if op.attributes["keep"]:
            return g
        axes = op.attributes["axes"]
        shape = [1 if i in axes else d for i, d in enumerate(op.operands[0].type.shape)]
        return self.op("reshape", g, shape=shape)


Rule = Callable[[_Adjoints, Operation, Value, list[bool]], Sequence[Value | None]]
RULES: dict[str, Rule] = {}
#: The graph ops with no rule on purpose, because no gradient flows through them: the structure
#: and the emits (sinks), inputs and constants (leaves), compares (boolean results) and
#: `one_hot` (integer operand). Every other graph op has a rule (test_op_coverage checks).
NO_GRADIENT = (
    ops_with(Trait.FUNC) | ops_with(Trait.EMIT) | ops_with(Trait.INPUT) | ops_with(Trait.CONSTANT_LIKE)
    | ops_with(Trait.COMPARE) | {"graph.one_hot"}
)


def _rule(*names: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        for name in names:
            RULES[name] = rule
        return rule

    return register


# -- unary --------------------------------------------------------------------------------------


@_rule("graph.neg")
def _neg(ad: _Adjoints, op: Operation, g: Value, wants: list[bool]) -> Sequence[Value | None]:
    return [ad.op("neg", g)]


@_rule("graph.exp")
def _exp(ad, op, g, wants):
    return [ad.op("mul", g, op.result)]


@_rule("graph.log")
def _log(ad, op, g, wants):
    return [ad.op("div", g, op.operands[0])]


@_rule("graph.sqrt")
def _sqrt(ad, op, g, wants):
    return [ad.op("div", ad.op("mul", g, ad.like(0.5, g)), op.result)]


@_rule("graph.rsqrt")
def _rsqrt(ad, op, g, wants):
    y = op.result
    cube = ad.op("mul", ad.op("mul", y, y), y)
    return [ad.op("mul", ad.op("mul", g, cube), ad.like(-0.5, g))]


@_rule("graph.tanh")
def _tanh(ad, op, g, wants):
    y = op.result
    return [ad.op("mul", g, ad.op("sub", ad.like(1.0, y), ad.op("mul", y, y)))]


@_rule("graph.erf")
def _erf(ad, op, g, wants):
    x = op.operands[0]
    density = ad.op("exp", ad.op("neg", ad.op("mul", x, x)))
    return [ad.op("mul", ad.op("mul", g, density), ad.like(2.0 / math.sqrt(math.pi), g))]


@_rule("graph.abs")
def _abs(ad, op, g, wants):
    x = op.operands[0]
    zero = ad.like(0.0, x)
    negative = ad.op("where", ad.op("lt", x, zero), ad.op("neg", g), ad.like(0.0, g))
    return [ad.op("where", ad.op("gt", x, zero), g, negative)]


@_rule("graph.recip")
def _recip(ad, op, g, wants):
    y = op.result
    return [ad.op("neg", ad.op("mul", g, ad.op("mul", y, y)))]


@_rule("graph.sin")
def _sin(ad, op, g, wants):
    return [ad.op("mul", g, ad.op("cos", op.operands[0]))]


@_rule("graph.cos")
def _cos(ad, op, g, wants):
    return [ad.op("neg", ad.op("mul", g, ad.op("sin", op.operands[0])))]


# -- binary, select -----------------------------------------------------------------------------


@_rule("graph.add")
def _add(ad, op, g, wants):
    return [g, g]


@_rule("graph.sub")
def _sub(ad, op, g, wants):
    return [g, ad.op("neg", g) if wants[1] else None]


@_rule("graph.mul")
def _mul(ad, op, g, wants):
    a, b = op.operands
    return [ad.op("mul", g, b) if wants[0] else None, ad.op("mul", g, a) if wants[1] else None]


@_rule("graph.div")
def _div(ad, op, g, wants):
    b = op.operands[1]
    da = ad.op("div", g, b) if wants[0] else None
    db = ad.op("neg", ad.op("div", ad.op("mul", g, op.result), b)) if wants[1] else None
    return [da, db]


@_rule("graph.pow")
def _pow(ad, op, g, wants):
    a, b = op.operands
    da = db = None
    if wants[0]:
        slope = ad.op("mul", b, ad.op("pow", a, ad.op("sub", b, ad.like(1.0, b))))
        da = ad.op("mul", g, slope)
    if wants[1]:
        db = ad.op("mul", ad.op("mul", g, op.result), ad.op("log", a))
    return [da, db]


def _extremum(ad: _Adjoints, op: Operation, g: Value, wins: str) -> Sequence[Value | None]:
    """a's share is 1 where it wins, 1/2 on ties, else 0; b takes the rest of g."""
    a, b = op.operands
    tie = ad.op("where", ad.op("eq", a, b), ad.like(0.5, g), ad.like(0.0, g))
    share = ad.op("where", ad.op(wins, a, b), ad.like(1.0, g), tie)
    da = ad.op("mul", g, share)
    return [da, ad.op("sub", g, da)]


@_rule("graph.maximum")
def _maximum(ad, op, g, wants):
    return _extremum(ad, op, g, "gt")


@_rule("graph.minimum")
def _minimum(ad, op, g, wants):
    return _extremum(ad, op, g, "lt")


@_rule("graph.where")
def _where(ad, op, g, wants):
    cond = op.operands[0]
    zero = ad.like(0.0, g)
    return [
        None,
        ad.op("where", cond, g, zero) if wants[1] else None,
        ad.op("where", cond, zero, g) if wants[2] else None,
    ]


# -- reduce -------------------------------------------------------------------------------------


@_rule("graph.sum")
def _sum(ad, op, g, wants):
    return [ad.op("broadcast", ad.kept(g, op), shape=list(op.operands[0].type.shape))]


@_rule("graph.max", "graph.min")
def _reduce_extremum(ad, op, g, wants):
    """Shared equally by the elements equal to the extreme."""
    x = op.operands[0]
    shape = list(x.type.shape)
    axes = op.attributes["axes"]
    extreme = ad.op("broadcast", ad.kept(op.result, op), shape=shape)
    hits = ad.op("cast", ad.op("eq", x, extreme), dtype=x.type.dtype)
    count = ad.op("sum", hits, axes=axes, keep=True)
    share = ad.op("div", ad.kept(g, op), count)
    return [ad.op("mul", hits, ad.op("broadcast", share, shape=shape))]


# -- shape --------------------------------------------------------------------------------------


@_rule("graph.reshape")
def _reshape(ad, op, g, wants):
    return [ad.op("reshape", g, shape=list(op.operands[0].type.shape))]


@_rule("graph.transpose")
def _transpose(ad, op, g, wants):
    perm = op.attributes["perm"]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [ad.op("transpose", g, perm=inverse)]


@_rule("graph.broadcast")
def _broadcast(ad, op, g, wants):
    return [ad.unbroadcast(g, op.operands[0].type.shape)]


@_rule("graph.slice")
def _slice(ad, op, g, wants):
    axis = op.attributes["axis"]
    dim = op.operands[0].type.shape[axis]
    return [ad.op("pad", g, axis=axis, before=op.attributes["start"], after=dim - op.attributes["end"])]


@_rule("graph.pad")
def _pad(ad, op, g, wants):
    axis = op.attributes["axis"]
    start = op.attributes["before"]
    return [ad.op("slice", g, axis=axis, start=start, end=start + op.operands[0].type.shape[axis])]


@_rule("graph.concat")
def _concat(ad, op, g, wants):
    axis = op.attributes["axis"]
    pieces: list[Value | None] = []
    start = 0
    for operand, wanted in zip(op.operands, wants):
        end = start + operand.type.shape[axis]
        pieces.append(ad.op("slice", g, axis=axis, start=start, end=end) if wanted else None)
        start = end
    return pieces


@_rule("graph.squeeze")
def _squeeze(ad, op, g, wants):
    return [ad.op("expand_dims", g, axis=op.attributes["axis"])]


@_rule("graph.expand_dims")
def _expand_dims(ad, op, g, wants):
    return [ad.op("squeeze", g, axis=op.attributes["axis"])]


# -- contract -----------------------------------------------------------------------------------


def _swap_last(ad: _Adjoints, x: Value) -> Value:
    rank = x.type.rank
    return ad.op("transpose", x, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


@_rule("graph.matmul")
def _matmul(ad, op, g, wants):
    """dA = g·Bᵀ and dB = Aᵀ·g, each summed over the batch dimensions its operand was broadcast on."""
    a, b = op.operands
    da = ad.unbroadcast(ad.op("matmul", g, _swap_last(ad, b)), a.type.shape) if wants[0] else None
    db = ad.unbroadcast(ad.op("matmul", _swap_last(ad, a), g), b.type.shape) if wants[1] else None
    return [da, db]


# -- index, cast --------------------------------------------------------------------------------


@_rule("graph.take")
def _take(ad, op, g, wants):
    x, idx = op.operands
    axis = op.attributes["axis"]
    return [ad.op("scatter_add", idx, g, axis=axis, dim=x.type.shape[axis]), None]


@_rule("graph.take_along")
def _take_along(ad, op, g, wants):
    x, idx = op.operands
    axis = op.attributes["axis"]
    return [ad.op("scatter_add_along", idx, g, axis=axis, dim=x.type.shape[axis]), None]


@_rule("graph.scatter_add")
def _scatter_add(ad, op, g, wants):
    return [None, ad.op("take", g, op.operands[0], axis=op.attributes["axis"])]


@_rule("graph.scatter_add_along")
def _scatter_add_along(ad, op, g, wants):
    return [None, ad.op("take_along", g, op.operands[0], axis=op.attributes["axis"])]


@_rule("graph.cast")
def _cast(ad, op, g, wants):
    return [ad.op("cast", g, dtype=op.operands[0].type.dtype)]
