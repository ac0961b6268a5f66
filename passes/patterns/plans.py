"""Finding a graph's matches, and deciding which become kernel launches and why the others fall back.

Seeds are the graph's reductions along one axis, in block order. A seed grows
a region (`regions.grow`) that is matched first against the forward families;
failing those, against the backward of each forward region whose values it
reads. The values of forward regions are free for later regions (a backward
reads its forward's), and a forward whose intermediate values are read
outside it also seeds a backward region from those readers (a loss written
without the max shift has no reduction in its backward). A seed inside a
matched slice is not grown again; the other reductions of a region a match
took only part of are grown again, that slice left out (a softmax backward
whose dx is a layernorm backward's dy grows into one region with it).

A match is taken when its kernel can stand for its slice:

- its rows are along the last axis, its operands' dtypes are ones the
  target's templates store (`KernelTarget.float_storage`, `index_storage`;
  on CUDA f32 or bf16, integer targets i32 or i64), its row count fits a
  launch;
- no emit (`graph.observe`, `graph.metric`) reads a value inside the slice
  other than one the kernel writes;
- every other value of the slice read outside it is one the kernel writes,
  once the other taken matches are replaced (a forward's intermediates that
  only its backward reads die with the backward's replacement) — or one row
  reduction of the kernel's inputs, recomputed for its readers (CSE shares
  an accuracy metric's row maximum with a loss's);
- a backward whose forward falls back still needs the forward's outputs its
  kernel reads (a softmax's y, a layernorm's mean and rstd) as graph values.

Otherwise the match *falls back*, with its reason, and its ops are left to
`fuse`. Dropping one match may expose another's values, so the decision is
made to a fixpoint.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from attrs import define, field

from ...diagnostics import Location
from ...dialects.core import REGISTRY, Block, Operation, Value
from ...dialects.traits import Trait, has_trait
from ..targets import KernelTarget, PatternKernel
from .domain import OpClass, is_float_cast, seed_domain, splat_value
from .families import Match
from .memo import MatchCache
from .regions import Region, grow

#: How far up from a region's input its model path is looked for (logits scaled in the loss: `(/ logits t)`).
PATH_SEARCH_DEPTH = 4
#: How often a reduction may seed a region (again after a match took part of the region it grew).
GROWTHS_PER_SEED = 2
#: A launch's row count is a 32-bit int.
MAX_ROWS = 2**31 - 1
#: The kernel outputs a caller may read directly (the rest are statistics).
DATA_OUTPUTS = ("y", "dx", "dlogits")


def find_matches(block: Block, cache: MatchCache) -> list[Match]:
    """The matches of the reductions of `block`, forwards and backwards, in block order."""
    order = {op: i for i, op in enumerate(block.ops)}
    matches: list[Match] = []
    forward_of: dict[Value, Match] = {}
    claimed: set[Operation] = set()
    tried: set[Operation] = set()

    intermediates: set[Value] = set()

    def free(value: Value) -> bool:
        return value in forward_of

    def confirm(match: Match | None) -> bool:
        if match is None or claimed.intersection(match.slice):
            return False
        matches.append(match)
        claimed.update(match.slice)
        if match.direction == "forward":
            # The forward proper (its slice and what the slice reads) is free for its backward; the rest of its
            # region (what was computed from its outputs: a loss, its gradient) may belong to the backward.
            inside = {op.result for op in match.slice}
            for value in [*inside, *(v for op in match.slice for v in op.operands if v not in inside)]:
                forward_of.setdefault(value, match)
            intermediates.update(inside - match.output_values())
        return True

    seeds = {op: domain for op in block.ops if (domain := seed_domain(op)) is not None}
    queue = deque(seeds)
    grown: Counter[Operation] = Counter()
    while queue:
        op = queue.popleft()
        if op in tried or op in claimed or grown[op] == GROWTHS_PER_SEED:
            continue
        grown[op] += 1
        region = grow([op], seeds[op], order, free, blocked=claimed, intermediate=intermediates.__contains__)
        if region is None:
            continue
        match = cache.forward(region)
        if not confirm(match):
            match = _backward(region, forward_of, cache)
            if not confirm(match):
                tried.update(region.ops)
                continue
        tried.update(match.slice)
        # The region's other reductions may be another family's: a softmax backward whose dx is a layernorm
        # backward's dy grows into one region with it. They are grown again, the match's slice left out.
        queue.extendleft(reversed([o for o in region.ops if o in seeds and o not in tried and o not in claimed]))
    for forward in [m for m in matches if m.direction == "forward"]:
        readers = _readers_outside(forward, claimed, order)
        if readers and not any(m.forward is forward for m in matches):
            region = grow(readers, forward.region.domain, order, free, blocked=claimed,
                          intermediate=intermediates.__contains__)
            forward.backward_unmatched = region is None or not confirm(_backward(region, forward_of, cache))
    return sorted(matches, key=lambda m: order[m.slice[0]])


def _backward(region: Region, forward_of: dict[Value, Match], cache: MatchCache) -> Match | None:
    forwards = list(dict.fromkeys(forward_of[v] for v in region.free))
    best = None
    for forward in forwards:
        if forward.region.domain != region.domain:
            continue
        match = cache.backward(region, forward)
        if match is not None and (best is None or match.score > best.score):
            best = match
    return best


def _readers_outside(match: Match, claimed: set[Operation], order: dict[Operation, int]) -> list[Operation]:
    """Ops outside every match that read a value of `match`'s slice it does not write."""
    outputs = match.output_values()
    inside = set(match.slice)
    readers: dict[Operation, None] = {}
    for op in match.slice:
        if op.result in outputs:
            continue
        for user in op.result.users():
            if user not in claimed and user in order and user not in inside:
                readers[user] = None
    return sorted(readers, key=order.__getitem__)


