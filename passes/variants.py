"""Variants of the train graph: `accumulate`, `stack`, `diagnose`.

Each clones `@train` (the `graph.func` with `kind = "train"`) into a sibling
graph placed right after it; `diagnose` also strips observations from
`@train`. `accumulate` and `stack` need the gradient outputs of `autodiff`;
so does a `grads` diagnostic.

- `accumulate` → `@train_accumulating {kind = "train_accumulating"}` (unless the
  run has one microbatch, which only ever runs `@train`): one more
  `graph.input {role = "grad", name = "grad/<path>"}` per gradient output
  (named like the output, so a caller feeds the previous call's outputs back
  unchanged); each `grad/<path>` output is that input plus the fresh gradient.
- `stack{k=4}` → `@train_stacked {kind = "train_stacked", k}`: the same
  inputs, except each batch field has a leading dimension k (microbatch i is
  `field[i]`). The graph runs k copies of train, one per microbatch, sharing
  the params. Outputs: `loss` (and any other float non-gradient output) is the
  mean over the k microbatches; `grad/<path>` is the *sum* of the k
  microbatch gradients, exactly what k `@train_accumulating` calls add up, so
  a driver divides by the step's microbatch count once whichever graph it
  used. Metrics are averaged over the k copies, counters summed, observations
  dropped (diagnostics run on `@train_diagnosed`).
- `diagnose` → `@train_diagnosed {kind = "train_diagnosed"}` when at least
  one `exp.diagnostic` is enabled: train plus, for each enabled diagnostic and
  each tensor it selects, `graph.observe {name = "<diagnostic>:<path>"}` of one
  f32 scalar (reducers: mean, rms, max, min, norm = √Σx²). With several
  microbatches and a `grads` diagnostic, `@train_diagnosed` also adds into the
  previous gradients as `@train_accumulating` does (the driver runs it as the
  step's last microbatch) and reduces the step's mean gradient. A diagnostic's
  `of = {kind, glob}` selects observed tensors (by the `name` of their
  `graph.observe`), gradients (by param path) or params (by path). Globs are
  fnmatch patterns whose `*` matches any run of characters, dots included
  (`model.blocks.*` matches `model.blocks.0.attn.qkv.weight`). The raw
  observations are removed from both graphs: `@train` carries none.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from attrs import define

from ..diagnostics import SxError
from ..dialects.core import FLOAT_DTYPES, Builder, Operation, Region, TensorType, Value
from ..dialects.exp import REDUCERS
from ..dialects.graph import (
    emit_name,
    erase_derived,
    func_kind,
    graph_funcs,
    input_name,
    input_role,
    is_derived,
    is_input,
    op_axis,
    return_names,
)
from ..dialects.traits import Trait, has_trait
from .autodiff import GRAD_PREFIX, func_name
from .manager import CompilationUnit, Pass, register_pass

# -- shared: finding and cloning the train graph ------------------------------------------------


def train_graph(module: Operation, needs_grads: bool = False) -> Operation:
    """The module's `graph.func` with kind = "train"."""
    for op in module.body.ops:
        if op.name == "graph.func" and func_kind(op) == "train":
            if needs_grads and not any(n.startswith(GRAD_PREFIX) for n in return_names(op.body.last_op)):
                raise SxError(f"@{func_name(op)} has no gradient outputs: run 'autodiff' first", op.diagnostic_loc)
            return op
    raise SxError("the module has no graph.func with kind = \"train\"")


def new_graph(module: Operation, after: Operation, name: str, **attributes) -> Operation:
    """An empty `graph.func @name` with these attributes, placed right after `after`."""
    func = Operation.create("graph.func", attributes={**attributes, "sym_name": name},
                            regions=[Region.with_block()], loc=after.loc)
    existing = [op for op in module.body.ops if op.name == "graph.func" and func_name(op) == name]
    for old in existing:
        old.erase()
    module.body.insert_after(func, after)
    return func


def clone_graph(module: Operation, train: Operation, name: str, skip: Iterable[str] = (), **attributes) -> Operation:
    """A copy of `train` named `name`, without the ops named in `skip`."""
    func = new_graph(module, train, name, **{**train.attributes, **attributes})
    values: dict[Value, Value] = {}
    skipped = set(skip)
    for op in train.body.ops:
        if op.name not in skipped:
            func.body.append(op.clone(values))
    return func


def strip_observations(func: Operation) -> None:
    for op in list(func.body.ops):
        if op.name == "graph.observe":
            op.erase()


