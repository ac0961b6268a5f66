"""`match-patterns`: row programs and the cross-entropy tail recognised from their math, as kernel launches.

The first pass of the CUDA lowering (`fuse`, `plan-buffers` and `emit-cuda`
follow). In every `graph.func` it finds the regions whose math is one of the
pattern families — softmax, log-softmax, layernorm, rmsnorm along the last
axis and their backwards, and the cross-entropy tail (logits and integer
targets to the loss, forward and backward) — however the math was written,
and replaces each by a `kern.launch` of a module-level `kern.kernel` symbol
(`kind = "row"` with its `family`, or `kind = "cross_entropy"` with its
`direction`; identical kernels are one symbol). How: a region is grown
structurally from each reduction along one axis (`patterns/regions.py`),
then its math is confirmed by evaluating it in float64 on random rows and
comparing with each family's formula under every binding of its values by
role (`patterns/families.py`); the form it was written in is read off the
match (`patterns/forms.py`). docs/cuda.md, section "Pattern families", has
the families, the forms and how to read a `fell back`.

Guarantees: a replaced region's values that anything else reads are the
kernel's outputs (reshaped to the graph's shapes; a backward's `dx` added to
the gradient it was accumulated into; a loss multiplied by what the
template's sum or mean leaves over); float casts at a region's boundary are
absorbed into the kernel's operand and result dtypes; everything else is
left as it was. A region matched but not taken — rows along another axis, a
dtype the templates do not store, an observation of a value inside it, an
intermediate value read elsewhere — is left to `fuse` and recorded with its
reason.

A taken forward whose backward is not recognised gets a `fell back` line for the backward.

Facts: `unit.facts.lowering.patterns[graph][family]` = `{"group",
"direction", "kernels", "fired", "paths", "as", "fell_back"}` (see
`pattern_facts`). Option `remarks` prints one line per region on standard
error: the kernel it became, or `fell back` and why.
"""

from __future__ import annotations

import sys
from typing import Any

from attrs import define

from ..dialects.core import Block, Builder, Operation, SymbolRef, TensorType, Value
from ..dialects.graph import graph_funcs
from ..dialects.kern import kernel_attributes
from ..dialects.printer import print_attr_dict
from ..dialects.rewriting import GreedyRewriteDriver, PatternRewriter, RewritePattern
from .manager import CompilationUnit, Pass, parse_pipeline, register_pass
from .patterns import attention as attention_family
from .patterns.attention import AttentionPlan, find_attention, plan_attention
from .patterns.domain import is_float_cast
from .patterns.families import BACKWARD_OF, Match
from .patterns.forms import kernel_form
from .patterns.memo import MatchCache
from .patterns.plans import DATA_OUTPUTS, Plan, find_matches, loss_factor, plan_matches, recomputable, storage
from .targets import KernelTarget, PatternKernel, PatternLaunches, kernel_target

#: Kernel operand names by how they are laid out: rows [rows, cols], columns [cols], per-row values [rows].
ROW_OPERANDS = frozenset({"x", "y", "dy", "dx", "logits", "dlogits"})
COLUMN_OPERANDS = frozenset({"weight", "bias", "dweight", "dbias"})
PER_ROW_OPERANDS = frozenset({"mean", "rstd", "lse", "losses", "targets"})
#: Report groups of the families.
GROUPS = {"row": "row programs", "cross_entropy": "cross-entropy tail", "attention": "attention"}


