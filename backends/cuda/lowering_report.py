"""The lowering report `run --device cuda` prints before its first step and logs as the `lowering` event.

The report's layout belongs to the report renderer that `explain --device cuda --target` prints
(docs/cuda.md, the seed page's "The lowering report"); `lowering_report` is the one place the CUDA
executor asks for the text, from the lowering's facts (`unit.facts["lowering"]` of the experiment's
module, and of the stacked graphs' when a run stacks) and what only the opened device can tell
(`CudaExecutor.device_facts`: its name, memory, which graphs are captured, the stacking chosen).
Until the renderer lands, `render` below lays the same facts out in the seed's shape.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ...report import KIND_TITLES
from .runtime import format_bytes

if TYPE_CHECKING:
    from .executor import CudaExecutor

#: Width of a row's title column, as on the seed page.
TITLE_WIDTH = 26
#: Width of a pattern line's family column.
FAMILY_WIDTH = 19
#: Model paths listed per pattern line before "N more".
PATHS_SHOWN = 4


def lowering_report(executor: CudaExecutor) -> str | None:
    """The report of the experiment's graphs as `executor` lowered them, or None before any."""
    if executor.experiment is None:
        return None
    return render(executor.report_facts(), executor.device_facts())


def render(lowering: dict[str, Any], device: dict[str, Any]) -> str:
    """The lowering block: the device line, one row per graph (pattern lines under it), the run's lines."""
    lines = [f"lowering: {device['device']} {device['arch']} {device['name']}, patterns on"]
    captured = set(device["capture"]["graphs"]) if device["capture"]["available"] else set()
    kinds = lowering.get("kinds", {})
    updates = lowering.get("updates", {})
    merged = {fact["graph"]: group for group, fact in updates.items()}
    for name, row in lowering.get("graphs", {}).items():
        kind = kinds.get(name)
        if kind == "update" and name not in merged:
            continue  # a lone parameter's update: part of its group's row below
        if name in merged:
            group = merged[name]
            title = f"update {group}"
            head = f"{updates[group]['graphs']} graphs: {updates[group]['nodes']} nodes, "
        else:
            title = KIND_TITLES.get(kind or "", name) if kind != "train_stacked" or "accumulating" not in name \
                else "train stacked accumulating"
            head = f"{row['nodes']} nodes, "
        text = head + _kernels(row) + (", captured" if name in captured else "")
        lines.append(f"  {title:<{TITLE_WIDTH}}{text}")
        lines.extend(_pattern_lines(lowering.get("patterns", {}).get(name, {})))
    stacking = device.get("stacking")
    if stacking is not None:
        others = [str(k) for k in stacking["candidates"] if k != stacking["chosen"]]
        among = f" (of {', '.join(map(str, stacking['candidates']))})" if others else ""
        lines.append(f"  {'stacking':<{TITLE_WIDTH}}{stacking['chosen']}{among}: chosen when the run opened its device")
    memory = device["memory"]
    lines.append(f"  {'memory':<{TITLE_WIDTH}}{format_bytes(memory['pool'])} of arrays, "
                 f"{format_bytes(memory['activations'])} of activations; {format_bytes(memory['free'])} free "
                 f"of {format_bytes(memory['total'])}")
    if not device["capture"]["available"]:
        lines.append(f"  {'capture':<{TITLE_WIDTH}}off: {device['capture']['reason']}")
    return "\n".join(lines)


def _kernels(row: dict[str, Any]) -> str:
    groups = row.get("fused_groups", [])
    text = f"{row['kernels']} kernels"
    if groups:
        median = statistics.median(groups)
        text += (f": {len(groups)} fused groups of {min(groups)} to {max(groups)} nodes "
                 f"(median {median:g})")
    if row.get("gemms"):
        text += f", {row['gemms']} GEMMs"
    return text


def _pattern_lines(families: dict[str, Any]) -> list[str]:
    by_group: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for family, fact in families.items():
        if fact.get("fired"):
            by_group.setdefault(fact["group"], []).append((family, fact))
    lines = []
    for group, found in by_group.items():
        counts = ", ".join(f"{family.replace('_', ' ')} {fact['fired']}" for family, fact in found)
        paths = compress_paths(p for _, fact in found for p in fact.get("paths", []))
        shown = ", ".join(paths[:PATHS_SHOWN]) + (f", {len(paths) - PATHS_SHOWN} more" if len(paths) > PATHS_SHOWN else "")
        lines.append(f"    {group:<{FAMILY_WIDTH}}{counts}   {shown}".rstrip())
        for phrase in dict.fromkeys(a for _, fact in found for a in fact.get("as", [])):
            lines.append(f"    {'':<{FAMILY_WIDTH}}as {phrase}")
        for _, fact in found:
            for fell in fact.get("fell_back", []):
                lines.append(f"    {'':<{FAMILY_WIDTH}}fell back {fell.get('path', '')}: {fell.get('reason', '')}")
    return lines


def compress_paths(paths: Iterable[str]) -> list[str]:
    """Model paths in first-seen order, those differing in one number folded: `model.blocks.{0..11}.attn`."""
    seen = list(dict.fromkeys(p for p in paths if p))
    folded: dict[str, list[int]] = {}
    order: list[str] = []
    for path in seen:
        match = re.search(r"\.(\d+)(?=\.|$)", path)
        key = path if match is None else path[:match.start(1)] + "{}" + path[match.end(1):]
        if key not in folded:
            folded[key] = []
            order.append(key)
        if match is not None:
            folded[key].append(int(match.group(1)))
    result = []
    for key in order:
        numbers = sorted(set(folded[key]))
        if not numbers:
            result.append(key)
        elif len(numbers) == 1:
            result.append(key.replace("{}", str(numbers[0])))
        elif numbers == list(range(numbers[0], numbers[-1] + 1)):
            result.append(key.replace("{}", f"{{{numbers[0]}..{numbers[-1]}}}"))
        else:
            result.append(key.replace("{}", "{" + ",".join(map(str, numbers)) + "}"))
    return result