# -- accumulate ---------------------------------------------------------------------------------


@register_pass
@define
class Accumulate(Pass):
    """Adds `@train_accumulating`, which adds its fresh gradients into the previous ones.

    Guarantees: `@train` is unchanged; each `grad/<path>` output of the clone is
    its `grad/<path>` input plus what `@train` returns for it; other outputs match `@train`'s.
    A module whose `exp.run` has one microbatch gets no clone: no step would run it.
    """

    name = "accumulate"
    summary = "clone @train into @train_accumulating, adding previous gradients (inputs grad/<path>)"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        train = train_graph(module, needs_grads=True)
        run = next((op for op in module.body.ops if op.name == "exp.run"), None)
        if run is None or run.attributes.get("microbatches", 2) != 1:
            build_accumulating(module, train)


def build_accumulating(module: Operation, train: Operation) -> Operation:
    func = clone_graph(module, train, "train_accumulating", kind="train_accumulating")
    add_previous_gradients(func)
    return func


def add_previous_gradients(func: Operation) -> None:
    """Give `func` a `grad/<path>` input per gradient output and return that input plus the fresh gradient."""
    ret = func.body.last_op
    inputs = [op for op in func.body.ops if op.name == "graph.input"]
    builder = Builder(func.body, anchor=inputs[-1].next_op if inputs else func.body.first_op)
    for index, name in enumerate(return_names(ret)):
        if not name.startswith(GRAD_PREFIX):
            continue
        fresh = ret.operands[index]
        previous = builder.create("graph.input", [], {"name": name, "role": "grad"}, result_types=[fresh.type],
                                  loc=fresh.op.loc if fresh.op else ret.loc).result
        total = Builder(func.body, anchor=ret, loc=ret.loc).value("graph.add", previous, fresh)
        ret.set_operand(index, total)


# -- stack --------------------------------------------------------------------------------------


@register_pass
@define
class Stack(Pass):
    """Adds `@train_stacked`: k microbatches in one graph (batch fields get a leading k).

    Guarantees: `@train` is unchanged; `grad/<path>` is the sum of the k
    microbatch gradients, the loss and metrics their mean, counters their sum.
    """

    name = "stack"
    summary = "clone @train into @train_stacked running k microbatches (summed grads, mean loss and metrics)"
    k: int = 4

    def run(self, unit: CompilationUnit) -> None:
        if self.k < 1:
            raise SxError(f"stack needs k ≥ 1, got {self.k}")
        module = unit.require_module(self.name)
        build_stacked(module, train_graph(module, needs_grads=True), self.k)


def build_stacked(module: Operation, train: Operation, k: int, accumulating: bool = False,
                  suffix: str = "", **attributes: Any) -> Operation:
    """`@train_stacked` for k microbatches; with `accumulating`, `@train_stacked_accumulating` (kind
    `train_stacked`, `accumulating = true`), which adds the k gradients into `grad/<path>` inputs as
    `@train_accumulating` does: what a device runs for the second and later k microbatches of a step.
    `suffix` follows the name; `attributes` are added to the graph's."""
    name = ("train_stacked_accumulating" if accumulating else "train_stacked") + suffix
    extra = {"accumulating": True} if accumulating else {}
    func = new_graph(module, train, name, **{**train.attributes, "kind": "train_stacked", "k": k, **extra,
                                             **attributes})
    builder = Builder(func.body)
    shared: dict[Value, Value] = {}
    stacked: dict[Value, Value] = {}
    for op in train.body.ops:
        if op.name != "graph.input":
            continue
        t = op.result.type
        if input_role(op) == "batch":
            stacked[op.result] = builder.create(op.name, [], dict(op.attributes),
                                                result_types=[t.with_shape((k,) + t.shape)], loc=op.loc).result
        else:
            builder.insert(op.clone(shared))
    ret = train.body.last_op
    outputs: list[list[Value]] = [[] for _ in ret.operands]
    emitted: dict[tuple[str, str], list[Value]] = {}
    for i in range(k):
        values = dict(shared)
        for field, whole in stacked.items():
            builder.loc = field.op.loc
            one = builder.value("graph.slice", whole, axis=0, start=i, end=i + 1)
            values[field] = builder.value("graph.squeeze", one, axis=0)
        for op in train.body.ops:
            if has_trait(op, Trait.EMIT):
                emitted.setdefault((op.name, emit_name(op)), []).append(values[op.operands[0]])
            elif op.name not in ("graph.input", "graph.return"):
                builder.insert(op.clone(values))
        for index, value in enumerate(ret.operands):
            outputs[index].append(values[value])
    builder.loc = ret.loc
    results = [_combine(builder, copies, averaged=not name.startswith(GRAD_PREFIX))
               for name, copies in zip(return_names(ret), outputs)]
    for (kind, name), copies in emitted.items():
        if kind != "graph.observe":
            builder.create(kind, [_combine(builder, copies, averaged=kind == "graph.metric")], {"name": name})
    builder.create("graph.return", results, dict(ret.attributes), loc=ret.loc)
    if accumulating:
        add_previous_gradients(func)
    return func


