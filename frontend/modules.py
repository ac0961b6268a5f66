"""Modules and parameters (language.md §4).

`(defmodule name (args…) body…)` defines a *constructor*. Calling it runs the
body once, at model definition, under the current module path: `(param name
shape :init init)` registers a parameter at `path.name`, `(sub name expr)` runs
`expr` under `path.name`, `(sub-list name n expr)` runs it `n` times under
`path.name.0 …`. The body returns the forward function, which becomes a
*module*: calling it while a graph is traced records ops carrying the module's
path; calling it at top level is an error. `(defmodel model (ctor …))` runs a
constructor at the root path `model`.

A parameter's `:init` is an `Init` (`dialects/inits.py`, which also computes
the initial values from the run seed and the parameter's path).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from attrs import define, field

from ..diagnostics import Location, SxError
from ..dialects.inits import Init
from .analysis import Env, register_special_form
from .calls import Builtin, Closure, invoke, register_builtin, user_location
from .data import Keyword, SxList, Symbol
from .evaluator import Defined
from .limits import MAX_PARAMS
from .printing import short_int, show
from .tracer import (
    Tensor,
    Trace,
    Traceable,
    active_trace,
    describe,
    dtype_name,
    module_path,
    require_trace,
)

#: Bounds that turn an absurd knob (2^31 layers, a [10^9 10^9] weight) into an error at the form instead
#: of an evaluation that never ends: far beyond any model (16384 blocks; 2^40 elements, 4 TiB as f32).
MAX_SUBMODULES = 1 << 14
MAX_PARAM_ELEMENTS = 1 << 40


def _normal(loc: Location | None, std: object) -> Init:
    return Init("normal", {"std": _located_number(std, "(normal std): std", loc)})


def _uniform(loc: Location | None, lo: object, hi: object) -> Init:
    return Init("uniform", {"lo": _located_number(lo, "(uniform lo hi): lo", loc), "hi": _located_number(hi, "(uniform lo hi): hi", loc)})


def _constant(loc: Location | None, value: object) -> Init:
    return Init("constant", {"value": _located_number(value, "(constant v): v", loc)})


def _located_number(x: object, what: str, loc: Location | None) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise SxError(f"{what} must be a number, got {describe(x)}", loc)
    try:
        number = float(x)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise SxError(f"{what} must be a finite number, got {short_int(x)}", loc)
    return number


class Param(Traceable):
    """A registered parameter; inside a trace it is the graph input named by its path."""

    __slots__ = ("path", "shape", "dtype", "init", "loc")

    def __init__(self, path: str, shape: tuple[int, ...], dtype: str, init: Init, loc: Location | None) -> None:
        self.path = path
        self.shape = shape  # type: ignore[misc]
        self.dtype = dtype
        self.init = init
        self.loc = loc

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def trace_value(self, trace: Trace, loc: Location | None) -> Tensor:
        from ..dialects.core import TensorType

        return trace.input("param", self.path, TensorType(self.shape, self.dtype), self.loc)

    def __sx_repr__(self) -> str:
        return f"#<param {self.path} [{' '.join(map(str, self.shape))}]>"


@define
class ModelTree:
    """The parameters and modules of one compilation, and the path constructors run under."""

    params: dict[str, Param] = field(factory=dict)
    #: Module paths being constructed, innermost last; empty at top level.
    path_stack: list[str] = field(factory=list)
    #: defmodel name -> (constructor name, module).
    models: dict[str, tuple[str, Any]] = field(factory=dict)

    def add_param(self, name: str, shape: tuple[int, ...], dtype: str, init: Init, loc: Location | None) -> Param:
        if not self.path_stack:
            raise SxError(f"(param {name} …) outside a module: parameters are registered by a defmodule body", loc)
        if len(self.params) >= MAX_PARAMS:
            raise SxError(f"the model has more than {MAX_PARAMS} parameters (tensors); is a sub-list far longer than meant?", loc)
        path = f"{self.path_stack[-1]}.{name}"
        first = self.params.get(path)
        if first is not None:
            raise SxError(f"parameter {path} is defined twice (first at {first.loc})", loc)
        param = self.params[path] = Param(path, shape, dtype, init, loc)
        return param

    @contextmanager
    def under(self, path: str) -> Iterator[None]:
        self.path_stack.append(path)
        try:
            yield
        finally:
            self.path_stack.pop()

    def child(self, name: str) -> str:
        return f"{self.path_stack[-1]}.{name}" if self.path_stack else name


def tree_of(env: Env) -> ModelTree:
    """The model tree of the session evaluating `env` (each `Evaluator` gets one, see `install`)."""
    return env.evaluator.model_tree  # type: ignore[attr-defined]


def install(evaluator: Any) -> None:
    """Give a new evaluator session its model tree and the argument-less initializers."""
    evaluator.model_tree = ModelTree()
    evaluator.globals.update(INIT_VALUES)


class Module:
    """A constructed module: its path, its constructor's name and its forward function."""

    __slots__ = ("path", "constructor", "forward", "callable")

    def __init__(self, path: str, constructor: str, forward: Any) -> None:
        self.path = path
        self.constructor = constructor
        self.forward = forward
        if isinstance(forward, Closure) and forward.name is None:
            # A wrong call of the module names it: "'model.blocks.0' expects 1 argument, got 2".
            forward.name = path
        #: What .sx code calls: a builtin that runs the forward function under the module's path.
        self.callable = Builtin(path, self.call, wants_loc=True)

    def call(self, loc: Location | None, *args: Any) -> Any:
        trace = require_trace(f"module {self.path} ({self.constructor})", loc)
        trace.module_calls.setdefault(self.path, list(args))
        with module_path(self.path):
            return invoke(self.forward, list(args), loc)

    def __sx_repr__(self) -> str:
        return f"#<module {self.constructor} at {self.path}>"


