"""The analyser: each form, once, to a tree of Python closures ("nodes", ``node(frame) -> value``).

Analysis resolves every local variable to a (depth, slot) address: a runtime frame is a
Python list whose slot 0 is the enclosing frame, so a variable reference is one or two
list indexings. `let` bindings live in the slots of the enclosing function's frame.
Macros are expanded during analysis (`Analyzer.macro_of`, `expand_1`): a macro must be
defined before the forms that use it are evaluated.

The special forms are registered here: the core ones by their analysers (`core_form`,
filled by `special_forms`), those of the layers above as functions of their unevaluated
arguments (`register_special_form`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..diagnostics import Location, SxError, nearest, source_line
from .calls import MISSING, Closure, Macro, invoke, parse_params
from .data import (
    MAP_KEY_RULE,
    MAP_KEY_TYPES,
    QUASIQUOTE,
    QUOTE,
    UNQUOTE,
    UNQUOTE_SPLICING,
    SxList,
    SxMap,
    SxVector,
    Symbol,
    element_loc,
)
from .expansions import endless_expansion, in_expansions, stamp
from .limits import MAX_EXPANSION_DEPTH, MAX_NESTING
from .printing import described

if TYPE_CHECKING:
    from .evaluator import Evaluator

# -- registries -------------------------------------------------------------------------------

#: Special form name -> analyser(evaluator, form, scope, loc) -> node.
CORE_FORMS: dict[str, Callable] = {}

#: Special forms registered by other layers: name -> fn(env, args, loc) -> value.
SPECIAL_FORMS: dict[str, Callable[[Env, list, Location | None], Any]] = {}


def register_special_form(name: str, fn: Callable[[Env, list, Location | None], Any]) -> None:
    """Make `name` a special form: `fn(env, args, loc)` gets the unevaluated argument forms.

    `env.eval(form)` evaluates one of them where the special form appears;
    `env.loc_of_arg(i)` locates argument i. Return a `Defined` to print `name = value`.
    """
    SPECIAL_FORMS[name] = fn


def core_form(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering an analyser `(evaluator, form, scope, loc) -> node` as the core form `name`."""

    def register(fn: Callable) -> Callable:
        CORE_FORMS[name] = fn
        return fn

    return register




class FrameInfo:
    """The slots of one runtime frame (a function's arguments and its `let` bindings)."""

    __slots__ = ("size",)

    def __init__(self, size: int = 1) -> None:
        self.size = size

    def allocate(self) -> int:
        self.size += 1
        return self.size - 1


class Scope:
    """The local names visible at a point of the code, mapped to slots of frames.

    Scopes nest (a `let` in a `let` in a function …); `bound` is shared by a scope
    and all its descendants and holds every name any of them binds, so a name no
    local binds (`+`, a global) is known to be global at once instead of after a
    walk up every enclosing scope: with that walk, 20,000 nested `let`s took
    minutes to analyse.
    """

    __slots__ = ("names", "frame", "parent", "cache", "bound")

    def __init__(self, frame: FrameInfo, parent: Scope | None) -> None:
        self.names: dict[str, int] = {}
        self.frame = frame
        self.parent = parent
        self.bound: set[str] = parent.bound if parent is not None else set()
        #: Nodes analysed for `Env.eval`, by form identity (the form is kept alive with its node).
        self.cache: dict[int, tuple[Any, Callable]] = {}

    def lookup(self, name: str) -> tuple[int, int] | None:
        """(frames up, slot) of a local `name`, or None for a global."""
        if name not in self.bound:
            return None
        depth, scope = 0, self
        while scope is not None:
            slot = scope.names.get(name)
            if slot is not None:
                return depth, slot
            parent = scope.parent
            if parent is not None and parent.frame is not scope.frame:
                depth += 1
            scope = parent
        return None

    def bind(self, name: str) -> int:
        slot = self.frame.allocate()
        self.names[name] = slot
        self.bound.add(name)
        return slot

    def child(self) -> Scope:
        """A nested scope in the same frame (a `let`)."""
        return Scope(self.frame, self)

    def function(self) -> Scope:
        """The scope of a function body: a new frame whose slot 0 is this scope's frame."""
        return Scope(FrameInfo(), self)

    def all_names(self) -> set[str]:
        names, scope = set(), self
        while scope is not None:
            names.update(scope.names)
            scope = scope.parent
        return names


