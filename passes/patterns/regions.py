"""Growing a region from reductions through the ops of their row domain.

A region starts at one or more ops of a domain (a reduction along the rows,
or the users of another region's values) and grows to a fixpoint:

- downstream: a user of a region value (or of one of its inputs, or of a
  free intermediate of a forward the region reads) joins when
  the domain gives it a meaning and every other operand it reads is
  available: a region value, an input, or a *leaf-like* value — a splat
  constant, integer per-row indices (targets), a column or whole value, a
  value of another region named free (a backward reads its forward's), or
  plumbing made of those (a broadcast of a weight, an iota, an `eq` of an
  iota with broadcast targets) which joins too. Growing downstream never
  takes a new row input — a residual add or a gradient stops it — but for
  one add, once nothing else grows: autodiff's accumulation of a gradient
  into another (a layernorm's dx into the residual stream's), whose other
  operand becomes the region's *accumulator*.
- upstream: an input (a row or per-row value read from outside) is absorbed,
  its defining op joining, when that does not add more than the one row
  input it replaces: `x * x` becomes `x`, `exp(x)` becomes `x`,
  `neg(scatter(t, c))` becomes nothing, but `add(a, b)` (two rows for one)
  stays outside.

The region is generous on purpose: which of its values are the family's
input and outputs is the math's to say (`families`), and the ops outside the
slice between them stay for `fuse`. Float casts (insert-casts' precision
boundaries) join on the inputs' side only — a cast absorbed upstream, a cast
of an input, a cast in plumbing — so a kernel reads a bf16 input as bf16,
while the casts of its outputs stay outside for the rewrite to absorb.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable

from attrs import define, field

from ...dialects.core import Operation, Value
from ...dialects.printer import print_attr_dict
from .domain import Classified, Kind, OpClass, RowDomain, classify, is_index, splat_value

#: A region stops growing beyond this many ops (a pathological graph must not make the pass slow).
MAX_REGION_OPS = 600
#: How deep plumbing made of leaf-like values (broadcasts of weights, iota compares, the forward's ties) is followed.
PLUMBING_DEPTH = 5


@define(eq=False)
class Region:
    """Ops of one domain (in block order), what each does there, and the values they read from outside."""

    domain: RowDomain
    ops: list[Operation]
    classes: dict[Operation, Classified]
    #: The kind of every region value and of every leaf that is not a splat constant.
    kinds: dict[Value, Kind]
    #: Values read from outside, in first-use order.
    leaves: list[Value] = field(factory=list)
    #: Leaves that are another region's values (a backward's reads of its forward).
    free: frozenset[Value] = frozenset()
    #: A row value from outside that a region row value is added to (a gradient accumulated into another's).
    accumulators: tuple[Value, ...] = ()
    op_set: frozenset[Operation] = frozenset()

    def __attrs_post_init__(self) -> None:
        produced = {r for op in self.ops for r in op.results}
        seen: dict[Value, None] = {}
        for op in self.ops:
            for operand in op.operands:
                if operand not in produced:
                    seen.setdefault(operand, None)
        self.leaves = list(seen)
        self.op_set = frozenset(self.ops)

    @property
    def values(self) -> list[Value]:
        return [op.result for op in self.ops]

    def kind(self, value: Value) -> Kind | None:
        return self.kinds.get(value)

    def refs(self) -> dict[Value, tuple[str, int]]:
        """Each value of the region by position: ("op", i) for the i-th op's result, ("leaf", j) for the j-th leaf."""
        refs: dict[Value, tuple[str, int]] = {v: ("leaf", j) for j, v in enumerate(self.leaves)}
        refs.update({op.result: ("op", i) for i, op in enumerate(self.ops)})
        return refs

    def at(self, ref: tuple[str, int]) -> Value:
        kind, index = ref
        return self.ops[index].result if kind == "op" else self.leaves[index]

    def signature(self) -> tuple:
        """The region's structure without its place in the graph: equal signatures match alike (the twelve
        layers' layernorms are recognised once)."""
        refs = self.refs()
        ops = tuple((op.name, print_attr_dict({k: v for k, v in op.attributes.items() if k != "path"}),
                     str(op.result.type), tuple(refs[v] for v in op.operands)) for op in self.ops)
        leaves = tuple((str(v.type), self.kinds.get(v), splat_value(v.op), v in self.free, v in self.accumulators)
                       for v in self.leaves)
        return (self.domain, ops, leaves)

    def reductions(self) -> list[Operation]:
        return [op for op in self.ops if self.classes[op].op_class is OpClass.REDUCE_ROW]


