"""The lowering report's text (docs/cuda.md, "The lowering report"), from the lowering document alone.

The document is what `passes.lowering_report.lowering_document` returns (the `device` object of the
explain document); an executor hands it up with its device's facts (`LoweringFacts`), and
`lowering_text` renders those: `run` prints it before its first step and records it as the `lowering`
event, `explain --device cuda` prints it in place of the device hole.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

from ..byte_text import show_bytes
from ..dialects.graph import show_shape
from ..passes.lowering_report import DeviceFacts, LoweringFacts, apply_device
from ..passes.roofline import GPUS
from .text import compress_paths, plural, table

#: The lowering report's first column (row names, run-wide keys) is at least this wide, as on the seed page.
LOWERING_NAME_WIDTH = 24
#: A family line's group label ("cross-entropy tail") and kernel columns are at least this wide (then a space).
FAMILY_LABEL_WIDTH = 18
FAMILY_KERNELS_WIDTH = 28
#: Model paths (after folding) a family line shows before counting the rest.
PATHS_SHOWN = 3


def render_lowering(document: dict[str, Any], device: DeviceFacts | None = None) -> str:
    """The lowering report's text (the seed page's "The lowering report"), from the lowering document alone.

    `document` is what `passes.lowering_report.lowering_document` returns (the `device` object of the
    explain document); `device` what an opened device told, applied to a copy (the document is not
    changed), None to print what the document holds (`explain --device cuda --target` measures nothing).
    `explain --device cuda` prints this in place of the device hole; the CUDA executor prints it before a
    run's first step and sends it as the `lowering` event.
    """
    doc = apply_device(copy.deepcopy(document), device) if device is not None else document
    rows = doc["rows"]
    name_width = max([LOWERING_NAME_WIDTH, *(len(r["name"]) for r in rows)])
    label_width = max([FAMILY_LABEL_WIDTH, *(len(g["group"]) for r in rows for g in r["families"])])
    under = " " * (4 + label_width + 1)
    arch = doc["arch"]
    # A GPU's lowering names its compute capability; the compiled CPU target its machine (x86_64).
    target = arch if doc["executor"] == "cpu-c" else f"compute_{arch.removeprefix('sm_')}"
    lines = [f"lowering: {doc['executor']} {target} {doc['name'] or '(device not measured)'}, "
             f"patterns {'on' if doc['patterns'] else 'off'}"]
    train_lines: list[str] | None = None
    estimate = doc.get("estimate")
    for row in rows:
        modelled = _modelled_row(estimate["rows"][row["name"]]) if estimate is not None else ""
        lines.append(f"  {row['name']:<{name_width}}  {_lowering_row(row)}{modelled}")
        # A row's family lines align their paths: two spaces past its longest kernel list, at least.
        kernels_width = max([FAMILY_KERNELS_WIDTH, *(len(_family_kernels(g)) + 2 for g in row["families"])])
        family_lines = [line for g in row["families"] for line in _family_lines(g, label_width, kernels_width, under)]
        if row["kind"] == "train":
            train_lines = family_lines
        if family_lines and row["kind"] != "train" and row["kind"].startswith("train") and family_lines == train_lines:
            lines.append(f"    {'patterns':<{label_width}} same as train")
        else:
            lines += family_lines
        if "launches" in row:
            lines.append("    launches:")
            lines += table([_launch_cells(i, launch) for i, launch in enumerate(row["launches"], 1)], 6, right=(0,))
    run_lines = _lowering_run_lines(doc) + (_estimate_lines(estimate) if estimate is not None else [])
    for key, text in run_lines:
        lines.append(f"  {key:<{name_width}}  {text}")
    return "\n".join(lines) + "\n"


def _lowering_row(row: dict[str, Any]) -> str:
    """`1259 nodes, 302 kernels: 49 fused groups of 2 to 15 nodes (median 5), 66 GEMMs`, an update group's
    row after its graph count, `captured` where the run captures it."""
    text = f"{plural(row['graphs'], 'graph')}: " if row["kind"] == "update" else ""
    text += f"{row['nodes']} nodes, {plural(row['kernels'], 'kernel')}"
    details = []
    sizes = row["fused_groups"]
    if sizes:
        if sizes[0] == sizes[-1]:
            details.append(f"{plural(len(sizes), 'fused group')} of {sizes[0]} nodes")
        else:
            details.append(f"{len(sizes)} fused groups of {sizes[0]} to {sizes[-1]} nodes (median {statistics.median_low(sizes)})")
    if row["gemms"]:
        details.append(plural(row["gemms"], "GEMM"))
    if details:
        text += ": " + ", ".join(details)
    return text + (", captured" if row["captured"] else "")


def _ms(milliseconds: float) -> str:
    """`152 ms`, `38.2 ms`, `0.0123 ms`: three significant digits, whole milliseconds from 100 on."""
    return f"{milliseconds:.0f} ms" if milliseconds >= 100 else f"{milliseconds:.3g} ms"


def _decimal_bytes(nbytes: int) -> str:
    """`390.1 GB`, `12.3 MB`, `4.6 kB`: device-memory traffic in decimal units, as bandwidths are given."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def _modelled_row(row: dict[str, Any]) -> str:
    """`; modelled 38.2 ms a call, 1 a step` (`--gpu`): a row's modelled time, and how often a step calls it."""
    calls = f"{row['calls']} a step" if row["calls"] else "not in a step"
    return f"; modelled {_ms(row['ms'])} a call, {calls}"


