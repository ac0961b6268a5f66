"""The text of a byte count that reports and messages write."""

from __future__ import annotations

#: Binary units above bytes, smallest first.
UNITS = (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30))


def show_bytes(nbytes: int) -> str:
    """Bytes to one decimal in the largest binary unit they reach, as the explain page writes memory:
    `512 B`, `12.6 KiB`, `915.5 MiB`, `139.8 GiB`. A message that needs the exact count adds it."""
    for unit, size in reversed(UNITS):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"
