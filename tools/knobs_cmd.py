"""`sexpgpu knobs FILE`: each knob with its default, its doc and the value each variant gives it.

With `--variant`/`--set` a `selected` column shows the selection and where
each value came from. `--json` prints
`{"file", "variants": [names], "knobs": [{"name", "default", "doc", "variants": {variant: value}, "selected": [value, source]}]}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..diagnostics import display_path
from ..frontend.evaluator import Evaluator
from ..frontend.selection import Selection, plain_value, show_value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the experiment (.sx)")
    parser.add_argument("--json", action="store_true", help="print the knobs as one JSON document")


def file_selection(path: str, variant: str | None, sets: list[str]) -> Selection:
    """Evaluate the file (no graph is traced) and return its knobs, variants and selection."""
    evaluator = Evaluator(variant=variant, sets=sets)
    evaluator.eval_file(path)
    selection = evaluator.experiment.selection  # type: ignore[attr-defined]
    selection.check_command_line()
    return selection


def knobs_document(path: str, variant: str | None, sets: list[str]) -> dict[str, Any]:
    selection = file_selection(path, variant, sets)
    return {
        "file": display_path(path),
        "variants": list(selection.variants),
        "knobs": [
            {
                "name": knob.name,
                "default": plain_value(knob.default),
                "doc": knob.doc,
                "variants": {
                    v.name: plain_value(v.values[knob.name]) for v in selection.variants.values() if knob.name in v.values
                },
                "selected": [plain_value(selection.values[knob.name][0]), selection.values[knob.name][1]],
            }
            for knob in selection.knobs.values()
        ],
    }


def render(path: str, variant: str | None, sets: list[str]) -> str:
    selection = file_selection(path, variant, sets)
    if not selection.knobs:
        return f"{display_path(path)}: no knobs"
    show_selected = variant is not None or bool(sets)
    header = ["knob", "default", *selection.variants, *(["selected"] if show_selected else []), "doc"]
    rows = [header]
    for knob in selection.knobs.values():
        row = [knob.name, show_value(knob.default)]
        row += [show_value(v.values[knob.name]) if knob.name in v.values else "-" for v in selection.variants.values()]
        if show_selected:
            value, source = selection.values[knob.name]
            row.append(f"{show_value(value)} ({source})")
        row.append(knob.doc or "")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    if args.json:
        json.dump(knobs_document(args.file, args.variant, args.set), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(args.file, args.variant, args.set))
    return 0