class Env:
    """Where a registered special form appears: evaluates its argument forms there."""

    __slots__ = ("evaluator", "scope", "frame", "form")

    def __init__(self, evaluator: Evaluator, scope: Scope, frame: list, form: SxList) -> None:
        self.evaluator = evaluator
        self.scope = scope
        self.frame = frame
        self.form = form

    def eval(self, form: Any, loc: Location | None = None) -> Any:
        """Evaluate `form` in the special form's lexical environment."""
        cached = self.scope.cache.get(id(form))
        if cached is None or cached[0] is not form:
            # A nested frame: the form may bind `let` slots the running frame does not have.
            inner = self.scope.function()
            body = self.evaluator.analyze(form, inner, loc or self.form.loc)
            info = inner.frame

            def node(frame: list, body: Callable = body, info: FrameInfo = info) -> Any:
                return body([frame] + [None] * (info.size - 1))

            cached = (form, node)
            self.scope.cache[id(form)] = cached
        return cached[1](self.frame)

    def loc_of_arg(self, index: int) -> Location | None:
        """The location of argument `index` (0 is the first after the form's name)."""
        return element_loc(self.form, index + 1)

    def bind_global(self, name: str, value: Any) -> None:
        self.evaluator.globals[name] = value


def _is_special(name: str) -> bool:
    return name in CORE_FORMS or name in SPECIAL_FORMS


