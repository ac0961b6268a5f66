"""The attention family: `softmax(scale·Q·Kᵀ + mask)·V` and its backward, recognised around a softmax match.

Structure first. A softmax forward match (`families`) along the last axis of
a `[..., T, T]` value is the anchor: its input must be reached from a
contraction `A·B` (`A` `[..., T, d]`, `B` `[..., d, T]`, batch dimensions the
scores' own: one product per head) through a *score chain* — products and
quotients by splat constants (the scale), an added tensor computed from
constants only or a `where` choosing between the scores and a constant
under a condition computed from constants (the mask), float casts — and its
output must be read, through float casts, by a second contraction `P·V`
(`V` `[..., T, d]`). Each of `A`, `B`ᵀ and `V` is followed up through
views (slices, reshapes, transposes), float casts and splat-constant
factors to the value it is stored in (its *root*): the view is proven by
composing strides (`StridedView`), so Q, K and V are read where they are —
three slices of one packed `[B, T, 3·C]` projection are the `packed` layout,
a `[B, H, T, d]` tensor the `heads` layout.

Then the math. The ops between the contractions are evaluated in float64 on
random Q, K and V (one head when the batch is large: every op is per head)
and compared with the formula, with the causal mask and without one; a
region equal to neither falls back ("a mask that is neither causal nor
absent"). The comparison is repeated on inputs of zero, tiny and huge scale,
where a clamp inside the chain would show (the regime trial of the row
families). The backward is bound the same way around the softmax backward
match whose `y` is the forward's probabilities: `dP = dO·Vᵀ` feeds its `dy`;
its `dx` reaches, through a chain like the forward's (the scale, the mask's
`where`), contractions with views of K and Q, and `Pᵀ·dO` is dV; the
gradients the graph holds are checked against the formula's.

Nothing here claims what it has not checked: a contraction whose operand is
not a strided view of one root, a chain op of another kind, a batch that
differs from the scores', a value the formula does not reproduce — the
region is not attention, and its softmax stays a row program.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from attrs import define, field, frozen

from ...dialects.core import Block, Operation, Value
from ...dialects.graph_semantics import numpy_binary, numpy_unary
from ...dialects.traits import Trait, has_trait
from ..targets import KernelTarget
from .domain import is_float, is_float_cast, splat_value
from .evaluate import GUARD_OPS
from .families import TOLERANCE, Match, holds, softmax
from .plans import Decision, doomed_ops, first_loc, most_common_path, storage

#: Above this many elements per evaluated tensor, the evaluation keeps one head (all ops are per head).
FULL_EVALUATION_LIMIT = 1 << 20
#: The scales of the regime trial's Q and K (zero, tiny, huge: a clamp in the chain shows at one of them).
REGIME_SCALES = (0.0, 1e-4, 30.0)
#: A masked score at or below this adds exactly zero to a softmax of f32 scores (exp underflows).
LARGE_NEGATIVE = -1e4
#: How close a backward of a region holding bf16 values must be to the formula (bf16 keeps 8 bits).
BF16_TOLERANCE = 2.0**-8
#: Ops a chain of views may hold.
VIEW_OPS = frozenset({"graph.reshape", "graph.transpose", "graph.slice", "graph.expand_dims", "graph.squeeze"})


# --- strided views ------------------------------------------------------------------------------------------

@frozen
class StridedView:
    """Elements of a contiguous root: index i of the view is element `offset + Σ i_k·strides[k]` of the root."""

    root: Value
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, root: Value) -> StridedView:
        shape = tuple(root.type.shape)
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return cls(root, 0, shape, tuple(reversed(strides)))

    def apply(self, op: Operation) -> StridedView | None:
        """This view seen through the view op `op` (None when the result is no strided view of the root)."""
        attributes = op.attributes
        shape, strides = list(self.shape), list(self.strides)
        if op.name == "graph.transpose":
            perm = attributes["perm"]
            return StridedView(self.root, self.offset, tuple(shape[p] for p in perm), tuple(strides[p] for p in perm))
        if op.name == "graph.slice":
            axis = attributes["axis"] % len(shape)
            start = attributes["start"]
            shape[axis] = attributes["end"] - start
            return StridedView(self.root, self.offset + start * strides[axis], tuple(shape), tuple(strides))
        if op.name in ("graph.reshape", "graph.expand_dims", "graph.squeeze"):
            new = _reshaped_strides(shape, strides, list(op.result.type.shape))
            return None if new is None else StridedView(self.root, self.offset, tuple(op.result.type.shape), new)
        return None

    def transposed(self) -> StridedView:
        """The view with its last two axes swapped."""
        shape, strides = list(self.shape), list(self.strides)
        shape[-2:], strides[-2:] = shape[:-3:-1], strides[:-3:-1]
        return StridedView(self.root, self.offset, tuple(shape), tuple(strides))

    def same(self, other: StridedView) -> bool:
        """The same elements in the same order (strides of size-1 axes do not matter)."""
        if self.root is not other.root or self.offset != other.offset or self.shape != other.shape:
            return False
        return all(size == 1 or a == b for size, a, b in zip(self.shape, self.strides, other.strides))


def _reshaped_strides(shape: list[int], strides: list[int], new_shape: list[int]) -> tuple[int, ...] | None:
    """The strides of `new_shape` over the same elements without a copy, or None (numpy's no-copy reshape)."""
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    new_strides = [0] * len(new_shape)
    targets = [i for i, n in enumerate(new_shape) if n != 1]
    oi = ni = 0
    while oi < len(old) and ni < len(targets):
        o_end, n_end = oi + 1, ni + 1
        o_size, n_size = old[oi][0], new_shape[targets[ni]]
        while o_size != n_size:
            if o_size < n_size:
                if o_end == len(old):
                    return None
                o_size *= old[o_end][0]
                o_end += 1
            else:
                if n_end == len(targets):
                    return None
                n_size *= new_shape[targets[n_end]]
                n_end += 1
        for k in range(oi, o_end - 1):
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        step = old[o_end - 1][1]
        for k in range(n_end - 1, ni - 1, -1):
            new_strides[targets[k]] = step
            step *= new_shape[targets[k]]
        oi, ni = o_end, n_end
    if oi != len(old) or ni != len(targets):
        return None
    return tuple(new_strides)


@define(eq=False)
class Operand:
    """A contraction operand followed to its root: the view, the splat factors and the ops between."""

    value: Value
    view: StridedView
    scale: float
    ops: list[Operation]

    @property
    def root(self) -> Value:
        return self.view.root


def follow(value: Value) -> Operand:
    """`value` followed up through views, float casts and splat-constant factors to the value it is read from."""
    ops: list[Operation] = []
    scale = 1.0
    current = value
    while current.op is not None:
        op = current.op
        if op.name in VIEW_OPS or is_float_cast(op):
            ops.append(op)
            current = op.operands[0]
            continue
        factor = _splat_factor(op)
        if factor is None:
            break
        ops.append(op)
        scale *= factor[0]
        current = factor[1]
    view = StridedView.of(current)
    for op in reversed(ops):
        if op.name in VIEW_OPS:
            applied = view.apply(op)
            if applied is None:
                return Operand(value, StridedView.of(value), 1.0, [])
            view = applied
    return Operand(value, view, scale, ops)


def _splat_factor(op: Operation) -> tuple[float, Value] | None:
    """`op` multiplies or divides one value by a splat constant: the factor and the value."""
    if op.name not in ("graph.mul", "graph.div") or len(op.operands) != 2:
        return None
    a, b = op.operands
    cb = splat_value(b.op)
    if cb is not None and cb != 0.0:
        return (cb if op.name == "graph.mul" else 1.0 / cb), a
    ca = splat_value(a.op)
    if ca is not None and op.name == "graph.mul":
        return ca, b
    return None


def constant_derived(value: Value, memo: dict[Value, bool]) -> bool:
    """Whether `value` is computed from constants alone (an iota comparison, a literal mask, their broadcasts)."""
    if value in memo:
        return memo[value]
    op = value.op
    result = op is not None and op.name != "graph.input" and (
        op.name in ("graph.const", "graph.iota") or (bool(op.operands)
                                                      and all(constant_derived(v, memo) for v in op.operands)))
    memo[value] = result
    return result


# --- matches ------------------------------------------------------------------------------------------------

@define(eq=False)
class AttentionMatch:
    """A recognised attention forward or backward: its roots, layout, scale, mask, slice and outputs."""

    direction: str
    #: The softmax (forward) or softmax backward row-family match inside it.
    inner: Match
    #: Kernel operand role -> the contraction operand (q, k, v; do for a backward) followed to its root.
    operands: dict[str, Operand]
    #: Kernel output role -> (the graph value, whether it is the kernel's output transposed on its last axes).
    outputs: dict[str, tuple[Value, bool]]
    #: Every op the kernel stands for (block order).
    slice: list[Operation]
    scale: float
    causal: bool
    head_dim: int
    seq: int
    batch: tuple[int, ...]
    forms: list[str] = field(factory=list)
    forward: AttentionMatch | None = None
    #: Why the region is not attention's although its structure is (the math departs), if it is not.
    refusal: str | None = None
    #: The probabilities (the softmax's y) as the forward holds them.
    probabilities: Value | None = None
    #: The op applying the mask (an add or a `where`), and the value it gives masked scores on the trials.
    mask_op: Operation | None = None
    mask_value: float | None = None
    #: The ops computing the mask from constants (evaluated with the slice, not part of it: layers share them).
    constants: list[Operation] = field(factory=list)
    #: A forward whose softmax has a backward that is not recognised as attention's.
    backward_unrecognised: bool = False

    @property
    def family(self) -> str:
        return f"attention_{self.direction}"

    def output_values(self) -> set[Value]:
        return {value for value, _ in self.outputs.values()}

    @property
    def layout(self) -> str:
        """`packed` when q, k and v are slices of one value, else `heads`."""
        roots = {self.operands[r].root for r in ("q", "k", "v") if r in self.operands}
        if self.forward is not None:
            roots = {self.forward.operands[r].root for r in ("q", "k", "v")}
        return "packed" if len(roots) == 1 else "heads"


def match_attention(forward: Match, block_order: dict[Operation, int], verdicts: dict[tuple, Any]
                    ) -> AttentionMatch | None:
    """The attention forward around the softmax forward `forward`, or None when the structure is not there."""
    if forward.family != "softmax" or forward.direction != "forward":
        return None
    x = forward.inputs["x"]
    shape = tuple(x.type.shape)
    if len(shape) < 2 or shape[-1] != shape[-2] or not forward.region.domain.is_last_axis:
        return None
    seq, batch = shape[-1], shape[:-2]
    memo: dict[Value, bool] = {}
    chain = _score_chain(x, memo)
    if chain is None:
        return None
    scores, chain_ops, mask_ops, score_scale, mask_op = chain
    a, b = (follow(v) for v in scores.op.operands)
    if a.value.type.shape[:-2] != batch or b.value.type.shape[:-2] != batch:
        return None
    head_dim = a.value.type.shape[-1]
    if tuple(b.value.type.shape[-2:]) != (head_dim, seq):
        return None
    ys = forward.outputs["y"]
    pv = _reader_contraction(ys, batch, seq)
    if pv is None:
        return None
    product, cast_ops = pv
    v = follow(product.operands[1])
    if tuple(v.value.type.shape) != (*batch, seq, head_dim):
        return None
    k_view = Operand(b.value, b.view.transposed(), b.scale, b.ops)
    operands = {"q": a, "k": k_view, "v": v}
    core = sorted({scores.op, *chain_ops, *forward.slice, *cast_ops, product}, key=block_order.__getitem__)
    match = AttentionMatch("forward", forward, operands, {"o": (product.result, False)}, core,
                           scale=score_scale * a.scale * b.scale, causal=mask_op is not None, head_dim=head_dim,
                           seq=seq, batch=batch, probabilities=ys[0], mask_op=mask_op,
                           constants=sorted(mask_ops, key=lambda op: block_order.get(op, -1)))
    key = ("forward", signature([*match.constants, *match.slice]))
    if key in verdicts:
        match.refusal, match.causal, match.mask_value = verdicts[key]
    else:
        match.refusal = _confirm_forward(match, scores, score_scale)
        verdicts[key] = (match.refusal, match.causal, match.mask_value)
    match.refusal = forward.refusal or match.refusal
    match.forms = _forms(match, score_scale, a, b)
    return match


def _score_chain(x: Value, memo: dict[Value, bool]):
    """From the softmax's input up to the score contraction: (the contraction's result, the chain's ops, the
    mask's ops, the scale on the scores, the op applying the mask or None); None when another op is there."""
    chain: list[Operation] = []
    mask_ops: set[Operation] = set()
    scale = 1.0
    mask_op: Operation | None = None
    current = x
    while current.op is not None and current.op.name != "graph.matmul":
        op = current.op
        chain.append(op)
        if is_float_cast(op):
            current = op.operands[0]
            continue
        factor = _splat_factor(op)
        if factor is not None:
            scale *= factor[0]
            current = factor[1]
            continue
        if op.name in ("graph.add", "graph.where") and mask_op is None:
            lanes = op.operands[1:] if op.name == "graph.where" else op.operands
            free = [v for v in lanes if not constant_derived(v, memo)]
            constant = [v for v in op.operands if constant_derived(v, memo)]
            if len(free) != 1 or len(constant) != len(op.operands) - 1:
                return None
            mask_op = op
            mask_ops |= _ops_computing(constant)
            current = free[0]
            continue
        # Any other elementwise op of the scores and constants (a clamp, a soft cap) is the math's to judge.
        free = [v for v in op.operands if not constant_derived(v, memo)]
        if not has_trait(op, Trait.ELEMENTWISE) or len(free) != 1 or op.result.type.shape != x.type.shape:
            return None
        current = free[0]
    if current.op is None or len(current.type.shape) != len(x.type.shape):
        return None
    return current, chain, mask_ops, scale, mask_op


def _ops_computing(values: Iterable[Value]) -> set[Operation]:
    found: set[Operation] = set()
    stack = [v.op for v in values if v.op is not None]
    while stack:
        op = stack.pop()
        if op not in found:
            found.add(op)
            stack.extend(v.op for v in op.operands if v.op is not None)
    return found


def _reader_contraction(ys: Sequence[Value], batch: tuple[int, ...], seq: int) -> tuple[Operation, list[Operation]] | None:
    """The contraction `P·V` reading the probabilities (through float casts) as its left operand."""
    frontier = list(ys)
    casts: list[Operation] = []
    found = None
    while frontier:
        value = frontier.pop()
        for user in value.users():
            if is_float_cast(user):
                casts.append(user)
                frontier.append(user.result)
            elif (user.name == "graph.matmul" and user.operands[0] is value and user.operands[1] is not value
                  and tuple(user.result.type.shape[:-1]) == (*batch, seq)):
                if found is not None and found is not user:
                    return None
                found = user
    if found is None:
        return None
    return found, [c for c in casts if c.result is found.operands[0] or _reaches(c, found)]


def _reaches(cast: Operation, target: Operation) -> bool:
    return any(u is target or (is_float_cast(u) and _reaches(u, target)) for u in cast.result.users())


# --- numeric confirmation -----------------------------------------------------------------------------------

def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    """softmax(scale·q·kᵀ + mask)·v in float64, heads along the leading axes."""
    return attention_of_scores(scale * (q @ np.swapaxes(k, -1, -2)), v, causal)


def attention_of_scores(s: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """softmax(s + mask)·v for scaled scores `s`."""
    if causal:
        t = s.shape[-1]
        s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, s)
    return _softmax_last(s) @ v


def _softmax_last(s: np.ndarray) -> np.ndarray:
    flat = s.reshape(-1, s.shape[-1])
    return softmax(flat).reshape(s.shape)


def attention_gradients(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, scale: float,
                        causal: bool) -> dict[str, np.ndarray]:
    """dq, dk, dv of `attention_reference` for the upstream gradient `do`."""
    s = scale * (q @ np.swapaxes(k, -1, -2))
    if causal:
        t = s.shape[-1]
        s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, s)
    p = _softmax_last(s)
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return {"dq": scale * ds @ k, "dk": scale * np.swapaxes(ds, -1, -2) @ q, "dv": np.swapaxes(p, -1, -2) @ do}


