"""`sexpgpu diff A.sx B.sx [selection] [--json]`: what differs between two explain documents.

Both files are compiled as `explain` compiles them; the selection flags apply
to b only, so `diff my-run.sx my-run.sx --set lr=0.25` compares a file with
itself under another learning rate. Rows pair by key within each section
(knobs, parameters, graphs, training step, optimizer groups); only rows whose
text differs are kept, and a key only one side has reads `-`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterator
from typing import Any

from ..dialects.graph import show_shape
from ..frontend.selection import show_value
from ..report.document import build_document
from ..report.explain_text import step_rows
from ..report.text import human_count
from .explain_cmd import compile_unit

#: Rows a section prints before summarising the rest as a count (the graphs share them fairly).
MAX_ROWS = 20
#: A changed value longer than this shows only the words that changed.
LONG_VALUE = 48
MISSING = "-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="the first experiment (.sx), compiled with its defaults")
    parser.add_argument("b", help="the second experiment (.sx), compiled with the selection flags")
    parser.add_argument("--json", action="store_true", help="print the whole structured diff as JSON")


#: A row of a section: (group, key, value); the graphs section groups its rows by graph, the others have one group.
Row = tuple[str | None, str, str]


def _knob_rows(doc: dict[str, Any]) -> Iterator[Row]:
    yield None, "variant", doc["selection"]["variant"] or "none"
    for knob in doc["selection"]["knobs"]:
        yield None, knob["name"], f"{show_value(knob['value'])} ({knob['source']})"


def _parameter_rows(doc: dict[str, Any]) -> Iterator[Row]:
    for module in doc["parameters"]["modules"]:
        for leaf in module["leaves"]:
            yield None, leaf["path"], f"{show_shape(leaf['shape'])} {leaf['dtype']} {leaf['group']}"


def _graph_rows(doc: dict[str, Any]) -> Iterator[Row]:
    for g in doc["graphs"]:
        name = g["name"]
        yield name, f"{name} nodes", str(g["nodes"])
        for o in g["ops"]:
            yield name, f"{name} {o['family']}", str(o["count"])
        for rank, t in enumerate(g["largest"], start=1):
            # The location is left out: two files put the same tensor at different lines.
            yield (
                name, f"{name} largest {rank}",
                f"{human_count(t['elements'])} {show_shape(t['shape'])} {t['dtype']} {t['op']}",
            )


def _step_rows(doc: dict[str, Any]) -> Iterator[Row]:
    for key, _, text in step_rows(doc):
        yield None, key, text


def _group_rows(doc: dict[str, Any]) -> Iterator[Row]:
    for g in doc["groups"]:
        name = g["name"]
        yield None, f"{name} optimizer", g["optimizer"]
        yield None, f"{name} members", f"{g['params']} {'param' if g['params'] == 1 else 'params'}, {human_count(g['elements'])}"
        states = ", ".join(s["name"] for s in g["states"]) or "none"
        yield None, f"{name} states", f"{states} {human_count(g['state_elements'])}"
        yield None, f"{name} constants", ", ".join(show_value(c) for c in g["constants"]) or "none"


SECTIONS = (
    ("knobs", _knob_rows),
    ("parameters", _parameter_rows),
    ("graphs", _graph_rows),
    ("training step", _step_rows),
    ("optimizer groups", _group_rows),
)

#: The graphs that vary the train graph: a row of theirs that changed exactly as train's did is train's news.
TRAIN_VARIANTS = ("train_accumulating", "train_stacked", "train_diagnosed")


def diff_documents(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Each section's differing rows, `{"key", "a", "b", "group"}` with None for a side that lacks the key.

    `group` (the graph a graphs row belongs to, else None) is for the text's fair share of rows; the
    JSON document leaves it out. A row of a train variant (train accumulating, stacked, diagnosed)
    whose two values are exactly train's row's is left out: it repeats train's change.
    """
    variants = {g["name"] for doc in (a, b) for g in doc["graphs"] if g["kind"] in TRAIN_VARIANTS}
    sections = []
    for name, rows_of in SECTIONS:
        rows_a = {key: (group, value) for group, key, value in rows_of(a)}
        rows_b = {key: (group, value) for group, key, value in rows_of(b)}
        keys = list(rows_a) + [k for k in rows_b if k not in rows_a]
        rows = []
        for k in keys:
            group = (rows_a.get(k) or rows_b[k])[0]
            va, vb = rows_a.get(k, (None, None))[1], rows_b.get(k, (None, None))[1]
            if va != vb:
                rows.append({"key": k, "a": va, "b": vb, "group": group})
        by_key = {row["key"]: row for row in rows}
        rows = [row for row in rows if not _repeats_train(row, variants, by_key)]
        if rows:
            sections.append({"name": name, "rows": rows})
    return sections