@register_pass
@define
class MatchPatterns(Pass):
    """Replaces softmax, log-softmax, layernorm, rmsnorm (and backwards) and the cross-entropy tail by pattern
    kernel launches, recognised from their math; records what fired and what fell back (module docstring)."""

    name = "match-patterns"
    summary = "replace row programs and the cross-entropy tail, recognised from their math, by kernel launches"
    remarks: bool = False
    #: The kernel target whose templates the kernels are (`passes/targets.py`).
    target: str = "cuda"
    #: Whether attention regions become the target's attention kernels (false leaves them to the softmax row
    #: program and `fuse`, for a backend that renders the target's row programs but no attention kernel).
    attention: bool = True

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        target = kernel_target(self.target)
        kernels = KernelTable(module)
        lowering = unit.facts.lowering_facts()
        facts = lowering.patterns = lowering.patterns if lowering.patterns is not None else {}
        cache = MatchCache()
        for func in graph_funcs(module):
            block = func.regions[0].blocks[0]
            matches = find_matches(block, cache)
            order = {op: i for i, op in enumerate(block.ops)}
            # A target without attention kernels leaves attention to its softmax row program and `fuse`.
            attention = find_attention(matches, order, cache.attention) if self.attention and target.attention_head_dims else []
            inner = {a.inner for a in attention}
            others = {op for m in matches if m not in inner for op in m.slice}
            attention_plans = plan_attention(block, attention, others, target)
            # A taken attention stands for its softmax and softmax backward: they are not row programs there.
            subsumed = {plan.match.inner for plan in attention_plans if plan.taken}
            plans = plan_matches(block, [m for m in matches if m not in subsumed], target)
            name = func.attributes["sym_name"]
            if str(func.attributes.get("kind", "")).startswith("train"):
                _name_unmatched_backwards(plans)
            if not plans and not attention_plans:
                facts[name] = {}
                continue
            replace = ReplaceRegions(block, plans, kernels, target, attention_plans)
            GreedyRewriteDriver([replace]).rewrite_block(block)
            facts[name] = pattern_facts(plans, replace.symbols)
            attention_facts(facts[name], attention_plans, replace.symbols)
            if self.remarks:
                lines = [(plan.match.slice[0], remark(name, plan, replace.symbols.get(plan))) for plan in plans]
                lines += [(plan.match.slice[0], attention_remark(name, plan, replace.symbols.get(plan, [])))
                          for plan in attention_plans]
                for _, line in sorted(lines, key=lambda item: order.get(item[0], -1)):
                    print(line, file=sys.stderr)


def remark(graph: str, plan: Plan, symbols: list[str] | None) -> str:
    where = f"{plan.loc}: " if plan.loc is not None else ""
    what = f"{_display(plan.family)} at {plan.path or '(no path)'} in @{graph}"
    declined = "".join(f"\n{where}remark: {_display(_forward_key(family))} at {plan.path or '(no path)'} in @{graph}: "
                       f"fell back: {reason}" for family, reason in plan.match.declined)
    if plan.taken:
        forms = "".join(f"; as {form}" for form in plan.match.forms)
        kernels = ", ".join(f"@{symbol}" for symbol in symbols or [])
        return f"{where}remark: {what}: kernel {kernels}{forms}{declined}"
    return f"{where}remark: {what}: fell back: {plan.reason}{declined}"


def _name_unmatched_backwards(plans: list[Plan]) -> None:
    """A taken forward whose backward was not recognised gets a `fell back` line for the backward (silence would
    hide that `fuse` computes it): label smoothing written as two terms, an added z-loss."""
    for plan in plans:
        match = plan.match
        backward = BACKWARD_OF.get(match.family)
        if not plan.taken or not match.backward_unmatched or backward is None:
            continue
        family = "cross_entropy_backward" if match.family == "cross_entropy" else backward[0]
        name = "cross-entropy" if match.family == "cross_entropy" else _display(match.family)
        reason = (f"its backward is not recognised as the {name} backward (another term in the gradient, such as "
                  "label smoothing); fuse computes it")
        if (family, reason) not in match.declined:
            match.declined = (*match.declined, (family, reason))


def attention_remark(graph: str, plan: AttentionPlan, symbols: list[str]) -> str:
    """A remark line of an attention region: its kernels and forms, or `fell back` and why."""
    where = f"{plan.loc}: " if plan.loc is not None else ""
    what = f"attention {plan.match.direction} at {plan.path or '(no path)'} in @{graph}"
    if plan.taken:
        forms = f"; as {', '.join(plan.match.forms)}" if plan.match.direction == "forward" else ""
        return f"{where}remark: {what}: kernel {', '.join(f'@{s}' for s in symbols)}{forms}"
    return f"{where}remark: {what}: fell back: {plan.reason}"


