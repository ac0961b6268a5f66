"""IR core and the dialects. Importing this package registers every op."""

from . import cpu, exp, graph, kern  # noqa: F401