def _estimate_lines(estimate: dict[str, Any]) -> list[tuple[str, str]]:
    """The step estimate's lines (`--gpu`): the step, its shares, and the GPU's figures with their source."""
    gpu = GPUS[estimate["gpu"]]
    step = (f"{_ms(estimate['step_ms'])} a step on {estimate['gpu']}, stacking {estimate['stacking']}: "
            f"{estimate['launches']} launches, {_decimal_bytes(estimate['bytes'])} of device memory")
    if estimate["tokens_per_second"] is not None:
        step += f", {estimate['tokens_per_second']:,.0f} tokens/s"
    if estimate["mfu"] is not None:
        step += f", MFU {estimate['mfu']:.1%} ({estimate['mfu_dtype']} matmul FLOPs over the dense peak)"
    shares = estimate["shares"]
    spent = [f"GEMMs {shares['gemm']:.0%}", f"memory-bound kernels {shares['memory_bound']:.0%}"]
    if shares["compute_bound"] >= 0.005:
        spent.append(f"compute-bound kernels {shares['compute_bound']:.0%}")
    spent.append(f"launches {shares['launch']:.0%}")
    figures = (f"{gpu.name}: {gpu.bandwidth / 1e12:.2f} TB/s, bf16 {gpu.bf16_peak / 1e12:.0f} TFLOP/s dense "
               f"({gpu.gemm_fraction:.0%} of it in GEMMs), f32 {gpu.f32_peak / 1e12:.1f} TFLOP/s; launches "
               f"{gpu.launch_captured * 1e6:.1f} µs captured, {gpu.launch_uncaptured * 1e6:.1f} µs not")
    lines = [("estimate", step), ("", "spent in " + ", ".join(spent))]
    if estimate["unmodelled"]:
        lines.append(("", f"{', '.join(estimate['unmodelled'])} kernels counted by their bytes, not their FLOPs "
                          "(no model of their arithmetic)"))
    return [*lines, ("gpu", figures), ("", f"from the {gpu.source}")]


def _family_kernels(group: dict[str, Any]) -> str:
    """`layernorm 24, softmax backward 12`: each family that fired, with how often when more than once."""
    return ", ".join(k["name"] if k["fired"] == 1 else f"{k['name']} {k['fired']}" for k in group["kernels"])


def _folded_paths(paths: list[str | None]) -> list[str]:
    """Model paths folded where they differ in one index; regions outside any module read last."""
    inside = compress_paths(p for p in paths if p)
    return [*inside, *(["outside modules"] if any(not p for p in paths) else [])]


def _family_lines(group: dict[str, Any], label_width: int, kernels_width: int, under: str) -> list[str]:
    """A report group's line (its kernels and the model paths of their regions), its `as` lines and its
    `fell back` lines."""
    paths = _folded_paths(group["paths"]) if group["paths"] else []
    if len(paths) > PATHS_SHOWN:
        paths = [*paths[:PATHS_SHOWN], f"{len(paths) - PATHS_SHOWN} more"]
    reasons: dict[tuple[str, str], list[str | None]] = {}
    for fell in group["fell_back"]:
        reasons.setdefault((fell["family"], fell["reason"]), []).append(fell["path"])
    fell_lines = [f"fell back {family} at {', '.join(_folded_paths(where))}: {reason}"
                  for (family, reason), where in reasons.items()]
    label = f"    {group['group']:<{label_width}} "
    if not group["kernels"]:  # nothing fired: the group's first line says why
        return [label + fell_lines[0], *(under + line for line in fell_lines[1:])] if fell_lines else []
    lines = [f"{label}{_family_kernels(group):<{kernels_width}} {', '.join(paths)}".rstrip()]
    named = len({k["base"] for k in group["kernels"]} | {a["family"] for a in group["as"]}) > 1
    lines += [f"{under}as {a['family'] + ': ' if named else ''}{a['form']}" for a in group["as"]]
    lines += [under + line for line in fell_lines]
    return lines


