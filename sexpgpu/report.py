"""The explain document: one dict describing what the compiler made of a file, and its text.

`build_document` reads the experiment module (the `exp` ops and the
`graph.func` ops) and the facts passes left on the unit, and returns one dict
with stable keys (`sexpgpu/schemas/explain.schema.json`). `render_text` turns
that dict, and only that dict, into the report `sexpgpu explain` prints, so
the text and `--json` cannot disagree. `diff` compares two such documents.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from attrs import frozen

from .diagnostics import display_path
from .dialects.core import Operation, TensorType
from .dialects.exp import GRAPH_KINDS
from .dialects.printer import attribute_json
from .dialects.traits import FAMILIES
from .version import __version__

#: Rows of largest tensors kept per graph, in the document and the text (an update group's row shows one).
LARGEST_KEPT = 10
#: Constants the text lists per group before eliding the rest (the document keeps all).
CONSTANTS_SHOWN = 8
#: Emit names the text lists per kind of emit before summarising the rest (the document keeps all).
EMITS_SHOWN = 4
#: The order the text lists emits in, by kind (the document keeps the graph's order).
EMIT_ORDER = ("metric", "counter", "observe")
#: Width of element-count columns: "25.8M" and "8192" right-aligned under one another, as on the seed page.
COUNT_WIDTH = 6
#: Width of dtype columns (the widest dtype name, "bf16").
DTYPE_WIDTH = 4
DEVICE_HOLE = "device: (hole) — run explain --device cuda on a GPU machine"
#: The lowering report's first column (row names, run-wide keys) is at least this wide, as on the seed page.
LOWERING_NAME_WIDTH = 24
#: A family line's group label ("cross-entropy tail") and kernel columns are at least this wide (then a space).
FAMILY_LABEL_WIDTH = 18
FAMILY_KERNELS_WIDTH = 28
#: Model paths (after folding) a family line shows before counting the rest.
PATHS_SHOWN = 3

#: How a graph.func's `kind` reads in reports; evaluations and clip graphs read as their symbol.
KIND_TITLES = {
    "train": "train",
    "train_accumulating": "train accumulating",
    "train_stacked": "train stacked",
    "train_diagnosed": "train diagnosed",
}

#: The order graphs are reported in, by kind (a step's graphs, then evaluations, clipping, updates).
GRAPH_ORDER = {kind: i for i, kind in enumerate(GRAPH_KINDS)}


# -- number formats shared by explain and diff ------------------------------------------------


def human_count(n: int) -> str:
    """An element count to 3 significant digits: 1040, 393k, 6.44M, 13.3M."""
    if n < 10_000:
        return str(n)
    for suffix, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        scaled = n / scale
        if scaled < 999.5:
            return f"{scaled:.3g}{suffix}"
    return f"{n / 1e12:.3g}T"


def mib(nbytes: int) -> str:
    """Bytes in MiB to one decimal; below 0.1 MiB to 3 significant digits, so a small model is not 0.0."""
    value = nbytes / 2**20
    return f"{value:.1f} MiB" if value >= 0.1 or value == 0 else f"{value:.3g} MiB"


def show_value(value: Any) -> str:
    """A knob value or folded constant as the user would write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + " ".join(show_value(v) for v in value) + "]"
    return str(value)


def show_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def compress_paths(paths: Iterable[str]) -> list[str]:
    """Model paths that differ in one numeric component merge: model.blocks.{0..11}.attn."""
    templates: dict[str, list[list[str]]] = {}
    for path in paths:
        parts = path.split(".")
        key = ".".join("#" if p.isdigit() else p for p in parts)
        templates.setdefault(key, []).append(parts)
    out: list[str] = []
    for group in templates.values():
        unique = [list(p) for p in dict.fromkeys(tuple(p) for p in group)]
        varying = [i for i in range(len(unique[0])) if len({p[i] for p in unique}) > 1]
        if len(varying) != 1:
            out.extend(".".join(p) for p in unique)
            continue
        pos = varying[0]
        numbers = sorted(int(p[pos]) for p in unique)
        contiguous = numbers == list(range(numbers[0], numbers[-1] + 1))
        span = f"{{{numbers[0]}..{numbers[-1]}}}" if contiguous else "{" + ",".join(map(str, numbers)) + "}"
        merged = list(unique[0])
        merged[pos] = span
        out.append(".".join(merged))
    return out


