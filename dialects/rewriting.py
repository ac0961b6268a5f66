"""Pattern rewriting: patterns match ops (alone or with their operands' definers) and rewrite them
through a `PatternRewriter`, driven by a worklist to a fixpoint.

As in MLIR's greedy driver (and xDSL's `pattern_rewriter.py`): a worklist
holds every op of a block, or of every block nested in an op; each op popped
is offered to the patterns that name its kind (then to the patterns for any
kind) until one rewrites it. Every change pushes what it may have enabled
(the new ops, the users of replaced values, the definers of erased
operands), so the driver stops at a fixpoint: no pattern applies to any op.
Pure ops left without uses are erased along the way unless the driver is
told not to.

Two ways to write a pattern:

- `RewritePattern`: `op_names` and `match_and_rewrite(op, rewriter)`, which
  checks what it needs by hand and returns whether it rewrote.

      class FoldDoubleNeg(RewritePattern):
          op_names = ("graph.neg",)

          def match_and_rewrite(self, op, rewriter):
              inner = op.operands[0].op
              if inner is not None and inner.name == "graph.neg":
                  rewriter.replace_op(op, [inner.operands[0]])
                  return True
              return False

- `PatternRule`: a declarative `Pat` tree over the root op and its operands'
  definers, with bound names (as tinygrad's `UPat` or MLIR's DRR), and a
  `rewrite` that receives the bindings as keyword arguments. The rule
  applied when `rewrite` changed the IR through the rewriter; a rewrite that
  declines (a condition over several bindings failed) changes nothing.

      class FoldDoubleNeg(PatternRule):
          pattern = Pat("graph.neg", Pat("graph.neg", Pat.var("x")))

          def rewrite(self, rewriter, x, root):
              rewriter.replace_op(root, [x])

  The root op is always bound as `root` unless its `Pat` names it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from ..diagnostics import Location
from .core import REGISTRY, Block, Builder, Operation, Region, TensorType, Value


def is_trivially_dead(op: Operation) -> bool:
    """A pure, region-free op none of whose results is used (unknown ops are never dead)."""
    for r in op.results:  # most ops are live: look at their uses before their definition
        if r.uses:
            return False
    opdef = REGISTRY.ops.get(op.name)
    return opdef is not None and opdef.pure and not op.regions


# -- operand patterns ------------------------------------------------------------------------------


class Pat:
    """A pattern over a value and, when it names op kinds, the op defining it.

    `Pat(kind, *operands, ...)` matches a value defined by an op of `kind` (an
    op name, a collection of names, or a predicate on the op, such as a trait
    query) whose operands match `operands` in order (any operands when none
    are given); `Pat.var(name)` matches any value, a block argument too.
    Constraints: `attrs` (attribute name -> the value it must equal, or a
    predicate on it), `where` (a predicate on the op), `one_use` (the value
    has exactly one use), `commutative` (the operand patterns may match the
    operands in any order). `name` binds the op (for `Pat.var`, the value);
    a name bound twice must bind the same thing.
    """

    __slots__ = ("names", "test", "operands", "name", "attrs", "where", "one_use", "commutative")

    def __init__(
        self,
        kind: str | Collection[str] | Callable[[Operation], bool] | None,
        *operands: Pat,
        name: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        where: Callable[[Operation], bool] | None = None,
        one_use: bool = False,
        commutative: bool = False,
    ) -> None:
        self.names: frozenset[str] | None = None
        self.test: Callable[[Operation], bool] | None = None
        if isinstance(kind, str):
            self.names = frozenset((kind,))
        elif callable(kind):
            self.test = kind
        elif kind is not None:
            self.names = frozenset(kind)
        self.operands: tuple[Pat, ...] | None = operands or None
        self.name = name
        self.attrs = dict(attrs or {})
        self.where = where
        self.one_use = one_use
        self.commutative = commutative

    @classmethod
    def var(cls, name: str | None = None, one_use: bool = False) -> Pat:
        """Any value, bound as `name`."""
        return cls(None, name=name, one_use=one_use)

    def match(self, op: Operation) -> dict[str, Any] | None:
        """The bindings when `op` (as the root) matches this pattern, else None."""
        bindings: dict[str, Any] = {}
        if self.one_use and not (len(op.results) == 1 and len(op.result.uses) == 1):
            return None
        return bindings if self._match_op(op, bindings) else None

    def _match_value(self, value: Value, bindings: dict[str, Any]) -> bool:
        if self.one_use and len(value.uses) != 1:
            return False
        if self.names is None and self.test is None:  # Pat.var
            return self._bind(value, bindings)
        op = value.op
        return op is not None and self._match_op(op, bindings)

    def _match_op(self, op: Operation, bindings: dict[str, Any]) -> bool:
        if self.names is not None and op.name not in self.names:
            return False
        if self.test is not None and not self.test(op):
            return False
        for key, expected in self.attrs.items():
            if key not in op.attributes:
                return False
            actual = op.attributes[key]
            if not (expected(actual) if callable(expected) else _attribute_equal(actual, expected)):
                return False
        if self.where is not None and not self.where(op):
            return False
        if self.operands is not None and not self._match_operands(self.operands, op.operands, bindings):
            return False
        return self._bind(op, bindings)

    def _match_operands(self, patterns: tuple[Pat, ...], operands: Sequence[Value], bindings: dict[str, Any]) -> bool:
        if len(operands) != len(patterns):
            return False
        orders = itertools.permutations(patterns) if self.commutative else (patterns,)
        for order in orders:
            trial = dict(bindings)
            if all(p._match_value(v, trial) for p, v in zip(order, operands)):
                bindings.update(trial)
                return True
        return False

    def _bind(self, thing: Any, bindings: dict[str, Any]) -> bool:
        if self.name is None:
            return True
        bound = bindings.setdefault(self.name, thing)
        return bound is thing


def _attribute_equal(actual: Any, expected: Any) -> bool:
    """Equality of attribute values as they print: a list equals a tuple of the same items; `1`,
    `1.0` and `true` all differ."""
    if isinstance(expected, (list, tuple)):
        return isinstance(actual, (list, tuple)) and len(actual) == len(expected) and all(
            _attribute_equal(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, bool) or isinstance(actual, bool):
        return actual is expected
    return isinstance(actual, float) == isinstance(expected, float) and actual == expected


# -- patterns and the rewriter --------------------------------------------------------------------


class RewritePattern:
    """One rewrite. `op_names` restricts it to those op kinds (empty: every op)."""

    op_names: ClassVar[tuple[str, ...]] = ()

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        """Rewrite `op` through `rewriter` and return True, or change nothing and return False."""
        raise NotImplementedError


class PatternRule(RewritePattern):
    """A rewrite of what `pattern` matches: subclasses set `pattern` and define `rewrite`,
    which gets the rewriter and the bindings (the root as `root` unless the pattern names it)."""

    pattern: ClassVar[Pat]
    _root_name: ClassVar[str] = "root"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        pattern = cls.__dict__.get("pattern")
        if pattern is not None:
            cls.op_names = tuple(sorted(pattern.names)) if pattern.names is not None else ()
            cls._root_name = pattern.name or "root"

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        bindings = self.pattern.match(op)
        if bindings is None:
            return False
        bindings.setdefault(self._root_name, op)
        actions = rewriter.actions
        self.rewrite(rewriter, **bindings)
        return rewriter.actions != actions

    def rewrite(self, rewriter: PatternRewriter, **bindings: Any) -> None:
        """Rewrite the match through `rewriter`; change nothing to decline it."""
        raise NotImplementedError


class PatternRewriter:
    """The only way patterns change the IR, so the driver sees every change."""

    def __init__(self, driver: GreedyRewriteDriver) -> None:
        self._driver = driver
        #: The op being rewritten: new ops go before it.
        self.current: Operation | None = None
        #: How many changes were made (a rule applied when its rewrite made one).
        self.actions = 0

    def create(
        self,
        name: str,
        operands: Sequence[Value] = (),
        attributes: dict[str, Any] | None = None,
        result_types: Sequence[TensorType] | None = None,
        loc: Location | None = None,
        *,
        before: Operation | None = None,
        after: Operation | None = None,
    ) -> Operation:
        """Create an op (types inferred unless given) before the current one, or before `before`
        or after `after`; it joins the worklist."""
        if after is not None:
            anchor = after.next_op
            block = after.parent
        else:
            anchor = before if before is not None else self.current
            if anchor is None:
                raise RuntimeError("PatternRewriter.create outside a rewrite")
            block = anchor.parent
        if block is None:
            raise ValueError(f"cannot insert next to {(after or anchor).name}: it is in no block")
        op = Builder(block, anchor=anchor).create(name, operands, attributes, result_types, loc)
        self._inserted(op)
        return op

    def insert_op_before(self, op: Operation, anchor: Operation) -> None:
        """Insert a detached op before `anchor`; it joins the worklist."""
        if anchor.parent is None:
            raise ValueError(f"cannot insert before {anchor.name}: it is in no block")
        anchor.parent.insert_before(op, anchor)
        self._inserted(op)

    def insert_op_after(self, op: Operation, anchor: Operation) -> None:
        """Insert a detached op after `anchor`; it joins the worklist."""
        if anchor.parent is None:
            raise ValueError(f"cannot insert after {anchor.name}: it is in no block")
        anchor.parent.insert_after(op, anchor)
        self._inserted(op)

    def move_op_into(self, op: Operation, region: Region, before: Operation | None = None) -> None:
        """Move `op` from its block to the end of `region`'s last block (before `before` when
        given, an op of that region); it and its users are revisited."""
        if not region.blocks:
            region.add_block(Block())
        if op.parent is not None:
            op.parent.detach(op)
        if before is None:
            region.blocks[-1].append(op)
        else:
            if before.parent is None or before.parent.parent is not region:
                raise ValueError(f"cannot move {op.name} before {before.name}: it is not in that region")
            before.parent.insert_before(op, before)
        self._inserted(op)
        for result in op.results:
            for user in result.users():
                self._driver.push(user)

    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        """Make every reader of `old` read `new`; the readers are revisited."""
        if old is new:
            return
        if old.type != new.type:
            raise ValueError(f"replacing a {old.type} value by a {new.type} value")
        for user in old.users():
            self._driver.push(user)
        old.replace_all_uses_with(new)
        self.actions += 1

    def replace_op(self, op: Operation, new: Operation | Sequence[Value]) -> None:
        """Replace `op`'s results by `new` (an op's results, or values) and erase `op`."""
        values = new.results if isinstance(new, Operation) else list(new)
        if len(values) != len(op.results):
            raise ValueError(f"replacing {op.name} with {len(op.results)} results by {len(values)} values")
        for old, value in zip(op.results, values):
            self.replace_all_uses_with(old, value)
        self.erase_op(op)

    def erase_op(self, op: Operation) -> None:
        """Erase an op whose results are unused; its operands' definers are revisited (they may be dead now)."""
        for operand in op.operands:
            if operand.op is not None:
                self._driver.push(operand.op)
        op.erase()
        self.actions += 1
        self._driver.changed = True

    def _inserted(self, op: Operation) -> None:
        self._driver.push(op)
        self.actions += 1


