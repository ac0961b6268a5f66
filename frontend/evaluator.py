"""The .sx evaluator (language.md §2).

Each top-level form is analysed once into a tree of Python closures ("nodes",
``node(frame) -> value``) and then run. Analysis resolves every local variable
to a (depth, slot) address: a runtime frame is a Python list whose slot 0 is the
enclosing frame, so a variable reference is one or two list indexings.
`let` bindings live in the slots of the enclosing function's frame. `def` always
defines a global (the session's top-level environment, shared with required
files). Macros are expanded during analysis, so a macro must be defined before
the forms that use it are evaluated.

This module holds the machinery and the registries; it imports none of the
modules that fill them. The core special forms are in `special_forms`, the
builtins in `builtins`, `tracer`, `modules` and `experiment_forms`; `library`
puts them together, and importing the package does that (see `library`).

Extension points for the layers above (the experiment language):

- `core_form`: the analyser of a core special form (`special_forms` registers them).
- `register_builtin` / `@builtin`: Python functions by name, optionally given the
  call's `Location` and the call's `:key value` pairs as Python keyword arguments.
- `register_special_form`: forms that receive their arguments unevaluated, with an
  `Env` to evaluate them in and the form's location.
- `data.TENSOR_OPS`: tensor implementations of the overloaded arithmetic.
- `user_location`, `call_trail`: where the user's code is, from inside a builtin.
- `Evaluator`: a session with its own globals; `eval_file`, `load_prelude`.
- `Defined`: the value of a defining form, printed `name = value` by `eval`.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import os
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..diagnostics import Location, Note, SxError, nearest, source_line
from .data import (
    MAP_KEY_RULE,
    MAP_KEY_TYPES,
    QUASIQUOTE,
    QUOTE,
    SELF_EVALUATING_NAMES,
    UNQUOTE,
    UNQUOTE_SPLICING,
    Keyword,
    SxList,
    SxMap,
    SxVector,
    Symbol,
    element_loc,
)
from .limits import MAX_EXPANSION_DEPTH, MAX_NESTING
from .printing import described, show, shown
from .reader import read_file, read_text

#: Nested calls of .sx functions allowed before a located "too deep" error.
MAX_CALL_DEPTH = 10_000
#: Python frames the analysed code may use: a few per .sx call and per nested form, with room to spare.
_PYTHON_RECURSION_LIMIT = max(MAX_CALL_DEPTH * 12, MAX_NESTING * 8) + 10_000
#: "called from" lines an error keeps.
_MAX_TRAIL = 20
#: Stack of the evaluation thread: room for `_PYTHON_RECURSION_LIMIT` frames (see `_STACK_BYTES_PER_FRAME`).
_THREAD_STACK_BYTES = 1024 * 1024 * 1024


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


class BuiltinError(Exception):
    """Raised by a builtin for a bad argument; the evaluator locates it at the call."""


_MISSING = object()


class ParamSpec:
    """A parsed argument list: `(a b &rest xs &key k (k2 default))`."""

    __slots__ = ("required", "rest", "keys", "defaults")

    def __init__(self, required: list[str], rest: str | None, keys: list[str], defaults: list[Any]) -> None:
        self.required = required
        self.rest = rest
        self.keys = keys
        #: One per key: the default's form, or `_MISSING` for a required key.
        self.defaults = defaults

    @property
    def names(self) -> list[str]:
        return self.required + ([self.rest] if self.rest else []) + self.keys


def parse_params(form: Any, loc: Location | None, what: str) -> ParamSpec:
    """Parse an argument list; `what` names the function in errors."""
    if form is None:
        form = SxList()
    if not isinstance(form, (SxList, SxVector)):
        raise SxError(f"{what}: expected an argument list like (a b &key c), got {show(form)}", loc)
    required: list[str] = []
    rest = None
    keys: list[str] = []
    defaults: list[Any] = []
    mode = "positional"
    for i, item in enumerate(form):
        item_loc = element_loc(form, i)
        if isinstance(item, Symbol) and item.name in ("&rest", "&key"):
            if mode == "&rest" and rest is None:
                raise SxError(f"{what}: &rest takes one name", element_loc(form, i - 1))
            if item.name == mode or (item.name == "&rest" and mode == "&key"):
                order = "appears twice" if item.name == mode else "comes before &key"
                raise SxError(f"{what}: {item.name} {order}", item_loc)
            mode = item.name
            continue
        if mode == "&key" and isinstance(item, SxList) and len(item) == 2 and isinstance(item[0], Symbol):
            keys.append(item[0].name)
            defaults.append(item[1])
            continue
        if not isinstance(item, Symbol):
            raise SxError(f"{what}: argument names must be symbols, got {show(item)}", item_loc)
        if mode == "positional":
            required.append(item.name)
        elif mode == "&rest":
            if rest is not None:
                raise SxError(f"{what}: &rest takes one name", item_loc)
            rest = item.name
        else:
            keys.append(item.name)
            defaults.append(_MISSING)
    if mode == "&rest" and rest is None:
        raise SxError(f"{what}: &rest takes one name", element_loc(form, len(form) - 1))
    spec = ParamSpec(required, rest, keys, defaults)
    seen = set()
    for name in spec.names:
        if name in seen:
            raise SxError(f"{what}: argument '{name}' appears twice", loc)
        seen.add(name)
    return spec


class Closure:
    """A function made by `fn`, `defn` or `defmacro`."""

    sx_kind = "a function"
    __slots__ = ("name", "spec", "env", "body", "nslots", "simple", "padding", "key_slots", "default_nodes")

    def __init__(self, name: str | None, spec: ParamSpec, env: list | None, body: Callable, nslots: int,
                 default_nodes: list) -> None:  # fmt: skip
        self.name = name
        self.spec = spec
        self.env = env
        self.body = body
        self.nslots = nslots
        self.simple = not spec.rest and not spec.keys
        #: Slots after the arguments (for `let` bindings), filled with nil.
        self.padding = [None] * (nslots - 1 - len(spec.required))
        first_key = 1 + len(spec.required) + (1 if spec.rest else 0)
        self.key_slots = {k: first_key + i for i, k in enumerate(spec.keys)}
        self.default_nodes = default_nodes

    def describe(self) -> str:
        return f"'{self.name}'" if self.name else "the anonymous function"

    def __sx_repr__(self) -> str:
        return f"#<function {self.name}>" if self.name else "#<function>"

    def bind(self, args: list, loc: Location | None) -> list:
        """The frame for a call with `args`, checking arity and keyword arguments."""
        spec = self.spec
        nreq = len(spec.required)
        if len(args) < nreq:
            missing = spec.required[len(args)]
            raise SxError(
                f"{self.describe()} expects {counted(nreq, 'argument')}{' and more' if spec.rest else ''}, "
                f"got {len(args)}: missing '{missing}'",
                loc,
            )
        extra = args[nreq:]
        frame = [self.env, *args[:nreq]]
        if spec.rest:
            frame.append(SxList(extra))
        if spec.keys:
            frame.extend(_MISSING for _ in spec.keys)
            frame.extend(self.padding[len(spec.keys) + (1 if spec.rest else 0):])
            self._bind_keys(frame, extra, loc)
        else:
            if extra and not spec.rest:
                raise SxError(
                    f"{self.describe()} expects {counted(nreq, 'argument')}, got {len(args)}: "
                    f"extra argument {show(extra[0])}",
                    loc,
                )
            frame.extend(self.padding[(1 if spec.rest else 0):])
        return frame

    def _bind_keys(self, frame: list, extra: list, loc: Location | None) -> None:
        if len(extra) % 2:
            raise SxError(
                f"keyword arguments to {self.describe()} must come in ':name value' pairs; "
                f"got an odd number ({len(extra)}) after the positional arguments",
                loc,
            )
        for i in range(0, len(extra), 2):
            key = extra[i]
            if not isinstance(key, Keyword):
                raise SxError(
                    f"{self.describe()} expects keyword arguments (:name value) after "
                    f"{counted(len(self.spec.required), 'positional argument')}, got {show(key)}",
                    loc,
                )
            slot = self.key_slots.get(key.name)
            if slot is None:
                hint = nearest(key.name, self.spec.keys)
                known = " ".join(":" + k for k in self.spec.keys)
                raise SxError(
                    f"{self.describe()} has no keyword argument ':{key.name}'"
                    + (f"; did you mean ':{hint}'?" if hint else f" (it takes {known})"),
                    loc,
                )
            frame[slot] = extra[i + 1]
        for key, default, node in zip(self.spec.keys, self.spec.defaults, self.default_nodes):
            slot = self.key_slots[key]
            if frame[slot] is _MISSING:
                if default is _MISSING:
                    raise SxError(f"{self.describe()} requires the keyword argument ':{key}'", loc)
                frame[slot] = node(frame)


class Macro:
    """A macro: a function from forms to a form, run during analysis; `loc` is its `defmacro`."""

    sx_kind = "a macro"
    __slots__ = ("name", "fn", "loc")

    def __init__(self, name: str, fn: Closure, loc: Location | None = None) -> None:
        self.name = name
        self.fn = fn
        self.loc = loc

    def __sx_repr__(self) -> str:
        return f"#<macro {self.name}>"


class Signature:
    """What a Python function takes from a .sx call, read from its Python signature.

    The one check of every builtin's arguments (and of the tensor implementations the
    overloaded builtins hand a call to): positional parameters without a default are
    required, `*args` takes any number more, keyword-only parameters without a default
    are required keyword arguments. `kwargs`: the function takes `:name value` pairs
    (as keyword-only or defaulted parameters, `-` in names written `_`; any with `**kwargs`).
    """

    __slots__ = ("min_args", "max_args", "arg_names", "keywords", "required_keywords", "any_keyword")

    def __init__(self, fn: Callable, skip: int = 0, kwargs: bool = False) -> None:
        params = list(inspect.signature(fn).parameters.values())[skip:]
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.min_args = sum(1 for p in positional if p.default is p.empty)
        #: The positional parameters' names, as .sx writes them, to name a missing argument.
        self.arg_names = [p.name.replace("_", "-") for p in positional]
        has_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
        self.max_args = None if has_varargs else len(positional)
        self.keywords = (
            {p.name for p in params if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)}
            if kwargs
            else set()
        )
        self.required_keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        self.any_keyword = kwargs and any(p.kind is p.VAR_KEYWORD for p in params)

    def check(self, name: str, args: Sequence[Any], kwargs: dict[str, Any] | None, loc: Location | None) -> None:
        """An error at `loc` unless `args` and `kwargs` fit the signature."""
        n = len(args)
        for key in kwargs or ():
            spelt = key.replace("_", "-")
            if spelt in self.arg_names[:n]:
                raise SxError(
                    f"'{name}' got '{spelt}' twice: as argument {self.arg_names.index(spelt) + 1} and as :{spelt}", loc
                )
            if not self.any_keyword and key not in self.keywords:
                hint = nearest(key, self.keywords)
                raise SxError(
                    f"'{name}' has no keyword argument ':{spelt}'"
                    + (f"; did you mean ':{hint.replace('_', '-')}'?" if hint else ""),
                    loc,
                )
        if n < self.min_args or (self.max_args is not None and n > self.max_args):
            if self.max_args == self.min_args:
                expected = counted(self.min_args, "argument")
            elif self.max_args is None:
                expected = f"at least {counted(self.min_args, 'argument')}"
            else:
                expected = f"{self.min_args} to {self.max_args} arguments"
            if n < self.min_args:
                missing = self.arg_names[n]
                detail = f": missing '{missing}'" if not missing.startswith("-") else ""
            else:
                detail = f": extra argument {shown(args[self.max_args])}"
            raise SxError(f"'{name}' expects {expected}, got {n}{detail}", loc)
        for key in self.required_keywords:
            if not kwargs or key not in kwargs:
                raise SxError(f"'{name}' requires the keyword argument ':{key.replace('_', '-')}'", loc)


def signature_of(fn: Callable, skip: int = 0, kwargs: bool = False) -> Signature:
    """The `Signature` of `fn` (its first `skip` parameters are not the call's), made once per code.

    Keyed by the code object, not the function: each session makes new closures and
    bound methods of the same code, and a cache holding them would keep every session alive.
    """
    if inspect.ismethod(fn):
        fn, skip = fn.__func__, skip + 1
    key = (getattr(fn, "__code__", fn), skip, kwargs)
    signature = _SIGNATURES.get(key)
    if signature is None:
        signature = _SIGNATURES[key] = Signature(fn, skip, kwargs)
    return signature


_SIGNATURES: dict[tuple[Any, int, bool], Signature] = {}


def argument_error(message: str, loc: Location | None, operand: int | str) -> SxError:
    """An error about one argument of a builtin's call, located at the call.

    `operand` is the argument's index among the positional arguments or the name of a
    keyword argument (as the Python parameter spells it); a call of a builtin named in
    `OPERAND_LOCATED` moves the caret under that argument's form.
    """
    err = SxError(message, loc)
    err.operand = operand  # type: ignore[attr-defined]
    return err


class Builtin:
    """A function written in Python.

    `wants_loc`: the function's first argument is the call's `Location`.
    `kwargs`: trailing `:name value` pairs become Python keyword arguments (see `Signature`).
    """

    sx_kind = "a function"
    __slots__ = ("name", "fn", "wants_loc", "signature", "takes_keywords", "min_args", "max_args", "plain")

    def __init__(self, name: str, fn: Callable, wants_loc: bool = False, kwargs: bool = False) -> None:
        self.name = name
        self.fn = fn
        self.wants_loc = wants_loc
        self.signature = signature = signature_of(fn, 1 if wants_loc else 0, kwargs)
        self.takes_keywords = bool(signature.keywords or signature.any_keyword)
        self.min_args = signature.min_args
        self.max_args = signature.max_args
        #: No keyword is required: a call with a fitting number of arguments and no keywords needs no other check.
        self.plain = not signature.required_keywords

    def __sx_repr__(self) -> str:
        return f"#<builtin {self.name}>"

    def call(self, args: list, loc: Location | None) -> Any:
        kwargs = None
        given = args
        if self.takes_keywords:
            start = self._keywords_start(args, loc)
            if start < len(args):
                kwargs = {args[i].name.replace("-", "_"): args[i + 1] for i in range(start, len(args), 2)}
                args = args[:start]
        n = len(args)
        if kwargs is not None or not self.plain or n < self.min_args or (self.max_args is not None and n > self.max_args):
            self.signature.check(self.name, args, kwargs, loc)
        try:
            if self.wants_loc:
                return self.fn(loc, *args, **kwargs) if kwargs else self.fn(loc, *args)
            return self.fn(*args, **kwargs) if kwargs else self.fn(*args)
        except BuiltinError as e:
            raise SxError(f"'{self.name}': {e}", loc) from None
        except RecursionError:
            raise SxError(f"'{self.name}': the data nests too deeply", loc) from None
        except OverflowError as e:  # an int too large for a float, in any builtin's arithmetic
            raise SxError(f"'{self.name}': {e}", loc) from None
        except SxError as e:
            operand = getattr(e, "operand", None)
            if operand.__class__ is str:
                # A keyword argument: the index of its value among the call's arguments, if it was given.
                e.operand = next(  # type: ignore[attr-defined]
                    (i + 1 for i in range(len(args), len(given), 2) if given[i].name.replace("-", "_") == operand), None
                )
            raise

    def _keywords_start(self, args: list, loc: Location | None) -> int:
        """Where the trailing `:name value` pairs start (the end of `args` when there are none)."""
        signature = self.signature
        start = len(args)
        for i in range(signature.min_args, len(args)):
            arg = args[i]
            if isinstance(arg, Keyword) and (signature.any_keyword or arg.name.replace("-", "_") in signature.keywords):
                start = i
                break
        else:
            # No known keyword: trailing pairs that look like keyword arguments are a misspelling.
            for i in range(signature.min_args, len(args)):
                if (len(args) - i) % 2 == 0 and all(isinstance(k, Keyword) for k in args[i::2]):
                    start = i
                    break
        tail = args[start:]
        if len(tail) % 2:
            raise SxError(f"keyword arguments to '{self.name}' must come in ':name value' pairs", loc)
        for i in range(0, len(tail), 2):
            if not isinstance(tail[i], Keyword):
                raise SxError(f"'{self.name}' expects ':name value' pairs after {show(tail[0])}, got {show(tail[i])}", loc)
        return start


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# -- registries -------------------------------------------------------------------------------

#: Builtins every new `Evaluator` starts with, by name.
BUILTINS: dict[str, Builtin] = {}

#: Special form name -> analyser(evaluator, form, scope, loc) -> node.
CORE_FORMS: dict[str, Callable] = {}

#: Special forms registered by other layers: name -> fn(env, args, loc) -> value.
SPECIAL_FORMS: dict[str, Callable[[Env, list, Location | None], Any]] = {}


def register_builtin(name: str, fn: Callable, *, loc: bool = False, kwargs: bool = False) -> Builtin:
    """Make `fn` the builtin `name` in every evaluator created afterwards (and return it).

    With `loc=True` the function receives the call's `Location` first. With
    `kwargs=True`, trailing `:name value` pairs become Python keyword arguments
    (keyword-only or defaulted parameters, `-` in names written `_`).
    """
    b = Builtin(name, fn, loc, kwargs)
    BUILTINS[name] = b
    return b


def builtin(name: str, *, loc: bool = False, kwargs: bool = False) -> Callable[[Callable], Callable]:
    """Decorator form of `register_builtin`."""

    def register(fn: Callable) -> Callable:
        register_builtin(name, fn, loc=loc, kwargs=kwargs)
        return fn

    return register


def register_special_form(name: str, fn: Callable[[Env, list, Location | None], Any]) -> None:
    """Make `name` a special form: `fn(env, args, loc)` gets the unevaluated argument forms.

    `env.eval(form)` evaluates one of them where the special form appears;
    `env.loc_of_arg(i)` locates argument i. Return a `Defined` to print `name = value`.
    """
    SPECIAL_FORMS[name] = fn


#: Functions run on every new `Evaluator` (e.g. to load the prelude, add session builtins).
SESSION_HOOKS: list[Callable[[Evaluator], None]] = []


def core_form(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering an analyser `(evaluator, form, scope, loc) -> node` as the core form `name`."""

    def register(fn: Callable) -> Callable:
        CORE_FORMS[name] = fn
        return fn

    return register


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


# -- call stack -------------------------------------------------------------------------------

#: Locations of the calls of .sx functions in progress, outermost first.
_CALLS: list[Location | None] = []
#: Files whose code is library code (the prelude): `user_location` looks through them.
LIBRARY_FILES: set[str] = set()


def call_trail() -> list[Location]:
    """The call sites of the .sx functions in progress, innermost first."""
    return [loc for loc in reversed(_CALLS) if loc is not None]


def user_location(loc: Location | None) -> Location | None:
    """`loc` if it is in the user's code; else the innermost call site in user code, with `loc` as `via`."""
    if loc is None or loc.file not in LIBRARY_FILES:
        return loc
    for frame in reversed(_CALLS):
        if frame is not None and frame.file not in LIBRARY_FILES:
            return frame.with_via(loc)
    return loc


def invoke(fn: Any, args: list, loc: Location | None) -> Any:
    """Call a .sx function value (closure or builtin) with evaluated `args`, from `loc`."""
    if fn.__class__ is Closure:
        frame = [fn.env, *args, *fn.padding] if fn.simple and len(args) == len(fn.spec.required) else fn.bind(args, loc)
        calls = _CALLS
        if len(calls) >= MAX_CALL_DEPTH:
            raise SxError(
                f"calls nest too deeply (more than {MAX_CALL_DEPTH}) in {fn.describe()}; "
                "is a recursion missing its base case?",
                loc,
            )
        calls.append(loc)
        try:
            return fn.body(frame)
        except RecursionError:
            raise SxError(
                f"calls and forms nest too deeply in {fn.describe()} (past the evaluator's recursion limit)", loc
            ) from None
        except SxError as e:
            if e.loc is not None and e.loc.file in LIBRARY_FILES and loc is not None and loc.file not in LIBRARY_FILES:
                # An error inside library code (the prelude) is the user's call's: located there, via the library.
                e.loc = loc.with_via(e.loc)
                e.trail.clear()
                raise
            # A deep recursion repeats one call site: keep each run of them once.
            trail = e.trail
            if loc is not None and (not trail or trail[-1] != loc) and len(trail) < _MAX_TRAIL:
                trail.append(loc)
            raise
        finally:
            calls.pop()
    if fn.__class__ is Builtin:
        return fn.call(args, loc)
    if isinstance(fn, Macro):
        raise SxError(f"macro '{fn.name}' cannot be called as a function", loc)
    raise SxError(f"{show(fn)} is not a function", loc)


# -- analysis ---------------------------------------------------------------------------------


class _FrameInfo:
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

    def __init__(self, frame: _FrameInfo, parent: Scope | None) -> None:
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
        return Scope(_FrameInfo(), self)

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

            def node(frame: list, body: Callable = body, info: _FrameInfo = info) -> Any:
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


class Evaluator:
    """A session: one global environment, the files it required, the library files."""

    def __init__(
        self,
        extra_builtins: dict[str, Builtin] | None = None,
        variant: str | None = None,
        sets: list[str] | None = None,
    ) -> None:
        self.globals: dict[str, Any] = {name: Symbol(name) for name in SELF_EVALUATING_NAMES}
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
        #: Forms being analysed, each inside the one before (see `MAX_NESTING`).
        self._nesting = 0
        #: The macro uses whose expansions are being analysed, outermost first.
        self._expansions: list[tuple[Macro, Location | None]] = []
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
        scope = Scope(_FrameInfo(), None)
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
            if loc is not None and len(e.trail) < _MAX_TRAIL:
                e.trail.append(loc)
            raise

    def gensym(self, prefix: Any = "g") -> Symbol:
        """A fresh symbol, `g#1`: numbered per session, and `#` keeps it apart from ordinary names."""
        name = prefix.name if isinstance(prefix, Symbol) else str(prefix)
        return Symbol(f"{name}#{next(self._gensym_counter)}")

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
        """One expansion of a macro use; lists the expansion builds are located at the use.

        Each such list gets its own `ExpandedLocation`: the use's position, and where
        the macro's template wrote the list, so an error there names both.
        """
        expansion = invoke(macro.fn, list(form[1:]), loc)
        if loc is not None:
            _stamp(expansion, macro, loc)
        return expansion

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
        raise _endless_expansion(macro, loc)

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
            raise _endless_expansion(first, where)
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
            self.analyze(d, inner, loc) if d is not _MISSING else None for d in spec.defaults
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


# -- macro expansions ------------------------------------------------------------------------


@attrs.frozen
class ExpandedLocation(Location):
    """Where a list that a macro's expansion built is: the position of the macro's `use`.

    It remembers the `macro` and where its template wrote the list (`origin`, None when
    the macro built it otherwise), so an error located here can name both, as
    `in_expansions` does. Ops and reports see the use's position, as before.
    """

    macro: Macro | None = attrs.field(default=None, eq=False, repr=False)
    use: Location | None = attrs.field(default=None, eq=False, repr=False)
    origin: Location | None = attrs.field(default=None, eq=False, repr=False)

    def with_via(self, via: Location | None) -> Location:
        return attrs.evolve(self, via=via)


def _stamp(expansion: Any, macro: Macro, use: Location) -> None:
    """Locate the lists an expansion built (they have no location) at the macro's `use`."""
    stack = [expansion]
    while stack:
        form = stack.pop()
        if isinstance(form, (SxList, SxVector, SxMap)) and form.loc is None:
            form.loc = ExpandedLocation(
                use.file, use.line, use.col, use.end_col, use.via, macro=macro, use=use, origin=form.origin
            )
            stack.extend(form)


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


def _endless_expansion(macro: Macro, loc: Location | None) -> SxError:
    return SxError(
        f"macro '{macro.name}' expands without end: more than {MAX_EXPANSION_DEPTH} expansions inside one "
        "another (does its expansion use it again?)",
        loc,
    )


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


# -- the evaluation thread --------------------------------------------------------------------

#: Stack sizes tried for the evaluation thread, largest first: a smaller one when the process
#: may not map the larger (`ulimit -v`), with a recursion limit in proportion.
_STACK_SIZES = (_THREAD_STACK_BYTES, 256 << 20, 64 << 20, 16 << 20)
#: Bytes of thread stack to allow per frame of Python's recursion limit. Python-to-Python calls
#: take none; a recursion through C takes some (`=` on nested lists: about 280 bytes a frame,
#: measured on CPython 3.11), so this leaves a margin of seven.
_STACK_BYTES_PER_FRAME = 2 << 10
#: Seconds a Ctrl-C waits for the evaluation to stop before the process leaves it behind.
_INTERRUPT_GRACE = 2.0


def run_deep(body: Callable[[], Any]) -> Any:
    """Run `body` where deep recursion of analysed code fits (a thread with a large stack).

    Ctrl-C interrupts it: the `KeyboardInterrupt` the main thread gets is raised in the
    evaluation thread too, so a long evaluation stops and the interrupt reaches the caller.
    """
    if getattr(_deep, "active", False):
        return body()
    result: list = []
    error: list[BaseException] = []

    def target() -> None:
        _deep.active = True
        try:
            result.append(body())
        except BaseException as e:  # handed to the calling thread as is
            error.append(e)

    old_limit = sys.getrecursionlimit()
    try:
        thread = _start_deep_thread(target, old_limit)
        # `_join` returns or raises only once the thread has ended, so the limit (the process's) is never
        # lowered under a thread deep in its recursion, which would abort the process.
        _join(thread)
    finally:
        sys.setrecursionlimit(old_limit)
    if error:
        raise error[0]
    return result[0]


def _stack_sizes() -> list[int]:
    """The stack sizes to try: under a virtual-memory limit, none over a quarter of it (the rest is the heap's)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return list(_STACK_SIZES)
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return list(_STACK_SIZES)
    return [size for size in _STACK_SIZES if size <= limit // 4] or [_STACK_SIZES[-1]]


def _start_deep_thread(target: Callable[[], None], old_limit: int) -> threading.Thread:
    """Start `target` on a daemon thread with the largest stack the process can have."""
    old_size = threading.stack_size()
    sizes = _stack_sizes()
    try:
        for size in sizes:
            thread = threading.Thread(target=target, name="sx-eval", daemon=True)
            limit = min(_PYTHON_RECURSION_LIMIT, size // _STACK_BYTES_PER_FRAME)
            sys.setrecursionlimit(max(old_limit, limit))
            try:
                threading.stack_size(size)
                thread.start()
            except (RuntimeError, ValueError, MemoryError):
                if size == sizes[-1]:
                    raise SxError(
                        "cannot start the evaluator: the process may not map a thread stack of "
                        f"{size >> 20} MiB (is the virtual memory limit, ulimit -v, too low?)"
                    ) from None
                continue
            return thread
    finally:
        threading.stack_size(old_size)
    raise AssertionError("unreachable")


def _join(thread: threading.Thread) -> None:
    """Wait for `thread`; on Ctrl-C, interrupt it and wait a little for it to stop.

    A thread still running after that is left with the process: it ends at once with Ctrl-C's status,
    because finalizing the interpreter under a thread deep in its recursion can abort the process.
    """
    try:
        thread.join()
    except KeyboardInterrupt:
        if thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
        thread.join(_INTERRUPT_GRACE)
        if thread.is_alive():
            os.write(2, b"interrupted\n")
            os._exit(130)
        raise


_deep = threading.local()