# --- decisions ----------------------------------------------------------------------------------------------

#: The match a decision is about: a row family's (`Match`) or attention's (`attention.AttentionMatch`).
MatchT = TypeVar("MatchT")


@define(eq=False)
class Decision(Generic[MatchT]):
    """A match and its kernel: taken (`reason` None) or fallen back, with the model path and the location
    its report lines name."""

    match: MatchT
    path: str
    loc: Location | None
    reason: str | None = None

    @property
    def taken(self) -> bool:
        return self.reason is None


@define(eq=False)
class Plan(Decision[Match]):
    """A row family's or the cross-entropy tail's match and its kernel."""

    #: The kernel's template options (eps, weight, stats, reduction, ...), once decided.
    options: dict[str, Any] = field(factory=dict)
    #: Values inside the slice that others read and are recomputed for them (a row reduction of an input that
    #: common-subexpression elimination shared with another computation, such as an accuracy's row maximum).
    recomputed: list[Value] = field(factory=list)

    @property
    def family(self) -> str:
        match = self.match
        if match.family == "cross_entropy":
            return f"cross_entropy_{match.direction}"
        return match.family

    def kernel(self) -> PatternKernel:
        match = self.match
        cols = match.region.domain.cols
        if match.family == "cross_entropy":
            return PatternKernel("cross_entropy", match.direction, cols, self.options)
        return PatternKernel("row", match.family, cols, self.options)


def plan_matches(block: Block, matches: list[Match], target: KernelTarget) -> list[Plan]:
    """A plan per match for `target`, taken or fallen back with its reason (see the module docstring)."""
    plans = [Plan(m, region_path(m), first_loc(m.slice)) for m in matches]
    by_match = {plan.match: plan for plan in plans}
    for plan in plans:
        plan.reason = _static_reason(plan.match, target)
    while True:
        removed = {op for plan in plans if plan.taken for op in plan.match.slice}
        doomed = doomed_ops(block, removed)
        changed = False
        for plan in plans:
            if not plan.taken:
                continue
            reason = _exposure(plan, doomed)
            if reason is None and plan.match.forward is not None:
                reason = _missing_stats(plan.match, by_match[plan.match.forward])
            if reason is not None:
                plan.reason = reason
                changed = True
        if not changed:
            break
    for plan in plans:
        plan.options = _options(plan, plans, doomed)
    return plans