@define(eq=False)
class _Evaluator:
    """The core ops evaluated in float64, with the batch kept whole when small and reduced to one head when not."""

    batch: tuple[int, ...]
    reduce: bool

    @classmethod
    def for_match(cls, batch: tuple[int, ...], seq: int) -> _Evaluator:
        return cls(batch, math.prod(batch) * seq * seq > FULL_EVALUATION_LIMIT)

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(shape)
        n = len(self.batch)
        if self.reduce and len(shape) >= n + 1 and shape[:n] == self.batch:
            return (1,) * n + shape[n:]
        return shape

    def draw(self, shape: Sequence[int], rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal(self.shape(shape)) * scale

    def run(self, ops: Sequence[Operation], env: dict[Value, np.ndarray]) -> dict[Value, np.ndarray]:
        with np.errstate(all="ignore"):
            for op in ops:
                if op.results and op.result not in env:
                    env[op.result] = self.compute(op, [self._read(v, env) for v in op.operands])
        return env

    def _read(self, value: Value, env: dict[Value, np.ndarray]) -> np.ndarray:
        """A value of the environment; a splat constant read from outside the ops is computed."""
        if value not in env and splat_value(value.op) is not None:
            env[value] = self.compute(value.op, [])
        return env[value]

    def compute(self, op: Operation, args: list[np.ndarray]) -> np.ndarray:
        name, attributes = op.name, op.attributes
        shape = self.shape(op.result.type.shape)
        if name == "graph.const":
            value = attributes["value"]
            return np.broadcast_to(np.asarray(value, dtype=np.float64 if is_float(op.result) else None), shape)
        if name == "graph.iota":
            axis = attributes["axis"]
            index = np.arange(shape[axis]).reshape([-1 if i == axis else 1 for i in range(len(shape))])
            return np.broadcast_to(index, shape)
        if name == "graph.matmul":
            return np.matmul(*args)
        if name == "graph.broadcast":
            return np.broadcast_to(args[0], shape)
        if name in ("graph.reshape", "graph.expand_dims", "graph.squeeze"):
            return np.reshape(args[0], shape)
        if name == "graph.transpose":
            return np.transpose(args[0], attributes["perm"])
        if name in ("graph.sum", "graph.max", "graph.min"):
            reduce = {"graph.sum": np.sum, "graph.max": np.max, "graph.min": np.min}[name]
            return reduce(args[0], axis=tuple(attributes["axes"]), keepdims=bool(attributes.get("keep")))
        if name == "graph.cast":
            dtype = attributes["dtype"]
            return args[0] != 0 if dtype == "i1" else args[0].astype(np.int64 if dtype.startswith("i") else np.float64)
        if name == "graph.where":
            return np.where(*args)
        unary = numpy_unary().get(name)
        if unary is not None:
            return np.asarray(unary(args[0]), dtype=np.float64)
        binary = numpy_binary().get(name)
        if binary is not None:
            return np.asarray(binary(*args))
        raise _Unevaluable(name)


class _Unevaluable(Exception):
    """An op in a region the evaluator has no meaning for: the region is not confirmed."""


def _confirm_forward(match: AttentionMatch, scores: Value, score_scale: float) -> str | None:
    """None when the region computes the formula (with its causal mask or none) on every trial; else why not.

    The trials: random Q, K and V; then the regimes — Q and K of zero, tiny and huge scale, and scores held at,
    below and above every constant the chain compares with (where a clamp stops being the identity)."""
    evaluator = _Evaluator.for_match(match.batch, match.seq)
    rng = np.random.default_rng(1700)
    a_value, b_value = scores.op.operands
    v_value = match.outputs["o"][0].op.operands[1]
    shape = evaluator.shape(scores.type.shape)
    steps = np.array([-1.0, 0.0, 1.0])[np.arange(shape[-1]) % 3]
    held = [None] + [None] * len(REGIME_SCALES)
    held += [np.broadcast_to((c + (1.0 + abs(c)) * steps) / score_scale, shape) for c in _compared(match)]
    verdicts = set()
    for trial, scaled in enumerate(held):
        scale = (1.0, *REGIME_SCALES)[trial] if trial <= len(REGIME_SCALES) else 1.0
        a = evaluator.draw(a_value.type.shape, rng, scale)
        b = evaluator.draw(b_value.type.shape, rng, scale)
        v = evaluator.draw(v_value.type.shape, rng)
        env = {a_value: a, b_value: b, v_value: v}
        raw = a @ b if scaled is None else scaled
        env[scores] = raw
        try:
            env = evaluator.run([*match.constants, *match.slice], env)
        except _Unevaluable as error:
            return f"its region holds {error}, which the attention formula has no meaning for"
        got = env[match.outputs["o"][0]]
        if trial == 0 and match.mask_op is not None:
            match.mask_value = _masked_value(match.mask_op, env)
        fits = [causal for causal in (match.causal, not match.causal)
                if _holds(got, attention_of_scores(score_scale * raw, v, causal), trial)]
        if not fits:
            if trial == 0:
                return "its mask is neither causal nor absent" if match.causal else \
                    "its math departs from the attention formula"
            return f"{_guard(match)} is not in the attention formula (it changes the result on queries and keys " \
                "of zero, tiny or huge scale, or on scores at its constants)"
        verdicts.add(fits[0])
    if len(verdicts) != 1:
        return "its mask is neither causal nor absent"
    match.causal = verdicts.pop()
    return None


def _compared(match: AttentionMatch) -> list[float]:
    """The finite constants the score chain's maximums, minimums and comparisons compare with."""
    found: dict[float, None] = {}
    for op in match.slice:
        if op.name in GUARD_OPS and op not in match.inner.slice:
            for operand in op.operands:
                const = splat_value(operand.op)
                if const is not None and math.isfinite(const):
                    found.setdefault(const, None)
    return list(found)


def _guard(match: AttentionMatch) -> str:
    """The first op of the score chain that is neither a scale, the mask, a cast nor the softmax's."""
    known = {*match.inner.slice, match.mask_op}
    for op in match.slice:
        if op in known or op.name in ("graph.matmul", "graph.const") or is_float_cast(op) or _splat_factor(op):
            continue
        if has_trait(op, Trait.ELEMENTWISE) and op.result.type.shape == match.probabilities.type.shape:
            where = f" at {op.loc.short()}" if op.loc is not None else ""
            return f"the `{op.name.removeprefix('graph.')}`{where}"
    return "an op of its scores"


def _masked_value(op: Operation, env: dict[Value, np.ndarray]) -> float:
    """The least value the mask gives a score (an added tensor's, or the constant a `where` chooses)."""
    lanes = op.operands if op.name == "graph.add" else op.operands[1:]
    memo: dict[Value, bool] = {}
    return float(min(np.min(env[v]) if v in env else np.inf for v in lanes if constant_derived(v, memo)))


def _holds(got: np.ndarray, want: np.ndarray, trial: int) -> bool:
    """The first trial's outputs equal the formula's; a regime trial's wherever the region's are finite."""
    if trial == 0:
        return _agrees(got, want)
    return holds(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]))