@register_pass
@define
class StackVariants(Pass):
    """Adds the stacked train graphs of every stacking degree a device may choose, for the training driver.

    Guarantees: `@train` is unchanged; for each divisor k > 1 of the run's
    microbatches there is `@"train_stacked/<k>"` (as `stack{k}` builds it) and,
    when k is less than the microbatches, `@"train_stacked_accumulating/<k>"`,
    both `derived`; a run of one microbatch gets none.
    """

    name = "stack-variants"
    summary = "add @train_stacked/<k> (and its accumulating twin) for each divisor k > 1 of the microbatches"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        erase_derived(module, "train_stacked")
        microbatches = run_microbatches(module)
        if microbatches < 2:
            return
        train = train_graph(module, needs_grads=True)
        # Each graph is placed right after @train: the largest degree ends up first.
        for k in (k for k in range(2, microbatches + 1) if microbatches % k == 0):
            if k < microbatches:
                build_stacked(module, train, k, accumulating=True, suffix=f"/{k}", derived=True)
            build_stacked(module, train, k, suffix=f"/{k}", derived=True)


def stack_variants(module: Operation) -> dict[int, list[Operation]]:
    """The graphs `stack-variants` added, by degree: `@train_stacked/<k>`, then its accumulating twin if any."""
    variants: dict[int, list[Operation]] = {}
    for func in graph_funcs(module):
        if is_derived(func) and func_kind(func) == "train_stacked":
            variants.setdefault(int(func.attributes["k"]), []).append(func)
    return {k: sorted(funcs, key=lambda f: f.attributes.get("accumulating") is True) for k, funcs in variants.items()}


def _combine(builder: Builder, copies: list[Value], averaged: bool) -> Value:
    """The sum of the per-microbatch copies, or their mean when `averaged` and float."""
    merged = None if averaged else _merged_scatter(builder, copies)
    if merged is not None:
        return merged
    total = copies[0]
    for value in copies[1:]:
        total = builder.value("graph.add", total, value)
    if averaged and len(copies) > 1 and total.type.dtype in FLOAT_DTYPES:
        scale = builder.create("graph.const", [], {"value": 1.0 / len(copies)}, result_types=[total.type]).result
        total = builder.value("graph.mul", total, scale)
    return total


def _merged_scatter(builder: Builder, copies: list[Value]) -> Value | None:
    """One `scatter_add` over the positions of every copy, standing for their sum, when each copy is a
    `scatter_add` alike (an embedding's gradient) that nothing else reads; None otherwise.

    The k scatters would each write a whole table (zeros where no position
    lands) and k - 1 additions read them back; the merged one scatters the
    positions concatenated in microbatch order (llm.c's encoder backward over
    the step's tokens), adding only into the rows they name. Each row is then
    one sum in position order, where the k scatters added k partial sums:
    equal up to f32 rounding.
    """
    ops = [value.op for value in copies]
    first = ops[0]
    if len(copies) < 2 or first is None or first.name != "graph.scatter_add":
        return None
    signature = (dict(first.attributes), [v.type for v in first.operands], first.result.type)
    for value, op in zip(copies, ops):
        if (op is None or op.name != first.name or value.has_uses
                or (dict(op.attributes), [v.type for v in op.operands], op.result.type) != signature):
            return None
    builder.loc = first.loc
    path = {"path": first.attributes["path"]} if "path" in first.attributes else {}
    indices = builder.value("graph.concat", *(op.operands[0] for op in ops), axis=0, **path)
    updates = builder.value("graph.concat", *(op.operands[1] for op in ops), axis=op_axis(first), **path)
    merged = builder.create(first.name, [indices, updates], dict(first.attributes), result_types=[first.result.type])
    for op in ops:
        op.erase()
    return merged.result


# -- diagnose -----------------------------------------------------------------------------------


