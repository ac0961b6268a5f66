"""Where a macro's expansion is: the use site every list (and name) an expansion built carries.

A macro's expansion is new data with no place in any file. `stamp` gives each list it
built an `ExpandedLocation`: the position of the macro's use, remembering the macro and
where its template wrote the list. `in_expansions` turns an error located there into
what compilers print: the error at the template, a note `in the expansion of macro 'm'`
at each use it came from. Every path that evaluates code (`Evaluator.eval_toplevel`,
`Analyzer.expand_all`, the experiment lowering's tracing) passes its errors through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ..diagnostics import Location, Note, SxError
from .data import SxList, SxMap, SxVector, Symbol
from .limits import MAX_EXPANSION_DEPTH

if TYPE_CHECKING:
    from .calls import Macro


@attrs.frozen
class ExpandedLocation(Location):
    """Where a list or name that a macro's expansion holds is: the position of the macro's `use`
    for a list, where the macro wrote it for a name (`stamp`).

    It remembers the `macro`, its `use` and where its template wrote the list or name
    (`origin`, None when the macro built it otherwise), so an error located here can name
    both, as `in_expansions` does. Ops and reports see the position, as before.
    """

    macro: Macro | None = attrs.field(default=None, eq=False, repr=False)
    use: Location | None = attrs.field(default=None, eq=False, repr=False)
    origin: Location | None = attrs.field(default=None, eq=False, repr=False)

    def with_via(self, via: Location | None) -> Location:
        return attrs.evolve(self, via=via)


def stamp(expansion: Any, macro: Macro, use: Location, arguments: list) -> Any:
    """`expansion`, what the macro's `use` expanded to, located there: the lists it built and the names.

    A list the expansion built has no location: it gets the use's position (what ops and
    reports see). A name the macro wrote (from its template, or made) is replaced by the
    same name located where it was written (or at the use), remembering the use, so an
    error at a name the expansion holds names the use too. Names and lists the use passed
    in (`arguments`) are the user's own code and keep their locations.
    """
    given = _symbols_in(arguments)
    if expansion.__class__ is Symbol:
        return expansion if id(expansion) in given else _expanded_symbol(expansion, macro, use)
    stack = [expansion]
    while stack:
        form = stack.pop()
        if isinstance(form, (SxList, SxVector, SxMap)) and form.loc is None:
            form.loc = ExpandedLocation(
                use.file, use.line, use.col, use.end_col, use.via, macro=macro, use=use, origin=form.origin
            )
            for i, item in enumerate(form):
                if item.__class__ is Symbol:
                    if id(item) not in given and not isinstance(item.loc, ExpandedLocation):
                        form[i] = _expanded_symbol(item, macro, use)
                else:
                    stack.append(item)
    return expansion


def _symbols_in(forms: list) -> set[int]:
    """The identities of the symbols in `forms`, at any depth."""
    found = set()
    stack = list(forms)
    while stack:
        form = stack.pop()
        if form.__class__ is Symbol:
            found.add(id(form))
        elif isinstance(form, list):
            stack.extend(form)
    return found


def _expanded_symbol(sym: Symbol, macro: Macro, use: Location) -> Symbol:
    written = sym.loc
    at = written or use
    loc = ExpandedLocation(at.file, at.line, at.col, at.end_col, at.via, macro=macro, use=use, origin=written)
    return Symbol(sym.name, loc)


#: Notes an error in nested expansions keeps: the innermost ones and the outermost use.
_MAX_EXPANSION_NOTES = 8


def in_expansions(err: SxError) -> SxError:
    """`err`, when located in a macro's expansion, told as compilers tell it.

    The error moves to where the macro wrote the failing form (its template, else the
    `defmacro`), and a note `in the expansion of macro 'm'` points at each use it was
    expanded from, innermost first. Any other error is left as it is.
    """
    where = err.loc
    if not isinstance(where, ExpandedLocation):
        return err
    notes: list[Note] = []
    while isinstance(where, ExpandedLocation):
        macro = where.macro
        written = where.origin or (macro.loc if macro is not None else None) or where
        if notes:
            notes[-1] = Note(written, notes[-1].message)
        else:
            err.loc = written.with_via(where.via) if where.via is not None else written
        notes.append(Note(where.use, f"in the expansion of macro '{macro.name if macro else '?'}'"))
        where = where.use
    if len(notes) > _MAX_EXPANSION_NOTES:
        left_out = len(notes) - _MAX_EXPANSION_NOTES
        notes = [*notes[: _MAX_EXPANSION_NOTES - 1], Note(None, f"({left_out} more expansions)"), notes[-1]]
    err.notes[:0] = notes
    return err


def endless_expansion(macro: Macro, loc: Location | None) -> SxError:
    return SxError(
        f"macro '{macro.name}' expands without end: more than {MAX_EXPANSION_DEPTH} expansions inside one "
        "another (does its expansion use it again?)",
        loc,
    )