def _agrees(got: np.ndarray, want: np.ndarray, tolerance: float = TOLERANCE) -> bool:
    """Equal within `tolerance` of each element and of the largest magnitude, all finite."""
    if not np.all(np.isfinite(got)):
        return False
    return bool(np.all(np.abs(got - want) <= tolerance * (np.abs(want) + np.abs(want).max())))


def _tolerance(ops: Sequence[Operation]) -> float:
    """TOLERANCE, or bf16's precision when the region holds bf16 values: a constant there (the scale of the
    gradient) is rounded to bf16, so the math as written differs from the formula by that rounding, which
    the kernel, computing with the scale in f32, does not make."""
    return BF16_TOLERANCE if any(r.type.dtype == "bf16" for op in ops for r in op.results) else TOLERANCE


def _forms(match: AttentionMatch, score_scale: float, a: Operand, b: Operand) -> list[str]:
    """The `as` phrases: how the mask, the scale and the heads were written, and the softmax's own."""
    mask_op = match.mask_op
    if mask_op is None:
        mask = "without a mask"
    elif not match.causal:
        mask = "with a mask that masks nothing"
    else:
        built = "a comparison of iotas" if any(op.name == "graph.iota" for op in match.constants) else "constants"
        value = match.mask_value if match.mask_value is not None else -math.inf
        masked = "-inf" if value == -math.inf else f"{value:g}"
        mask = (f"causal mask as a where of the scores and {masked} by {built}" if mask_op.name == "graph.where"
                else f"causal mask as an added tensor of 0 and {masked} from {built}")
    places = [name for name, factor in (("the scores", score_scale), ("Q", a.scale), ("K", b.scale))
              if factor != 1.0]
    scale = f"scale on {' and '.join(places)}" if places else "without a scale"
    roots = {operand.root for operand in match.operands.values()}
    if len(roots) == 1:
        heads = "heads sliced from a packed QKV projection"
    elif any(op.name in VIEW_OPS for operand in match.operands.values() for op in operand.ops):
        heads = "heads split by reshape and transpose"
    else:
        heads = "heads given apart"
    return [mask, scale, heads, *match.inner.forms]


