"""Recomputing a fused kernel's cheap pointwise values in the kernels that read them, instead of storing them.

The step of `fuse` after its groups are formed: rematerialisation, as
PyTorch's min-cut partitioner chooses what a backward recomputes rather than
saves. A value one kernel computes elementwise from its own inputs and stores
only for fused kernels that run after a GEMM or template kernel following it
(GELU's `1 + erf(x/√2)`, `x/2` and `exp(-x²/2)`, which the backward reads
after the GEMMs in between) is
computed again inside each kernel that reads it, from the same inputs, when
that takes at most `limit` ops and reads no more new bytes than the value
has. The writer then stores only what GEMMs, template kernels and the graph's
outputs read; a reader reads the inputs instead (for GELU the
pre-activation, which the first GEMM of the MLP wrote anyway). Recomputed ops
do not count against `max-nodes`: they replace a read. A value some GEMM,
template kernel, view or output reads stays stored, so nothing is recomputed
for it, and a kernel that would have no plan with the copies keeps reading
the stored value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..dialects.core import Operation, Value
from ..dialects.traits import Trait, has_trait
from .fuse_plan import plan_group, splat_value, view_sources

if TYPE_CHECKING:
    from .fuse import Group


def recompute_pointwise(groups: Sequence[Group], barriers: int, escapes: set[Value],
                        sources: dict[Value, list[Value]], limit: int) -> list[Group]:
    """Recompute, in their readers' kernels, the values each group stores only for fused groups it
    reaches through one of `barriers` (the GEMMs and template kernels, as group bits) and computes in
    at most `limit` elementwise ops from its inputs; the groups left with ops."""
    if limit < 1:
        return list(groups)
    owner = {op: group for group in groups for op in group.ops}
    copies: dict[Group, dict[Value, Value]] = {}
    for writer in groups:
        for value in list(writer.plan.outputs):
            if writer.ops:
                _recompute(value, writer, owner, copies, barriers, escapes, sources, limit)
    return [group for group in groups if group.ops]


def _recompute(value: Value, writer: Group, owner: dict[Operation, Group], copies: dict[Group, dict[Value, Value]],
               barriers: int, escapes: set[Value], sources: dict[Value, list[Value]], limit: int) -> None:
    """Recompute `value` in every fused group that reads it, when it is cheap and read by them alone,
    each after a barrier that follows the writer."""
    if value in escapes:
        return
    members = set(writer.ops)
    cone = _cone(value, writer.ops, sources, limit)
    if cone is None:
        return
    readers: dict[Group, list[Operation]] = {}
    for use_op in value.users():
        reader = owner.get(use_op)
        if reader is None:
            return  # a GEMM, a template kernel, a view or an output reads the stored value
        if reader is not writer:
            if not writer.descendants & reader.ancestors & barriers:
                return  # a reader the writer's kernel could take: fusion and max-nodes decided
            readers.setdefault(reader, []).append(use_op)
    if not readers or any(not _pays(cone, members, reader, value) for reader in readers):
        return
    undo = [(reader, reader.ops, reader.plan, dict(copies.get(reader, {}))) for reader in readers]
    made: list[Operation] = []
    replaced: list[tuple[Operation, int]] = []
    for reader, use_ops in readers.items():
        mapper = copies.setdefault(reader, {})
        fresh = [op.clone(mapper) for op in cone if op.result not in mapper]
        for op in fresh:
            use_ops[0].parent.insert_before(op, use_ops[0])
        made.extend(fresh)
        for use_op in use_ops:
            for k, operand in enumerate(use_op.operands):
                if operand is value:
                    use_op.set_operand(k, mapper[value])
                    replaced.append((use_op, k))
        reader.ops = _ordered(reader.ops, fresh, mapper)
    plans = {reader: plan_group(reader.ops, escapes, sources) for reader in readers}
    if any(plan is None for plan in plans.values()):
        for use_op, k in replaced:
            use_op.set_operand(k, value)
        for op in reversed(made):
            op.erase()
        for group, ops, plan, mapper in undo:
            group.ops, group.plan = ops, plan
            copies[group] = mapper
        return
    writer.ops = _without_dead(writer.ops)
    if writer.ops:
        # Fewer outputs and the ops only they needed gone: the writer's plan over its domain still holds.
        plans[writer] = plan_group(writer.ops, escapes, sources)
        if plans[writer] is None:
            raise AssertionError(f"fuse lost the plan of the kernel that computed {value.op.name}")
    for group, plan in plans.items():
        group.plan = plan
        for op in group.ops:
            owner[op] = group


def _cone(value: Value, ops: list[Operation], sources: dict[Value, list[Value]],
          limit: int) -> list[Operation] | None:
    """The ops of the writing group that compute `value` from its inputs (in block order), when they are
    elementwise, at most `limit`, and read only buffers from outside it (no value the group computes
    through a view) and splat constants."""
    members = set(ops)
    found: set[Operation] = set()
    stack = [value]
    while stack:
        current = stack.pop()
        op = current.op
        if op in found:
            continue
        if op is None or op not in members:
            if splat_value(current) is None and any(s.op in members for s in view_sources(current, sources)):
                return None
            continue
        if not (op.name.startswith("graph.") and has_trait(op, Trait.ELEMENTWISE)):
            return None
        found.add(op)
        if len(found) > limit:
            return None
        stack.extend(op.operands)
    return [op for op in ops if op in found]


def _pays(cone: list[Operation], members: set[Operation], reader: Group, value: Value) -> bool:
    """Whether the reader's kernel reads no more new bytes recomputing `value` than it would reading it."""
    read = {a.root for a in reader.plan.inputs}
    leaves = {source for op in cone for operand in op.operands if operand.op not in members
              and splat_value(operand) is None for source in view_sources(operand)}
    return sum(leaf.type.nbytes for leaf in leaves - read) <= value.type.nbytes


def _ordered(ops: list[Operation], fresh: list[Operation], mapper: dict[Value, Value]) -> list[Operation]:
    """The reader's ops with the new copies after the copies it had (each copy after what it reads)."""
    copied = {v.op for v in mapper.values()}
    earlier = [op for op in ops if op in copied and op not in fresh]
    return [*earlier, *fresh, *(op for op in ops if op not in copied)]


def _without_dead(ops: list[Operation]) -> list[Operation]:
    """The writer's ops less those nothing reads any more (their outside readers recompute them), which
    are erased."""
    dead: list[Operation] = []
    for op in reversed(ops):
        if not any(r.has_uses for r in op.results):
            op.erase()
            dead.append(op)
    return [op for op in ops if op not in dead]