def region_path(match: Match) -> str:
    """The model path of the region: its ops' most common `path`, else its forward's, else that of its input or
    of what the input was computed from."""
    path = most_common_path(match.slice)
    if path:
        return path
    if match.forward is not None:
        return region_path(match.forward)
    value = match.inputs.get("x")
    for _ in range(PATH_SEARCH_DEPTH):
        if value is None or value.op is None:
            break
        if "path" in value.op.attributes:
            return value.op.attributes["path"]
        value = value.op.operands[0] if value.op.operands else None
    return ""


def most_common_path(ops: Iterable[Operation]) -> str:
    """The `path` most of `ops` carry (the first seen of equally common ones), "" when none has one."""
    paths = Counter(op.attributes["path"] for op in ops if "path" in op.attributes)
    return paths.most_common(1)[0][0] if paths else ""


def first_loc(ops: Iterable[Operation]) -> Location | None:
    """The first source location among `ops`, where a report line about them points."""
    return next((op.loc for op in ops if op.loc is not None), None)


def _static_reason(match: Match, target: KernelTarget) -> str | None:
    if match.refusal is not None:
        return match.refusal
    domain = match.region.domain
    if not domain.is_last_axis:
        return f"rows along axis {domain.axis} of {domain.rank}, not the last"
    if domain.rows > MAX_ROWS:
        return f"{domain.rows} rows, more than a launch's 32-bit row count"
    for role, value in _graph_operands(match):
        dtype = storage(value, target).type.dtype
        allowed = target.index_storage if role == "targets" else target.float_storage
        if dtype not in allowed:
            return f"dtype {dtype} of its {role} is not taken ({' or '.join(allowed)})"
    return None


def _graph_operands(match: Match) -> Iterable[tuple[str, Value]]:
    for role, value in match.inputs.items():
        yield role, value
    for role, values in match.outputs.items():
        yield role, values[0]


def storage(value: Value, target: KernelTarget) -> Value:
    """A kernel reads a row input across a float cast from its source (insert-casts' boundary) when the
    target stores the source's dtype."""
    op = value.op
    if op is not None and is_float_cast(op) and op.operands[0].type.dtype in target.float_storage:
        return op.operands[0]
    return value


def doomed_ops(block: Block, removed: set[Operation]) -> set[Operation]:
    """The ops replaced, and the pure ops that only they (transitively) read."""
    doomed = set(removed)
    for op in block.reversed_ops():
        if op in doomed or not op.results:
            continue
        opdef = REGISTRY.ops.get(op.name)
        if opdef is None or not opdef.pure:
            continue
        if all(user in doomed for r in op.results for user in r.users()):
            doomed.add(op)
    return doomed


def _exposure(plan: Plan, doomed: set[Operation]) -> str | None:
    """Why a value inside the slice (one the kernel does not write) is read by an op that stays, else None.

    A forward's value computed row by row from the kernel's inputs is recomputed for its readers instead.
    """
    match = plan.match
    inside = set(match.slice)
    outputs = match.output_values()
    exposed = []
    plan.recomputed = []
    for op in match.slice:
        value = op.result
        if value in outputs:
            continue
        readers = [user for user in value.users() if user not in inside and user not in doomed]
        for user in readers:
            if has_trait(user, Trait.EMIT):
                kind = "an observation" if user.name == "graph.observe" else f"a {user.name.removeprefix('graph.')}"
                return f"{kind} ({user.attributes.get('name')}) reads a value inside the region"
        if readers and recomputable(match, value) is not None:
            plan.recomputed.append(value)
        elif readers:
            exposed.append((op, readers[0]))
    if not exposed:
        return None
    op, user = exposed[0]
    where = f" at {op.loc.short()}" if op.loc is not None else ""
    return f"{op.name}{where} is read outside the region ({user.name}) and the kernel does not write it"


