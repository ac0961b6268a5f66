"""The core special forms (language.md §2): quoting, conditionals, binding, functions, definitions.

Each form is an analyser `(evaluator, form, scope, loc) -> node` registered by
name with `core_form`: it checks the form's shape once, analyses its parts,
and returns the closure that runs it (see `evaluator` for nodes, scopes and
frames). The layers above register their own forms with `register_special_form`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..diagnostics import Location, SxError
from .analysis import CORE_FORMS, check_nesting, constant_node, core_form, truthy
from .calls import Closure, Macro, counted
from .data import (
    QUASIQUOTE,
    QUOTE,
    UNQUOTE,
    UNQUOTE_SPLICING,
    Keyword,
    SxList,
    SxMap,
    SxVector,
    Symbol,
    element_loc,
)
from .evaluator import Defined
from .printing import show

if TYPE_CHECKING:
    from .analysis import Scope
    from .evaluator import Evaluator


def _expect(cond: bool, message: Callable[[], str], loc: Location | None) -> None:
    """An error at `loc` unless `cond`; `message` makes its text (printing forms costs, so only on failure)."""
    if not cond:
        raise SxError(message(), loc)


def _arity(form: SxList, low: int, high: int | None, usage: str) -> None:
    n = len(form) - 1
    if n < low or (high is not None and n > high):
        raise SxError(f"'{form[0].name}' expects {usage}, got {counted(n, 'form')}", form.loc)


@core_form(QUOTE)
def _quote(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    _arity(form, 1, 1, "one form: (quote x)")
    check_nesting(form[1], element_loc(form, 1))
    return constant_node(form[1])


@core_form(QUASIQUOTE)
def _quasiquote(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    _arity(form, 1, 1, "one form: `x")
    check_nesting(form[1], element_loc(form, 1))
    return _template(ev, form[1], scope, 1, element_loc(form, 1))


def _template(ev: Evaluator, form: Any, scope: Scope, depth: int, loc: Location | None):
    """A node building the quasiquoted `form` at nesting `depth` (1 = unquotes are evaluated)."""
    cls = form.__class__
    if cls is SxList and form and form[0].__class__ is Symbol:
        head = form[0].name
        if head == UNQUOTE or head == UNQUOTE_SPLICING:
            _arity(form, 1, 1, f"one form: ({head} x)")
            if head == UNQUOTE_SPLICING and depth == 1:
                raise SxError("',@' is only allowed inside a list or vector", form.loc)
            if depth == 1:
                return ev.analyze(form[1], scope, element_loc(form, 1))
            inner = _template(ev, form[1], scope, depth - 1, element_loc(form, 1))
            sym = form[0]
            return lambda f: SxList([sym, inner(f)])
        if head == QUASIQUOTE:
            _arity(form, 1, 1, "one form: `x")
            inner = _template(ev, form[1], scope, depth + 1, element_loc(form, 1))
            sym = form[0]
            return lambda f: SxList([sym, inner(f)])
    if cls in (SxList, SxVector, SxMap) and form:
        origin = form.loc
        parts = []  # (splice?, node)
        for i, item in enumerate(form):
            item_loc = element_loc(form, i)
            if (
                item.__class__ is SxList and len(item) == 2 and item[0].__class__ is Symbol
                and item[0].name == UNQUOTE_SPLICING and depth == 1
            ):  # fmt: skip
                parts.append((True, ev.analyze(item[1], scope, element_loc(item, 1)), item.loc))
            else:
                parts.append((False, _template(ev, item, scope, depth, item_loc), item_loc))

        def build(f: list) -> Any:
            items: list = []
            for splice, node, where in parts:
                if splice:
                    value = node(f)
                    if value is None:
                        continue
                    if not isinstance(value, list):
                        raise SxError(f"',@' needs a list to splice, got {show(value)}", where)
                    items.extend(value)
                else:
                    items.append(node(f))
            return cls(items, origin=origin)

        return build
    return constant_node(form)


@core_form("if")
def _if(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    _arity(form, 2, 3, "(if test then [else])")
    test, then = ev.analyze(form[1], scope, element_loc(form, 1)), ev.analyze(form[2], scope, element_loc(form, 2))
    other = ev.analyze(form[3], scope, element_loc(form, 3)) if len(form) > 3 else constant_node(None)

    def node(f: list) -> Any:
        v = test(f)
        if v is None or v is False or (v.__class__ is SxList and not v):
            return other(f)
        return then(f)

    return node


def _when_unless(negate: bool):
    def analyse(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
        _arity(form, 1, None, f"({form[0].name} test body…)")
        test = ev.analyze(form[1], scope, element_loc(form, 1))
        body = ev.analyze_body(form, scope, form, 2)

        def node(f: list) -> Any:
            return body(f) if truthy(test(f)) != negate else None

        return node

    return analyse


CORE_FORMS["when"] = _when_unless(False)
CORE_FORMS["unless"] = _when_unless(True)


@core_form("cond")
def _cond(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    clauses = []
    for i, clause in enumerate(form[1:], 1):
        where = element_loc(form, i)
        if not (isinstance(clause, SxList) and len(clause) >= 1):
            raise SxError(f"cond: each clause is (test body…), got {show(clause)}", where)
        test = clause[0]
        is_else = test.__class__ is Keyword and test.name == "else" or test is True
        test_node = ev.analyze(test, scope, element_loc(clause, 0))
        clauses.append((is_else, test_node, ev.analyze_body(clause, scope, clause, 1) if len(clause) > 1 else None))

    def node(f: list) -> Any:
        for is_else, test, body in clauses:
            value = True if is_else else test(f)
            if truthy(value):
                return body(f) if body is not None else value
        return None

    return node


@core_form("do")
def _do(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    return ev.analyze_body(form, scope, form, 1)


def _bindings(form: SxList) -> list[tuple[Symbol, Any, Location | None]]:
    _arity(form, 1, None, f"({form[0].name} ((name value) …) body…)")
    bindings = form[1]
    where = element_loc(form, 1)
    _expect(
        bindings is None or isinstance(bindings, SxList),
        lambda: f"{form[0].name}: bindings are a list of (name value), got {show(bindings)}",
        where,
    )
    out = []
    for i, b in enumerate(bindings or ()):
        bloc = element_loc(bindings, i)
        if not (isinstance(b, SxList) and len(b) == 2 and isinstance(b[0], Symbol)):
            raise SxError(f"{form[0].name}: each binding is (name value), got {show(b)}", bloc)
        if form[0].name == "let" and any(b[0] == seen for seen, _, _ in out):
            # let binds in parallel: a second binding of a name could only be a mistake.
            raise SxError(f"let: '{b[0].name}' is bound twice", element_loc(b, 0))
        out.append((b[0], b[1], element_loc(b, 1)))
    return out


def _let_node(slots: list[int], values: list, body: Callable) -> Callable[[list], Any]:
    pairs = list(zip(slots, values))

    def node(f: list) -> Any:
        computed = [v(f) for _, v in pairs]
        for (slot, _), value in zip(pairs, computed):
            f[slot] = value
        return body(f)

    return node


@core_form("let")
def _let(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    bindings = _bindings(form)
    values = [ev.analyze(value, scope, where) for _, value, where in bindings]
    inner = scope.child()
    slots = [inner.bind(sym.name) for sym, _, _ in bindings]
    return _let_node(slots, values, ev.analyze_body(form, inner, form, 2))


@core_form("let*")
def _let_star(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    inner = scope
    slots, values = [], []
    for sym, value, where in _bindings(form):
        values.append(ev.analyze(value, inner, where))
        inner = inner.child()
        slots.append(inner.bind(sym.name))
    body = ev.analyze_body(form, inner, form, 2)
    pairs = list(zip(slots, values))

    def node(f: list) -> Any:
        for slot, value in pairs:
            f[slot] = value(f)
        return body(f)

    return node


@core_form("fn")
def _fn(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    _arity(form, 1, None, "(fn (args…) body…)")
    return ev.analyze_function(None, form[1], form, 2, scope, loc)


def _name_of(form: SxList, what: str) -> Symbol:
    _expect(
        len(form) > 1 and isinstance(form[1], Symbol),
        lambda: f"'{form[0].name}' expects a name first: {what}",
        element_loc(form, 1) if len(form) > 1 else form.loc,
    )
    return form[1]


@core_form("def")
def _def(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    name = _name_of(form, "(def name value)").name
    _arity(form, 2, 2, "(def name value)")
    value_node = ev.analyze(form[2], scope, element_loc(form, 2))
    g = ev.globals

    def node(f: list) -> Defined:
        value = value_node(f)
        if isinstance(value, Closure) and value.name is None:
            value.name = name
        g[name] = value
        return Defined(name, value)

    return node


def _body_start(form: SxList) -> int:
    """Where a defn/defmacro body starts: after an optional docstring."""
    return 4 if len(form) > 4 and isinstance(form[3], str) else 3


@core_form("defn")
def _defn(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    name = _name_of(form, "(defn name (args…) body…)").name
    _arity(form, 2, None, "(defn name (args…) body…)")
    g = ev.globals
    # Bound before the body is analysed is not needed: globals resolve at run time.
    make = ev.analyze_function(name, form[2], form, _body_start(form), scope, loc)

    def node(f: list) -> Defined:
        g[name] = fn = make(f)
        return Defined(name, fn)

    return node


@core_form("defmacro")
def _defmacro(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    name = _name_of(form, "(defmacro name (args…) body…)").name
    _arity(form, 2, None, "(defmacro name (args…) body…)")
    make = ev.analyze_function(name, form[2], form, _body_start(form), scope, loc)
    g = ev.globals

    def node(f: list) -> Defined:
        g[name] = macro = Macro(name, make(f), loc)
        return Defined(name, macro)

    return node


def _and_or(is_and: bool):
    def analyse(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
        nodes = [ev.analyze(x, scope, element_loc(form, i + 1)) for i, x in enumerate(form[1:])]

        def node(f: list) -> Any:
            value: Any = True if is_and else None
            for n in nodes:
                value = n(f)
                if truthy(value) != is_and:
                    return value
            return value

        return node

    return analyse


CORE_FORMS["and"] = _and_or(True)
CORE_FORMS["or"] = _and_or(False)


@core_form("set!")
def _set(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    sym = _name_of(form, "(set! name value)")
    _arity(form, 2, 2, "(set! name value)")
    value_node = ev.analyze(form[2], scope, element_loc(form, 2))
    address = scope.lookup(sym.name)
    if address is not None:
        depth, slot = address

        def set_local(f: list) -> Any:
            value = value_node(f)
            target = f
            for _ in range(depth):
                target = target[0]
            target[slot] = value
            return value

        return set_local
    g, name = ev.globals, sym.name

    def set_global(f: list) -> Any:
        if name not in g:
            raise ev.unbound(name, sym.loc, scope)
        g[name] = value = value_node(f)
        return value

    return set_global


@core_form("require")
def _require(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    _arity(form, 1, 1, '(require "path.sx")')
    path_node = ev.analyze(form[1], scope, element_loc(form, 1))

    def node(f: list) -> None:
        target = path_node(f)
        if not isinstance(target, str):
            raise SxError(f"require expects a path string, got {show(target)}", element_loc(form, 1))
        ev.require(target, loc)
        return None

    return node


@core_form("assert")
def _assert(ev: Evaluator, form: SxList, scope: Scope, loc: Location | None):
    _arity(form, 1, 2, '(assert test ["message"])')
    test = ev.analyze(form[1], scope, element_loc(form, 1))
    message = ev.analyze(form[2], scope, element_loc(form, 2)) if len(form) > 2 else None
    text = show(form[1])

    def node(f: list) -> None:
        if not truthy(test(f)):
            detail = message(f) if message is not None else text
            raise SxError(f"assertion failed: {detail if isinstance(detail, str) else show(detail)}", loc)
        return None

    return node
