"""The frontend: reading, evaluating and tracing .sx files into the experiment module.

Importing the package composes the language (`library`), so every `Evaluator` starts with it.
"""

from . import library  # noqa: F401  (registers the builtins, the forms and the session hook)
