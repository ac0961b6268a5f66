"""`gemm-layouts`: the layouts GEMM operands are read in, chosen so that transposes are GEMM flags, not copies.

cuBLASLt reads an operand transposed for free (`transpose_a`/`transpose_b`,
`fuse`'s `lower_matmul` folds a `graph.transpose` of the last two axes into
them); any other view of an operand is a copy kernel. Autodiff and the bf16
policy hide the free transposes behind ops `lower_matmul` does not look
through, so before this pass a training step copied Wᵀ, Xᵀ, Pᵀ and Kᵀ.
The rewrites, each a pattern driven to a fixpoint:

- **casts before views** (`CastBeforeView`): a cast of a transpose or reshape
  whose result only feeds matmuls is the view of a cast of the source, and
  that cast is usually there already (the forward's bf16 copy of a weight,
  of an activation, of the attention probabilities): Wᵀ, Xᵀ and Pᵀ become
  transposes of buffers, so GEMM flags;
- **operand transposes split** (`SplitOperandTranspose`): a matmul operand
  transposed by a permutation that moves the stored row (the last axis)
  elsewhere, such as Kᵀ = `transpose(k, [0, 2, 3, 1])` of a head split, is
  the last-two-axes swap (a GEMM flag) of a permutation that keeps the
  stored row last (`[0, 2, 1, 3]`, the head layout every other head GEMM
  reads): one coalesced head-layout copy, shared;
- **products transposed back** (`SwapTransposedProduct`): a matmul read only
  through a transpose that puts its last axis second to last (autodiff's
  dKᵀ = Qᵀ·dS read as dK) is the product of the swapped operands,
  Cᵀ = Bᵀ·Aᵀ, read through what remains of the permutation;
- **one copy of each layout** (`ShareLayout`): a transpose or cast feeding
  matmuls that an earlier op already computes (same operand, permutation or
  dtype; the model path aside) is that op's result, so the forward's head
  layouts and weight casts serve the backward's GEMMs too.

The lowerings run the casts alone (`transposes=false`) before `match-patterns`:
a layer norm's output, read by the forward's cast and by the weight
gradient's Xᵀ, is then read by one cast only, and `match-patterns` writes it
in that dtype (no cast kernel); the rest runs after, on the pattern kernels'
graph.

Guarantees: every rewrite computes the same values (views and casts
commute; matmul(A, B)ᵀ = matmul(Bᵀ, Aᵀ) exactly, products accumulate the
same terms); only ops that feed matmuls move, so graphs without matmuls are
unchanged. Heads are not batched by stride: a head split of `[B, T, H·d]`
is two batch axes with unrelated strides (T·H·d and d), and cuBLASLt's
strided batch has one stride, so the head layout stays one copy (as llm.c's
permute kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import define

from ..dialects.core import Operation, Value
from ..dialects.graph import graph_funcs, transpose_perm
from ..dialects.rewriting import GreedyRewriteDriver, PatternRewriter, RewritePattern
from .manager import CompilationUnit, Pass, register_pass

#: Views whose elements are the operand's, in another shape or order: a cast commutes with them.
_VIEWS = ("graph.transpose", "graph.reshape", "graph.expand_dims", "graph.squeeze")


@register_pass
@define
class GemmLayouts(Pass):
    """Rewrites the views and casts around matmuls so that each operand is a buffer or a transpose of
    its last two axes (a GEMM flag) of one, wherever the graph allows.

    Guarantees: the graph computes the same values; ops that feed no matmul are left as they are.
    """

    name = "gemm-layouts"
    summary = "read GEMM operands through transpose flags: casts before views, transposes split, layouts shared"
    #: With false, only casts move before views and are shared (`CastBeforeView`, `ShareLayout` of casts):
    #: the lowerings run that before `match-patterns`, so a norm whose every outside reader now casts
    #: writes the cast's dtype itself, and the transposes after it, on the pattern kernels' graph.
    transposes: bool = True

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        patterns = [CastBeforeView(), ShareLayout(("graph.cast",))]
        if self.transposes:
            patterns += [SplitOperandTranspose(), SwapTransposedProduct(), ShareLayout(("graph.transpose",))]
        driver = GreedyRewriteDriver(patterns)
        for func in graph_funcs(module):
            for region in func.regions:
                for block in region.blocks:
                    driver.rewrite_block(block)


def feeds_matmuls(value: Value) -> bool:
    """Whether every reader of `value` is a matmul, or a view or cast read only by matmuls in turn."""
    users = list(value.users())
    return bool(users) and all(user.name == "graph.matmul" or (user.name in (*_VIEWS, "graph.cast")
                                                               and feeds_matmuls(user.result)) for user in users)


def precedes(first: Operation, later: Operation) -> bool:
    """Whether `first` comes before `later` in one block."""
    op = first.next_op
    while op is not None:
        if op is later:
            return True
        op = op.next_op
    return False


def _same_but_path(a: Operation, b: Operation) -> bool:
    strip = ("path",)
    return ({k: v for k, v in a.attributes.items() if k not in strip}
            == {k: v for k, v in b.attributes.items() if k not in strip})


def _earlier_twin(op: Operation) -> Operation | None:
    """An op before `op` computing the same thing from the same operand (its path aside)."""
    for user in op.operands[0].users():
        if user is not op and user.name == op.name and _same_but_path(user, op) and precedes(user, op):
            return user
    return None


def _view(rewriter: PatternRewriter, name: str, source: Value, attributes: dict, at: Operation) -> Value:
    """`name` of `source` with `attributes`, the result of an earlier identical op when there is one."""
    made = rewriter.create(name, [source], attributes, loc=at.loc, before=at)
    twin = _earlier_twin(made)
    if twin is None:
        return made.result
    rewriter.erase_op(made)
    return twin.result


def _transposed(rewriter: PatternRewriter, value: Value, perm: Sequence[int], at: Operation) -> Value:
    """`value` transposed by `perm`, a transpose of a transpose composed and an identity dropped."""
    source = value
    if value.op is not None and value.op.name == "graph.transpose":
        inner = transpose_perm(value.op)
        source, perm = value.op.operands[0], [inner[axis] for axis in perm]
    if list(perm) == list(range(len(perm))):
        return source
    path = at.attributes.get("path")
    return _view(rewriter, "graph.transpose", source, {"perm": list(perm), **({"path": path} if path else {})}, at)


def _swap_last_two(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


class CastBeforeView(RewritePattern):
    """`cast(view(x))` read only by matmuls is `view(cast(x))`, the cast an earlier one when it exists."""

    op_names = ("graph.cast",)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        view = op.operands[0].op
        if view is None or view.name not in _VIEWS or not feeds_matmuls(op.result):
            return False
        cast = _view(rewriter, "graph.cast", view.operands[0], dict(op.attributes), op)
        rewriter.replace_op(op, [_view(rewriter, view.name, cast, dict(view.attributes), op)])
        return True


class SplitOperandTranspose(RewritePattern):
    """A matmul operand `transpose(x, p)` whose permutation moves the last axis, and whose last-two
    swap keeps it last, is the swap (a GEMM flag) of `transpose(x, p')`, p' keeping the stored row last."""

    op_names = ("graph.matmul",)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        operands = list(op.operands)
        changed = False
        for k, operand in enumerate(operands):
            view = operand.op
            if view is None or view.name != "graph.transpose":
                continue
            perm, rank = transpose_perm(view), operand.type.rank
            if perm[-1] == rank - 1 or perm[-2] != rank - 1:
                continue
            keeping_row = [*perm[:-2], perm[-1], perm[-2]]
            if keeping_row == list(range(rank)):
                continue
            inner = _transposed(rewriter, view.operands[0], keeping_row, op)
            operands[k] = rewriter.create("graph.transpose", [inner], {"perm": _swap_last_two(rank)},
                                          loc=view.loc, before=op).result
            changed = True
        if not changed:
            return False
        product = rewriter.create("graph.matmul", operands, dict(op.attributes), loc=op.loc)
        product.result.name_hint = op.result.name_hint
        rewriter.replace_op(op, product)
        return True