@define(eq=False)
class _Grower:
    domain: RowDomain
    order: dict[Operation, int]
    free: Callable[[Value], bool]
    #: Ops that may not join (other matches' slices): their values are read as inputs.
    blocked: Collection[Operation] = ()
    #: Free values whose readers the region grows into (a forward's intermediates, for its backward).
    intermediate: Callable[[Value], bool] = lambda v: False
    ops: set[Operation] = field(factory=set)
    seen_free: set[Value] = field(factory=set)
    classes: dict[Operation, Classified] = field(factory=dict)
    kinds: dict[Value, Kind] = field(factory=dict)
    inputs: dict[Value, None] = field(factory=dict)
    accumulators: list[Value] = field(factory=list)
    #: Accumulating adds seen while growing, with their outside operand.
    pending: dict[Operation, Value] = field(factory=dict)
    frontier: deque[Value] = field(factory=deque)

    def known(self, value: Value) -> Kind | None:
        return None if splat_value(value.op) is not None else self.kinds.get(value)

    def add(self, op: Operation, classified: Classified) -> None:
        if op in self.ops:
            return
        self.ops.add(op)
        self.classes[op] = classified
        self.kinds[op.result] = classified.result_kind
        self.inputs.pop(op.result, None)
        self.frontier.append(op.result)
        for operand, kind in zip(op.operands, classified.operand_kinds):
            if splat_value(operand.op) is None:
                self.kinds.setdefault(operand, kind)
            if operand.op in self.ops or operand in self.accumulators or self.leaf_like(operand, kind):
                continue
            if operand not in self.inputs:
                self.inputs[operand] = None
                self.frontier.append(operand)

    def leaf_like(self, value: Value, kind: Kind) -> bool:
        """A value a region may read without it counting as an input."""
        if self.free(value):
            if self.intermediate(value) and value not in self.seen_free:
                # A forward's intermediate this region reads: its other readers are the backward's too.
                self.seen_free.add(value)
                self.frontier.append(value)
            return True
        if splat_value(value.op) is not None:
            return True
        return kind in (Kind.COLUMN, Kind.WHOLE) or (kind is Kind.PER_ROW and is_index(value))

    def available(self, value: Value, kind: Kind, depth: int = 0) -> list[tuple[Operation, Classified]] | None:
        """The plumbing ops to add so the region can read `value` as `kind` ([] when it already can), or None."""
        if value.op in self.ops or value in self.inputs or self.leaf_like(value, kind):
            return []
        op = value.op
        if op is None or depth >= PLUMBING_DEPTH or op not in self.order or op in self.blocked:
            return None
        known = lambda v: kind if v is value else self.known(v)  # noqa: E731
        classified = classify(op, self.domain, known, casts=True)
        if classified is None or classified.result_kind is not kind:
            return None
        plumbing = [(op, classified)]
        for operand, operand_kind in zip(op.operands, classified.operand_kinds):
            more = self.available(operand, operand_kind, depth + 1)
            if more is None:
                return None
            plumbing += more
        return plumbing

    def try_add(self, op: Operation) -> bool:
        """Add `op` (with the plumbing it needs) when the domain gives it a meaning and its operands are available."""
        if op in self.ops or op not in self.order or op in self.blocked:
            return False
        classified = classify(op, self.domain, self.known, casts=op.operands[0] in self.inputs if op.operands else False)
        if classified is None:
            return False
        plumbing: list[tuple[Operation, Classified]] = []
        missing = []
        for operand, kind in zip(op.operands, classified.operand_kinds):
            more = self.available(operand, kind)
            if more is None:
                missing.append(operand)
            else:
                plumbing += more
        if missing:
            if self.accumulates(op, classified, missing):
                self.pending.setdefault(op, missing[0])
            return False
        for inner, inner_classified in reversed(plumbing):
            self.add(inner, inner_classified)
        self.add(op, classified)
        return True

    def accumulates(self, op: Operation, classified: Classified, missing: list[Value]) -> bool:
        """`op` adds a region row value to one row value from outside: autodiff accumulating a gradient (a
        layernorm's dx into the residual's)."""
        if op.name != "graph.add" or classified.result_kind is not Kind.ROW or len(missing) != 1:
            return False
        (outside,) = missing
        other = op.operands[1] if op.operands[0] is outside else op.operands[0]
        return other.op in self.ops and outside is not other

    def take_accumulator(self) -> bool:
        """Once nothing else grows, one pending accumulating add joins; its outside value is the accumulator."""
        if self.accumulators:
            return False
        for op in sorted(self.pending, key=self.order.__getitem__):
            outside = self.pending[op]
            if op in self.ops or self.available(outside, Kind.ROW) is not None:
                continue
            classified = classify(op, self.domain, self.known)
            if classified is not None and self.accumulates(op, classified, [outside]):
                self.accumulators.append(outside)
                self.add(op, classified)
                return True
        return False

    def grow_downstream(self) -> bool:
        changed = False
        while self.frontier and len(self.ops) < MAX_REGION_OPS:
            value = self.frontier.popleft()
            for user in sorted(value.users(), key=lambda u: self.order.get(u, -1)):
                changed |= self.try_add(user)
        return changed

    def absorb_upstream(self) -> bool:
        """Absorb inputs whose definer adds at most the one row input it replaces (an input read elsewhere too
        becomes a value of the region others read: whether that is allowed is for the match to say)."""
        changed = False
        for value in list(self.inputs):
            op = value.op
            if (value not in self.inputs or op is None or op not in self.order or op in self.blocked
                    or len(self.ops) >= MAX_REGION_OPS):
                continue
            classified = classify(op, self.domain, self.known, casts=True)
            if classified is None:
                continue
            new_inputs = set()
            plumbing: list[tuple[Operation, Classified]] = []
            for operand, kind in zip(op.operands, classified.operand_kinds):
                more = self.available(operand, kind)
                if more is None:
                    new_inputs.add((operand, kind))
                else:
                    plumbing += more
            replaces_row = self.kinds.get(value) is Kind.ROW
            if len(new_inputs) > 1 or (new_inputs and not replaces_row and any(k is Kind.ROW for _, k in new_inputs)):
                continue
            for inner, inner_classified in reversed(plumbing):
                self.add(inner, inner_classified)
            self.add(op, classified)
            changed = True
        return changed