def attention_facts(facts: dict[str, dict[str, Any]], plans: list[AttentionPlan],
                    symbols: dict[AttentionPlan, list[str]]) -> None:
    """The attention regions' facts, as `pattern_facts` records a family's (forms on the forward)."""
    for plan in plans:
        match = plan.match
        entry = facts.setdefault(match.family, {"group": GROUPS["attention"], "direction": match.direction,
                                                "kernels": [], "fired": 0, "paths": [], "as": [], "fell_back": []})
        if plan.taken:
            entry["kernels"].extend(s for s in symbols.get(plan, []) if s not in entry["kernels"])
            entry["fired"] += 1
            entry["paths"].append(plan.path)
            form = ", ".join(match.forms)
            if match.direction == "forward" and form not in entry["as"]:
                entry["as"].append(form)
        else:
            loc = plan.loc.short() if plan.loc is not None else None
            entry["fell_back"].append({"path": plan.path, "reason": plan.reason, "loc": loc})


def _forward_key(family: str) -> str:
    """A forward family's name in the facts (the cross-entropy tail's carries its direction)."""
    return "cross_entropy_forward" if family == "cross_entropy" else family


def _display(family: str) -> str:
    return family.replace("cross_entropy_", "cross-entropy ").replace("_backward", " backward").replace("_", "-")


def pattern_facts(plans: list[Plan], symbols: dict[Plan, list[str]]) -> dict[str, dict[str, Any]]:
    """Per family: its report group, direction, kernels, how often it fired, the model paths of its regions,
    the `as` forms found, and the regions that fell back with their reasons."""
    facts: dict[str, dict[str, Any]] = {}

    def entry_of(family: str, kind: str, direction: str) -> dict[str, Any]:
        return facts.setdefault(family, {"group": GROUPS[kind], "direction": direction, "kernels": [], "fired": 0,
                                         "paths": [], "as": [], "fell_back": []})

    for plan in plans:
        loc = plan.loc.short() if plan.loc is not None else None
        for family, reason in plan.match.declined:
            kind = "cross_entropy" if family.startswith("cross_entropy") else "row"
            direction = "backward" if family.endswith("backward") else "forward"
            entry_of(_forward_key(family), kind, direction)["fell_back"].append(
                {"path": plan.path, "reason": reason, "loc": loc})
        entry = entry_of(plan.family, plan.match.kind, plan.match.direction)
        if plan.taken:
            entry["kernels"].extend(symbol for symbol in symbols[plan] if symbol not in entry["kernels"])
            entry["fired"] += 1
            entry["paths"].append(plan.path)
            entry["as"].extend(form for form in plan.match.forms if form not in entry["as"])
        else:
            entry["fell_back"].append({"path": plan.path, "reason": plan.reason, "loc": loc})
    return facts


class KernelTable:
    """The module's `kern.kernel` symbols: one per distinct kernel, named after its family, dtype and row length."""

    def __init__(self, module: Operation) -> None:
        self.module = module
        self.by_attributes: dict[str, str] = {}
        self.names: set[str] = set()
        for op in module.body.ops:
            if op.name == "kern.kernel":
                self.names.add(op.attributes["sym_name"])
                self.by_attributes.setdefault(_key(op.attributes), op.attributes["sym_name"])

    def symbol(self, stem: str, attributes: dict[str, Any], loc) -> str:
        """The symbol of the kernel with these attributes, created before the first graph when new."""
        key = _key(attributes)
        if key in self.by_attributes:
            return self.by_attributes[key]
        name, n = stem, 1
        while name in self.names:
            n += 1
            name = f"{stem}_{n}"
        anchor = next((op for op in self.module.body.ops if op.name == "graph.func"), None)
        Builder(self.module.body, anchor=anchor).create(
            "kern.kernel", [], {"sym_name": name, **attributes}, result_types=[], loc=loc)
        self.names.add(name)
        self.by_attributes[key] = name
        return name