class Analyzer:
    """Analyses forms against a global environment (`globals`), expanding macros as it goes."""

    def __init__(self, globals: dict[str, Any]) -> None:
        self.globals = globals
        #: Forms being analysed, each inside the one before (see `MAX_NESTING`).
        self._nesting = 0
        #: The macro uses whose expansions are being analysed, outermost first.
        self._expansions: list[tuple[Macro, Location | None]] = []

    # -- macros --

    def macro_of(self, form: Any, scope: Scope | None = None) -> Macro | None:
        """The macro `form` uses, if its head names one (and no local shadows it)."""
        if form.__class__ is SxList and form and form[0].__class__ is Symbol:
            name = form[0].name
            if scope is not None and scope.lookup(name) is not None:
                return None
            value = self.globals.get(name)
            if isinstance(value, Macro):
                return value
        return None

    def expand_1(self, macro: Macro, form: SxList, loc: Location | None) -> Any:
        """One expansion of a macro use, located there (`expansions.stamp`).

        Each list the expansion builds gets its own `ExpandedLocation`: the use's position,
        and where the macro's template wrote the list; each name the macro wrote remembers
        the use too. An error at either names both.
        """
        arguments = list(form[1:])
        expansion = invoke(macro.fn, arguments, loc)
        return expansion if loc is None else stamp(expansion, macro, loc, arguments)

    def macroexpand(self, form: Any, loc: Location | None, once: bool = False) -> Any:
        for _ in range(MAX_EXPANSION_DEPTH):
            macro = self.macro_of(form)
            if macro is None:
                return form
            form = self.expand_1(macro, form, getattr(form, "loc", None) or loc)
            if once:
                return form
        macro = self.macro_of(form)
        if macro is None:
            return form
        raise endless_expansion(macro, loc)

    def expand_all(self, form: Any, loc: Location | None) -> Any:
        """`form` with every macro use expanded (for the `macro-expand` pass); quoted data untouched."""
        try:
            return self._expand_all(form, loc, 0)
        except SxError as err:
            raise in_expansions(err) from None

    def _expand_all(self, form: Any, loc: Location | None, depth: int) -> Any:
        if depth > MAX_NESTING:
            raise _nested_too_deeply(form, getattr(form, "loc", None) or loc)
        form = self.macroexpand(form, loc)
        if form.__class__ is SxList and form:
            head = form[0]
            if head.__class__ is Symbol and head.name in (QUOTE, QUASIQUOTE):
                # Templates expand after substitution, when the macro's result is expanded.
                return form
            return form.with_items([self._expand_all(x, element_loc(form, i), depth + 1) for i, x in enumerate(form)])
        if isinstance(form, (SxVector, SxMap)):
            return form.with_items([self._expand_all(x, element_loc(form, i), depth + 1) for i, x in enumerate(form)])
        return form

    # -- analysis --

    def analyze(self, form: Any, scope: Scope, loc: Location | None) -> Callable[[list], Any]:
        """The node computing `form` in `scope`; `loc` locates `form` when it is an atom."""
        cls = form.__class__
        if cls is Symbol:
            return self._analyze_symbol(form, scope)
        if cls is not SxList and cls is not SxVector and cls is not SxMap:
            return constant_node(form)
        if not form and cls is SxList:
            return constant_node(None)
        self._nesting += 1
        try:
            if self._nesting > MAX_NESTING:
                raise _nested_too_deeply(form, form.loc or loc)
            if cls is SxList:
                return self._analyze_list(form, scope)
            nodes = [self.analyze(x, scope, element_loc(form, i)) for i, x in enumerate(form)]
            if cls is SxVector:
                return lambda f: SxVector([n(f) for n in nodes])
            return _map_node(nodes, [element_loc(form, i) for i in range(0, len(form), 2)])
        finally:
            self._nesting -= 1

    def _analyze_symbol(self, sym: Symbol, scope: Scope) -> Callable[[list], Any]:
        name = sym.name
        address = scope.lookup(name)
        if address is not None:
            return _local_ref(*address)
        if _is_special(name) and name not in self.globals:
            raise SxError(f"'{name}' is a special form, not a value", sym.loc)
        g = self.globals
        loc = sym.loc

        def global_ref(f: list) -> Any:
            try:
                return g[name]
            except KeyError:
                raise self.unbound(name, loc, scope) from None

        return global_ref

    def unbound(self, name: str, loc: Location | None, scope: Scope) -> SxError:
        hint = nearest(name, scope.all_names() | set(self.globals) | set(CORE_FORMS) | set(SPECIAL_FORMS))
        return SxError(f"unbound symbol '{name}'" + (f"; did you mean '{hint}'?" if hint else ""), loc)

    def _analyze_list(self, form: SxList, scope: Scope) -> Callable[[list], Any]:
        head = form[0]
        loc = form.loc
        if head.__class__ is Symbol and scope.lookup(head.name) is None:
            name = head.name
            core = CORE_FORMS.get(name)
            if core is not None:
                return core(self, form, scope, loc)
            special = SPECIAL_FORMS.get(name)
            if special is not None:
                return self._analyze_registered(special, form, scope)
            macro = self.macro_of(form, scope)
            if macro is not None:
                return self._analyze_expansion(macro, form, scope, loc)
            if (name == UNQUOTE or name == UNQUOTE_SPLICING) and name not in self.globals:
                spelling = "," if name == UNQUOTE else ",@"
                raise SxError(f"'{spelling}' ({name}) is only allowed inside a quasiquote (`)", loc)
        fnode = self.analyze(head, scope, element_loc(form, 0))
        args = [self.analyze(x, scope, element_loc(form, i + 1)) for i, x in enumerate(form[1:])]
        if head.__class__ is Symbol and head.name in OPERAND_LOCATED and scope.lookup(head.name) is None:
            return _operand_call_node(fnode, args, loc, form)
        return _call_node(fnode, args, loc)

    def _analyze_expansion(self, macro: Macro, form: SxList, scope: Scope, loc: Location | None) -> Callable[[list], Any]:
        expansions = self._expansions
        if len(expansions) >= MAX_EXPANSION_DEPTH:
            first, where = expansions[0]
            raise endless_expansion(first, where)
        expansions.append((macro, loc))
        try:
            return self.analyze(self.expand_1(macro, form, loc), scope, loc)
        finally:
            expansions.pop()

    def _analyze_registered(self, special: Callable, form: SxList, scope: Scope) -> Callable[[list], Any]:
        args = list(form[1:])
        loc = form.loc

        def node(f: list) -> Any:
            return special(Env(self, scope, f, form), args, loc)

        return node

    def analyze_body(self, forms: list, scope: Scope, owner: Any, start: int) -> Callable[[list], Any]:
        """Nodes for `owner[start:]` run in order; the value of the last (nil if none)."""
        nodes = [self.analyze(owner[i], scope, element_loc(owner, i)) for i in range(start, len(owner))]
        return _sequence(nodes)

    def analyze_function(self, name: str | None, params: Any, owner: SxList, start: int, scope: Scope,
                         loc: Location | None) -> Callable[[list], Closure]:  # fmt: skip
        """A node making a closure from an argument list and the body `owner[start:]`."""
        spec = parse_params(params, loc, f"'{name}'" if name else "fn")
        inner = scope.function()
        for arg in spec.names:
            inner.bind(arg)
        # Key defaults see the arguments before them (bound above, filled in order).
        default_nodes = [
            self.analyze(d, inner, loc) if d is not MISSING else None for d in spec.defaults
        ]
        body = self.analyze_body(owner, inner, owner, start)
        info = inner.frame

        def make(f: list) -> Closure:
            return Closure(name, spec, f, body, info.size, default_nodes)

        return make


def constant_node(value: Any) -> Callable[[list], Any]:
    return lambda f: value


def _local_ref(depth: int, slot: int) -> Callable[[list], Any]:
    if depth == 0:
        return lambda f: f[slot]
    if depth == 1:
        return lambda f: f[0][slot]
    if depth == 2:
        return lambda f: f[0][0][slot]

    def ref(f: list) -> Any:
        for _ in range(depth):
            f = f[0]
        return f[slot]

    return ref