#: Module builtins by identity, so `defmodel` can print what it made.
_MODULES: dict[int, Module] = {}


class Constructor:
    """What `defmodule` defines: running it builds a module under the current path."""

    __slots__ = ("name", "body", "tree")

    def __init__(self, name: str, body: Any, tree: ModelTree) -> None:
        self.name = name
        self.body = body
        self.tree = tree

    def construct(self, loc: Location | None, *args: Any) -> Any:
        tree = self.tree
        if not tree.path_stack:
            raise SxError(
                f"module constructor '{self.name}' called outside defmodel or sub: "
                f"a module needs a path, e.g. (defmodel model ({self.name} …)) or (sub name ({self.name} …))",
                loc,
            )
        forward = invoke(self.body, list(args), loc)
        if not isinstance(forward, (Closure, Builtin)):
            return forward
        module = Module(tree.path_stack[-1], self.name, forward)
        _MODULES[id(module.callable)] = module
        return module.callable


def module_of(value: Any) -> Module | None:
    """The module behind a module builtin, if `value` is one."""
    return _MODULES.get(id(value))


class Shown:
    """A value that prints as fixed text (what a defining form shows)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __sx_repr__(self) -> str:
        return self.text


# -- special forms -----------------------------------------------------------------------------


def symbol_arg(args: list, index: int, env: Env, usage: str) -> str:
    if len(args) <= index or not isinstance(args[index], Symbol):
        raise SxError(f"expected a name: {usage}", env.loc_of_arg(index) if len(args) > index else env.form.loc)
    return args[index].name


def _defmodule(env: Env, args: list, loc: Location | None) -> Defined:
    """`(defmodule name (args…) body…)`: the body becomes the constructor's function."""
    usage = "(defmodule name (args…) body…)"
    name = symbol_arg(args, 0, env, usage)
    if len(args) < 3:
        raise SxError(f"defmodule {name} needs an argument list and a body: {usage}", loc)
    fn_form = SxList([Symbol("fn", loc), *args[1:]], loc, [loc] + [env.loc_of_arg(i) for i in range(1, len(args))])
    body = env.eval(fn_form, loc)
    body.name = name
    ctor = Constructor(name, body, tree_of(env))
    builtin = Builtin(name, ctor.construct, wants_loc=True)
    env.bind_global(name, builtin)
    return Defined(name, Shown(f"#<module constructor {name}>"))


def _param(env: Env, args: list, loc: Location | None) -> Param:
    """`(param name [dims] :init init :dtype f32)`."""
    usage = "(param name [dims] :init init)"
    name = symbol_arg(args, 0, env, usage)
    if len(args) < 2:
        raise SxError(f"param {name} needs a shape: {usage}", loc)
    shape = env.eval(args[1], env.loc_of_arg(1))
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise SxError(f"param {name}: shape must be a vector of positive ints, got {show(shape)}", env.loc_of_arg(1))
    if math.prod(shape) > MAX_PARAM_ELEMENTS:
        raise SxError(f"param {name}: shape {show(shape)} has {math.prod(shape)} elements, more than a parameter may "
                      f"have ({MAX_PARAM_ELEMENTS})", env.loc_of_arg(1))
    options = _keyword_options(env, args, 2, {"init", "dtype"}, f"param {name}")
    init = options.get("init", Init("normal", {"std": 0.02}))
    if not isinstance(init, Init):
        raise SxError(
            f"param {name}: :init must be (normal std), (uniform lo hi), zeros, ones or (constant v), got {show(init)}",
            loc,
        )
    dtype = dtype_name(options["dtype"], f"param {name}", loc) if "dtype" in options else "f32"
    return tree_of(env).add_param(name, tuple(shape), dtype, init, user_location(loc))