def _dim3(dims: list[int]) -> str:
    return "×".join(str(d) for d in dims)


def _launch_cells(index: int, launch: dict[str, Any]) -> list[str]:
    """One launch of `SEXPGPU_EXPLAIN=kernels`: order, kernel symbol (`gemm` for cuBLASLt), grid and block (a
    GEMM's transposes, m×n×k, batch and epilogue), the shape and dtype it writes, model path."""
    gemm = launch["gemm"]
    if gemm is not None:
        letters = ("t" if gemm["transpose_a"] else "n") + ("t" if gemm["transpose_b"] else "n")
        where = f"cuBLASLt {letters} {gemm['m']}×{gemm['n']}×{gemm['k']}"
        where += f" batch {gemm['batch']}" if gemm["batch"] > 1 else ""
        where += f" {gemm['epilogue']}" if gemm["epilogue"] != "none" else ""
    else:
        where = f"grid {_dim3(launch['grid'])} block {_dim3(launch['block'])}"
        where += f" shared {launch['shared']}" if launch["shared"] else ""
    return [str(index), launch["symbol"] or launch["kernel"], where, show_shape(launch["shape"]), launch["dtype"],
            launch["path"] or "-"]


def _either(options: list[int]) -> str:
    """`4, 2 or 1`."""
    text = [str(o) for o in options]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


def _lowering_run_lines(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The run-wide lines: memory, stacking, capture, the compiled kernels, then what they cannot do here."""
    lines = []
    memory = doc["memory"]
    planned = f"{show_bytes(memory['persistent_bytes'])} persistent (parameters, gradients, optimizer states)"
    if memory["largest_arena"] is not None:
        planned += f", arenas up to {show_bytes(memory['largest_arena']['bytes'])} ({memory['largest_arena']['row']})"
    if memory["total_bytes"] is None:
        lines.append(("memory", f"not measured; planned {planned}"))
    else:
        free = f", {show_bytes(memory['free_bytes'])} free" if memory["free_bytes"] is not None else ""
        lines.append(("memory", f"{show_bytes(memory['total_bytes'])}{free}; planned {planned}"))
    stacking = doc["stacking"]
    degrees = stacking["degrees"]
    if stacking["chosen"] is not None:
        text = f"{stacking['chosen']}, of {_either(degrees)}: the largest whose activations fit"
    elif len(degrees) == 1:
        text = "1: one microbatch a step, nothing to stack"
    else:
        text = f"{_either(degrees)}: chosen when the run opens its device"
        if stacking["planned"] is not None:
            text += f"; train stacked above runs {stacking['planned']}"
    lines.append(("stacking", text))
    capture = doc["capture"]
    if capture["off"]:
        lines.append(("capture", f"off: {capture['off']}"))
    elif not capture["measured"]:
        lines.append(("capture", "not measured: a run captures each graph large enough after its tenth call"))
    compiled = doc["compiled"]
    if compiled is not None and "most_registers" not in compiled:  # C for a CPU: no registers or spills to tell
        cached = ", from the cache" if compiled.get("from_cache") else ""
        lines.append(("compiled", f"{plural(compiled['kernels'], 'kernel')} and {plural(compiled['functions'], 'graph function')} "
                                  f"in {plural(compiled['files'], 'C file')} by {compiled['compiler']} for {doc['arch']} "
                                  f"(-O3 -march=native -fopenmp){cached}"))
    elif compiled is not None:
        most = compiled["most_registers"]
        spills = compiled["spills"]
        spilled = f"{len(spills)} spilling ({', '.join(spills)})" if spills else "no spills"
        lines.append(("compiled", f"{plural(compiled['kernels'], 'kernel')} in {plural(compiled['functions'], 'function')} "
                                  f"by {compiled['compiler']} for {doc['arch']}: at most {most['registers']} registers "
                                  f"({most['kernel']}), {spilled}"))
        lines += [("cannot", limit) for limit in compiled["limits"]]
    return lines


def lowering_text(facts: LoweringFacts) -> str:
    """The lowering report of what an executor lowered, with its device's figures, without a final newline
    (`Executor.lowering_facts`; the training driver takes this to print a run's report)."""
    return render_lowering(facts.document, facts.device).rstrip("\n")
