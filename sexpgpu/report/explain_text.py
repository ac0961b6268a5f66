"""The explain report's text, rendered from the explain document alone (`document.build_document`)."""

from __future__ import annotations

from typing import Any

from ..byte_text import show_bytes
from ..dialects.exp import KIND_TITLES
from ..dialects.graph import show_shape
from ..frontend.selection import show_value
from .lowering_text import render_lowering
from .text import compress_paths, human_count, plural, span, table

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
    rows = [["variant", sel["variant"] or "none"]]
    rows += [[k["name"], show_value(k["value"]), k["source"]] for k in sel["knobs"]]
    return ["selection:", *table(rows, 2, min_widths=(0, 10))]


def _leaf_row(leaf: dict[str, Any], name: str, indent: int) -> list[str]:
    return [" " * indent + name, show_shape(leaf["shape"]), leaf["dtype"], human_count(leaf["elements"]), leaf["group"]]


def _numbered(name: str) -> tuple[str, int, str] | None:
    """`blocks.3.attn.qkv.weight` as ("blocks", 3, "attn.qkv.weight"); None without a numbered component."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


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
            rows.append([f"{' ' * indent}{head}{span(sorted(members))}", f"{len(members)} × {human_count(each)}"])
            rows += [_leaf_row(leaf, rest, indent + 2) for rest, leaf in first]
            continue
        for number, items in members.items():
            rows.append([f"{' ' * indent}{head}{number}", human_count(sum(leaf["elements"] for _, leaf in items))])
            rows += [_leaf_row(leaf, rest, indent + 2) for rest, leaf in items]
    return rows


def _render_parameters(doc: dict[str, Any]) -> list[str]:
    p = doc["parameters"]
    lines = [f"parameters: {p['count']}, {human_count(p['elements'])} elements, {show_bytes(p['master_bytes'])} as f32 master weights"]
    rows: list[list[str]] = []
    for module in p["modules"]:
        rows.append(["  " + module["name"], human_count(module["elements"])])
        rows += _tree_rows(module["leaves"], 4)
    # Module totals sit in the shape column; leaves' element counts align right.
    lines += table(rows, 0, right=(3,), min_widths=(0, 0, DTYPE_WIDTH, COUNT_WIDTH))
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
    lines += table(group_rows, 4, right=(2, 4))
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
        lines += table(rows, 4, min_widths=(7,))
        if train is not None and g is not train and g["kind"].startswith("train") and g["largest"] == train["largest"]:
            lines.append("    largest tensors: as train")
        elif g["kind"] == "update" and g["largest"]:
            # A row summing a group's update graphs: every one reads and writes tensors of its parameter's
            # size, so their largest is the group's largest parameter (the document keeps ten).
            lines.append("    largest tensor:  " + "  ".join(_largest_rows(g["largest"][:1])[0]))
        elif g["largest"]:
            lines.append("    largest tensors:")
            lines += table(_largest_rows(g["largest"]), 6, right=(0,), min_widths=(COUNT_WIDTH, 0, DTYPE_WIDTH))
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
            f"<= {show_bytes(peak['bytes'])} for one microbatch, an upper bound: nothing reused in place; "
            f"parameters {show_bytes(peak['param_bytes'])} and gradients {show_bytes(peak['grad_bytes'])} besides"
        )
    rows.append(("peak activation", "peak activation", text))
    unheld = s["attention_unheld"]
    if unheld is not None:
        text = (f"{plural(unheld['tensors'], 'sequence×sequence tensor')}, {show_bytes(unheld['bytes'])}, in "
                f"{plural(unheld['regions'], 'attention region')}: a target that fuses attention (cuda) holds none of them")
        rows.append(("attention", "attention", text))
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
    return ["diagnostics:", *table(rows, 2)]


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
        lines += table(rows, 4)
    return lines


def _show_kept_paths(paths: list[str]) -> str:
    """Model paths in order, numbered blocks merged; ops outside any module (`-`, the loss) read last."""
    inside = sorted(compress_paths(p for p in paths if p != "-"))
    return ", ".join([*inside, *(["outside modules"] if "-" in paths else [])]) or "-"


def _render_ranks(doc: dict[str, Any]) -> list[str]:
    r = doc["ranks"]
    total = doc["step"]["microbatches"]
    rows = [["ranks", f"{r['ranks']}, each running {r['microbatches_per_rank']} of the {total} microbatches of a step "
                      f"({r['records_per_rank']} records)"]]
    if r["tokens_per_step"] is not None:
        rows.append(["tokens", f"{r['tokens_per_step']} per step, {r['tokens_per_rank']} per rank"])
    memory = r["memory"]
    states = show_bytes(memory["state_bytes"])
    if r["zero_stage"] == 1 and memory["state_bytes"] != memory["unsharded_state_bytes"]:
        states += f" (ZeRO-1: its shard of {show_bytes(memory['unsharded_state_bytes'])})"
    parts = [f"parameters {show_bytes(memory['parameter_bytes'])}", f"gradients {show_bytes(memory['gradient_bytes'])}",
             f"optimizer states {states}"]
    fixed = memory["parameter_bytes"] + memory["gradient_bytes"] + memory["state_bytes"]
    if memory["activation_bytes"] is not None:
        parts.append(f"activations <= {show_bytes(memory['activation_bytes'])} for one microbatch")
        fixed += memory["activation_bytes"]
    rows.append(["memory per rank", f"<= {show_bytes(fixed)}: " + ", ".join(parts)])
    sharded = [g["name"] for g in r["groups"] if g["sharded"]]
    what = "gradients reduce-scattered and all-gathered"
    if sharded:
        what = (f"gradients reduce-scattered{', then all-gathered for clipping' if r['gradients_gathered'] else ''}, "
                f"each rank updating its shard, parameters all-gathered (ZeRO-1: {', '.join(sharded)})")
        if len(sharded) < len(r["groups"]):
            what += "; the other gradients reduce-scattered and all-gathered"
    road = {"NCCL": "through NCCL on the GPUs"}.get(r["transport"], f"through {r['transport']}")
    if r["host_staging"] is not None:
        road += f" by host staging ({r['host_staging']})"
    rows.append(["collectives", f"each step {road}: {what}; {show_bytes(r['bytes_sent_per_step'])} sent per rank"])
    degrees = " or ".join(str(k) for k in r["stacking_degrees"])
    rows.append(["stacking", f"{degrees}: the divisors of each rank's {plural(r['microbatches_per_rank'], 'microbatch', 'microbatches')} "
                             "(a device chooses when the run opens it; the CPU runs 1)"])
    return ["ranks:", *table(rows, 2)]


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
        ["training step:", *table([[label, text] for _, label, text in step_rows(doc)], 2)],
        *([_render_ranks(doc)] if "ranks" in doc else []),
        _render_diagnostics(doc),
        _render_precision(doc),
        [DEVICE_HOLE] if device is None else [render_lowering(device).rstrip("\n")],
    ]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"
