"""`working-copies`: each bf16-read parameter's bf16 working copy, written by its optimizer update.

Under the bf16 policy `insert-casts` casts a master weight to bf16 in every
graph where a matmul reads it: one cast launch per call reading 4 bytes and
writing 2 per element (per microbatch where microbatches are not stacked).
llm.c's AdamW kernel writes the bf16 copy of each weight as it updates the
f32 master, and every forward reads that copy. This pass does the same in
the IR, for each f32 parameter `p` that has an update graph and that a graph
the training driver feeds parameters to (kind train, train_accumulating,
train_stacked, train_diagnosed or evaluation) casts to bf16, directly or
through transposes, reshapes, broadcasts and takes of it (a weight and its
Wᵀ, a bias broadcast over the rows, an embedding's gathered rows):

- every such cast in those graphs becomes the same ops applied to
  a new input `graph.input {name = "bf16/<p>", role = "working_copy"}` of p's
  shape in bf16; p's own input stays where something else reads it;
- p's update graph returns one more value, `bf16`: its new parameter cast to
  bf16, so the update writes the copy of the weight it has just computed
  (`fuse` keeps it in the group's `multi_tensor_update` kernel: 2 bytes more
  written per element, no launch);
- a graph `@working_copies {kind = "working_copies", derived = true}` casts
  every such parameter (inputs `<p>`, role param) to its copy (outputs
  `bf16/<p>`): the driver runs it when it sets the parameters (at the start
  of a run and on resume), so the copies are derived state that checkpoints
  do not hold.

A cast commutes with those ops (they move or repeat elements, the cast
rounds each one alone) and the copy is the same rounding of the same f32
value, so every graph computes bit-identical values. A module where no graph
casts a parameter with an update graph is unchanged, so the pass is
idempotent; run again after new casts, it gives their parameters copies too.
"""

from __future__ import annotations

from collections.abc import Collection

from attrs import define, field

from ..dialects.core import Builder, Operation, Region, Value
from ..dialects.graph import erase_derived, func_kind, graph_funcs, input_name, input_role, return_names
from ..dialects.rewriting import PatternRewriter, RewritePattern, apply_patterns_greedily
from .manager import CompilationUnit, Pass, register_pass

#: The graphs whose parameter casts read working copies: those the training driver feeds parameters to.
READING_KINDS = ("train", "train_accumulating", "train_stacked", "train_diagnosed", "evaluation")
#: Ops that only move or repeat the elements of their first operand (a take's other operand is its
#: indices): a cast of their result is the same op applied to the cast first operand.
_MOVES = ("graph.transpose", "graph.reshape", "graph.broadcast", "graph.take")
#: Moves that write a tensor of their own: taken only where the cast is their one reader, so the rewrite
#: never makes a second broadcast or gather beside one that something else reads in f32.
_WRITING_MOVES = ("graph.broadcast", "graph.take")
#: The input role, name prefix and update output of a working copy.
ROLE = "working_copy"
PREFIX = "bf16/"
UPDATE_OUTPUT = "bf16"
#: The symbol and kind of the graph that makes the copies from the parameters.
MAKER = "working_copies"


def cast_parameter(cast: Operation) -> tuple[Operation, list[Operation]] | None:
    """For a cast to bf16 of an f32 parameter (through element moves): the parameter's input and the moves
    from it outwards; None for any other op."""
    if cast.name != "graph.cast" or cast.attributes.get("dtype") != "bf16":
        return None
    moves: list[Operation] = []
    value = cast.operands[0]
    while value.op is not None and value.op.name in _MOVES:
        if value.op.name in _WRITING_MOVES and len(value.uses) != 1:
            return None
        moves.append(value.op)
        value = value.op.operands[0]
    source = value.op
    if source is None or source.name != "graph.input" or input_role(source) != "param" or value.type.dtype != "f32":
        return None
    return source, moves[::-1]


