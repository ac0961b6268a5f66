"""Functions and their calls: argument lists, closures, macros, builtins and their signatures, the call stack.

`invoke` calls a .sx function value (a `Closure` made by `fn`/`defn`/`defmacro`, or a
`Builtin` written in Python) with evaluated arguments; it keeps the stack of calls in
progress (`call_trail`, `user_location`) that errors and builtins consult. Builtins are
registered by name (`register_builtin`, `@builtin`) and every new `Evaluator` starts with them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ..diagnostics import Location, SxError, nearest
from .data import Keyword, SxList, SxVector, Symbol, element_loc
from .limits import MAX_CALL_DEPTH
from .printing import show, shown

#: "called from" lines an error keeps.
MAX_TRAIL = 20


class BuiltinError(Exception):
    """Raised by a builtin for a bad argument; the evaluator locates it at the call."""


#: A `ParamSpec` default meaning "required", and a key slot not yet filled by the call.
MISSING = object()


class ParamSpec:
    """A parsed argument list: `(a b &rest xs &key k (k2 default))`."""

    __slots__ = ("required", "rest", "keys", "defaults")

    def __init__(self, required: list[str], rest: str | None, keys: list[str], defaults: list[Any]) -> None:
        self.required = required
        self.rest = rest
        self.keys = keys
        #: One per key: the default's form, or `MISSING` for a required key.
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
            defaults.append(MISSING)
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
            frame.extend(MISSING for _ in spec.keys)
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
            if frame[slot] is MISSING:
                if default is MISSING:
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


# -- registry ---------------------------------------------------------------------------------

#: Builtins every new `Evaluator` starts with, by name.
BUILTINS: dict[str, Builtin] = {}


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
            if loc is not None and (not trail or trail[-1] != loc) and len(trail) < MAX_TRAIL:
                trail.append(loc)
            raise
        finally:
            calls.pop()
    if fn.__class__ is Builtin:
        return fn.call(args, loc)
    if isinstance(fn, Macro):
        raise SxError(f"macro '{fn.name}' cannot be called as a function", loc)
    raise SxError(f"{show(fn)} is not a function", loc)

