"""Counts, model paths and aligned tables, as explain, the lowering report and diff write them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def human_count(n: int) -> str:
    """An element count to 3 significant digits: 1040, 393k, 6.44M, 13.3M."""
    if n < 10_000:
        return str(n)
    for suffix, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        scaled = n / scale
        if scaled < 999.5:
            return f"{scaled:.3g}{suffix}"
    return f"{n / 1e12:.3g}T"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def span(numbers: list[int]) -> str:
    """Numbers as a path component: `{0..11}` when contiguous, else `{0,2,5}`."""
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{{{numbers[0]}..{numbers[-1]}}}"
    return "{" + ",".join(map(str, numbers)) + "}"


def compress_paths(paths: Iterable[str]) -> list[str]:
    """Model paths that differ in one numeric component merge: model.blocks.{0..11}.attn."""
    templates: dict[str, list[list[str]]] = {}
    for path in paths:
        parts = path.split(".")
        key = ".".join("#" if p.isdigit() else p for p in parts)
        templates.setdefault(key, []).append(parts)
    out: list[str] = []
    for group in templates.values():
        unique = [list(p) for p in dict.fromkeys(tuple(p) for p in group)]
        varying = [i for i in range(len(unique[0])) if len({p[i] for p in unique}) > 1]
        if len(varying) != 1:
            out.extend(".".join(p) for p in unique)
            continue
        pos = varying[0]
        merged = list(unique[0])
        merged[pos] = span(sorted(int(p[pos]) for p in unique))
        out.append(".".join(merged))
    return out


def table(rows: Sequence[Sequence[str]], indent: int, right: Sequence[int] = (), min_widths: Sequence[int] = ()) -> list[str]:
    """Rows as aligned columns two spaces apart; columns listed in `right` align right."""
    if not rows:
        return []
    ncols = max(len(r) for r in rows)
    widths = [max((len(r[c]) for r in rows if c < len(r)), default=0) for c in range(ncols)]
    for c, w in enumerate(min_widths):
        widths[c] = max(widths[c], w)
    lines = []
    for row in rows:
        cells = []
        for c, cell in enumerate(row):
            last = c == len(row) - 1
            if c in right:
                cells.append(cell.rjust(widths[c]))
            else:
                cells.append(cell if last else cell.ljust(widths[c]))
        lines.append(" " * indent + "  ".join(cells).rstrip())
    return lines
