"""Pattern rewriting: patterns match one op and rewrite it through a `PatternRewriter`.

As in MLIR's greedy driver (and xDSL's `pattern_rewriter.py`): a worklist
holds every op of a block; each op popped is offered to the patterns that
name its kind (then to the patterns for any kind) until one rewrites it.
Every change pushes what it may have enabled (the new ops, the users of
replaced values, the definers of erased operands), so the driver stops at a
fixpoint: no pattern applies to any op. Ops left without uses that are pure
are erased along the way.

    class FoldDoubleNeg(RewritePattern):
        op_names = ("graph.neg",)

        def match_and_rewrite(self, op, rewriter):
            inner = op.operands[0].op
            if inner is not None and inner.name == "graph.neg":
                rewriter.replace_op(op, [inner.operands[0]])
                return True
            return False
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from ..diagnostics import Location
from ..dialects.core import Block, Builder, Operation, TensorType, Value
from .dce import is_trivially_dead


class RewritePattern:
    """One rewrite. `op_names` restricts it to those op kinds (empty: every op)."""

    op_names: ClassVar[tuple[str, ...]] = ()

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        """Rewrite `op` through `rewriter` and return True, or change nothing and return False."""
        raise NotImplementedError


class PatternRewriter:
    """The only way patterns change the IR, so the driver sees every change."""

    def __init__(self, driver: GreedyRewriteDriver) -> None:
        self._driver = driver
        #: The op being rewritten: new ops go before it.
        self.current: Operation | None = None

    def create(
        self,
        name: str,
        operands: Sequence[Value] = (),
        attributes: dict[str, Any] | None = None,
        result_types: Sequence[TensorType] | None = None,
        loc: Location | None = None,
    ) -> Operation:
        """Create an op before the current one (types inferred unless given); it joins the worklist."""
        anchor = self.current
        if anchor is None:
            raise RuntimeError("PatternRewriter.create outside a rewrite")
        if anchor.parent is None:
            raise ValueError(f"cannot insert before {anchor.name}: it is in no block")
        op = Builder(anchor.parent, anchor=anchor).create(name, operands, attributes, result_types, loc)
        self._driver.push(op)
        return op

    def insert_op_before(self, op: Operation, anchor: Operation) -> None:
        """Insert a detached op before `anchor`; it joins the worklist."""
        if anchor.parent is None:
            raise ValueError(f"cannot insert before {anchor.name}: it is in no block")
        anchor.parent.insert_before(op, anchor)
        self._driver.push(op)

    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        """Make every reader of `old` read `new`; the readers are revisited."""
        if old is new:
            return
        if old.type != new.type:
            raise ValueError(f"replacing a {old.type} value by a {new.type} value")
        for user in old.users():
            self._driver.push(user)
        old.replace_all_uses_with(new)

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
        self._driver.changed = True


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
        self.changed = False
        self.rewrites = 0
        for op in block.ops:
            self.push(op)
        limit = self.max_rewrites if self.max_rewrites is not None else 10 * len(block) + 1000
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
