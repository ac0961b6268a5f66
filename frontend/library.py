"""The .sx language a session starts with, put together from its parts.

The evaluator analyses and runs forms and keeps the registries the parts fill
(builtins, special forms, session hooks); the parts import the evaluator,
never the other way round. Importing a part registers its names:

- `special_forms`: quote, quasiquote, if, cond, let, fn, def, defn, defmacro, … (§2)
- `builtins`: scalars, lists, strings, maps, errors (§2)
- `tracer`: tensors and their primitives
- `modules`: defmodule, param, sub, defmodel and the initializers (§4)
- `experiment_forms`: the experiment forms (§3) and the prelude

This module imports them all and adds the session hook that gives every new
`Evaluator` its experiment definition, model tree and prelude. The package
imports it (`frontend/__init__.py`), so an `Evaluator` made anywhere starts
with the whole language.
"""

from __future__ import annotations

from . import builtins, modules, special_forms, tracer  # noqa: F401  (each registers its names)
from .evaluator import SESSION_HOOKS
from .experiment_forms import install

SESSION_HOOKS.append(install)