# --- backward -----------------------------------------------------------------------------------------------

def match_attention_backward(forward: AttentionMatch, backward: Match, block_order: dict[Operation, int],
                             verdicts: dict[tuple, Any]) -> AttentionMatch | None:
    """The attention backward around the softmax backward `backward` of `forward`'s softmax, or None."""
    if backward.forward is not forward.inner or "dy" not in backward.inputs or not backward.outputs.get("dx"):
        return None
    batch, seq, head_dim = forward.batch, forward.seq, forward.head_dim
    dp_cast: list[Operation] = []
    dp = backward.inputs["dy"]
    while dp.op is not None and is_float_cast(dp.op):
        dp_cast.append(dp.op)
        dp = dp.op.operands[0]
    if dp.op is None or dp.op.name != "graph.matmul":
        return None
    do, vt = (follow(v) for v in dp.op.operands)
    if not vt.view.same(forward.operands["v"].view.transposed()) or tuple(do.value.type.shape) != (*batch, seq,
                                                                                                   head_dim):
        return None
    memo: dict[Value, bool] = {}
    probabilities = {forward.probabilities, *(c.result for c in forward.slice if is_float_cast(c)
                                              and c.operands[0] is forward.probabilities)}
    # Autodiff may hold dx twice (before and after adding the max's zero gradient): the last one read on.
    for dx in sorted(backward.outputs["dx"], key=lambda v: -block_order.get(v.op, -1)):
        grads, chain_ops = _gradient_chain(dx, memo)
        outputs, contractions = _gradient_contractions(forward, grads, probabilities, do)
        if set(outputs) == {"dq", "dk", "dv"}:
            break
    else:
        return None
    extra = {op for product in contractions for operand in product.operands
             for op in _views_of(operand, grads | probabilities)}
    core = sorted({dp.op, *dp_cast, *backward.slice, *chain_ops, *contractions, *extra}, key=block_order.__getitem__)
    match = AttentionMatch("backward", backward, {"do": do}, outputs, core, scale=forward.scale,
                           causal=forward.causal, head_dim=head_dim, seq=seq, batch=batch, forward=forward,
                           probabilities=forward.probabilities)
    match.refusal = forward.refusal and f"its forward fell back: {forward.refusal}"
    if match.refusal is None:
        key = ("backward", signature([*forward.constants, *forward.slice, *match.slice]))
        if key not in verdicts:
            verdicts[key] = _confirm_backward(match, dp.op)
        match.refusal = verdicts[key]
    return match