def _repeats_train(row: dict[str, Any], variants: set[str], by_key: dict[str, dict[str, Any]]) -> bool:
    group = row["group"]
    if group not in variants:
        return False
    train = by_key.get("train" + row["key"][len(group):])
    return train is not None and (train["a"], train["b"]) == (row["a"], row["b"])


def public(sections: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sections as the JSON document has them (`sexpgpu/schemas/diff.schema.json`)."""
    return [{"name": s["name"], "rows": [{k: r[k] for k in ("key", "a", "b")} for r in s["rows"]]} for s in sections]


def describe(file: str, variant: str | None, sets: list[str]) -> str:
    """A side as its command line: `my-run.sx --variant smoke --set lr=0.25`."""
    words = [file] + (["--variant", variant] if variant else []) + [w for s in sets for w in ("--set", s)]
    return " ".join(words)


def condense(a: str, b: str) -> tuple[str, str]:
    """Two long texts as the words that differ, each with a word of context, and `…` for the rest.

    `<= 106.5 MiB for one microbatch, … parameters 12.7 MiB …` against the same
    sentence with other numbers reads `<= 106.5 MiB … parameters 12.7 MiB and
    gradients 12.7 MiB besides` and `<= 20.9 MiB … parameters 2.6 MiB …`.
    """
    words_a, words_b = a.split(" "), b.split(" ")
    out_a: list[str] = []
    out_b: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=words_a, b=words_b, autojunk=False).get_opcodes():
        if tag != "equal":
            out_a += words_a[i1:i2]
            out_b += words_b[j1:j2]
            continue
        run = words_a[i1:i2]
        head = 0 if i1 == 0 else 1  # a word of context after the difference before
        tail = 0 if i2 == len(words_a) else 1  # and before the one after
        if len(run) - head - tail >= 2:
            run = [*run[:head], "…", *run[len(run) - tail :]]
        out_a += run
        out_b += run
    return " ".join(out_a), " ".join(out_b)


def _fair_share(rows: list[dict[str, Any]], cap: int) -> dict[Any, int]:
    """How many rows of each group to show: one of each in turn until `cap` are taken."""
    sizes: dict[Any, int] = {}
    for row in rows:
        sizes[row.get("group")] = sizes.get(row.get("group"), 0) + 1
    shown = dict.fromkeys(sizes, 0)
    left = cap
    while left > 0 and any(shown[g] < sizes[g] for g in sizes):
        for group in sizes:
            if left > 0 and shown[group] < sizes[group]:
                shown[group] += 1
                left -= 1
    return shown


def render_diff(diff: dict[str, Any]) -> str:
    """The text: each section's rows (each group's fair share of MAX_ROWS), long values condensed."""
    lines = [f"a  {diff['a']}", f"b  {diff['b']}", ""]
    if not diff["sections"]:
        return "\n".join([*lines, "identical"]) + "\n"
    for section in diff["sections"]:
        rows = section["rows"]
        quota = _fair_share(rows, MAX_ROWS)
        taken = dict.fromkeys(quota, 0)
        table: list[list[str] | str] = []
        for row in rows:
            group = row.get("group")
            taken[group] += 1
            if taken[group] <= quota[group]:
                va, vb = row["a"] or MISSING, row["b"] or MISSING
                if row["a"] and row["b"] and max(len(va), len(vb)) > LONG_VALUE:
                    va, vb = condense(va, vb)
                table.append([row["key"], va, vb])
            if taken[group] == quota[group] + 1 and group is not None:
                hidden = sum(1 for r in rows if r.get("group") == group) - quota[group]
                table.append(f"  … and {hidden} more {group} {'row' if hidden == 1 else 'rows'}")
        cells = [row for row in table if isinstance(row, list)]
        widths = [max(len(row[c]) for row in cells) for c in range(2)]
        lines.append(section["name"])
        lines += [row if isinstance(row, str) else f"  {row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}"
                  for row in table]
        hidden = len(rows) - sum(quota.values())
        if hidden and None in quota:
            lines.append(f"  … and {hidden} more")
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
        sys.stdout.write(json.dumps({**diff, "sections": public(sections)}, indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(render_diff(diff))
    return 0
