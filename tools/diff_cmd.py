"""`sexpgpu diff A.sx B.sx [selection] [--json]`: what differs between two explain documents.

Both files are compiled as `explain` compiles them; the selection flags apply
to b only, so `diff my-run.sx my-run.sx --set lr=0.25` compares a file with
itself under another learning rate. Rows pair by key within each section
(knobs, parameters, graphs, training step, optimizer groups); only rows whose
text differs are kept, and a key only one side has reads `-`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from ..report import build_document, human_count, show_shape, show_value, step_rows
from .explain_cmd import compile_unit

#: Rows a section prints before summarising the rest as a count.
MAX_ROWS = 20
MISSING = "-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="the first experiment (.sx), compiled with its defaults")
    parser.add_argument("b", help="the second experiment (.sx), compiled with the selection flags")
    parser.add_argument("--json", action="store_true", help="print the whole structured diff as JSON")


def _knob_rows(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    yield "variant", show_value(doc["selection"]["variant"])
    for knob in doc["selection"]["knobs"]:
        yield knob["name"], f"{show_value(knob['value'])} ({knob['source']})"


def _parameter_rows(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for module in doc["parameters"]["modules"]:
        for leaf in module["leaves"]:
            yield leaf["path"], f"{show_shape(leaf['shape'])} {leaf['dtype']} {leaf['group']}"


def _graph_rows(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for g in doc["graphs"]:
        yield f"{g['name']} nodes", str(g["nodes"])
        for o in g["ops"]:
            yield f"{g['name']} {o['family']}", str(o["count"])
        for rank, t in enumerate(g["largest"], start=1):
            # The location is left out: two files put the same tensor at different lines.
            yield (
                f"{g['name']} largest {rank}",
                f"{human_count(t['elements'])} {show_shape(t['shape'])} {t['dtype']} {t['op']}",
            )


def _step_rows(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for key, _, text in step_rows(doc):
        yield key, text


def _group_rows(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for g in doc["groups"]:
        name = g["name"]
        yield f"{name} optimizer", g["optimizer"]
        yield f"{name} members", f"{g['params']} {'param' if g['params'] == 1 else 'params'}, {human_count(g['elements'])}"
        states = ", ".join(s["name"] for s in g["states"]) or "none"
        yield f"{name} states", f"{states} {human_count(g['state_elements'])}"
        yield f"{name} constants", ", ".join(show_value(c) for c in g["constants"]) or "none"


SECTIONS = (
    ("knobs", _knob_rows),
    ("parameters", _parameter_rows),
    ("graphs", _graph_rows),
    ("training step", _step_rows),
    ("optimizer groups", _group_rows),
)


def diff_documents(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Each section's differing rows, `{"key", "a", "b"}` with None for a side that lacks the key."""
    sections = []
    for name, rows_of in SECTIONS:
        rows_a, rows_b = dict(rows_of(a)), dict(rows_of(b))
        keys = list(rows_a) + [k for k in rows_b if k not in rows_a]
        rows = [{"key": k, "a": rows_a.get(k), "b": rows_b.get(k)} for k in keys if rows_a.get(k) != rows_b.get(k)]
        if rows:
            sections.append({"name": name, "rows": rows})
    return sections


def describe(file: str, variant: str | None, sets: list[str]) -> str:
    """A side as its command line: `my-run.sx --variant smoke --set lr=0.25`."""
    words = [file] + (["--variant", variant] if variant else []) + [w for s in sets for w in ("--set", s)]
    return " ".join(words)


def render_diff(diff: dict[str, Any]) -> str:
    lines = [f"a  {diff['a']}", f"b  {diff['b']}", ""]
    if not diff["sections"]:
        return "\n".join([*lines, "identical"]) + "\n"
    for section in diff["sections"]:
        rows = section["rows"]
        shown = [[r["key"], r["a"] or MISSING, r["b"] or MISSING] for r in rows[:MAX_ROWS]]
        widths = [max(len(row[c]) for row in shown) for c in range(2)]
        lines.append(section["name"])
        lines += [f"  {k.ljust(widths[0])}  {va.ljust(widths[1])}  {vb}" for k, va, vb in shown]
        if len(rows) > MAX_ROWS:
            lines.append(f"  … and {len(rows) - MAX_ROWS} more")
        lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    unit_a = compile_unit(args.a, None, [])
    unit_b = compile_unit(args.b, args.variant, args.set)
    doc_a = build_document(unit_a.module, unit_a.facts, unit_a.path)
    doc_b = build_document(unit_b.module, unit_b.facts, unit_b.path)
    sections = diff_documents(doc_a, doc_b)
    diff = {
        "a": describe(args.a, None, []),
        "b": describe(args.b, args.variant, args.set),
        "identical": not sections,
        "sections": sections,
    }
    if args.json:
        sys.stdout.write(json.dumps(diff, indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(render_diff(diff))
    return 0