def _views_of(value: Value, sources: set[Value]) -> list[Operation]:
    """The transposes and casts between one of `sources` and `value` (empty when `value` is no view of one)."""
    found = follow(value)
    return found.ops if found.root in sources else []


def signature(ops: Sequence[Operation]) -> tuple:
    """The structure of `ops` without their place in the graph: each op's name, attributes, result type and
    operands (an earlier op's result by position, else the value from outside by type, splat value and the
    strided view of its root it is, roots numbered by first appearance). Equal signatures evaluate alike."""
    refs: dict[Value, int] = {}
    roots: dict[Value, int] = {}
    items = []
    for index, op in enumerate(ops):
        operands = []
        for value in op.operands:
            if value in refs:
                operands.append(refs[value])
                continue
            found = follow(value)
            view = found.view
            root = roots.setdefault(view.root, len(roots))
            operands.append((str(value.type), splat_value(value.op), root, view.offset, view.shape, view.strides,
                             found.scale, str(view.root.type)))
        attributes = tuple(sorted((k, repr(v)) for k, v in op.attributes.items() if k != "path"))
        items.append((op.name, attributes, tuple(str(r.type) for r in op.results), tuple(operands)))
        for result in op.results:
            refs[result] = index
    return tuple(items)


def _gradient_contractions(forward: AttentionMatch, grads: set[Value], probabilities: set[Value],
                           do: Operand) -> tuple[dict[str, tuple[Value, bool]], list[Operation]]:
    """The contractions of the score gradient with views of K and Q (dQ, dK) and of the probabilities with
    dO (dV): each output role's value, whether it is transposed, and the contractions."""
    outputs: dict[str, tuple[Value, bool]] = {}
    contractions: list[Operation] = []
    q, k = forward.operands["q"].view, forward.operands["k"].view
    for product in _contractions_reading(grads | probabilities):
        left, right = product.operands
        lf, rf = follow(left), follow(right)
        role = None
        if left in grads and rf.view.same(k):
            role, transposed = "dq", False
        elif right in grads and lf.view.same(q.transposed()):
            role, transposed = "dk", True
        elif _transposed_of(left, grads) and rf.view.same(q):
            role, transposed = "dk", False
        elif _transposed_of(left, probabilities) and rf.view.same(do.view):
            role, transposed = "dv", False
        if role is None or role in outputs:
            continue
        outputs[role] = (product.result, transposed)
        contractions.append(product)
    return outputs, contractions