def recomputable(match: Match, value: Value, current: Callable[[Value], Value] = lambda v: v) -> list[Operation] | None:
    """The slice ops computing `value` from the forward kernel's inputs and constants, row by row (elementwise
    ops, row reductions, views, broadcasts, precision casts), else None.

    The readers outside get a copy of these ops (rematerialisation, as Inductor's partitioner does for a
    backward that reads a forward's intermediates): `fuse` puts them in the backward's own kernels, which
    costs one more pass over the rows and saves the region's kernel. `current` gives the value that has
    replaced an input, once an earlier region's kernel writes it.
    """
    if match.direction != "forward":
        return None
    inputs = {current(v) for v in match.inputs.values()} | set(match.inputs.values())
    inside = set(match.slice)
    ops: list[Operation] = []
    stack = [value]
    while stack:
        current = stack.pop()
        if current in inputs or splat_value(current.op) is not None:
            continue
        op = current.op
        if op is None or op not in inside:
            return None
        if op not in ops:
            ops.append(op)
            stack.extend(op.operands)
    per_row = (OpClass.ELEMENTWISE, OpClass.REDUCE_ROW, OpClass.VIEW, OpClass.BROADCAST)
    if any(match.region.classes[op].op_class not in per_row and not is_float_cast(op) for op in ops):
        return None
    return [op for op in match.slice if op in ops]


def _missing_stats(match: Match, forward: Plan) -> str | None:
    """A backward whose forward falls back needs the forward's outputs it reads as values of the graph."""
    if forward.taken:
        return None
    missing = [role for role in match.stats if not forward.match.outputs.get(role)]
    if missing:
        return f"its forward fell back, and no value holds the {' and '.join(missing)} its kernel reads"
    return None


def _options(plan: Plan, plans: list[Plan], doomed: set[Operation]) -> dict[str, Any]:
    """The template options of the plan's kernel."""
    match = plan.match
    params = match.params
    family = match.family
    if family in ("layernorm", "rmsnorm"):
        options = {"eps": float(params["eps"]), "weight": bool(params.get("weight"))}
        if family == "layernorm":
            options["bias"] = bool(params.get("bias"))
        options["stats"] = _stats_needed(plan, plans, doomed)
        return options
    if family in ("layernorm_backward", "rmsnorm_backward"):
        forward = match.forward.params
        options = {"weight": bool(forward.get("weight"))}
        if family == "layernorm_backward":
            options["bias"] = bool(forward.get("bias"))
        return options
    if family == "cross_entropy" and match.direction == "forward":
        return {"reduction": _reduction(match)[0]} if "loss" in match.outputs else {}
    if family == "cross_entropy":
        scale = float(params["scale"])
        rows = match.region.domain.rows
        if "dloss" not in match.inputs and _near(scale * rows, 1.0):
            return {"grad": params["grad"], "scale": 1.0, "mean": True}
        return {"grad": params["grad"], "scale": scale, "mean": False}
    return {}


def _reduction(match: Match) -> tuple[str, float]:
    """The template's reduction of the losses (sum or mean) and the factor left over to multiply by."""
    scale = float(match.params["scale"])
    rows = match.region.domain.rows
    if _near(scale, 1.0):
        return "sum", 1.0
    return "mean", 1.0 if _near(scale * rows, 1.0) else scale * rows


def _near(a: float, b: float) -> bool:
    """Equal up to f32 rounding: a graph's constants (1/rows written as a literal) are f32."""
    return abs(a - b) <= 1e-6 * abs(b)


def loss_factor(match: Match) -> float:
    return _reduction(match)[1]


def _stats_needed(plan: Plan, plans: list[Plan], doomed: set[Operation]) -> bool:
    """A norm writes its mean and rstd when a taken backward reads them or a value equal to one is read."""
    if any(p.taken and p.match.forward is plan.match for p in plans):
        return True
    for role in ("mean", "rstd"):
        for value in plan.match.outputs.get(role, []):
            if any(user not in doomed for user in value.users()):
                return True
    return False