class GreedyRewriteDriver:
    """Applies patterns to the ops of blocks until none applies.

    `max_rewrites` bounds the work: patterns that undo each other would
    otherwise loop forever, which is a bug in the patterns, raised as such.
    """

    def __init__(self, patterns: Iterable[RewritePattern], erase_dead: bool = True, max_rewrites: int | None = None):
        self.by_name: dict[str, list[RewritePattern]] = {}
        self.any_op: list[RewritePattern] = []
        for pattern in patterns:
            if pattern.op_names:
                for name in pattern.op_names:
                    self.by_name.setdefault(name, []).append(pattern)
            else:
                self.any_op.append(pattern)
        self._patterns_for: dict[str, list[RewritePattern]] = {}
        self.erase_dead = erase_dead
        self.max_rewrites = max_rewrites
        self.worklist: deque[Operation] = deque()
        self.queued: set[Operation] = set()
        self.changed = False
        self.rewrites = 0

    def push(self, op: Operation) -> None:
        if op not in self.queued:
            self.queued.add(op)
            self.worklist.append(op)

    def patterns_for(self, name: str) -> list[RewritePattern]:
        """The patterns naming this op kind, then those for every kind."""
        found = self._patterns_for.get(name)
        if found is None:
            found = self._patterns_for[name] = [*self.by_name.get(name, ()), *self.any_op]
        return found

    def rewrite_block(self, block: Block) -> bool:
        """Rewrite `block` to a fixpoint; True when anything changed."""
        for op in block.ops:
            self.push(op)
        return self._run(len(block))

    def rewrite_nested(self, root: Operation) -> bool:
        """Rewrite every op nested in `root`'s regions (at any depth; not `root` itself) to a
        fixpoint, e.g. the ops of every `graph.func` of a `builtin.module`; True when anything changed."""
        count = 0
        for op in root.walk():
            if op is not root:
                self.push(op)
                count += 1
        return self._run(count)

    def _run(self, op_count: int) -> bool:
        self.changed = False
        self.rewrites = 0
        limit = self.max_rewrites if self.max_rewrites is not None else 10 * op_count + 1000
        rewriter = PatternRewriter(self)
        while self.worklist:
            op = self.worklist.popleft()
            self.queued.discard(op)
            if op.parent is None:  # erased after it was queued
                continue
            if self.erase_dead and is_trivially_dead(op):
                rewriter.erase_op(op)
                continue
            rewriter.current = op
            for pattern in self.patterns_for(op.name):
                if pattern.match_and_rewrite(op, rewriter):
                    self.changed = True
                    self.rewrites += 1
                    if self.rewrites > limit:
                        raise RuntimeError(f"rewriting did not converge after {limit} rewrites (last: {op.name})")
                    if op.parent is not None:  # rewritten in place: other patterns may apply now
                        self.push(op)
                    break
            rewriter.current = None
        return self.changed


def apply_patterns_greedily(block: Block, patterns: Iterable[RewritePattern], erase_dead: bool = True) -> bool:
    """Rewrite `block` with `patterns` to a fixpoint; True when anything changed."""
    return GreedyRewriteDriver(patterns, erase_dead=erase_dead).rewrite_block(block)