def _transposed_of(value: Value, sources: set[Value]) -> bool:
    """`value` is one of `sources` with its last two axes swapped (through float casts, views and splat factors:
    the confirmation evaluates them)."""
    found = follow(value)
    return found.root in sources and found.view.same(StridedView.of(found.root).transposed())


def _gradient_chain(dx: Value, memo: dict[Value, bool]) -> tuple[set[Value], list[Operation]]:
    """The values the softmax backward's dx reaches through splat factors, float casts and a `where` between it
    and a constant (the mask's backward), and the chain's ops."""
    values, ops = {dx}, []
    current = dx
    while True:
        users = list(current.users())
        step = None
        for user in users:
            factor = _splat_factor(user)
            if is_float_cast(user) or (factor is not None and factor[1] is current):
                step = user
            elif user.name == "graph.where" and constant_derived(user.operands[0], memo) and current in \
                    user.operands[1:] and all(constant_derived(v, memo) for v in user.operands[1:] if v is not current):
                step = user
            if step is not None:
                break
        if step is None:
            return values, ops
        ops.append(step)
        values.add(step.result)
        current = step.result


def _contractions_reading(values: set[Value]) -> list[Operation]:
    """The contractions reading one of `values`, directly or through float casts and transposes."""
    found: dict[Operation, None] = {}
    frontier, seen = list(values), set(values)
    while frontier:
        value = frontier.pop()
        for user in value.users():
            if user.name == "graph.matmul":
                found[user] = None
            elif (user.name == "graph.transpose" or is_float_cast(user)) and user.result not in seen:
                seen.add(user.result)
                frontier.append(user.result)
    return list(found)


