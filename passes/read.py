"""`read`: the unit's source text to located forms."""

from __future__ import annotations

from typing import ClassVar

from attrs import define

from ..diagnostics import SxError
from ..frontend.reader import read_file, read_text
from .manager import CompilationUnit, Pass, register_pass


@register_pass
@define
class ReadPass(Pass):
    """Reads the unit's text (or its file) into `unit.forms`.

    Guarantees: `unit.forms` holds every top-level datum in file order, each
    located by `unit.forms.locs`.
    """

    name: ClassVar[str] = "read"
    summary: ClassVar[str] = "read the .sx source into located forms"

    def run(self, unit: CompilationUnit) -> None:
        if unit.text is not None:
            unit.forms = read_text(unit.text, unit.path or "<input>")
        elif unit.path is not None:
            unit.forms = read_file(unit.path)
        else:
            raise SxError("read: the unit has neither a path nor text")
