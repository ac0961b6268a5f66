"""IR core and the dialects. Importing this package registers every op."""

from sexpgpu.dialects import exp, graph  # noqa: F401