def _confirm_backward(match: AttentionMatch, dp_product: Operation) -> str | None:
    """None when the gradients the graph holds are the formula's on random inputs; else why not."""
    forward = match.forward
    assert forward is not None
    evaluator = _Evaluator.for_match(match.batch, match.seq)
    rng = np.random.default_rng(1701)
    scores = next(op for op in forward.slice if op.name == "graph.matmul")
    a_value, b_value = scores.operands
    v_value = forward.outputs["o"][0].op.operands[1]
    a = evaluator.draw(a_value.type.shape, rng)
    b = evaluator.draw(b_value.type.shape, rng)
    v = evaluator.draw(v_value.type.shape, rng)
    do = evaluator.draw(match.operands["do"].value.type.shape, rng)
    env = {a_value: a, b_value: b, v_value: v, dp_product.operands[0]: do,
           dp_product.operands[1]: np.swapaxes(v, -1, -2)}
    score_scale = forward.scale / (forward.operands["q"].scale * forward.operands["k"].scale)
    grads = attention_gradients(a, np.swapaxes(b, -1, -2), v, do, score_scale, forward.causal)
    # The contractions read views of Q, K, V and dO: bound to the arrays they are views of.
    sources = [(a, forward.operands["q"]), (np.swapaxes(b, -1, -2), forward.operands["k"]),
               (v, forward.operands["v"]), (do, match.operands["do"])]
    for value, _ in match.outputs.values():
        for operand in value.op.operands:
            if operand in env:
                continue
            found = follow(operand)
            for array, source in sources:
                # The operand is the source's root seen through a view, with its own splat factors.
                array = array * (found.scale / source.scale)
                if found.view.same(source.view):
                    env[operand] = array
                elif found.view.same(source.view.transposed()):
                    env[operand] = np.swapaxes(array, -1, -2)
    try:
        env = evaluator.run([*forward.constants, *forward.slice], env)
        env = evaluator.run(match.slice, env)
    except (_Unevaluable, KeyError) as error:
        return f"its region holds {error}, which the attention formula has no meaning for"
    for role, (value, transposed) in match.outputs.items():
        want = grads[role]
        got = env[value]
        if transposed:
            got = np.swapaxes(got, -1, -2)
        if not _agrees(got, want, _tolerance(match.slice)):
            return f"its {role} is not the attention formula's gradient"
    return None


def output_factor(match: AttentionMatch, role: str) -> float:
    """What the graph's value of an output is, as a multiple of the kernel's (which computes with the roots).

    The kernel's O is `softmax(scale·q·kᵀ)·v` of the roots; the graph's is a multiple when V was scaled on its
    way to the contraction. Its gradients are those of the roots for the root of dO; the graph's gradient of a
    contraction operand `c·root` is the root's divided by c (the graph's backward multiplies by c again)."""
    forward = match.forward or match
    q, k, v = (forward.operands[role].scale for role in ("q", "k", "v"))
    if role == "o":
        return v
    upstream = match.operands["do"].scale
    return {"dq": v * upstream / q, "dk": v * upstream / k, "dv": upstream}[role]




# --- finding and deciding -----------------------------------------------------------------------------------

def find_attention(matches: Sequence[Match], order: dict[Operation, int],
                   verdicts: dict[tuple, Any]) -> list[AttentionMatch]:
    """The attention forwards around the softmax matches, each followed by its backward when one is there;
    `verdicts` remembers the confirmations by structure (twelve layers' attentions are evaluated once)."""
    found: list[AttentionMatch] = []
    for match in matches:
        forward = match_attention(match, order, verdicts)
        if forward is None:
            continue
        found.append(forward)
        for other in matches:
            if other.forward is match:
                backward = match_attention_backward(forward, other, order, verdicts)
                forward.backward_unrecognised = backward is None
                if backward is not None:
                    found.append(backward)
                    break
    return found


@define(eq=False)
class AttentionPlan(Decision[AttentionMatch]):
    """An attention match and its kernel."""


def plan_attention(block: Block, found: Sequence[AttentionMatch], others: set[Operation],
                   target: KernelTarget) -> list[AttentionPlan]:
    """A plan per attention match for `target`, taken or fallen back with its reason: the region's math confirmed,
    a head dimension and dtypes the target's kernel takes, no value inside the region (the probabilities) read
    by what stays (an observation, a backward that is not attention's), a backward's forward taken. `others`
    are the ops other kernels replace."""
    plans = [AttentionPlan(m, most_common_path(m.slice), first_loc(m.slice)) for m in found]
    by_match = {plan.match: plan for plan in plans}
    backward_of = {plan.match.forward: plan for plan in plans if plan.match.forward is not None}
    for plan in plans:
        plan.reason = _static_reason(plan.match, target)
    while True:
        removed = others | {op for plan in plans if plan.taken for op in plan.match.slice}
        doomed = doomed_ops(block, removed)
        changed = False
        for plan in plans:
            if not plan.taken:
                continue
            forward = plan.match.forward
            reason = _exposure(plan.match, doomed)
            backward = backward_of.get(plan.match)
            if reason is not None and backward is not None and not backward.taken:
                reason = f"its backward fell back: {backward.reason}"
            if reason is None and forward is not None and not by_match[forward].taken:
                reason = f"its forward fell back: {by_match[forward].reason}"
            if reason is not None:
                plan.reason = reason
                changed = True
        if not changed:
            return plans


