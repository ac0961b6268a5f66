"""The form a matched region was written in, read off the structure that matched and its values.

A family's kernel is the same however the math was written; the form says
how it was written, for the report's `as` lines and the kernel's `form`
attribute. Forms the prelude writes add no `as` line (the report's rows stay
quiet for the common case), except the cross-entropy tail's, which always
says which form it found: a gather or a one-hot sum, of log-probabilities,
of shifted logits or of the logits themselves, negated per row or after the
reduction over rows.

Each phrase is read from the match: which ops its slice holds (a take-along
or not, a division by a constant after a sum, an rsqrt or a sqrt) and what
its values are on the evaluated rows (what the exponentials were shifted by,
whether a value of squares of the input is there, the sign of what the
reduction over rows adds).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ...dialects.core import Operation, Value
from .domain import Kind, OpClass, splat_value
from .families import Match, close, log_softmax, picked, softmax

#: A family's kernel form when the region was written the prelude's way.
PRELUDE_FORMS = {
    "softmax": "exponentials shifted by the row maximum, over their sum",
    "log_softmax": "shifted logits minus their log-sum-exp",
    "layernorm": "mean and variance",
    "rmsnorm": "root mean square",
}


def read_forms(match: Match) -> list[str]:
    """The phrases of `match`'s form: for row programs only those the prelude does not write."""
    if match.direction == "backward":
        return []
    if match.family == "cross_entropy":
        return _cross_entropy(match)
    return [*_row_program(match), *_mean_written(match)]


def kernel_form(match: Match) -> str:
    """The `form` attribute of the match's kernel (a backward takes its forward's)."""
    if match.direction == "backward" and match.forward is not None:
        return kernel_form(match.forward)
    phrases = match.forms
    if match.family == "cross_entropy":
        return phrases[0]
    return ", ".join(phrases) if phrases else PRELUDE_FORMS[match.family]


def _ops(match: Match, *names: str) -> list[Operation]:
    return [op for op in match.slice if op.name in names]


def _env(match: Match) -> dict[Value, np.ndarray]:
    return match.trials[0]


def _array(match: Match, value: Value) -> np.ndarray:
    return np.asarray(_env(match)[value], dtype=np.float64)


def _mean_written(match: Match) -> list[str]:
    """`sum / C` (or `/ rows` for the loss) rather than `sum * (1/C)`."""
    for op in _ops(match, "graph.div"):
        divisor = splat_value(op.operands[1].op)
        if divisor is not None and match.region.classes[op].result_kind in (Kind.PER_ROW, Kind.WHOLE):
            return ["mean written as sum and divide"]
    return []


def _row_program(match: Match) -> list[str]:
    family = match.family
    if family in ("softmax", "log_softmax"):
        return _exponentials(match)
    phrases = []
    if family == "layernorm" and _holds(match, Kind.ROW, _array(match, match.inputs["x"]) ** 2):
        phrases.append("variance as mean of squares minus squared mean")
    phrases += _normalizer(match)
    absent = [name for name in ("weight", "bias") if name in _affine_roles(family) and not match.params.get(name)]
    if absent:
        phrases.append("without " + " and ".join(absent))
    return phrases


def _affine_roles(family: str) -> tuple[str, ...]:
    return ("weight", "bias") if family == "layernorm" else ("weight",)


def _holds(match: Match, kind: Kind, want: np.ndarray) -> bool:
    region = match.region
    return any(region.kind(op.result) is kind and close(_array(match, op.result), want) for op in match.slice)


def _normalizer(match: Match) -> list[str]:
    if _ops(match, "graph.rsqrt"):
        return []
    if any(splat_value(op.operands[1].op) == -0.5 for op in _ops(match, "graph.pow")):
        return ["normalizer as a power of -1/2"]
    roots = {op.result for op in _ops(match, "graph.sqrt")}
    if not roots:
        return []
    roots |= {op.result for op in match.slice if op.operands and op.operands[0] in roots
              and match.region.classes[op].op_class in (OpClass.BROADCAST, OpClass.VIEW)}
    if any(op.operands[1] in roots and splat_value(op.operands[0].op) != 1.0 for op in _ops(match, "graph.div")):
        return ["division by the square root"]
    return ["normalizer as 1/sqrt"]


def _exponentials(match: Match) -> list[str]:
    """What the exponentials were shifted by: the row maximum (the prelude), nothing, the log-sum-exp."""
    x = _array(match, match.inputs["x"])
    if match.family == "log_softmax" and _holds(match, Kind.ROW, softmax(x)) and _ops(match, "graph.log"):
        return ["log of softmax"]
    outputs = match.output_values()
    exps = sorted(_ops(match, "graph.exp"), key=lambda op: op.result not in outputs)  # the output's own first
    for op in exps:
        if match.region.kind(op.result) is not Kind.ROW:
            continue
        shift = x - _array(match, op.operands[0])
        per_row = shift[:, :1]
        if not close(shift, np.broadcast_to(per_row, shift.shape)):
            continue
        if close(per_row, np.zeros_like(per_row)):
            return ["without the max shift, computed stably"]
        if close(per_row, x.max(1, keepdims=True)):
            return []
        if close(per_row, x[:, :1] - log_softmax(x)[:, :1]):
            return ["exp of x minus its log-sum-exp"]
        return ["exponentials shifted by another per-row value"]
    return []


def _cross_entropy(match: Match) -> list[str]:
    x = _array(match, match.inputs["x"])
    targets = np.asarray(_env(match)[match.inputs["targets"]])
    gather = bool(_ops(match, "graph.take_along"))
    pick = _picked(match)
    source = "shifted logits"
    if pick is not None:
        logp, logits = picked(log_softmax(x), targets), picked(x, targets)
        if close(np.abs(pick), np.abs(logp)):
            source = "log-probabilities"
        elif close(np.abs(pick), np.abs(logits)):
            source = "logits"
    pieces = [f"{'gather' if gather else 'one-hot sum'} of {source}, {_negation(match, x, targets)}"]
    return pieces + _mean_written(match)


def _depends_on(match: Match, roots: Iterable[Value]) -> set[Value]:
    reached = set(roots)
    for op in match.slice:
        if any(v in reached for v in op.operands):
            reached.add(op.result)
    return reached


def _picked(match: Match) -> np.ndarray | None:
    """The per-row value the targets pick (a take-along, or the row sum of a one-hot product)."""
    targeted = _depends_on(match, [match.inputs["targets"]])
    region = match.region
    for op in match.slice:
        if op.result not in targeted:
            continue
        op_class = region.classes[op].op_class
        if op_class in (OpClass.TAKE_ALONG, OpClass.REDUCE_ROW):
            return _array(match, op.result)
        if op_class is OpClass.REDUCE_ALL and region.kind(op.operands[0]) is Kind.ROW:
            return _array(match, op.operands[0]).sum(1, keepdims=True)
    return None


def _negation(match: Match, x: np.ndarray, targets: np.ndarray) -> str:
    """Negated per row when what the reduction over rows adds is the (positive) losses, else after it."""
    losses = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) + x.max(1, keepdims=True)
    losses = losses - picked(x, targets)
    for op in match.slice:
        if match.region.classes[op].op_class is OpClass.REDUCE_ALL:
            added = float(_array(match, op.operands[0]).sum())
            return "negated per row" if added * float(losses.sum()) > 0 else "negated after the reduction"
    return "negated per row"