def _variant(options: dict[str, Any]) -> str:
    """What sets a kernel apart from its family's plain one, for its symbol's name."""
    flags = [name for name in ("stats", "mean") if options.get(name)]
    flags += [f"no{name}" for name in ("weight", "bias") if options.get(name) is False]
    flags += [options["reduction"]] if options.get("reduction") else []
    flags += ["rowgrad"] if options.get("grad") == "row" else []
    return "".join(f"_{flag}" for flag in flags)


def _key(attributes: dict[str, Any]) -> str:
    """What makes two pattern kernels one: everything but the symbol, the model path and the form it was
    recognised in (descriptions of a region, not of the code)."""
    same = kernel_attributes(Operation.create("kern.kernel", attributes=attributes))
    return print_attr_dict({k: v for k, v in same.items() if k != "form"})


class ReplaceRegions(RewritePattern):
    """When the driver reaches the first op of a taken plan's slice, its kernel launch replaces the slice."""

    def __init__(self, block: Block, plans: list[Plan], kernels: KernelTable, target: KernelTarget,
                 attention: list[AttentionPlan] = ()) -> None:
        self.target = target
        self.pending: dict[Operation, Plan | AttentionPlan] = {
            plan.match.slice[0]: plan for plan in [*plans, *attention] if plan.taken}
        #: Block order, for placing launches: ops inserted before an op take places just before it.
        self.position: dict[Operation, float] = {op: float(i) for i, op in enumerate(block.ops)}
        self.kernels = kernels
        #: The kernel symbols each taken plan launches, in order.
        self.symbols: dict[Plan | AttentionPlan, list[str]] = {}
        #: Each replaced match's kernel outputs by operand name (a backward reads its forward's).
        self.outputs: dict[Match | attention_family.AttentionMatch, dict[str, Value]] = {}
        #: Where each replaced attention forward's kernel wrote O (its backward reads it there).
        self.o_placements: dict[attention_family.AttentionMatch, list[str]] = {}
        #: The values replaced so far and what replaced them (matches found before rewriting hold the old ones).
        self.replaced: dict[Value, Value] = {}
        #: The reshapes made into kernel layouts, by value and shape.
        self.reshapes: dict[tuple[Value, tuple[int, ...]], Value] = {}

    def current(self, value: Value) -> Value:
        while value in self.replaced:
            value = self.replaced[value]
        return value

    def anchor(self, match: Match, operands: list[Value]) -> Operation | None:
        """The op to insert the launch before: the slice's first op, or later when an operand is defined later;
        None when a reader of one of the launch's outputs comes before that."""
        position = self.position
        anchor: Operation | None = match.slice[0]
        for value in operands:
            if value.op is not None and value.op in position and position[value.op] >= position[anchor]:
                anchor = value.op.next_op
                if anchor is None:
                    return None
        inside = set(match.slice)
        for value in match.output_values():
            if any(user not in inside and position.get(user, -1.0) < position[anchor] for user in value.users()):
                return None
        return anchor

    def create(self, rewriter: PatternRewriter, name: str, operands: list[Value], attributes: dict[str, Any],
               types: list[TensorType], loc, anchor: Operation) -> Operation:
        """An op made through the rewriter before `anchor`, given its place in the block order."""
        op = rewriter.create(name, operands, attributes, types, loc, before=anchor)
        previous = op.prev_op
        low = self.position[previous] if previous is not None and previous in self.position else -1.0
        self.position[op] = (low + self.position[anchor]) / 2
        return op

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        plan = self.pending.pop(op, None)
        if plan is None:
            return False
        if isinstance(plan, AttentionPlan):
            _AttentionLaunch(self, plan, rewriter).build()
        else:
            _Launch(self, plan, rewriter).build()
        return True

    def launch_steps(self, rewriter: PatternRewriter, stem: str, base: dict[str, Any], launches: PatternLaunches,
                     values: dict[str, Value], types: dict[str, TensorType], path: str, loc,
                     anchor: Operation) -> list[str]:
        """One launch per step of a pattern kernel's program, each a kernel symbol of its own: a step's results
        (scratch included) are values the next step reads, so plan-buffers places them like any other. Returns
        the symbols; `values` gains the results by operand name."""
        symbols = []
        for index, step in enumerate(launches.steps):
            reads, writes = list(step.reads), list(step.writes)
            attributes = {**base, "step": index, "operands": [*reads, *writes],
                          "inputs": [types[n] for n in reads], "outputs": [types[n] for n in writes],
                          "grid": list(step.grid), "block": list(step.block), "shared": step.shared}
            suffix = f"_{step.name}" if step.name else ""
            symbol = self.kernels.symbol(stem + suffix, attributes, loc)
            symbols.append(symbol)
            launch = self.create(rewriter, "kern.launch", [values[n] for n in reads],
                                 {"kernel": SymbolRef(symbol), "path": path}, [types[n] for n in writes], loc, anchor)
            values.update(zip(writes, launch.results))
        return symbols