def _static_reason(match: AttentionMatch, target: KernelTarget) -> str | None:
    if match.refusal is not None:
        return match.refusal
    dims = target.attention_head_dims
    if match.head_dim not in dims:
        return f"head dimension {match.head_dim} is not taken ({', '.join(str(d) for d in dims)})"
    reason = unplaced(match)
    if reason is not None:
        return reason
    roles = match.forward.operands if match.forward is not None else match.operands
    operands = {**roles, **match.operands}
    dtypes = {role: storage(operand.root, target).type.dtype for role, operand in operands.items()}
    for role, dtype in dtypes.items():
        if dtype not in target.float_storage:
            return f"dtype {dtype} of its {role} is not taken ({' or '.join(target.float_storage)})"
    if len(set(dtypes.values())) > 1:
        return "its " + ", ".join(f"{role} {dtype}" for role, dtype in dtypes.items()) + " differ in dtype"
    return None


def _exposure(match: AttentionMatch, doomed: set[Operation]) -> str | None:
    """Why a value inside the region (the probabilities, the scores) is read by an op that stays, else None: an
    observation (directly or through the statistics `diagnose` made of it) first."""
    inside = set(match.slice)
    outputs = match.output_values()
    exposed = []
    for op in match.slice:
        if not op.results or op.result in outputs:
            continue
        what = "the probabilities" if op.result is match.probabilities else op.name
        for user in op.result.users():
            if user in inside or user in doomed:
                continue
            observation = _observation_reading(user)
            if observation is not None:
                return f"an observation ({observation.attributes.get('name')}) reads {what}"
            exposed.append((op, what, user))
    if not exposed:
        return None
    if match.backward_unrecognised:
        return ("its backward is not recognised as attention's (dP = dO·Vᵀ, dV = Pᵀ·dO and dQ, dK from the "
                "softmax backward), and it reads the probabilities")
    op, what, user = exposed[0]
    where = f" at {op.loc.short()}" if op.loc is not None else ""
    return f"{what}{where} are read outside the region ({user.name}), and the kernel does not write them"


#: How far through the statistics of a value an observation of it is looked for.
OBSERVATION_DEPTH = 6


def _observation_reading(op: Operation, depth: int = 0) -> Operation | None:
    """The `graph.observe` that is `op` or reads what it computes (the statistics `diagnose` makes of an
    observed tensor), within a few ops."""
    if op.name == "graph.observe":
        return op
    if depth == OBSERVATION_DEPTH:
        return None
    for result in op.results:
        for user in result.users():
            found = _observation_reading(user, depth + 1)
            if found is not None:
                return found
    return None


# --- the kernel's operands ----------------------------------------------------------------------------------

#: The permutation of a [B, H, T, d] value into merged heads [B, T, H, d] (what `merge-heads` reshapes).
MERGE_PERM = (0, 2, 1, 3)
#: The same from [B, H, d, T].
TRANSPOSED_MERGE_PERM = (0, 3, 1, 2)


def sizes(match: AttentionMatch) -> dict[str, int]:
    """The kernel's batch, heads and seq: a batch of two axes is (batch, heads), of one axis heads alone."""
    batch = match.batch
    return {"batch": batch[0] if len(batch) == 2 else 1, "heads": batch[-1] if batch else 1, "seq": match.seq}


def placement(view: StridedView, batch: tuple[int, ...]) -> list[str] | None:
    """Where a [*batch, T, d] view lives in its root, as `[offset, batch, head, token]` element strides; None
    when its head-dimension elements are not consecutive or its batch has more than two axes."""
    if len(batch) > 2 or (view.shape[-1] > 1 and view.strides[-1] != 1):
        return None
    lead = list(view.strides[: len(batch)])
    batch_stride, head_stride = ([0, 0] + lead)[-2:]
    return [str(view.offset), str(batch_stride), str(head_stride), str(view.strides[-2])]


def contiguous(match: AttentionMatch, merged: bool = False) -> list[str]:
    """The placement of a contiguous [*batch, T, d] kernel output, or of merged heads [B, T, H, d]."""
    counts = sizes(match)
    t, h, d = match.seq, counts["heads"], match.head_dim
    if merged:
        return ["0", str(t * h * d), str(d), str(h * d)]
    return ["0", str(h * t * d), str(t * d), str(d)]


def merged_reader(match: AttentionMatch) -> Operation | None:
    """A transpose of the forward's O into merged heads (the `merge-heads` the output projection reads): the
    kernel writes O there, so no copy makes it."""
    (o, transposed), = match.outputs.values()
    return merged_user(o, transposed, match)


def merged_user(value: Value, transposed: bool, match: AttentionMatch) -> Operation | None:
    """A transpose of `value`, a kernel output in heads [B, H, T, d] (or [B, H, d, T] when `transposed`: K's
    gradient of Q·Kᵀ) into merged heads [B, T, H, d], as the output projection reads O and the packed
    projection's gradient the gradients of Q, K and V: the kernel writes the value there instead."""
    if len(match.batch) != 2:
        return None
    perm = TRANSPOSED_MERGE_PERM if transposed else MERGE_PERM
    return next((u for u in value.users() if u.name == "graph.transpose" and tuple(u.attributes["perm"]) == perm),
                None)


def unplaced(match: AttentionMatch) -> str | None:
    """Why the kernel cannot read an operand where it is, else None."""
    if len(match.batch) > 2:
        return f"its batch has {len(match.batch)} axes (the kernel takes batch and heads)"
    for role, operand in match.operands.items():
        if placement(operand.view, match.batch) is None:
            return f"its {role} is not stored with consecutive head-dimension elements"
    return None