class SwapTransposedProduct(RewritePattern):
    """`transpose(matmul(a, b), p)`, the product read only here and p putting its last axis second to
    last, is `transpose(matmul(bᵀ, aᵀ), q)` with q keeping the last axis last (dropped when identity)."""

    op_names = ("graph.transpose",)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        product = op.operands[0]
        matmul = product.op
        rank = product.type.rank
        perm = transpose_perm(op)
        if (matmul is None or matmul.name != "graph.matmul" or len(product.uses) != 1 or perm[-1] != rank - 2
                or any(operand.type.rank != rank for operand in matmul.operands)):
            return False
        swap = _swap_last_two(rank)
        a, b = (_transposed(rewriter, operand, swap, matmul) for operand in matmul.operands)
        swapped = rewriter.create("graph.matmul", [b, a], dict(matmul.attributes), loc=matmul.loc, before=matmul)
        remaining = [swap[axis] for axis in perm]
        result = swapped.result if remaining == list(range(rank)) else rewriter.create(
            "graph.transpose", [swapped.result], {**op.attributes, "perm": remaining}, loc=op.loc).result
        result.name_hint = op.result.name_hint
        rewriter.replace_op(op, [result])
        rewriter.erase_op(matmul)
        return True


class ShareLayout(RewritePattern):
    """A transpose or cast (`op_names`) feeding matmuls that an earlier op computes already is that op's result."""

    def __init__(self, op_names: tuple[str, ...]) -> None:
        self.op_names = op_names

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        if not feeds_matmuls(op.result):
            return False
        twin = _earlier_twin(op)
        if twin is None:
            return False
        rewriter.replace_op(op, twin)
        return True

