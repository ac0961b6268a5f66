"""`macro-expand`: every macro use in the unit's forms expanded, recursively.

User macros must be known before their uses, so the forms that define names or
load files (`defmacro`, `def`, `defn`, `require`) are evaluated in order as
the pass goes, also inside a top-level `do` (what a macro defining several
things expands to); nothing else is evaluated. Quoted and quasiquoted data are
left as written.
"""

from __future__ import annotations

from typing import ClassVar

from attrs import define

from ..diagnostics import Location, SxError
from ..frontend.data import SxList, Symbol, element_loc
from ..frontend.evaluator import Evaluator, run_deep
from .manager import CompilationUnit, Pass, register_pass

#: Top-level forms the pass evaluates so later forms can use what they define.
DEFINING_HEADS = frozenset({"defmacro", "def", "defn", "require"})


@register_pass
@define
class MacroExpandPass(Pass):
    """Replaces `unit.forms` by the same forms with every macro use expanded.

    Guarantees: no form holds a macro use outside quoted data; each top-level
    form keeps its location.
    """

    name: ClassVar[str] = "macro-expand"
    summary: ClassVar[str] = "expand every macro use (dumps the expanded forms)"

    def run(self, unit: CompilationUnit) -> None:
        if unit.forms is None:
            raise SxError("macro-expand needs forms: run 'read' first")
        forms = unit.forms
        evaluator = Evaluator(variant=unit.variant, sets=unit.sets)
        locs = getattr(forms, "locs", None) or [None] * len(forms)

        def expand_all() -> SxList:
            expanded = SxList([], getattr(forms, "loc", None), [])
            for form, loc in zip(forms, locs):
                form = evaluator.expand_all(form, loc)
                expanded.append(form)
                expanded.locs.append(loc)
                define(form, loc)
            return expanded

        def define(form: object, loc: Location | None) -> None:
            """Evaluate `form` if it defines something; the defining forms of a top-level `do`."""
            if not (isinstance(form, SxList) and form and isinstance(form[0], Symbol)):
                return
            if form[0].name in DEFINING_HEADS:
                evaluator.eval_toplevel(form, loc)
            elif form[0].name == "do":
                for i in range(1, len(form)):
                    define(form[i], element_loc(form, i) or loc)

        unit.forms = run_deep(expand_all)