@define
class ReadWorkingCopy(RewritePattern):
    """`cast(moves(p)) -> bf16` → `moves(bf16/<p>)`, for the parameters in `params`; `copies` records
    each graph input it made (one per parameter and graph)."""

    op_names = ("graph.cast",)
    params: Collection[str]
    copies: dict[str, Value] = field(factory=dict)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        found = cast_parameter(op)
        if found is None or input_name(found[0]) not in self.params:
            return False
        param, moves = found
        value = self.copy_of(param, rewriter)
        for move in moves:
            value = rewriter.create(move.name, [value, *move.operands[1:]], dict(move.attributes),
                                    [move.result.type.with_dtype("bf16")], move.loc, before=op).result
        rewriter.replace_op(op, [value])
        return True

    def copy_of(self, param: Operation, rewriter: PatternRewriter) -> Value:
        path = input_name(param)
        if path not in self.copies:
            self.copies[path] = rewriter.create("graph.input", (), {"name": PREFIX + path, "role": ROLE},
                                                [param.result.type.with_dtype("bf16")], param.loc, after=param).result
        return self.copies[path]


def update_graphs(module: Operation) -> dict[str, Operation]:
    """Each parameter's update graph (`build-updates`), by parameter path."""
    return {str(func.attributes["param"]): func for func in graph_funcs(module)
            if func_kind(func) == "update" and "param" in func.attributes}


def write_copy(update: Operation) -> None:
    """Make an update graph also return its new parameter cast to bf16 (output `bf16`)."""
    ret = update.body.last_op
    names = return_names(ret)
    if UPDATE_OUTPUT in names:
        return
    b = Builder(update.body, anchor=ret, loc=ret.loc)
    copy = b.value("graph.cast", ret.operands[names.index("param")], dtype="bf16")
    b.create("graph.return", [*ret.operands, copy], {**ret.attributes, "names": [*names, UPDATE_OUTPUT]})
    ret.erase()
    update.verify()


def maker_graph(params: dict[str, Operation]) -> Operation:
    """`@working_copies`: each parameter of `params` (path → its `exp.param`) cast to bf16."""
    loc = next(iter(params.values())).loc
    func = Operation.create("graph.func", attributes={"sym_name": MAKER, "kind": MAKER, "derived": True},
                            regions=[Region.with_block()], loc=loc)
    b = Builder(func.body, loc=loc)
    inputs = [b.create("graph.input", (), {"name": path, "role": "param"}, result_types=[op.attributes["type"]]).result
              for path, op in params.items()]
    casts = [b.value("graph.cast", value, dtype="bf16") for value in inputs]
    b.create("graph.return", casts, {"names": [PREFIX + path for path in params]})
    func.verify()
    return func


def copies_read(module: Operation) -> set[str]:
    """The parameters whose working copies some graph reads."""
    return {input_name(op).removeprefix(PREFIX) for func in graph_funcs(module) if func_kind(func) in READING_KINDS
            for op in func.body.ops if op.name == "graph.input" and input_role(op) == ROLE}


@register_pass
@define
class WorkingCopies(Pass):
    """Gives each f32 parameter that the driver's graphs cast to bf16 a bf16 working copy its update writes.

    Guarantees: no graph of kind train, train_accumulating, train_stacked,
    train_diagnosed or evaluation casts (through transposes, reshapes,
    broadcasts and takes) an
    f32 parameter that has an update graph to bf16; each reads input
    `bf16/<p>` (role working_copy) instead; each such parameter's update
    graph returns `bf16`, the bf16 rounding of the `param` it returns;
    `@working_copies` (derived) makes every copy from its parameter. Every
    value the graphs compute is bit-identical to before.
    """

    name = "working-copies"
    summary = "bf16 working copies of the weights, written by their optimizer updates, read instead of casts"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        updates = update_graphs(module)
        for func in graph_funcs(module):
            if func_kind(func) in READING_KINDS:
                apply_patterns_greedily(func.body, [ReadWorkingCopy(params=updates.keys())])
        erase_derived(module, MAKER)
        # A group's members stay one update arithmetic (one flat update, one kernel): each writes its copy
        # when one of them is read, as llm.c's AdamW writes every weight's.
        groups = {updates[path].attributes.get("group") for path in copies_read(module)}
        copied = {path: func for path, func in updates.items() if func.attributes.get("group") in groups}
        for update in copied.values():
            write_copy(update)
        if copied:
            params = {op.attributes["path"]: op for op in module.body.ops if op.name == "exp.param"}
            module.body.append(maker_graph({path: params[path] for path in copied}))