def _sequence(nodes: list) -> Callable[[list], Any]:
    if not nodes:
        return constant_node(None)
    if len(nodes) == 1:
        return nodes[0]
    init, last = nodes[:-1], nodes[-1]

    def seq(f: list) -> Any:
        for n in init:
            n(f)
        return last(f)

    return seq


def _call_node(fnode: Callable, args: list, loc: Location | None) -> Callable[[list], Any]:
    # Specialised by argument count: building the argument list is most of a call's cost.
    if len(args) == 1:
        (a,) = args
        return lambda f: invoke(fnode(f), [a(f)], loc)
    if len(args) == 2:
        a, b = args
        return lambda f: invoke(fnode(f), [a(f), b(f)], loc)
    if len(args) == 3:
        a, b, c = args
        return lambda f: invoke(fnode(f), [a(f), b(f), c(f)], loc)
    return lambda f: invoke(fnode(f), [n(f) for n in args], loc)


#: Builtins whose errors may name the operand at fault (`SxError.operand`, an argument index):
#: a call of one written in user code moves the error's caret to that argument's form.
OPERAND_LOCATED: set[str] = set()


def _operand_call_node(fnode: Callable, args: list, loc: Location | None, form: SxList) -> Callable[[list], Any]:
    """A call whose error at this very form, naming an operand, is located at that operand."""

    def relocated(e: SxError) -> None:
        operand = getattr(e, "operand", None)
        if operand is not None:
            e.operand = None
            if e.loc is loc and 0 <= operand < len(args):
                where = element_loc(form, operand + 1)
                if where is not None and where is not loc:
                    e.loc = spanned(where)

    if len(args) == 2:  # (+ a b), the commonest: no list comprehension to build the arguments
        a, b = args

        def pair(f: list) -> Any:
            fn = fnode(f)
            values = [a(f), b(f)]
            try:
                return invoke(fn, values, loc)
            except SxError as e:
                relocated(e)
                raise

        return pair

    def node(f: list) -> Any:
        fn = fnode(f)
        values = [n(f) for n in args]
        try:
            return invoke(fn, values, loc)
        except SxError as e:
            relocated(e)
            raise

    return node


def spanned(loc: Location) -> Location:
    """`loc` with an end column spanning the bracketed form that starts there, when it ends on its line."""
    if loc.end_col is not None:
        return loc
    line = source_line(loc.file, loc.line)
    if line is None or loc.col < 1 or loc.col > len(line) or line[loc.col - 1] not in "([{":
        return loc
    depth, in_string, escaped = 0, False, False
    for i in range(loc.col - 1, len(line)):
        ch = line[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == ";":
            break
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return Location(loc.file, loc.line, loc.col, i + 2, loc.via)
    return loc


def truthy(value: Any) -> bool:
    """nil, false and the empty list are false; everything else (0, "", []) is true."""
    return not (value is None or value is False or (value.__class__ is SxList and not value))



def form_name(form: Any) -> str:
    """A form named in a message: `(let …)`, `[…]`, `{…}`, or an atom as printed."""
    if form.__class__ is SxList:
        return f"({form[0].name} …)" if form and form[0].__class__ is Symbol else "(…)"
    if form.__class__ is SxVector:
        return "[…]"
    if form.__class__ is SxMap:
        return "{…}"
    return described(form)


def _nested_too_deeply(form: Any, loc: Location | None) -> SxError:
    return SxError(f"{form_name(form)} is nested more than {MAX_NESTING} forms deep", loc)


def check_nesting(datum: Any, loc: Location | None) -> None:
    """An error unless `datum` (quoted data) nests at most `MAX_NESTING` deep; walked without recursion."""
    stack = [(datum, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)) and item:
            if depth > MAX_NESTING:
                raise _nested_too_deeply(item, getattr(item, "loc", None) or loc)
            stack.extend((x, depth + 1) for x in (item.values() if isinstance(item, dict) else item))


def _map_node(nodes: list, key_locs: list) -> Callable[[list], dict]:
    """A map literal's node: its keys checked against the map-key rule, each located at its form."""
    entries = list(zip(nodes[0::2], nodes[1::2], key_locs))

    def build(f: list) -> dict:
        out = {}
        for key_node, value_node, where in entries:
            key = key_node(f)
            if key.__class__ not in MAP_KEY_TYPES:
                raise SxError(f"{MAP_KEY_RULE}, got {described(key)}", where)
            out[key] = value_node(f)
        return out

    return build