# -- the document -----------------------------------------------------------------------------


def _exp_ops(module: Operation, name: str) -> list[Operation]:
    return [op for op in module.body.ops if op.name == name]


def _one(module: Operation, name: str) -> Operation:
    ops = _exp_ops(module, name)
    if len(ops) != 1:
        raise ValueError(f"the experiment module has {len(ops)} '{name}' ops, expected one")
    return ops[0]


def graph_title(func: Operation) -> str:
    kind = func.attributes.get("kind", "")
    if kind == "update":
        return f"update {func.attributes.get('group', func.attributes['sym_name'])}"
    return KIND_TITLES.get(kind, func.attributes["sym_name"])


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
    module: Operation, run: dict[str, Any], graphs_by_kind: dict[str, Operation], facts: dict[str, Any]
) -> dict[str, Any]:
    loaders = {op.attributes["name"]: op.attributes for op in _exp_ops(module, "exp.loader")}
    batch = loaders[run["loader"]]["batch"]
    evaluations = []
    for op in _exp_ops(module, "exp.evaluation"):
        attrs = op.attributes
        evaluations.append(
            {"name": attrs["name"], "every": attrs["every"], "loader": attrs["loader"], "batch": loaders[attrs["loader"]]["batch"]}
        )
    memory = facts.get("memory", {})
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
    }


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


