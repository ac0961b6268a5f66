"""`explain{json=false}`: the explain report of the unit's experiment, written to `unit.out`.

The document comes from `sexpgpu.report.document.build_document` (the module plus the
facts earlier passes left: casts and kept-f32 sites from `insert-casts`, the
memory bound from `plan-memory`); with `json=true` the pass writes the
document itself, pretty-printed, instead of its text.
"""

from __future__ import annotations

import json
from typing import ClassVar

from attrs import define

from ..report.document import build_document
from ..report.explain_text import render_text
from .manager import CompilationUnit, DumpPass, register_pass


@register_pass
@define
class ExplainPass(DumpPass):
    """Writes the explain report of the unit's module (its text, or with `json` the document).

    Guarantees: the unit is unchanged; the report covers the module and the
    facts earlier passes left.
    """

    name: ClassVar[str] = "explain"
    summary: ClassVar[str] = "dump the explain report (json=true: the document)"

    json: bool = False

    def dump(self, unit: CompilationUnit) -> None:
        document = build_document(unit.require_module(self.name), unit.facts, unit.path)
        if self.json:
            unit.out.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
        else:
            unit.out.write(render_text(document))
