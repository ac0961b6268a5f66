"""The explain document: one dict describing what the compiler made of a file.

`build_document` reads the experiment module (the `exp` ops and the
`graph.func` ops) and the facts passes left on the unit, and returns one dict
with stable keys (`sexpgpu/schemas/explain.schema.json`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..diagnostics import display_path
from ..dialects.core import Operation, TensorType
from ..dialects.exp import GRAPH_ORDER, graph_title
from ..dialects.printer import attribute_json
from ..dialects.traits import FAMILIES
from ..passes.flat_updates import FLAT_MEMBER_ALIGNMENT, flat_update_graph, param_type
from ..passes.lowering_report import stacking_degrees
from ..passes.patterns.attention import find_attention
from ..passes.patterns.memo import MatchCache
from ..passes.patterns.plans import find_matches
from ..passes.plan_buffers import member_offsets
from ..version import __version__

if TYPE_CHECKING:
    from ..passes.manager import UnitFacts

#: Rows of largest tensors kept per graph, in the document and the text (an update group's row shows one).
LARGEST_KEPT = 10


def _exp_ops(module: Operation, name: str) -> list[Operation]:
    return [op for op in module.body.ops if op.name == name]


def _one(module: Operation, name: str) -> Operation:
    ops = _exp_ops(module, name)
    if len(ops) != 1:
        raise ValueError(f"the experiment module has {len(ops)} '{name}' ops, expected one")
    return ops[0]



def _selection(module: Operation) -> dict[str, Any]:
    attrs = _one(module, "exp.selection").attributes
    knobs = [{"name": name, "value": attribute_json(value), "source": source} for name, (value, source) in attrs["knobs"].items()]
    return {"variant": attrs["variant"], "knobs": knobs}


def _parameters(params: list[Operation]) -> dict[str, Any]:
    modules: dict[str, dict[str, Any]] = {}
    total = 0
    for op in params:
        attrs = op.attributes
        path: str = attrs["path"]
        ptype: TensorType = attrs["type"]
        root, _, rest = path.partition(".")
        module = modules.setdefault(root, {"name": root, "elements": 0, "leaves": []})
        module["elements"] += ptype.numel
        module["leaves"].append(
            {
                "path": path,
                "name": rest or path,
                "shape": list(ptype.shape),
                "dtype": ptype.dtype,
                "elements": ptype.numel,
                "group": attrs["group"],
            }
        )
        total += ptype.numel
    # Master weights are always f32, whatever the compute precision (language §6).
    return {"count": len(params), "elements": total, "master_bytes": total * 4, "modules": list(modules.values())}


def _constant_order(value: Any) -> tuple[int, Any]:
    """Folded constants in numeric order; the non-finite ones are text in the document (JSON has no
    infinities): `-inf` and `inf` sort where they belong, `nan` and any other text last."""
    if isinstance(value, (int, float)):
        return (0, value)
    infinite = {"-inf": -math.inf, "inf": math.inf}.get(value)
    return (0, infinite) if infinite is not None else (1, str(value))


def _groups(groups: list[Operation], elements_of: dict[str, int]) -> list[dict[str, Any]]:
    out = []
    for op in groups:
        attrs = op.attributes
        members = list(attrs["members"])
        states = attrs.get("states") or {}
        out.append(
            {
                "name": attrs["name"],
                "optimizer": attrs["optimizer"],
                "params": len(members),
                "elements": sum(elements_of[m] for m in members),
                "members": members,
                "states": [{"name": k, "elements": v} for k, v in states.items()],
                "state_elements": sum(states.values()),
                "constants": sorted((attribute_json(c) for c in attrs.get("constants", [])), key=_constant_order),
            }
        )
    return out


def _largest(ops: Iterable[Operation]) -> list[dict[str, Any]]:
    results = [(r.type.numel, i, op, r) for i, op in enumerate(ops) for r in op.results]
    results.sort(key=lambda item: (-item[0], item[1]))
    return [
        {
            "elements": numel,
            "shape": list(r.type.shape),
            "dtype": r.type.dtype,
            "op": op.name.removeprefix("graph."),
            "loc": op.loc.short() if op.loc is not None else None,
        }
        for numel, _, op, r in results[:LARGEST_KEPT]
    ]


def _graphs(funcs: list[Operation], casts: dict[str, int]) -> list[dict[str, Any]]:
    """One entry per graph; the update graphs of a group add up into one `update <group>` entry."""
    by_title: dict[str, list[Operation]] = {}
    for func in sorted(funcs, key=lambda f: GRAPH_ORDER.get(f.attributes.get("kind", ""), len(GRAPH_ORDER))):
        by_title.setdefault(graph_title(func), []).append(func)
    out = []
    for title, members in by_title.items():
        families: dict[str, int] = {}
        emits: list[dict[str, str]] = []
        nodes = 0
        body_ops: list[Operation] = []
        for func in members:
            for op in func.body.ops:
                if op.name == "graph.return":
                    continue
                nodes += 1
                body_ops.append(op)
                families[op.family] = families.get(op.family, 0) + 1
                if op.family == "emit":
                    emit = {"kind": op.name.removeprefix("graph."), "name": op.attributes["name"]}
                    if emit not in emits:
                        emits.append(emit)
        order = [f for f in FAMILIES if f in families] + sorted(f for f in families if f not in FAMILIES)
        out.append(
            {
                "name": title,
                "kind": members[0].attributes.get("kind", "unknown"),
                "symbols": [f.attributes["sym_name"] for f in members],
                "nodes": nodes,
                "casts": sum(casts.get(f.attributes["sym_name"], 0) for f in members),
                "ops": [{"family": f, "count": families[f]} for f in order],
                "emits": emits,
                "largest": _largest(body_ops),
            }
        )
    return out


def _static_counters(train: Operation | None, microbatches: int) -> list[dict[str, Any]]:
    if train is None:
        return []
    counters: dict[str, dict[str, Any]] = {}
    for op in train.body.ops:
        if op.name != "graph.counter":
            continue
        source = op.operands[0].op
        static = source is not None and source.name == "graph.const" and not isinstance(source.attributes["value"], list)
        per_microbatch = source.attributes["value"] if static else None
        entry = counters.setdefault(op.attributes["name"], {"name": op.attributes["name"], "per_step": 0, "static": True})
        if static and entry["static"]:
            entry["per_step"] += per_microbatch * microbatches
        else:
            entry.update(per_step=None, static=False)
    return list(counters.values())


def _step(
    module: Operation, run: dict[str, Any], graphs_by_kind: dict[str, Operation], facts: UnitFacts,
    attention_unheld: bool,
) -> dict[str, Any]:
    loaders = {op.attributes["name"]: op.attributes for op in _exp_ops(module, "exp.loader")}
    batch = loaders[run["loader"]]["batch"]
    evaluations = []
    for op in _exp_ops(module, "exp.evaluation"):
        attrs = op.attributes
        evaluations.append(
            {"name": attrs["name"], "every": attrs["every"], "loader": attrs["loader"], "batch": loaders[attrs["loader"]]["batch"]}
        )
    memory = facts.memory
    train_symbol = graphs_by_kind["train"].attributes["sym_name"] if "train" in graphs_by_kind else None
    planned = memory.get(train_symbol)
    peak = (
        {"bytes": planned["peak_bytes"], "param_bytes": planned["param_bytes"], "grad_bytes": planned["grad_bytes"]}
        if planned
        else None
    )
    checkpoints = run.get("checkpoints")
    return {
        "microbatches": run["microbatches"],
        "batch": batch,
        "records_per_step": run["microbatches"] * batch,
        "steps": run["steps"],
        "counters": _static_counters(graphs_by_kind.get("train"), run["microbatches"]),
        "evaluations": evaluations,
        "checkpoints": checkpoints if isinstance(checkpoints, int) and not isinstance(checkpoints, bool) else None,
        "precision": run["precision"],
        "seed": run["seed"],
        "peak_activation": peak,
        "attention_unheld": _attention_unheld(graphs_by_kind.get("train")) if attention_unheld else None,
    }


def _attention_unheld(train: Operation | None) -> dict[str, Any] | None:
    """The sequence×sequence tensors (scores, probabilities and their gradients) of the train graph's
    attention regions whose math is recognised, which a target that fuses attention never holds; None without
    such a region."""
    if train is None:
        return None
    block = train.regions[0].blocks[0]
    cache = MatchCache()
    order = {op: i for i, op in enumerate(block.ops)}
    regions = [m for m in find_attention(find_matches(block, cache), order, cache.attention) if m.refusal is None]
    if not regions:
        return None
    square = {r for m in regions for op in m.slice for r in op.results if tuple(r.type.shape[-2:]) == (m.seq, m.seq)}
    return {"regions": sum(m.direction == "forward" for m in regions), "tensors": len(square),
            "bytes": sum(r.type.nbytes for r in square)}


def _diagnostics(module: Operation, graphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    diagnosed = [g["name"] for g in graphs if g["kind"] == "train_diagnosed"]
    out = []
    for op in _exp_ops(module, "exp.diagnostic"):
        attrs = op.attributes
        enabled = bool(attrs.get("enabled", True))
        out.append(
            {
                "name": attrs["name"],
                "of": attribute_json(attrs["of"]),
                "reducer": attrs["reducer"],
                "every": attrs["every"],
                "graphs": diagnosed if enabled else [],
                "enabled": enabled,
            }
        )
    return out


def _precision(run: dict[str, Any], facts: UnitFacts) -> dict[str, Any]:
    kept: dict[str, dict[str, list[str]]] = {}
    for entry in facts.kept_f32:
        op = str(entry["op"]).removeprefix("graph.")
        slot = kept.setdefault(op, {"paths": [], "graphs": []})
        for key, value in (("paths", entry.get("path") or "-"), ("graphs", entry["graph"])):
            if value not in slot[key]:
                slot[key].append(value)
    return {
        "policy": run["precision"],
        "casts": sum(facts.casts.values()),
        "kept_f32": [{"op": op, "paths": v["paths"], "graphs": v["graphs"]} for op, v in kept.items()],
    }


def build_document(module: Operation, facts: UnitFacts, path: str | None,
                   attention_unheld: bool = True) -> dict[str, Any]:
    """The explain document of an evaluated experiment module and the facts its passes left. Without
    `attention_unheld` (an explain that lowers for a target fusing attention, whose lowering report says
    what it holds) the recogniser does not run for `step.attention_unheld`: it costs seconds on GPT-2 small."""
    params = _exp_ops(module, "exp.param")
    run = attribute_json(_one(module, "exp.run").attributes)
    funcs = [op for op in module.body.ops if op.name == "graph.func"]
    graphs_by_kind: dict[str, Operation] = {}
    for func in funcs:
        graphs_by_kind.setdefault(func.attributes.get("kind", ""), func)
    parameters = _parameters(params)
    elements_of = {leaf["path"]: leaf["elements"] for m in parameters["modules"] for leaf in m["leaves"]}
    graphs = _graphs(funcs, facts.casts)
    return {
        "file": display_path(path) if path else "<input>",
        "version": __version__,
        "selection": _selection(module),
        "parameters": parameters,
        "groups": _groups(_exp_ops(module, "exp.group"), elements_of),
        "graphs": graphs,
        "step": _step(module, run, graphs_by_kind, facts, attention_unheld),
        "diagnostics": _diagnostics(module, graphs),
        "precision": _precision(run, facts),
        "device": None,
    }


def ranks_document(module: Operation, doc: dict[str, Any], ranks: int, transport: str,
                   host_staging: str | None) -> dict[str, Any]:
    """What `explain --ranks N` adds (`doc["ranks"]`): how a step splits over N data-parallel ranks, each
    rank's memory bound with ZeRO-1's sharded optimizer states, and the collectives a step runs, through
    `transport` (the device's answer: `NCCL`, or `MPI` with why device arrays are staged through host
    memory, `host_staging`) (docs/distributed.md). The microbatches must divide by `ranks` (the caller
    checks)."""
    run = attribute_json(_one(module, "exp.run").attributes)
    step = doc["step"]
    zero = ranks > 1 and int(run.get("zero_stage", 1)) == 1
    updates: dict[str, list[Operation]] = {}
    for func in module.body.ops:
        if func.name == "graph.func" and func.attributes.get("kind") == "update":
            updates.setdefault(str(func.attributes.get("group")), []).append(func)
    clipped = any(op.name == "graph.func" and op.attributes.get("kind") == "clip" for op in module.body.ops)
    groups = []
    for group in doc["groups"]:
        funcs = updates.get(group["name"], [])
        flat = len(funcs) > 1 and flat_update_graph(funcs, group["elements"]) is not None
        # The group's span in the flat arrays, each member aligned as flatten-updates lays it out.
        span = member_offsets([param_type(f).numel for f in funcs], FLAT_MEMBER_ALIGNMENT)[1]
        groups.append({"name": group["name"], "elements": group["elements"], "state_elements": group["state_elements"],
                       "sharded": zero and flat and span % ranks == 0})
    parameter_bytes = 4 * doc["parameters"]["elements"]
    state_bytes = sum(4 * g["state_elements"] // (ranks if g["sharded"] else 1) for g in groups)
    sharded_elements = sum(g["elements"] for g in groups if g["sharded"])
    # Ring collectives: a rank sends (N-1)/N of each buffer reduce-scattered or all-gathered.
    gathered = (3 if clipped else 2) * sharded_elements + 2 * (doc["parameters"]["elements"] - sharded_elements)
    tokens = next((c["per_step"] for c in step["counters"] if c["name"] == "tokens" and c["static"]), None)
    peak = step["peak_activation"]
    return {
        "ranks": ranks,
        "microbatches_per_rank": step["microbatches"] // ranks,
        "records_per_rank": step["records_per_step"] // ranks,
        "tokens_per_step": tokens,
        "tokens_per_rank": tokens // ranks if tokens is not None else None,
        "zero_stage": 1 if zero else 0,
        "groups": groups,
        "memory": {"parameter_bytes": parameter_bytes, "gradient_bytes": parameter_bytes, "state_bytes": state_bytes,
                   "unsharded_state_bytes": sum(4 * g["state_elements"] for g in groups),
                   "activation_bytes": peak["bytes"] if peak else None},
        "gradients_gathered": clipped and sharded_elements > 0,
        "transport": transport,
        "host_staging": host_staging,
        "bytes_sent_per_step": 4 * gathered * (ranks - 1) // ranks,
        "stacking_degrees": stacking_degrees(step["microbatches"], ranks),
    }
