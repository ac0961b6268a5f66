"""The .sx evaluator (language.md §2).

Each top-level form is analysed once into a tree of Python closures and then run.
`def` always defines a global (the session's top-level environment, shared with
required files). The evaluator is this core and the modules it imports, one per seam:

- `analysis`: the analyser (scopes, frames, nodes, macro expansion during analysis) and
  the registries of special forms;
- `calls`: functions and their calls (closures, macros, builtins, signatures, the call stack);
- `expansions`: where a macro's expansion is, and errors told at the macro's use;
- `deep`: the thread with a large stack that analysed code runs on.

None of them imports the modules that fill the registries. The core special forms are
in `special_forms`, the builtins in `builtins`, `tracer`, `modules` and
`experiment_forms`; `library` puts them together, and importing the package does
that (see `library`).

Extension points for the layers above (the experiment language):

- `analysis.core_form`: the analyser of a core special form (`special_forms` registers them).
- `calls.register_builtin` / `@calls.builtin`: Python functions by name, optionally given the
  call's `Location` and the call's `:key value` pairs as Python keyword arguments.
- `analysis.register_special_form`: forms that receive their arguments unevaluated, with an
  `Env` to evaluate them in and the form's location.
- `data.TENSOR_OPS`: tensor implementations of the overloaded arithmetic.
- `calls.user_location`, `calls.call_trail`: where the user's code is, from inside a builtin.
- `Evaluator`: a session with its own globals; `eval_file`, `load_prelude`.
- `Defined`: the value of a defining form, printed `name = value` by `eval`.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Callable
from typing import Any

from ..diagnostics import Location, SxError
from .analysis import Analyzer, FrameInfo, Scope, form_name
from .calls import BUILTINS, LIBRARY_FILES, MAX_TRAIL, Builtin
from .data import SELF_EVALUATING_NAMES, SxList, Symbol
from .deep import run_deep
from .expansions import in_expansions
from .printing import show
from .reader import read_file, read_text

# -- runtime values ---------------------------------------------------------------------------


class Values:
    """Several values, from `(values a b …)`; printed `#<values a b>`."""

    __slots__ = ("items",)

    def __init__(self, items: tuple) -> None:
        self.items = items

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Values) and other.items == self.items

    def __hash__(self) -> int:
        return hash(self.items)

    def __sx_repr__(self) -> str:
        return "#<values" + "".join(" " + show(x) for x in self.items) + ">"


class Defined:
    """What a defining top-level form returns: `eval` prints it `name = value`.

    Any special form or builtin that defines a name may return one.
    """

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value

    def __sx_repr__(self) -> str:
        return f"{self.name} = {show(self.value)}"


SESSION_HOOKS: list[Callable[[Evaluator], None]] = []

def eval_file_lines(path: str, variant: str | None = None, sets: list[str] | None = None,
                    on_line: Callable[[str], None] | None = None, text: str | None = None) -> list[str]:  # fmt: skip
    """What `sexpgpu eval` prints for `path` (or for `text` standing for it): one line per top-level form."""
    lines: list[str] = []

    def emit(form: Any, value: Any) -> None:
        line = show(value)
        lines.append(line)
        if on_line is not None:
            on_line(line)

    evaluator = Evaluator(variant=variant, sets=sets)
    if text is not None:
        evaluator.sources[os.path.abspath(path)] = text
    evaluator.eval_file(path, emit)
    return lines


class Evaluator(Analyzer):
    """A session: one global environment, the files it required, the library files."""

    def __init__(
        self,
        extra_builtins: dict[str, Builtin] | None = None,
        variant: str | None = None,
        sets: list[str] | None = None,
    ) -> None:
        super().__init__({name: Symbol(name) for name in SELF_EVALUATING_NAMES})
        self.globals.update(BUILTINS)
        if extra_builtins:
            self.globals.update(extra_builtins)
        #: Absolute paths of the files required so far.
        self.loaded: set[str] = set()
        #: The files being evaluated, outermost first (for require cycles).
        self.loading: list[str] = []
        #: Text that stands for a file's contents, by absolute path (a chunk of
        #: `sexpgpu-opt --split-input-file`, or standard input).
        self.sources: dict[str, str] = {}
        self._gensym_counter = itertools.count(1)
        for b in (
            Builtin("gensym", self.gensym),
            Builtin("macroexpand-1", lambda loc, form: self.macroexpand(form, loc, once=True), wants_loc=True),
            Builtin("macroexpand", lambda loc, form: self.macroexpand(form, loc), wants_loc=True),
        ):
            self.globals[b.name] = b
        #: The selection the command line asked for, for the layers that define knobs.
        self.variant = variant
        self.sets = list(sets or [])
        for hook in SESSION_HOOKS:
            hook(self)

    # -- entry points --

    def eval_file(
        self, path: str, on_result: Callable[[Any, Any], None] | None = None
    ) -> list[tuple[Any, Any]]:
        """Evaluate every top-level form of `path`; (form, value) for each.

        `on_result(form, value)` is called as each form finishes (so `eval` prints
        the values before an error in a later form).
        """
        return run_deep(lambda: self._eval_file(path, on_result))

    def eval_text(self, text: str, file: str = "<string>") -> list[Any]:
        """Evaluate every top-level form of `text`; the value of each."""
        self.sources[os.path.abspath(file)] = text  # what forms that read their file ahead (`defknobs`) see
        forms = read_text(text, file)
        return run_deep(lambda: [self.eval_toplevel(f, loc) for f, loc in zip(forms, forms.locs)])

    def load_prelude(self, path: str) -> None:
        """Evaluate a library file: `user_location` looks through its frames."""
        LIBRARY_FILES.add(os.path.abspath(path))
        LIBRARY_FILES.add(path)
        self.eval_file(path)

    def eval_toplevel(self, form: Any, loc: Location | None) -> Any:
        """Analyse and run one top-level form."""
        scope = Scope(FrameInfo(), None)
        try:
            node = self.analyze(form, scope, loc)
            return node([None] * scope.frame.size)
        except SxError as err:
            raise in_expansions(err) from None
        except RecursionError:
            # The bounds on nesting and calls keep within Python's limit; together they may not.
            raise SxError(
                f"{form_name(form)} nests too deeply to evaluate: its calls and forms together pass "
                "the evaluator's recursion limit",
                getattr(form, "loc", None) or loc,
            ) from None

    def read_source(self, path: str) -> SxList:
        """The forms of `path`: its text in `sources` when given there, else the file's."""
        text = self.sources.get(os.path.abspath(path))
        return read_file(path) if text is None else read_text(text, path)

    def _eval_file(self, path: str, on_result: Callable[[Any, Any], None] | None = None) -> list[tuple[Any, Any]]:
        forms = self.read_source(path)
        self.loading.append(os.path.abspath(path))
        results = []
        try:
            for form, loc in zip(forms, forms.locs):
                value = self.eval_toplevel(form, loc)
                results.append((form, value))
                if on_result is not None:
                    on_result(form, value)
        finally:
            self.loading.pop()
        return results

    def require(self, target: str, loc: Location | None) -> None:
        """Evaluate the `.sx` file `target` (relative to the requiring file) unless done already."""
        if not target.endswith(".sx"):
            raise SxError(f"cannot require '{target}': require loads .sx source files only", loc)
        base = os.path.dirname(loc.file) if loc and not loc.file.startswith("<") else "."
        path = os.path.normpath(os.path.join(base, target))
        full = os.path.abspath(path)
        if full in self.loading:
            chain = self.loading[self.loading.index(full):] + [full]
            raise SxError("require cycle: " + " -> ".join(os.path.basename(p) for p in chain), loc)
        if full in self.loaded:
            return
        if full not in self.sources:
            try:
                mode = os.stat(path).st_mode
            except OSError:
                raise SxError(f"cannot require '{target}': no such file {path}", loc) from None
            if not stat.S_ISREG(mode):
                kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
                raise SxError(f"cannot require '{target}': {path} is {kind}", loc)
        self.loaded.add(full)
        try:
            self._eval_file(path)
        except SxError as e:
            # An error in the required file lists the require among its "called from" lines.
            if loc is not None and len(e.trail) < MAX_TRAIL:
                e.trail.append(loc)
            raise

    def gensym(self, prefix: Any = "g") -> Symbol:
        """A fresh symbol, `g#1`: numbered per session, and `#` keeps it apart from ordinary names."""
        name = prefix.name if isinstance(prefix, Symbol) else str(prefix)
        return Symbol(f"{name}#{next(self._gensym_counter)}")