@define(eq=False)
class _Launch:
    """Builds one plan's launch: operands reshaped to the kernel's layout, results back to the graph's."""

    owner: ReplaceRegions
    plan: Plan
    rewriter: PatternRewriter

    def build(self) -> None:
        plan, match = self.plan, self.plan.match
        forward = match.forward
        if forward is not None and forward not in self.owner.outputs:
            # Its forward was not replaced after all (no launch position): it reads the forward's values.
            missing = [role for role in match.stats if not forward.outputs.get(role)]
            if missing:
                plan.reason = f"its forward fell back, and no value holds the {' and '.join(missing)} its kernel reads"
                return
        kernel = plan.kernel()
        target = self.owner.target
        input_names, output_names = target.pattern_operands(kernel)
        sources = {name: self.owner.current(self.source(name)) for name in input_names}
        accumulate = self.owner.current(match.accumulate) if match.accumulate is not None else None
        anchor = self.owner.anchor(match, [*sources.values(), *([accumulate] if accumulate is not None else [])])
        if anchor is None:
            plan.reason = "its operands are defined after a use of its results"
            return
        rows, cols = match.region.domain.rows, match.region.domain.cols
        outputs = {name: self.output_dtype(name) for name in output_names}
        dtypes = {name: value.type.dtype for name, value in sources.items()} | {n: d for n, (d, _) in outputs.items()}
        types = {name: self.layout(name, sources[name].type.dtype) for name in input_names}
        types |= {name: self.layout(name, outputs[name][0]) for name in output_names}
        launches = target.pattern_launches(kernel, dtypes, {"rows": rows})
        # Scratch (a backward's partial column sums, a loss's partial sums) is f32 the program's steps pass on.
        types |= {name: TensorType((nbytes // 4,), "f32") for name, nbytes in launches.scratch.items()}
        base = {"kind": kernel.kind, **kernel.attributes(), "rows": rows, "form": kernel_form(match),
                "dtypes": dtypes, "path": plan.path}
        data = "_".join(dict.fromkeys(dtypes[n] for n in (*input_names, *output_names) if n in ROW_OPERANDS))
        stem = f"{plan.family}_{data}_{cols}{_variant(kernel.options)}"
        values = {name: self.reshaped(sources[name], types[name], anchor) for name in input_names}
        self.owner.symbols[plan] = self.owner.launch_steps(self.rewriter, stem, base, launches, values, types,
                                                           plan.path, match.slice[0].loc, anchor)
        copies = self.recompute(plan.recomputed, anchor)
        for value in plan.recomputed:
            self.rewriter.replace_all_uses_with(value, copies[value])
        results = {name: values[name] for name in output_names}
        self.owner.outputs[match] = results
        for name, result in results.items():
            for value in outputs[name][1]:
                new = self.replacement(name, result, value, anchor, accumulate)
                self.rewriter.replace_all_uses_with(value, new)
                self.owner.replaced[value] = new

    @property
    def stamp(self) -> dict[str, str]:
        """The model path the ops made for the launch carry (none for a region outside the model)."""
        return {"path": self.plan.path} if self.plan.path else {}

    def recompute(self, values: list[Value], anchor: Operation) -> dict[Value, Value]:
        """Copies of the ops computing `values` from the kernel's inputs (each op once, before any value is
        replaced), for the readers outside the region: each value's copy, by value."""
        needed: set[Operation] = set()
        for value in values:
            ops = recomputable(self.plan.match, value, self.owner.current)
            assert ops is not None
            needed.update(ops)
        copies: dict[Value, Value] = {}
        for op in self.plan.match.slice:
            if op in needed:
                operands = [copies.get(v, self.owner.current(v)) for v in op.operands]
                copy = self.owner.create(self.rewriter, op.name, operands, dict(op.attributes),
                                         [r.type for r in op.results], op.loc, anchor)
                copies[op.result] = copy.result
        return copies

    def source(self, name: str) -> Value:
        """The graph value a kernel input reads: the match's own, its forward's, or the forward's kernel output."""
        match = self.plan.match
        forward = match.forward
        own = {"logits": "x"}.get(name, name) if match.family == "cross_entropy" else name
        if own in match.inputs:
            return storage(match.inputs[own], self.owner.target)
        if forward is not None and name in match.stats:
            replaced = self.owner.outputs.get(forward)
            return replaced[name] if replaced is not None else forward.outputs[name][0]
        if forward is not None and own in forward.inputs:
            return storage(forward.inputs[own], self.owner.target)
        if name == "dloss":
            const = self.owner.create(self.rewriter, "graph.const", [], {"value": 1.0}, [TensorType((), "f32")],
                                      match.slice[0].loc, match.slice[0])
            return const.result
        raise AssertionError(f"no value for the {name} of a {self.plan.family} kernel")

    def output_dtype(self, name: str) -> tuple[str, list[Value]]:
        """The dtype the kernel writes an output in, and the graph values that output replaces.

        A data output every outside reader of which casts to one other float dtype (directly, or through a
        reshape only casts read) is written in that dtype (the casts' results are replaced); statistics
        nothing reads are f32.
        """
        values = self.plan.match.outputs.get(name, [])
        if not values:
            return "f32", []
        inside = set(self.plan.match.slice)
        if name in DATA_OUTPUTS and self.plan.match.accumulate is None:
            readers = [u for v in values for u in v.users() if u not in inside]
            casts = [c for u in readers for c in _casts_reading(u)]
            dtypes = {c.attributes["dtype"] for c in casts}
            if readers and len(dtypes) == 1 and all(_casts_reading(u) for u in readers):
                (dtype,) = dtypes
                if dtype in self.owner.target.float_storage and dtype != values[0].type.dtype:
                    return dtype, [c.result for c in casts]
        return values[0].type.dtype, values

    def layout(self, name: str, dtype: str) -> TensorType:
        domain = self.plan.match.region.domain
        if name in ROW_OPERANDS:
            return TensorType((domain.rows, domain.cols), dtype)
        if name in COLUMN_OPERANDS:
            return TensorType((domain.cols,), dtype)
        if name in PER_ROW_OPERANDS or (name == "dloss" and self.plan.options.get("grad") == "row"):
            return TensorType((domain.rows,), dtype)
        return TensorType((), dtype)

    def reshaped(self, value: Value, target: TensorType, anchor: Operation) -> Value:
        """`value` in the kernel's layout: a reshape (one per value and shape, shared by a forward and its
        backward)."""
        if value.type.shape == target.shape:
            return value
        key = (value, target.shape)
        if key not in self.owner.reshapes:
            op = self.owner.create(self.rewriter, "graph.reshape", [value], {**self.stamp, "shape": list(target.shape)},
                                   [value.type.with_shape(target.shape)], anchor.loc, anchor)
            self.owner.reshapes[key] = op.result
        return self.owner.reshapes[key]

    def replacement(self, name: str, result: Value, value: Value, anchor: Operation, accumulate: Value | None) -> Value:
        """The kernel's output in `value`'s shape, added to the accumulated gradient or scaled as the loss was."""
        new = self.reshaped(result, value.type, anchor)
        match = self.plan.match
        if name == "dx" and accumulate is not None:
            add = self.owner.create(self.rewriter, "graph.add", [accumulate, new], dict(self.stamp), [value.type],
                                    anchor.loc, anchor)
            new = add.result
        if name == "loss" and loss_factor(match) != 1.0:
            factor = self.owner.create(self.rewriter, "graph.const", [], {**self.stamp, "value": loss_factor(match)},
                                       [value.type], anchor.loc, anchor)
            mul = self.owner.create(self.rewriter, "graph.mul", [new, factor.result], dict(self.stamp), [value.type],
                                    anchor.loc, anchor)
            new = mul.result
        return new


@define(eq=False)
class _AttentionLaunch:
    """Builds one attention plan's launches: Q, K, V (and dO) read where the graph holds them, O and the
    gradients written in merged heads when the graph merges them (the output projection reads O so, the packed
    projection's gradient dQ, dK and dV), else in heads; the graph's values replaced by views of the results."""

    owner: ReplaceRegions
    plan: AttentionPlan
    rewriter: PatternRewriter

    def build(self) -> None:
        plan, match = self.plan, self.plan.match
        forward = match.forward or match
        owner = self.owner
        if match.forward is not None and match.forward not in owner.outputs:
            plan.reason = "its forward's kernel had no place to launch"
            return
        roles = {**forward.operands, **match.operands}
        sources = {role: owner.current(operand.root) for role, operand in roles.items()}
        anchor = owner.anchor(match, list(sources.values()))
        if anchor is None:
            plan.reason = "its operands are defined after a use of its results"
            return
        dtype = sources["q"].type.dtype
        placements = {role: attention_family.placement(operand.view, match.batch) for role, operand in roles.items()}
        merged = attention_family.merged_reader(forward) if match.direction == "forward" else None
        placements["o"] = owner.o_placements.get(forward) or attention_family.contiguous(match, merged=merged is not None)
        seq, head_dim, batch = match.seq, match.head_dim, match.batch
        heads_type = TensorType((*batch, seq, head_dim), dtype)
        o_type = TensorType(merged.result.type.shape, dtype) if merged is not None else heads_type
        if match.direction == "backward":
            o_type = owner.outputs[forward]["o"].type
        stat_type = TensorType((*batch, seq), "f32")
        types = {role: value.type for role, value in sources.items()}
        types |= {"o": o_type, "lse": stat_type, "delta": stat_type}
        values = dict(sources)
        merged_grads: dict[str, Operation] = {}
        if match.direction == "backward":
            for role in ("dq", "dk", "dv"):
                reader = attention_family.merged_user(*match.outputs[role], match)
                if reader is not None:
                    merged_grads[role] = reader
                placements[role] = attention_family.contiguous(match, merged=reader is not None)
                types[role] = TensorType(reader.result.type.shape, dtype) if reader is not None else heads_type
            values |= {name: owner.outputs[forward][name] for name in ("o", "lse")}
        kernel = PatternKernel("attention", match.direction, head_dim,
                               {"causal": match.causal, "scale": float(match.scale), "placements": placements})
        target = owner.target
        inputs, outputs = target.pattern_operands(kernel)
        dtypes = {name: types[name].dtype for name in (*inputs, *outputs)}
        counts = attention_family.sizes(match)
        launches = target.pattern_launches(kernel, dtypes, counts)
        base = {"kind": "attention", **kernel.attributes(), "sizes": counts, "form": ", ".join(forward.forms),
                "dtypes": dtypes, "path": plan.path}
        stem = f"attention_{match.direction}_{dtype}_d{head_dim}"
        loc = match.slice[0].loc
        owner.symbols[plan] = owner.launch_steps(self.rewriter, stem, base, launches, values, types, plan.path, loc,
                                                 anchor)
        owner.outputs[match] = {name: values[name] for name in outputs}
        if match.direction == "forward":
            owner.o_placements[match] = placements["o"]
            result = self.scaled(values["o"], attention_family.output_factor(match, "o"), anchor)
            self.replace_output(result, match.outputs["o"][0], merged, anchor)
            return
        for role in ("dq", "dk", "dv"):
            graph_value, transposed = match.outputs[role]
            result = self.scaled(values[role], attention_family.output_factor(match, role), anchor)
            if role in merged_grads:
                self.replace_output(result, graph_value, merged_grads[role], anchor)
                continue
            if transposed:
                result = self.op("graph.transpose", [result], {"perm": _swap_last(result.type.rank)},
                                 graph_value.type.with_dtype(dtype), anchor)
            self.replace(graph_value, self.cast(result, graph_value.type.dtype, anchor))

    def replace_output(self, result: Value, value: Value, merged: Operation | None, anchor: Operation) -> None:
        """The graph's `value` (O or a gradient) replaced by the kernel's output, which is in merged heads when
        `merged`, the transpose of `value` into them, is given (then it replaces that transpose)."""
        if merged is None:
            self.replace(value, self.cast(result, value.type.dtype, anchor))
            return
        self.replace(merged.result, self.cast(result, merged.result.type.dtype, anchor))
        if any(user is not merged for user in value.users()):
            perm = list(merged.attributes["perm"])
            back = [perm.index(axis) for axis in range(len(perm))]
            unmerged = self.op("graph.transpose", [result], {"perm": back}, value.type.with_dtype(result.type.dtype),
                               anchor)
            self.replace(value, self.cast(unmerged, value.type.dtype, anchor))

    def op(self, name: str, operands: list[Value], attributes: dict[str, Any], result: TensorType,
           anchor: Operation) -> Value:
        stamp = {"path": self.plan.path} if self.plan.path else {}
        return self.owner.create(self.rewriter, name, operands, {**stamp, **attributes}, [result], anchor.loc,
                                 anchor).result

    def scaled(self, value: Value, factor: float, anchor: Operation) -> Value:
        """`value` times `factor` (a splat constant on the way back to the graph's scaling; none for 1)."""
        if factor == 1.0:
            return value
        const = self.op("graph.const", [], {"value": factor}, value.type, anchor)
        return self.op("graph.mul", [value, const], {}, value.type, anchor)

    def cast(self, value: Value, dtype: str, anchor: Operation) -> Value:
        if value.type.dtype == dtype:
            return value
        return self.op("graph.cast", [value], {"dtype": dtype}, value.type.with_dtype(dtype), anchor)

    def replace(self, old: Value, new: Value) -> None:
        self.rewriter.replace_all_uses_with(old, new)
        self.owner.replaced[old] = new


def _swap_last(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


def _casts_reading(reader: Operation) -> list[Operation]:
    """The float casts `reader` is, or reads through as a reshape only they read; empty when it is neither."""
    if is_float_cast(reader):
        return [reader]
    if reader.name == "graph.reshape":
        users = list(reader.result.users())
        if users and all(is_float_cast(u) for u in users):
            return users
    return []


def fuses_attention(pipeline: str) -> bool:
    """Whether a lowering `pipeline` makes attention regions its target's fused attention kernels: its
    `match-patterns` asks for them (option `attention`) and its target has some (`attention_head_dims`)."""
    return any(isinstance(step, MatchPatterns) and step.attention and bool(kernel_target(step.target).attention_head_dims)
               for step in parse_pipeline(pipeline))