@register_pass
@define
class Diagnose(Pass):
    """Strips observations from @train; adds `@train_diagnosed` with the enabled diagnostics' reductions.

    Guarantees: afterwards no graph has a raw `graph.observe` of the tracer;
    `@train_diagnosed` (present when a diagnostic is enabled) emits one f32
    scalar per enabled diagnostic and selected tensor.
    """

    name = "diagnose"
    summary = "strip observations from @train; add @train_diagnosed emitting each diagnostic's scalar reductions"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        diagnostics = [op for op in module.body.ops if op.name == "exp.diagnostic" and op.attributes.get("enabled", True)]
        needs_grads = any(d.attributes["of"]["kind"] == "grads" for d in diagnostics)
        train = train_graph(module, needs_grads=needs_grads)
        if diagnostics:
            build_diagnosed(module, train, diagnostics)
        strip_observations(train)


def build_diagnosed(module: Operation, train: Operation, diagnostics: list[Operation]) -> Operation:
    func = clone_graph(module, train, "train_diagnosed", kind="train_diagnosed")
    microbatches = run_microbatches(module)
    # A gradient diagnostic reduces the step's gradient, not one microbatch's: the graph then runs as the
    # step's last microbatch, adding into the gradients so far, and reduces their mean.
    accumulates = microbatches > 1 and any(d.attributes["of"]["kind"] == "grads" for d in diagnostics)
    if accumulates:
        add_previous_gradients(func)
    tensors = _diagnosable(func)
    strip_observations(func)
    builder = Builder(func.body, anchor=func.body.last_op)
    for diagnostic in diagnostics:
        name, of, reducer = (diagnostic.attributes[a] for a in ("name", "of", "reducer"))
        if reducer not in REDUCERS:
            raise SxError(f"diagnostic {name}: unknown reducer '{reducer}' (one of {', '.join(REDUCERS)})",
                          diagnostic.loc)
        if of["kind"] not in tensors:
            raise SxError(f"diagnostic {name}: cannot observe '{of['kind']}' (observed, grads or params)",
                          diagnostic.loc)
        builder.loc = diagnostic.loc
        for path, value in tensors[of["kind"]].items():
            if fnmatch.fnmatchcase(path, of["glob"]):
                if accumulates and of["kind"] == "grads":
                    mean = builder.create("graph.const", [], {"value": 1.0 / microbatches}, result_types=[value.type])
                    value = builder.value("graph.mul", value, mean.result)
                builder.create("graph.observe", [reduce_to_scalar(builder, value, reducer)],
                               {"name": f"{name}:{path}"})
    return func


def run_microbatches(module: Operation) -> int:
    """The microbatches a step of the module's `exp.run` takes (1 without one)."""
    runs = [op for op in module.body.ops if op.name == "exp.run"]
    return int(runs[0].attributes.get("microbatches", 1)) if runs else 1


def _diagnosable(func: Operation) -> dict[str, dict[str, Value]]:
    """The tensors a diagnostic may select, by kind and path."""
    ret = func.body.last_op
    found: dict[str, dict[str, Value]] = {"observed": {}, "grads": {}, "params": {}}
    for op in func.body.ops:
        if op.name == "graph.observe":
            found["observed"][emit_name(op)] = op.operands[0]
        elif is_input(op, "param"):
            found["params"][input_name(op)] = op.result
    for name, value in zip(return_names(ret), ret.operands):
        if name.startswith(GRAD_PREFIX):
            found["grads"][name[len(GRAD_PREFIX):]] = value
    return found


def reduce_to_scalar(builder: Builder, value: Value, reducer: str) -> Value:
    """One f32 scalar summarizing `value` by `reducer` (mean, rms, max, min or norm)."""
    if value.type.dtype != "f32":
        value = builder.value("graph.cast", value, dtype="f32")
    axes = list(range(value.type.rank))
    if reducer in ("max", "min"):
        return builder.value(f"graph.{reducer}", value, axes=axes, keep=False)
    if reducer in ("rms", "norm"):
        value = builder.value("graph.mul", value, value)
    total = builder.value("graph.sum", value, axes=axes, keep=False)
    if reducer in ("mean", "rms"):
        count = builder.create("graph.const", [], {"value": float(max(value.type.numel, 1))},
                               result_types=[TensorType((), "f32")]).result
        total = builder.value("graph.div", total, count)
    return builder.value("graph.sqrt", total) if reducer in ("rms", "norm") else total


