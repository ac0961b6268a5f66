"""The bounds on evaluation (language.md, "Bounds"): every one is a located error, never a hang.

They keep a careless or hostile file from exhausting time or memory before
anything runs: each is far above what a real experiment needs (GPT-2 at 48
layers traces fewer than 20,000 ops into its largest graph and has no tensor
over 2^31 elements), and each is checked where the value is made, so the
error points at the form that made it.
"""

from __future__ import annotations

#: Digits an integer may have, in the source and as the result of arithmetic: Python's own
#: limit on converting between text and int (`sys.get_int_max_str_digits()`), so every
#: integer prints and reads back.
MAX_INT_DIGITS = 4300
#: The integers are those of absolute value below this.
INT_LIMIT = 10**MAX_INT_DIGITS

#: Items of a list or vector made by `range`, `concat` or `map`; characters of a string made
#: by `str`, `format` or `concat`.
MAX_ITEMS = 1_000_000
MAX_STRING_CHARS = 16_000_000

#: A count the experiment forms take (steps, a batch, an interval, a seed): what numpy takes as an int64.
MAX_COUNT = 2**63 - 1

#: Elements of one tensor (a shape's product): 2^40, 4 TiB of f32 (a parameter's bound too).
MAX_ELEMENTS = 2**40
#: Ops of one traced graph.
MAX_GRAPH_OPS = 1_000_000
#: Parameters (tensors) of one model.
MAX_PARAMS = 10_000

#: Forms nested in forms (lists, vectors, maps), as evaluated or quoted.
MAX_NESTING = 30_000
#: Nested calls of .sx functions allowed before a located "too deep" error.
MAX_CALL_DEPTH = 10_000
#: Macro expansions nested in one another (an expansion that uses a macro, whose expansion …).
MAX_EXPANSION_DEPTH = 1_000


def int_in_range(value: int) -> bool:
    """Whether the integer `value` has at most `MAX_INT_DIGITS` digits."""
    return -INT_LIMIT < value < INT_LIMIT
