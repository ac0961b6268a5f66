"""The families' formulas, and the numeric search that binds a region's values to one of them.

A region is evaluated on random rows (`evaluate`); each family's formula is
then computed from every binding of its inputs to the region's values by
role — `x` any row value that feeds one of the region's row reductions, a
layernorm's weight and bias its column values (or none), eps its constants
(or 0), the loss's targets its integer per-row values — and compared with
every value of the region of the output's kind. A value equal to an output
on both trials (two row counts, fresh draws) within a tight float64
tolerance is that output. The binding keeps the ops between its inputs and
its outputs (the *slice*); among the bindings that match, the largest slice
wins, so `x` is bound as far upstream as the math allows (softmax is
shift-invariant: binding it after the max-shift also matches, with fewer ops).

Backward families are bound the same way in a backward region, with the
forward's values computed from the forward region's evaluation: the
gradient `dy` is any other row value, and `dx` (and a norm's weight and bias
gradients, column sums) must equal the family's formula of the forward's
input and outputs.

A forward binding must then hold on the regime trial too (`evaluate_regimes`:
rows of zeros, of tiny and huge scale, values at every constant a guard
compares with), where it is compared wherever the region's value is finite
(the kernel may be steadier than the math as written, never different from
it). There a guard that the random rows never reach — `rsqrt(maximum(var,
eps))`, `maximum(logp, -30)`, `log(maximum(p, 1e-30))`, an ignored target —
changes the region's value and not the formula's: every op of the slice must
be accounted for by the formula, so the best such binding is kept as a
*refused* match, whose kernel is never taken (`plans` reports it as fallen
back, naming the guard), and its backward with it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from attrs import define, field

from ...dialects.core import Operation, Value
from .domain import Kind, is_float, is_index, splat_value
from .evaluate import Env, evaluate, evaluate_regimes, sample_rows
from .regions import Region

#: Relative tolerance of a match (float64 evaluation: equal math agrees to about 1e-14).
TOLERANCE = 1e-9
TRIALS = 2
#: A gradient this small against what it is made of is zero in exact math.
DEGENERATE = 1e-6

#: The backward family of each forward family, and the forward outputs its kernel reads.
BACKWARD_OF = {
    "softmax": ("softmax_backward", ("y",)),
    "log_softmax": ("log_softmax_backward", ("y",)),
    "layernorm": ("layernorm_backward", ("mean", "rstd")),
    "rmsnorm": ("rmsnorm_backward", ("rstd",)),
    "cross_entropy": ("cross_entropy", ("lse",)),
}


@define(eq=False)
class Match:
    """A region bound to a family: the graph values its kernel reads and the region values it writes."""

    family: str
    direction: str
    region: Region
    #: Kernel input role -> graph value (a backward's forward outputs are in `stats` instead).
    inputs: dict[str, Value]
    #: Kernel output role -> the region values equal to it.
    outputs: dict[str, list[Value]]
    params: dict[str, Any]
    slice: list[Operation]
    forward: Match | None = None
    #: The row value the backward's dx is added to (a gradient accumulated into another), if any.
    accumulate: Value | None = None
    #: The forward's outputs a backward kernel reads.
    stats: tuple[str, ...] = ()
    #: The form the region was written in (`forms`), phrases for `as` lines.
    forms: list[str] = field(factory=list)
    #: The region evaluated on the trials' sample rows (for reading forms, and a backward's evaluation).
    trials: list[Env] = field(factory=list, repr=False)
    #: Why the kernel cannot stand for the slice although the trials matched (a guard the formula lacks).
    refusal: str | None = None
    #: Larger families the region matched on the trials but not on the regimes, with why (a floored loss
    #: taken as its log-softmax): `fell back` lines of their own.
    declined: tuple[tuple[str, str], ...] = ()
    #: A forward whose values ops outside every match read (a backward, by the look of it) where no backward
    #: of its family was recognised: label smoothing written as two terms, an added z-loss.
    backward_unmatched: bool = False

    @property
    def kind(self) -> str:
        return "cross_entropy" if self.family == "cross_entropy" else "row"

    @property
    def score(self) -> int:
        return len(self.slice)

    def evaluated(self) -> list[Env]:
        """The region evaluated on the sample rows (again, for a match remembered by structure)."""
        if not self.trials:
            self.trials = _trials(self.region)
        return self.trials

    def output_values(self) -> set[Value]:
        return {v for values in self.outputs.values() for v in values}


def close(got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> bool:
    """Equal within TOLERANCE relative to each element and to the largest magnitude (at least `floor`, the
    magnitude of what a gradient is made of: a gradient that is zero in exact math is rounding in the graph);
    both finite."""
    if got.shape != want.shape or got.dtype.kind not in "fc" or not np.all(np.isfinite(got)):
        return False
    if not np.all(np.isfinite(want)):
        return False
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, floor)
    return bool(np.all(np.abs(got - want) <= TOLERANCE * (np.abs(want) + scale) + 1e-300))


# --- formulas (rows along axis 1 of [R, C] arrays) ------------------------------------------------------------

def _lse(x: np.ndarray) -> np.ndarray:
    top = x.max(1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(1, keepdims=True))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    return x - _lse(x)


def moments(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(1, keepdims=True)
    return mean, 1.0 / np.sqrt(((x - mean) ** 2).mean(1, keepdims=True) + eps)


def rms(x: np.ndarray, eps: float) -> np.ndarray:
    return 1.0 / np.sqrt((x * x).mean(1, keepdims=True) + eps)


def picked(x: np.ndarray, targets: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, np.clip(targets.astype(np.int64), 0, x.shape[1] - 1), axis=1)


def one_hot(targets: np.ndarray, cols: int) -> np.ndarray:
    return (np.arange(cols)[None, :] == targets).astype(np.float64)


# --- the search ---------------------------------------------------------------------------------------------

@define(eq=False)
class _Search:
    region: Region
    trials: list[Env]
    free_ok: bool = False
    _pools: dict = field(factory=dict)

    def values(self, kind: Kind, *, leaves: bool = True, free: bool = True) -> list[Value]:
        return self._pool(kind, leaves, free)[0]

    def _pool(self, kind: Kind, leaves: bool, free: bool) -> tuple[list[Value], np.ndarray]:
        """The float values of `kind` (with leaves, with free ones) and their probes on the first trial."""
        key = (kind, leaves, free)
        if key not in self._pools:
            region = self.region
            pool = region.values + (region.leaves if leaves else [])
            values = [v for v in pool if region.kind(v) is kind and is_float(v) and splat_value(v.op) is None
                      and (free or v not in region.free)]
            env = self.trials[0]
            probes = np.array([_probe(np.asarray(env[v], dtype=np.float64)) for v in values]).reshape(
                len(values), len(PROBE_POSITIONS))
            self._pools[key] = (values, probes)
        return self._pools[key]

    def equal(self, kind: Kind, wants: Sequence[np.ndarray], leaves: bool = False, free: bool = True,
              floor: float = 0.0) -> list[Value]:
        """The values of `kind` equal to `wants[t]` on every trial t (a probe of a few elements first); region
        values only unless `leaves` (a family's outputs are computed by the region)."""
        values, probes = self._pool(kind, leaves, free)
        if not values:
            return []
        want = wants[0]
        if not np.all(np.isfinite(want)):
            return []
        probe = _probe(want)
        scale = max(float(np.max(np.abs(want))) if want.size else 0.0, floor)
        near = np.all(np.abs(probes - probe) <= TOLERANCE * (np.abs(probe) + scale) + 1e-300, axis=1)
        return [values[i] for i in np.flatnonzero(near)
                if all(close(np.asarray(env[values[i]], dtype=np.float64), w, floor)
                       for env, w in zip(self.trials, wants))]

    def affine(self, normed: Sequence[np.ndarray], with_bias: bool) -> list[tuple[Value, Value | None, Value | None]]:
        """Row values equal to `normed * weight (+ bias)` on every trial, with weight and bias column values of
        the region (None for a weight of ones, a bias of zeros): the columns are solved for per column by least
        squares over the first trial's rows, then checked on every trial."""
        values, stacked = self._rows()
        if not values:
            return []
        # A few columns first (most values fit no affine map of `normed`), then every column of the survivors.
        columns = PROBE_POSITIONS % stacked.shape[2]
        probed = self._probed_rows()
        _, _, ok = _affine_fit(normed[0][:, columns], probed, with_bias)
        # A value equal on every row (a broadcast column) fits any map with a zero weight: not a normalized row.
        if probed.shape[1] > 1:
            ok &= np.any(probed != probed[:, :1, :], axis=(1, 2))
        candidates = np.flatnonzero(ok)
        if not candidates.size:
            return []
        weight, bias, ok = _affine_fit(normed[0], stacked[candidates], with_bias)
        candidates = candidates[ok]
        found = []
        for i, w, b in zip(candidates, weight[ok], bias[ok]):
            scale = float(np.abs(stacked[i]).max())
            w = self._column(w, 1.0, scale)
            b = self._column(b, 0.0, scale)
            if w is False or b is False:
                continue
            wants = [a * (1.0 if w is None else env[w]) + (0.0 if b is None else env[b])
                     for a, env in zip(normed, self.trials)]
            if all(close(np.asarray(env[values[i]], dtype=np.float64), want) for env, want in zip(self.trials, wants)):
                found.append((values[i], w, b))
        return found

    def _column(self, solved: np.ndarray, identity: float, scale: float) -> Value | None | bool:
        """The column value equal to `solved` on the first trial; None when it is the identity (within the
        tolerance of values of magnitude `scale`); False when none."""
        solved = solved.reshape(1, -1)
        if np.all(np.abs(solved - identity) <= TOLERANCE * max(scale, abs(identity))):
            return None
        found = self.equal(Kind.COLUMN, [solved], leaves=True)
        return found[0] if found else False

    def _probed_rows(self) -> np.ndarray:
        """The region's row values on the first trial, at the probe columns only."""
        if "probed rows" not in self._pools:
            _, stacked = self._rows()
            self._pools["probed rows"] = stacked[:, :, PROBE_POSITIONS % stacked.shape[2]]
        return self._pools["probed rows"]

    def _rows(self) -> tuple[list[Value], np.ndarray]:
        if "rows" not in self._pools:
            values = self.values(Kind.ROW, leaves=False)
            env = self.trials[0]
            self._pools["rows"] = (values, np.array([np.asarray(env[v], dtype=np.float64) for v in values]))
        return self._pools["rows"]

    def gradient(self, dx: Sequence[np.ndarray], floor: float) -> Iterator[tuple[list[Value], dict[str, Any]]]:
        """The row values equal to `dx`; failing those, the ones equal to dx added to the region's accumulator.
        None when dx is zero in exact math (a softmax's gradient for a constant dy): rounding matches anything."""
        if float(np.max(np.abs(dx[0]))) <= DEGENERATE * floor:
            return
        found = self.equal(Kind.ROW, dx, free=False, floor=floor)
        if found:
            yield found, {}
            return
        for accumulator in self.region.accumulators:
            found = self.equal(Kind.ROW, [d + a for d, a in zip(dx, self.at(accumulator))], free=False, floor=floor)
            if found:
                yield found, {"accumulate": accumulator}

    def at(self, value: Value | None) -> list[np.ndarray | None]:
        return [None if value is None else np.asarray(env[value], dtype=np.float64) for env in self.trials]

    def slice(self, outputs: Sequence[Value], stops: set[Value]) -> list[Operation] | None:
        """The region ops between the bound inputs (`stops`) and `outputs`; None when the outputs read another
        input (an unbound leaf that is neither a splat constant nor, for a backward, a forward's value)."""
        region = self.region
        ops: set[Operation] = set()
        stack = list(outputs)
        while stack:
            value = stack.pop()
            if value in stops:
                continue
            op = value.op
            if op is not None and op in region.op_set:
                if op not in ops:
                    ops.add(op)
                    stack.extend(op.operands)
            elif splat_value(op) is None and not (self.free_ok and value in region.free):
                return None
        if self._reads_slice(stops, ops):
            return None
        return [op for op in region.ops if op in ops]

    def _reads_slice(self, stops: set[Value], ops: set[Operation]) -> bool:
        """Whether a bound input is computed from a value of the slice (it could not be read by the kernel that
        replaces the slice: an upstream gradient `dy / p * p` is no input of the backward that makes `dy / p`)."""
        region = self.region
        seen: set[Operation] = set()
        stack = [v.op for v in stops if v is not None and v.op is not None and v.op in region.op_set]
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for operand in op.operands:
                if operand.op is not None and operand.op in region.op_set:
                    if operand.op in ops:
                        return True
                    stack.append(operand.op)
        return False

    def row_inputs(self) -> list[Value]:
        """Row values that feed a row reduction of the region (a family's x reduces along its rows)."""
        region = self.region
        found: dict[Value, None] = {}
        stack = [op.operands[0] for op in region.reductions()]
        while stack:
            value = stack.pop()
            if value in found:
                continue
            if region.kind(value) is Kind.ROW and is_float(value) and splat_value(value.op) is None:
                found[value] = None
            op = value.op
            if op is not None and op in region.op_set:
                stack.extend(op.operands)
        return [v for v in [*region.values, *region.leaves] if v in found]


#: Elements of the first trial compared before a whole value is (flat positions, spread over the rows).
PROBE_POSITIONS = np.array([0, 1, 7, 13, 31, 64, 97, 128, 255, 331, 509, 777, 1023, 2047, 4093, 8191])


def _affine_fit(n: np.ndarray, stacked: np.ndarray, with_bias: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column, the weight (and bias) fitting each stacked value to `n * weight + bias` by least squares over
    the rows, and which values fit within TOLERANCE."""
    if with_bias and n.shape[0] > 1:
        centered = n - n.mean(0)
        means = stacked.mean(1)
        weight = ((stacked - means[:, None, :]) * centered).sum(1) / (centered * centered).sum(0)
        bias = means - weight * n.mean(0)
    else:
        weight = (stacked * n).sum(1) / (n * n).sum(0)
        bias = np.zeros_like(weight)
    fit = n * weight[:, None, :] + bias[:, None, :]
    scale = np.abs(stacked).max(axis=(1, 2), keepdims=True)
    ok = np.all(np.abs(stacked - fit) <= TOLERANCE * (np.abs(stacked) + scale) + 1e-300, axis=(1, 2))
    return weight, bias, ok


def _probe(array: np.ndarray) -> np.ndarray:
    flat = array.reshape(-1)
    return flat[PROBE_POSITIONS % flat.size]


def _trials(region: Region, given: Sequence[Env] = ()) -> list[Env]:
    envs = []
    for t in range(TRIALS):
        rng = np.random.default_rng(1000 + t)
        envs.append(evaluate(region, sample_rows(region, t), rng, given[t] if given else {}))
    return envs


def match_forward(region: Region) -> Match | None:
    """The forward family binding of `region` with the largest slice, or None."""
    with np.errstate(all="ignore"):
        return _match_forward(region)


def _match_forward(region: Region) -> Match | None:
    search = _Search(region, _trials(region))
    candidates: list[Match] = []
    for family, inputs, outputs, params in _forward_candidates(search):
        outputs = {role: values for role, values in outputs.items() if values}
        ops = search.slice([v for values in outputs.values() for v in values], set(inputs.values()) - {None})
        if not ops:
            continue
        candidates.append(Match(family, "forward", region, {r: v for r, v in inputs.items() if v is not None},
                                outputs, params, ops, trials=search.trials))
    if not candidates:
        return None
    # The largest slice that holds on the regimes (outputs a guard changes there dropped); failing all, the
    # largest, refused.
    candidates.sort(key=lambda m: -m.score)
    refused: dict[str, str] = {}
    for match in candidates:
        regimes = evaluate_regimes(region, match.inputs["x"], match.inputs.get("targets"), np.random.default_rng(2000))
        held = _held_on_regimes(search, match, regimes)
        if held is not None:
            held.declined = tuple((family, reason) for family, reason in refused.items() if family != held.family)
            return held
        refused.setdefault(match.family, _refusal(match, regimes))
    best = candidates[0]
    best.refusal = refused[best.family]
    return best


def _held_on_regimes(search: _Search, match: Match, regimes: list[Env]) -> Match | None:
    """`match` with only the output values that hold on the regime trial and that no guard changes there (an
    output floored after the family, `maximum(softmax(x), 1e-9)`, is the family's value on random rows only);
    None when a role keeps no value."""
    outputs: dict[str, list[Value]] = {}
    stops = set(match.inputs.values())
    for role, values in match.outputs.items():
        kept = [v for v in values if all(_value_holds(search, v, role, match, env, stops) for env in regimes)]
        if not kept:
            return None
        outputs[role] = kept
    if outputs == match.outputs:
        return match
    ops = search.slice([v for values in outputs.values() for v in values], stops)
    if not ops:
        return None
    return Match(match.family, "forward", match.region, match.inputs, outputs, match.params, ops,
                 trials=match.trials)


def _value_holds(search: _Search, value: Value, role: str, match: Match, env: Env, stops: set[Value]) -> bool:
    if not holds(env[value], formula_outputs(match, env)[role]):
        return False
    ops = search.slice([value], stops) or []
    return not any(_changes(op, env) for op in ops)


def formula_outputs(match: Match, env: Env) -> dict[str, np.ndarray]:
    """What the family's formula gives for each output role of a forward `match`, from its inputs in `env`."""
    x = np.asarray(env[match.inputs["x"]], dtype=np.float64)
    family, params = match.family, match.params
    if family == "softmax":
        return {"y": softmax(x)}
    if family == "log_softmax":
        return {"y": log_softmax(x)}
    weight = match.inputs.get("weight")
    scale = 1.0 if weight is None else env[weight]
    if family == "layernorm":
        mean, rstd = moments(x, params["eps"])
        bias = match.inputs.get("bias")
        return {"y": (x - mean) * rstd * scale + (0.0 if bias is None else env[bias]), "mean": mean, "rstd": rstd}
    if family == "rmsnorm":
        rstd = rms(x, params["eps"])
        return {"y": x * rstd * scale, "rstd": rstd}
    lse = _lse(x)
    losses = lse - picked(x, env[match.inputs["targets"]])
    return {"losses": losses, "lse": lse, "loss": params.get("scale", 1.0) * losses.sum()}


def holds(got: np.ndarray, want: np.ndarray) -> bool:
    """`got` (the region's value) equals `want` (the formula's) wherever `got` is finite, within TOLERANCE of
    each row's magnitude: where the math as written overflows, the kernel may be steadier."""
    got = np.asarray(got, dtype=np.float64)
    want = np.broadcast_to(np.asarray(want, dtype=np.float64), got.shape)
    finite = np.isfinite(got)
    if not np.all(np.isfinite(want[finite])):
        return False
    magnitude = np.where(finite, np.abs(want), 0.0)
    scale = magnitude.max(axis=-1, keepdims=True) if got.ndim else magnitude
    return bool(np.all(~finite | (np.abs(got - want) <= TOLERANCE * (np.abs(want) + scale) + 1e-300)))


def _refusal(match: Match, regimes: list[Env]) -> str:
    """Why `match`'s kernel cannot stand for its slice: the first guard of the slice the regimes reach."""
    family = match.family.replace("_", "-")
    guards = [op for op in match.slice if any(_changes(op, env) for env in regimes)]
    if not guards:
        return f"its math departs from the {family} formula on rows of zeros, of tiny or huge scale or at its constants"
    return (f"{_describe(guards[0])} is not in the {family} formula (it changes the result on rows of zeros, "
            "of tiny or huge scale or at its constants)")


def _changes(op: Operation, env: Env) -> bool:
    """Whether `op` is a guard that gives other values than the value it guards on `env`: an elementwise
    maximum or minimum (no family's formula has one), or a `where` choosing between one value and a constant."""
    if op.name in ("graph.maximum", "graph.minimum"):
        guarded = [o for o in op.operands if splat_value(o.op) is None]
    elif op.name == "graph.where":
        guarded = [o for o in op.operands[1:] if splat_value(o.op) is None]
        if len(guarded) != 1:
            return False
    else:
        return False
    return any(not np.array_equal(np.broadcast_to(env[o], np.shape(env[op.result])), env[op.result], equal_nan=True)
               for o in guarded)


def _describe(op: Operation) -> str:
    constants = [c for c in (splat_value(o.op) for o in op.operands) if c is not None]
    what = op.name.removeprefix("graph.") + (f" with {constants[0]:g}" if constants else "")
    where = f" at {op.loc.short()}" if op.loc is not None else ""
    return f"the guard `{what}`{where}"


def _forward_candidates(search: _Search) -> Iterator[tuple[str, dict, dict, dict]]:
    region = search.region
    xs = search.row_inputs()
    consts = sorted({c for c in (splat_value(v.op) for v in region.leaves) if c is not None and 0.0 < c < 1.0})
    targets = [v for v in [*region.leaves, *region.values] if region.kind(v) is Kind.PER_ROW and is_index(v)]
    for x in xs:
        xv = search.at(x)
        for family, formula in (("softmax", softmax), ("log_softmax", log_softmax)):
            y = search.equal(Kind.ROW, [formula(a) for a in xv])
            if y:
                yield family, {"x": x}, {"y": y}, {}
        for eps in [0.0, *consts]:
            stats = [moments(a, eps) for a in xv]
            xhat = [(a - m) * r for a, (m, r) in zip(xv, stats)]
            fits = search.affine(xhat, with_bias=True)
            if fits:
                means = search.equal(Kind.PER_ROW, [m for m, _ in stats])
                rstds = search.equal(Kind.PER_ROW, [r for _, r in stats])
            for y, weight, bias in fits:
                yield ("layernorm", {"x": x, "weight": weight, "bias": bias}, {"y": [y], "mean": means, "rstd": rstds},
                       {"eps": eps, "weight": weight is not None, "bias": bias is not None})
            rstds = [rms(a, eps) for a in xv]
            fits = search.affine([a * r for a, r in zip(xv, rstds)], with_bias=False)
            if fits:
                rstd_values = search.equal(Kind.PER_ROW, rstds)
            for y, weight, _ in fits:
                yield ("rmsnorm", {"x": x, "weight": weight}, {"y": [y], "rstd": rstd_values},
                       {"eps": eps, "weight": weight is not None})
        for target in targets:
            tv = search.at(target)
            lse = [_lse(a) for a in xv]
            losses = [s - picked(a, t) for a, s, t in zip(xv, lse, tv)]
            per_row = search.equal(Kind.PER_ROW, losses)
            lse_values = search.equal(Kind.PER_ROW, lse)
            for scale, totals in _scaled_totals(search, losses):
                yield ("cross_entropy", {"x": x, "targets": target},
                       {"losses": per_row, "lse": lse_values, "loss": totals}, {"scale": scale})
            if per_row:
                yield "cross_entropy", {"x": x, "targets": target}, {"losses": per_row, "lse": lse_values}, {}


def _scaled_totals(search: _Search, losses: Sequence[np.ndarray]) -> Iterator[tuple[float, list[Value]]]:
    """Whole values that are a constant multiple of the losses' sum over rows, grouped by that multiple."""
    groups: dict[float, list[Value]] = {}
    for value in search.values(Kind.WHOLE, leaves=False):
        ratios = [float(env[value]) / float(total.sum()) for env, total in zip(search.trials, losses)]
        if not all(np.isfinite(ratios)) or ratios[0] == 0.0:
            continue
        if all(abs(r - ratios[0]) <= TOLERANCE * abs(ratios[0]) for r in ratios):
            key = next((k for k in groups if abs(k - ratios[0]) <= TOLERANCE * abs(k)), ratios[0])
            groups.setdefault(key, []).append(value)
    yield from groups.items()


# --- backward -----------------------------------------------------------------------------------------------

def match_backward(region: Region, forward: Match) -> Match | None:
    """The backward of `forward`'s family bound in `region` (which reads the forward's values), or None."""
    with np.errstate(all="ignore"):
        return _match_backward(region, forward)


def _match_backward(region: Region, forward: Match) -> Match | None:
    # The region's free leaves that are the forward's are computed by its evaluation; others (another forward's
    # output, such as soft targets) are inputs like any, drawn at random.
    family, stats = BACKWARD_OF[forward.family]
    search = _Search(region, _trials(region, forward.evaluated()), free_ok=True)
    fx = [np.asarray(env[forward.inputs["x"]], dtype=np.float64) for env in forward.evaluated()]
    best: Match | None = None
    for inputs, outputs, params in _backward_candidates(search, forward, fx):
        outputs = {role: values for role, values in outputs.items() if values}
        accumulate = params.pop("accumulate", None)
        ops = search.slice([v for values in outputs.values() for v in values], {*inputs.values(), accumulate})
        if not ops:
            continue
        match = Match(family, "backward", region, inputs, outputs, params, ops, forward=forward, stats=stats,
                      accumulate=accumulate, trials=search.trials, refusal=forward.refusal and
                      f"its forward fell back: {forward.refusal}")
        if best is None or match.score > best.score:
            best = match
    return best


def _backward_candidates(search: _Search, forward: Match, fx: list[np.ndarray]) -> Iterator[tuple[dict, dict, dict]]:
    family = forward.family
    forward_slice = set(forward.slice)
    # The gradient: a row value not of the forward proper, or a constant (the loss a mean of the outputs).
    region = search.region
    dys = [v for v in search.values(Kind.ROW) if v.op not in forward_slice]
    dys += [v for v in region.leaves if splat_value(v.op) is not None and v.type.shape == region.domain.shape
            and is_float(v)]
    if family in ("softmax", "log_softmax"):
        ys = [softmax(a) if family == "softmax" else log_softmax(a) for a in fx]
        for dy in dys:
            g = [np.broadcast_to(a, f.shape) for a, f in zip(search.at(dy), fx)]
            if family == "softmax":
                dx = [y * (d - (d * y).sum(1, keepdims=True)) for y, d in zip(ys, g)]
            else:
                dx = [d - np.exp(y) * d.sum(1, keepdims=True) for y, d in zip(ys, g)]
            for found, params in search.gradient(dx, float(np.max(np.abs(g[0])))):
                yield {"dy": dy}, {"dx": found}, params
    elif family in ("layernorm", "rmsnorm"):
        eps = forward.params["eps"]
        weight = forward.inputs.get("weight")
        w = [None if weight is None else env[weight] for env in forward.evaluated()]
        for dy in dys:
            g = [np.broadcast_to(a, f.shape) for a, f in zip(search.at(dy), fx)]
            grads = [d if wv is None else d * wv for d, wv in zip(g, w)]
            if family == "layernorm":
                stats = [moments(a, eps) for a in fx]
                xhat = [(a - m) * r for a, (m, r) in zip(fx, stats)]
                dx = [(gr - gr.mean(1, keepdims=True) - xh * (gr * xh).mean(1, keepdims=True)) * r
                      for gr, xh, (_, r) in zip(grads, xhat, stats)]
            else:
                rstds = [rms(a, eps) for a in fx]
                xhat = [a * r for a, r in zip(fx, rstds)]
                dx = [(gr - xh * (gr * xh).mean(1, keepdims=True)) * r for gr, xh, r in zip(grads, xhat, rstds)]
            floor = float(np.max(np.abs(grads[0]))) * float(np.max(rms(fx[0], eps) if family == "rmsnorm"
                                                                    else moments(fx[0], eps)[1]))
            for found, params in search.gradient(dx, floor):
                outputs = {"dx": found}
                if forward.params.get("weight"):
                    outputs["dweight"] = search.equal(Kind.COLUMN, [(d * xh).sum(0, keepdims=True)
                                                                    for d, xh in zip(g, xhat)], free=False)
                if forward.params.get("bias"):
                    outputs["dbias"] = search.equal(Kind.COLUMN, [d.sum(0, keepdims=True) for d in g], free=False)
                yield {"dy": dy}, outputs, params
    elif family == "cross_entropy":
        yield from _cross_entropy_backward(search, forward, fx)


def _cross_entropy_backward(search: _Search, forward: Match, fx: list[np.ndarray]) -> Iterator[tuple[dict, dict, dict]]:
    cols = search.region.domain.cols
    targets = [env[forward.inputs["targets"]] for env in forward.evaluated()]
    bases = [softmax(a) - one_hot(t, cols) for a, t in zip(fx, targets)]
    upstreams = (search.values(Kind.WHOLE, free=False), search.values(Kind.PER_ROW, free=False))
    for value in search.values(Kind.ROW, leaves=False, free=False):
        ratios = [np.asarray(env[value], dtype=np.float64) / base for env, base in zip(search.trials, bases)]
        if not all(np.all(np.isfinite(r)) for r in ratios):
            continue
        per_row = [r[:, :1] for r in ratios]
        if not all(close(r, np.broadcast_to(p, r.shape)) for r, p in zip(ratios, per_row)):
            continue
        uniform = all(close(p, np.broadcast_to(p[:1], p.shape)) for p in per_row)
        if uniform:
            scale = float(per_row[0][0, 0])
            if all(abs(float(p[0, 0]) - scale) <= TOLERANCE * abs(scale) for p in per_row):
                yield {}, {"dlogits": [value]}, {"grad": "scalar", "scale": scale}
                continue
        for grad, pool in (("scalar", upstreams[0]), ("row", upstreams[1])):
            for upstream in pool:
                scale = _constant_ratio(per_row, search.at(upstream))
                if scale is not None:
                    yield {"dloss": upstream}, {"dlogits": [value]}, {"grad": grad, "scale": scale}


def _constant_ratio(per_row: Sequence[np.ndarray], upstream: Sequence[np.ndarray | None]) -> float | None:
    ratios = []
    for p, u in zip(per_row, upstream):
        if u is None:
            return None
        r = p / np.broadcast_to(u, p.shape)
        if not np.all(np.isfinite(r)) or not close(r, np.broadcast_to(r.flat[0], r.shape)):
            return None
        ratios.append(float(r.flat[0]))
    if ratios and all(abs(r - ratios[0]) <= TOLERANCE * abs(ratios[0]) for r in ratios):
        return ratios[0]
    return None