def _precision(run: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    kept: dict[str, dict[str, list[str]]] = {}
    for entry in facts.get("kept_f32", []):
        op = str(entry["op"]).removeprefix("graph.")
        slot = kept.setdefault(op, {"paths": [], "graphs": []})
        for key, value in (("paths", entry.get("path") or "-"), ("graphs", entry["graph"])):
            if value not in slot[key]:
                slot[key].append(value)
    return {
        "policy": run["precision"],
        "casts": sum(facts.get("casts", {}).values()),
        "kept_f32": [{"op": op, "paths": v["paths"], "graphs": v["graphs"]} for op, v in kept.items()],
    }


def build_document(module: Operation, facts: dict[str, Any], path: str | None) -> dict[str, Any]:
    """The explain document of an evaluated experiment module and the facts its passes left."""
    params = _exp_ops(module, "exp.param")
    run = attribute_json(_one(module, "exp.run").attributes)
    funcs = [op for op in module.body.ops if op.name == "graph.func"]
    graphs_by_kind: dict[str, Operation] = {}
    for func in funcs:
        graphs_by_kind.setdefault(func.attributes.get("kind", ""), func)
    parameters = _parameters(params)
    elements_of = {leaf["path"]: leaf["elements"] for m in parameters["modules"] for leaf in m["leaves"]}
    graphs = _graphs(funcs, facts.get("casts", {}))
    return {
        "file": display_path(path) if path else "<input>",
        "version": __version__,
        "selection": _selection(module),
        "parameters": parameters,
        "groups": _groups(_exp_ops(module, "exp.group"), elements_of),
        "graphs": graphs,
        "step": _step(module, run, graphs_by_kind, facts),
        "diagnostics": _diagnostics(module, graphs),
        "precision": _precision(run, facts),
        "device": None,
    }


# -- the text ---------------------------------------------------------------------------------


def _table(rows: Sequence[Sequence[str]], indent: int, right: Sequence[int] = (), min_widths: Sequence[int] = ()) -> list[str]:
    """Rows as aligned columns two spaces apart; columns listed in `right` align right."""
    if not rows:
        return []
    ncols = max(len(r) for r in rows)
    widths = [max((len(r[c]) for r in rows if c < len(r)), default=0) for c in range(ncols)]
    for c, w in enumerate(min_widths):
        widths[c] = max(widths[c], w)
    lines = []
    for row in rows:
        cells = []
        for c, cell in enumerate(row):
            last = c == len(row) - 1
            if c in right:
                cells.append(cell.rjust(widths[c]))
            else:
                cells.append(cell if last else cell.ljust(widths[c]))
        lines.append(" " * indent + "  ".join(cells).rstrip())
    return lines


def _show_constants(constants: list[Any]) -> str:
    if not constants:
        return "none"
    shown = ", ".join(show_value(c) for c in constants[:CONSTANTS_SHOWN])
    if len(constants) > CONSTANTS_SHOWN:
        shown += f", ... ({len(constants)} in all)"
    return shown


def _show_states(group: dict[str, Any]) -> str:
    return "states " + (", ".join(s["name"] for s in group["states"]) or "none")


def _show_of(of: Any) -> str:
    if isinstance(of, dict):
        return f"{of.get('kind', '')} {of.get('glob', '')}".strip()
    return str(of)


def _show_emits(emits: list[dict[str, str]]) -> str:
    """`metric train/loss, counter tokens`; a kind with many names (observations) lists a few and counts."""
    by_kind: dict[str, list[str]] = {kind: [] for kind in EMIT_ORDER}
    for e in emits:
        by_kind.setdefault(e["kind"], []).append(e["name"])
    shown = []
    for kind, names in by_kind.items():
        if not names:
            continue
        merged = compress_paths(names)
        if len(merged) > EMITS_SHOWN:
            merged = [*merged[: EMITS_SHOWN - 1], f"... ({len(names)} in all)"]
        shown.append(", ".join(f"{kind} {name}" if i == 0 else name for i, name in enumerate(merged)))
    return ", ".join(shown) or "none"


def _render_selection(doc: dict[str, Any]) -> list[str]:
    sel = doc["selection"]
    rows = [["variant", show_value(sel["variant"])]]
    rows += [[k["name"], show_value(k["value"]), k["source"]] for k in sel["knobs"]]
    return ["selection:", *_table(rows, 2, min_widths=(0, 10))]


def _leaf_row(leaf: dict[str, Any], name: str, indent: int) -> list[str]:
    return [" " * indent + name, show_shape(leaf["shape"]), leaf["dtype"], human_count(leaf["elements"]), leaf["group"]]


def _numbered(name: str) -> tuple[str, int, str] | None:
    """`blocks.3.attn.qkv.weight` as ("blocks", 3, "attn.qkv.weight"); None without a numbered component."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def _span(numbers: list[int]) -> str:
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{{{numbers[0]}..{numbers[-1]}}}"
    return "{" + ",".join(map(str, numbers)) + "}"


def _tree_rows(leaves: list[dict[str, Any]], indent: int) -> list[list[str]]:
    """A module's leaves by submodule: numbered submodules (`blocks.0`, `blocks.1`, ...) get a subtotal row
    and their leaves relative to it; submodules whose leaves agree in name, shape, dtype and group fold into
    one `blocks.{0..11}` row, so a twelve-layer model reads as one block."""
    rows: list[list[str]] = []
    i = 0
    while i < len(leaves):
        numbered = _numbered(leaves[i]["name"])
        if numbered is None:
            rows.append(_leaf_row(leaves[i], leaves[i]["name"], indent))
            i += 1
            continue
        prefix = numbered[0]
        # The run of leaves under prefix.N, in order, by N.
        members: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        while i < len(leaves):
            n = _numbered(leaves[i]["name"])
            if n is None or n[0] != prefix:
                break
            members.setdefault(n[1], []).append((n[2], leaves[i]))
            i += 1
        head = f"{prefix}." if prefix else ""

        def signature(items: list[tuple[str, dict[str, Any]]]) -> list[tuple[Any, ...]]:
            return [(rest, tuple(leaf["shape"]), leaf["dtype"], leaf["group"]) for rest, leaf in items]

        first = next(iter(members.values()))
        if len(members) > 1 and all(signature(m) == signature(first) for m in members.values()):
            each = sum(leaf["elements"] for _, leaf in first)
            rows.append([f"{' ' * indent}{head}{_span(sorted(members))}", f"{len(members)} × {human_count(each)}"])
            rows += [_leaf_row(leaf, rest, indent + 2) for rest, leaf in first]
            continue
        for number, items in members.items():
            rows.append([f"{' ' * indent}{head}{number}", human_count(sum(leaf["elements"] for _, leaf in items))])
            rows += [_leaf_row(leaf, rest, indent + 2) for rest, leaf in items]
    return rows


def _render_parameters(doc: dict[str, Any]) -> list[str]:
    p = doc["parameters"]
    lines = [f"parameters: {p['count']}, {human_count(p['elements'])} elements, {mib(p['master_bytes'])} as f32 master weights"]
    rows: list[list[str]] = []
    for module in p["modules"]:
        rows.append(["  " + module["name"], human_count(module["elements"])])
        rows += _tree_rows(module["leaves"], 4)
    # Module totals sit in the shape column; leaves' element counts align right.
    lines += _table(rows, 0, right=(3,), min_widths=(0, 0, DTYPE_WIDTH, COUNT_WIDTH))
    lines.append("  groups:")
    count_width = max([COUNT_WIDTH, *(len(str(g["params"])) for g in doc["groups"])])
    group_rows = [
        [
            g["name"],
            # "1 param " and "12 params" share a column: the count right, the word left.
            f"{g['params']:>{count_width}} {'param ' if g['params'] == 1 else 'params'}",
            human_count(g["elements"]),
            _show_states(g),
            human_count(g["state_elements"]),
            "constants " + _show_constants(g["constants"]),
        ]
        for g in doc["groups"]
    ]
    lines += _table(group_rows, 4, right=(2, 4))
    return lines


def _largest_rows(tensors: list[dict[str, Any]]) -> list[list[str]]:
    return [[human_count(t["elements"]), show_shape(t["shape"]), t["dtype"], t["op"], t["loc"] or "-"] for t in tensors]


def _render_graphs(doc: dict[str, Any]) -> list[str]:
    """Each graph with its ops, emits and its ten largest tensors. The variants of the train graph say
    `as train` where their largest tensors are train's; a row summing an optimizer group's update graphs
    shows their one largest tensor; update and clip graphs have no emits line when they emit nothing. The
    header counts graphs as `check` does: a group's update graphs share one row."""
    symbols = sum(len(g["symbols"]) for g in doc["graphs"])
    shared = " (an optimizer group's update graphs in one row)" if symbols != len(doc["graphs"]) else ""
    lines = [f"graphs: {symbols}{shared}"]
    train = next((g for g in doc["graphs"] if g["kind"] == "train"), None)
    for g in doc["graphs"]:
        count = f"{plural(len(g['symbols']), 'graph')}, " if g["kind"] == "update" else ""
        lines.append(
            f"  {g['name']}  {count}{g['nodes']} nodes, {plural(g['casts'], 'cast')} added by the "
            f"{doc['step']['precision']} policy"
        )
        rows = [["ops", ", ".join(f"{o['family']} {o['count']}" for o in g["ops"]) or "none"]]
        # Update and clip graphs read and write parameters and states: most emit nothing.
        if g["emits"] or g["kind"] not in ("update", "clip"):
            rows.append(["emits", _show_emits(g["emits"])])
        lines += _table(rows, 4, min_widths=(7,))
        if train is not None and g is not train and g["kind"].startswith("train") and g["largest"] == train["largest"]:
            lines.append("    largest tensors: as train")
        elif g["kind"] == "update" and g["largest"]:
            # A row summing a group's update graphs: every one reads and writes tensors of its parameter's
            # size, so their largest is the group's largest parameter (the document keeps ten).
            lines.append("    largest tensor:  " + "  ".join(_largest_rows(g["largest"][:1])[0]))
        elif g["largest"]:
            lines.append("    largest tensors:")
            lines += _table(_largest_rows(g["largest"]), 6, right=(0,), min_widths=(COUNT_WIDTH, 0, DTYPE_WIDTH))
    return lines


def step_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The `training step:` rows as (key, label, text); the key is unique, so diff can pair rows by it."""
    s = doc["step"]
    micro = plural(s["microbatches"], "microbatch", "microbatches")
    rows = [("records", "records", f"{micro} of {s['batch']} = {s['records_per_step']} per step, {plural(s['steps'], 'step')}")]
    for c in s["counters"]:
        text = f"{c['per_step']} per step (static)" if c["static"] else "counted as the run goes (not static)"
        rows.append((f"counter {c['name']}", f"counter {c['name']}", text))
    for e in s["evaluations"]:
        text = f"{e['name']}: every {plural(e['every'], 'step')}, the whole loader in batches of {e['batch']}"
        rows.append((f"evaluation {e['name']}", "evaluation", text))
    if not s["evaluations"]:
        rows.append(("evaluation", "evaluation", "none"))
    checkpoints = f"every {plural(s['checkpoints'], 'step')}" if s["checkpoints"] else "none"
    rows.append(("checkpoints", "checkpoints", checkpoints))
    rows.append(("precision", "precision", f"{s['precision']}, seed {s['seed']}"))
    peak = s["peak_activation"]
    if peak is None:
        text = "not planned (the pipeline ran no plan-memory)"
    else:
        text = (
            f"<= {mib(peak['bytes'])} for one microbatch, an upper bound: nothing reused in place; "
            f"parameters {mib(peak['param_bytes'])} and gradients {mib(peak['grad_bytes'])} besides"
        )
    rows.append(("peak activation", "peak activation", text))
    return rows


def _render_diagnostics(doc: dict[str, Any]) -> list[str]:
    if not doc["diagnostics"]:
        return ["diagnostics: none"]
    rows = [
        [
            d["name"],
            f"{d['reducer']} of {_show_of(d['of'])}",
            f"every {plural(d['every'], 'step')}",
            ", ".join(d["graphs"]) or "-",
            "on" if d["enabled"] else "off",
        ]
        for d in doc["diagnostics"]
    ]
    return ["diagnostics:", *_table(rows, 2)]


def _render_precision(doc: dict[str, Any]) -> list[str]:
    p = doc["precision"]
    if p["policy"] == "f32":
        summary = f"f32: everything runs in f32, {plural(p['casts'], 'cast')} added"
    else:
        summary = (
            f"{p['policy']} compute; parameters and optimizer states stay f32 master weights; "
            f"{plural(p['casts'], 'cast')} added"
        )
    lines = ["precision:", f"  {summary}"]
    if p["kept_f32"]:
        lines.append("  kept f32:")
        rows = [[k["op"], "in " + ", ".join(KIND_TITLES.get(g, g) for g in k["graphs"]), _show_kept_paths(k["paths"])]
                for k in p["kept_f32"]]  # fmt: skip
        lines += _table(rows, 4)
    return lines


def _show_kept_paths(paths: list[str]) -> str:
    """Model paths in order, numbered blocks merged; ops outside any module (`-`, the loss) read last."""
    inside = sorted(compress_paths(p for p in paths if p != "-"))
    return ", ".join([*inside, *(["outside modules"] if "-" in paths else [])]) or "-"


def render_text(doc: dict[str, Any]) -> str:
    """The explain report, rendered from the document alone."""
    p, s = doc["parameters"], doc["step"]
    header = (
        f"{doc['file']}: {plural(p['count'], 'parameter')}, {plural(s['steps'], 'step')}, "
        f"precision {s['precision']}  (sexpgpu-frontend {doc['version']})"
    )
    device = doc["device"]
    sections = [
        [header],
        _render_selection(doc),
        _render_parameters(doc),
        _render_graphs(doc),
        ["training step:", *_table([[label, text] for _, label, text in step_rows(doc)], 2)],
        _render_diagnostics(doc),
        _render_precision(doc),
        [DEVICE_HOLE] if device is None else [render_lowering(device).rstrip("\n")],
    ]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


# -- the lowering report ----------------------------------------------------------------------


@frozen
class DeviceFacts:
    """What an opened device tells the report; None for what was not measured (no device, or not yet)."""

    #: The device's name as its driver gives it (`NVIDIA H200`).
    name: str | None = None
    #: Bytes of device memory in all, and free when the device opened.
    total_memory: int | None = None
    free_memory: int | None = None
    #: The stacking degree the run chose (`train stacked` runs that many microbatches a call).
    stacking: int | None = None
    #: The graphs (symbol names) the run submits as captured segments; None when capture was not decided.
    captured: frozenset[str] | None = None
    #: Why capture is off on this device, when it is (PyCUDA has no stream capture).
    capture_off: str | None = None


def apply_device(document: dict[str, Any], device: DeviceFacts) -> dict[str, Any]:
    """`document` (in place, and returned) with what an opened device told: its name, memory, the stacking
    degree chosen and the rows it captures. A document is built without these first, so a report of the same
    lowering (the lowering cache's) takes a device's figures later."""
    document["name"] = device.name
    document["memory"].update(total_bytes=device.total_memory, free_bytes=device.free_memory)
    document["stacking"]["chosen"] = device.stacking
    document["capture"] = {"measured": device.captured is not None, "off": device.capture_off}
    for row in document["rows"]:
        row["captured"] = None if device.captured is None else any(s in device.captured for s in row["symbols"])
    return document


def render_lowering(document: dict[str, Any], device: DeviceFacts | None = None) -> str:
    """The lowering report's text (the seed page's "The lowering report"), from the lowering document alone.

    `document` is what `passes.lowering_report.lowering_document` returns (the `device` object of the
    explain document); `device` what an opened device told, applied to a copy (the document is not
    changed), None to print what the document holds (`explain --device cuda --target` measures nothing).
    `explain --device cuda` prints this in place of the device hole; the CUDA executor prints it before a
    run's first step and sends it as the `lowering` event.
    """
    doc = apply_device(copy.deepcopy(document), device) if device is not None else document
    rows = doc["rows"]
    name_width = max([LOWERING_NAME_WIDTH, *(len(r["name"]) for r in rows)])
    label_width = max([FAMILY_LABEL_WIDTH, *(len(g["group"]) for r in rows for g in r["families"])])
    under = " " * (4 + label_width + 1)
    arch = doc["arch"]
    # A GPU's lowering names its compute capability; the compiled CPU target its machine (x86_64).
    target = arch if doc["executor"] == "cpu-c" else f"compute_{arch.removeprefix('sm_')}"
    lines = [f"lowering: {doc['executor']} {target} {doc['name'] or '(device not measured)'}, "
             f"patterns {'on' if doc['patterns'] else 'off'}"]
    train_lines: list[str] | None = None
    for row in rows:
        lines.append(f"  {row['name']:<{name_width}}  {_lowering_row(row)}")
        # A row's family lines align their paths: two spaces past its longest kernel list, at least.
        kernels_width = max([FAMILY_KERNELS_WIDTH, *(len(_family_kernels(g)) + 2 for g in row["families"])])
        family_lines = [line for g in row["families"] for line in _family_lines(g, label_width, kernels_width, under)]
        if row["kind"] == "train":
            train_lines = family_lines
        if family_lines and row["kind"] != "train" and row["kind"].startswith("train") and family_lines == train_lines:
            lines.append(f"    {'patterns':<{label_width}} same as train")
        else:
            lines += family_lines
        if "launches" in row:
            lines.append("    launches:")
            lines += _table([_launch_cells(i, launch) for i, launch in enumerate(row["launches"], 1)], 6, right=(0,))
    for key, text in _lowering_run_lines(doc):
        lines.append(f"  {key:<{name_width}}  {text}")
    return "\n".join(lines) + "\n"


def _lowering_row(row: dict[str, Any]) -> str:
    """`1259 nodes, 302 kernels: 49 fused groups of 2 to 15 nodes (median 5), 66 GEMMs`, an update group's
    row after its graph count, `captured` where the run captures it."""
    text = f"{plural(row['graphs'], 'graph')}: " if row["kind"] == "update" else ""
    text += f"{row['nodes']} nodes, {plural(row['kernels'], 'kernel')}"
    details = []
    sizes = row["fused_groups"]
    if sizes:
        if sizes[0] == sizes[-1]:
            details.append(f"{plural(len(sizes), 'fused group')} of {sizes[0]} nodes")
        else:
            details.append(f"{len(sizes)} fused groups of {sizes[0]} to {sizes[-1]} nodes (median {statistics.median_low(sizes)})")
    if row["gemms"]:
        details.append(plural(row["gemms"], "GEMM"))
    if details:
        text += ": " + ", ".join(details)
    return text + (", captured" if row["captured"] else "")


def _family_kernels(group: dict[str, Any]) -> str:
    """`layernorm 24, softmax backward 12`: each family that fired, with how often when more than once."""
    return ", ".join(k["name"] if k["fired"] == 1 else f"{k['name']} {k['fired']}" for k in group["kernels"])


def _folded_paths(paths: list[str | None]) -> list[str]:
    """Model paths folded where they differ in one index; regions outside any module read last."""
    inside = compress_paths(p for p in paths if p)
    return [*inside, *(["outside modules"] if any(not p for p in paths) else [])]


def _family_lines(group: dict[str, Any], label_width: int, kernels_width: int, under: str) -> list[str]:
    """A report group's line (its kernels and the model paths of their regions), its `as` lines and its
    `fell back` lines."""
    paths = _folded_paths(group["paths"]) if group["paths"] else []
    if len(paths) > PATHS_SHOWN:
        paths = [*paths[:PATHS_SHOWN], f"{len(paths) - PATHS_SHOWN} more"]
    reasons: dict[tuple[str, str], list[str | None]] = {}
    for fell in group["fell_back"]:
        reasons.setdefault((fell["family"], fell["reason"]), []).append(fell["path"])
    fell_lines = [f"fell back {family} at {', '.join(_folded_paths(where))}: {reason}"
                  for (family, reason), where in reasons.items()]
    label = f"    {group['group']:<{label_width}} "
    if not group["kernels"]:  # nothing fired: the group's first line says why
        return [label + fell_lines[0], *(under + line for line in fell_lines[1:])] if fell_lines else []
    lines = [f"{label}{_family_kernels(group):<{kernels_width}} {', '.join(paths)}".rstrip()]
    named = len({k["base"] for k in group["kernels"]} | {a["family"] for a in group["as"]}) > 1
    lines += [f"{under}as {a['family'] + ': ' if named else ''}{a['form']}" for a in group["as"]]
    lines += [under + line for line in fell_lines]
    return lines


def _dim3(dims: list[int]) -> str:
    return "×".join(str(d) for d in dims)


def _launch_cells(index: int, launch: dict[str, Any]) -> list[str]:
    """One launch of `SEXPGPU_EXPLAIN=kernels`: order, kernel symbol (`gemm` for cuBLASLt), grid and block (a
    GEMM's transposes, m×n×k, batch and epilogue), the shape and dtype it writes, model path."""
    gemm = launch["gemm"]
    if gemm is not None:
        letters = ("t" if gemm["transpose_a"] else "n") + ("t" if gemm["transpose_b"] else "n")
        where = f"cuBLASLt {letters} {gemm['m']}×{gemm['n']}×{gemm['k']}"
        where += f" batch {gemm['batch']}" if gemm["batch"] > 1 else ""
        where += f" {gemm['epilogue']}" if gemm["epilogue"] != "none" else ""
    else:
        where = f"grid {_dim3(launch['grid'])} block {_dim3(launch['block'])}"
        where += f" shared {launch['shared']}" if launch["shared"] else ""
    return [str(index), launch["symbol"] or launch["kernel"], where, show_shape(launch["shape"]), launch["dtype"],
            launch["path"] or "-"]


def _either(options: list[int]) -> str:
    """`4, 2 or 1`."""
    text = [str(o) for o in options]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


def _bytes(nbytes: int) -> str:
    """Memory as the lowering report reads it: GiB from 1 GiB, KiB below 0.1 MiB, else MiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 // 10 else mib(nbytes)


def _lowering_run_lines(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The run-wide lines: memory, stacking, capture, the compiled kernels, then what they cannot do here."""
    lines = []
    memory = doc["memory"]
    planned = f"{_bytes(memory['persistent_bytes'])} persistent (parameters, gradients, optimizer states)"
    if memory["largest_arena"] is not None:
        planned += f", arenas up to {_bytes(memory['largest_arena']['bytes'])} ({memory['largest_arena']['row']})"
    if memory["total_bytes"] is None:
        lines.append(("memory", f"not measured; planned {planned}"))
    else:
        free = f", {_bytes(memory['free_bytes'])} free" if memory["free_bytes"] is not None else ""
        lines.append(("memory", f"{_bytes(memory['total_bytes'])}{free}; planned {planned}"))
    stacking = doc["stacking"]
    degrees = stacking["degrees"]
    if doc["executor"] == "cpu-c":
        text = "1: cpu-c runs one microbatch a call (train accumulating adds the others)"
    elif stacking["chosen"] is not None:
        text = f"{stacking['chosen']}, of {_either(degrees)}: the largest whose activations fit"
    elif len(degrees) == 1:
        text = "1: one microbatch a step, nothing to stack"
    else:
        text = f"{_either(degrees)}: chosen when the run opens its device"
        if stacking["planned"] is not None:
            text += f"; train stacked above runs {stacking['planned']}"
    lines.append(("stacking", text))
    capture = doc["capture"]
    if capture["off"]:
        lines.append(("capture", f"off: {capture['off']}"))
    elif not capture["measured"]:
        lines.append(("capture", "not measured: a run captures each graph large enough after its tenth call"))
    compiled = doc["compiled"]
    if compiled is not None and "most_registers" not in compiled:  # C for a CPU: no registers or spills to tell
        cached = ", from the cache" if compiled.get("from_cache") else ""
        lines.append(("compiled", f"{plural(compiled['kernels'], 'kernel')} and {plural(compiled['functions'], 'graph function')} "
                                  f"in one C file by {compiled['compiler']} for {doc['arch']} "
                                  f"(-O3 -march=native -fopenmp){cached}"))
    elif compiled is not None:
        most = compiled["most_registers"]
        spills = compiled["spills"]
        spilled = f"{len(spills)} spilling ({', '.join(spills)})" if spills else "no spills"
        lines.append(("compiled", f"{plural(compiled['kernels'], 'kernel')} in {plural(compiled['functions'], 'function')} "
                                  f"by {compiled['compiler']} for {doc['arch']}: at most {most['registers']} registers "
                                  f"({most['kernel']}), {spilled}"))
        lines += [("cannot", limit) for limit in compiled["limits"]]
    return lines