def grow(seeds: Iterable[Operation], domain: RowDomain, order: dict[Operation, int],
         free: Callable[[Value], bool] = lambda v: False, blocked: Collection[Operation] = (),
         intermediate: Callable[[Value], bool] = lambda v: False) -> Region | None:
    """The region grown from `seeds` (ops of `domain`) to a fixpoint, never through `blocked` ops, into the
    readers of the `intermediate` free values it reads; None when no seed has a meaning in it."""
    grower = _Grower(domain, order, free, blocked, intermediate)
    for seed in seeds:
        if seed.operands and seed.operands[0].type.shape == domain.shape:
            grower.kinds.setdefault(seed.operands[0], Kind.ROW)
        if not grower.try_add(seed):
            _add_with_inputs(grower, seed)
    if not grower.ops:
        return None
    while len(grower.ops) < MAX_REGION_OPS:
        grew = grower.grow_downstream()
        absorbed = grower.absorb_upstream()
        if not (grew or absorbed or grower.take_accumulator()):
            break
    ops = sorted(grower.ops, key=order.__getitem__)
    region = Region(domain, ops, {op: grower.classes[op] for op in ops}, {})
    region.kinds = {v: grower.kinds[v] for v in [*region.values, *region.leaves] if v in grower.kinds}
    region.free = frozenset(v for v in region.leaves if free(v))
    region.accumulators = tuple(grower.accumulators)
    return region


def _add_with_inputs(grower: _Grower, seed: Operation) -> None:
    """A seed whose operands are not available is added anyway: its operands become the region's inputs."""
    classified = classify(seed, grower.domain, grower.known)
    if classified is not None:
        grower.add(seed, classified)