def _keyword_options(env: Env, args: list, start: int, allowed: set[str], what: str) -> dict[str, Any]:
    """Evaluate the `:key value` pairs of `args[start:]`; unknown keys are errors."""
    out: dict[str, Any] = {}
    i = start
    while i < len(args):
        key = args[i]
        if not isinstance(key, Keyword) or i + 1 >= len(args):
            raise SxError(f"{what}: expected ':name value' pairs, got {show(key)}", env.loc_of_arg(i))
        if key.name not in allowed:
            raise SxError(f"{what}: unknown option :{key.name} (options: {', '.join(':' + a for a in sorted(allowed))})", env.loc_of_arg(i))
        out[key.name] = env.eval(args[i + 1], env.loc_of_arg(i + 1))
        i += 2
    return out


def _sub(env: Env, args: list, loc: Location | None) -> Any:
    """`(sub name expr)`: evaluate `expr` (a constructor call) under `path.name`."""
    name = symbol_arg(args, 0, env, "(sub name expr)")
    if len(args) != 2:
        raise SxError("expected (sub name expr)", loc)
    tree = tree_of(env)
    if not tree.path_stack:
        raise SxError(f"(sub {name} …) outside a module: submodules are made by a defmodule body", loc)
    with tree.under(tree.child(name)):
        return env.eval(args[1], env.loc_of_arg(1))


def _sub_list(env: Env, args: list, loc: Location | None) -> SxList:
    """`(sub-list name n expr)`: evaluate `expr` n times under `path.name.0 …`."""
    name = symbol_arg(args, 0, env, "(sub-list name n expr)")
    if len(args) != 3:
        raise SxError("expected (sub-list name n expr)", loc)
    n = env.eval(args[1], env.loc_of_arg(1))
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise SxError(f"sub-list {name}: the count must be a non-negative int, got {show(n)}", env.loc_of_arg(1))
    if n > MAX_SUBMODULES:
        raise SxError(f"sub-list {name}: {n} submodules is more than a list may have ({MAX_SUBMODULES})",
                      env.loc_of_arg(1))
    tree = tree_of(env)
    if not tree.path_stack:
        raise SxError(f"(sub-list {name} …) outside a module: submodules are made by a defmodule body", loc)
    base = tree.child(name)
    out = []
    for i in range(n):
        with tree.under(f"{base}.{i}"):
            out.append(env.eval(args[2], env.loc_of_arg(2)))
    return SxList(out)


class ModelValue:
    """What `defmodel` prints: `#<model gpt as model>`."""

    __slots__ = ("constructor", "name")

    def __init__(self, constructor: str, name: str) -> None:
        self.constructor = constructor
        self.name = name

    def __sx_repr__(self) -> str:
        return f"#<model {self.constructor} as {self.name}>"


def _defmodel(env: Env, args: list, loc: Location | None) -> Defined:
    """`(defmodel name (ctor …))`: run a constructor at the root path `name`."""
    name = symbol_arg(args, 0, env, "(defmodel name (constructor …))")
    if len(args) != 2:
        raise SxError("expected (defmodel name (constructor …))", loc)
    trace = active_trace()
    if trace is not None:
        raise SxError(
            f"defmodel cannot appear in code that runs while graph '{trace.name}' is traced (prepare, the "
            "objective, an evaluation or a module's forward function): define the model at top level",
            loc,
        )
    tree = tree_of(env)
    if tree.path_stack:
        raise SxError(f"defmodel {name} inside the constructor of {tree.path_stack[-1]}: a submodule is (sub name (constructor …))", loc)
    if name in tree.models:
        raise SxError(f"model {name} is defined twice", loc)
    with tree.under(name):
        value = env.eval(args[1], env.loc_of_arg(1))
    module = module_of(value)
    if module is None:
        raise SxError(f"defmodel {name}: expected a module constructor call, got {show(value)}", env.loc_of_arg(1))
    tree.models[name] = (module.constructor, value)
    env.bind_global(name, value)
    return Defined(name, ModelValue(module.constructor, name))


register_special_form("defmodule", _defmodule)
register_special_form("param", _param)
register_special_form("sub", _sub)
register_special_form("sub-list", _sub_list)
register_special_form("defmodel", _defmodel)
register_builtin("normal", _normal, loc=True)
register_builtin("uniform", _uniform, loc=True)
register_builtin("constant", _constant, loc=True)

#: Initializers without arguments are values: `:init zeros`.
INIT_VALUES = {"zeros": Init("zeros"), "ones": Init("ones")}

