"""The lowering document: what the CUDA lowering made of each graph a step runs, as the lowering report's numbers.

`lowering_document` reads a module after `CUDA_LOWERING` (`passes/pipelines.py`)
and the facts its passes left (`unit.facts.lowering`: `match-patterns`'
families, `fuse`'s rows and update groups, `plan-buffers`' arenas), and
returns one dict with stable keys (the `device` object of
`sexpgpu/schemas/explain.schema.json`). `sexpgpu.report.lowering_text`
renders it, and only it, as the report's text: `explain --device cuda` prints
it in place of the device hole, `run` before its first step.

What only the compiler can tell (the registers and spills of every kernel)
comes in as `compiled`, plain data the caller gathers from NVRTC
(`backends/cuda/lowering.py`); what only an opened device can tell (its name,
its memory, the stacking degree a run chose, which graphs it captured) is a
`DeviceFacts`, each field None where nothing was measured, and
`apply_device` writes it into a document. An executor hands both up as
`LoweringFacts` (`Executor.lowering_facts`): facts, never text, so the
backends render nothing and the layer above them prints.

Rows: one per graph, in the explain report's order (train, train
accumulating, train stacked, train diagnosed, each evaluation by name, clip
graphs, one row per optimizer group summing its update graphs). A row's
`kernels` are the launches one call makes on the device: every `kern.launch`
(a pattern program's steps, a norm backward's column sums included, are
launches of their own) and every `kern.gemm`, so they are what a profiler
counts.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from attrs import frozen

from ..dialects.core import Operation
from ..dialects.exp import GRAPH_ORDER, graph_title
from ..dialects.graph import func_kind, graph_funcs
from ..dialects.kern import gemm_dims
from .manager import LoweringPassFacts, UnitFacts
from .roofline import launch_costs

#: The report group of the update kernels (one per optimizer group when its graphs merge, as llm.c's AdamW).
UPDATE_GROUP = "pointwise programs"
#: Executors the report is written for (the first word of its first line).
EXECUTORS = ("cuda", "cuda-sim", "cpu-c")


def lowering_document(
    module: Operation,
    facts: UnitFacts,
    arch: str,
    executor: str = "cuda",
    compiled: Mapping[str, Any] | None = None,
    launches: bool = False,
) -> dict[str, Any]:
    """The lowering document of a module after `CUDA_LOWERING` and the facts its passes left (`unit.facts`).

    `arch` is the architecture the kernels were compiled for (`sm_90`); `compiled` the compiler's figures
    (`backends/cuda/lowering.compile_facts`), None when nothing was compiled; `launches` adds every launch of each row's first graph, in execution order
    (`SEXPGPU_EXPLAIN=kernels`). The device's fields are None: no device told them (`apply_device`).
    """
    if executor not in EXECUTORS:
        raise ValueError(f"no lowering report for executor {executor!r}")
    lowering = facts.lowering
    if lowering is None or lowering.graphs is None:
        raise ValueError("the lowering document needs a module after the CUDA lowering (fuse's facts are missing)")
    kernels = {op.attributes["sym_name"]: op for op in module.body.ops if op.name == "kern.kernel"}
    run = next(op.attributes for op in module.body.ops if op.name == "exp.run")
    rows = _rows(module, lowering, kernels, launches)
    stacked = next((f for f in graph_funcs(module) if func_kind(f) == "train_stacked"), None)
    document = {
        "executor": executor,
        "arch": arch,
        "name": None,
        "patterns": lowering.patterns is not None,
        "rows": rows,
        "memory": _memory(lowering, rows),
        "stacking": {"microbatches": run["microbatches"], "ranks": 1, "degrees": stacking_degrees(run["microbatches"]),
                     "chosen": None, "planned": stacked.attributes.get("k") if stacked is not None else None},
        "capture": {"measured": False, "off": None},
        "compiled": dict(compiled) if compiled is not None else None,
    }
    return document


@frozen
class DeviceFacts:
    """What an opened device tells the report; None for what was not measured (no device, or not yet)."""

    #: The device's name as its driver gives it (`NVIDIA H200`).
    name: str | None = None
    #: Bytes of device memory in all, and free when the device opened.
    total_memory: int | None = None
    free_memory: int | None = None
    #: The stacking degree the run chose (`train stacked` runs that many microbatches a call).
    stacking: int | None = None
    #: The graphs (symbol names) the run submits as captured segments; None when capture was not decided.
    captured: frozenset[str] | None = None
    #: Why capture is off on this device, when it is (PyCUDA has no stream capture).
    capture_off: str | None = None


def stacking_degrees(microbatches: int, ranks: int = 1) -> list[int]:
    """The stacking degrees a run chooses among: the divisors of each rank's microbatch count, largest first."""
    per_rank = max(1, microbatches // ranks)
    return [k for k in range(per_rank, 0, -1) if per_rank % k == 0]


def apply_device(document: dict[str, Any], device: DeviceFacts) -> dict[str, Any]:
    """`document` (in place, and returned) with what an opened device told: its name, memory, the stacking
    degree chosen and the rows it captures. A document is built without these first, so a report of the same
    lowering (the lowering cache's) takes a device's figures later."""
    document["name"] = device.name
    document["memory"].update(total_bytes=device.total_memory, free_bytes=device.free_memory)
    document["stacking"]["chosen"] = device.stacking
    document["capture"] = {"measured": device.captured is not None, "off": device.capture_off}
    for row in document["rows"]:
        row["captured"] = None if device.captured is None else any(s in device.captured for s in row["symbols"])
    return document


@frozen
class LoweringFacts:
    """What an executor made of the graphs it compiled (`Executor.lowering_facts`): the lowering document, as
    the compiler alone tells it, and what the opened device told. The layer above the executors renders them."""

    #: The lowering document without the device's figures (`lowering_document`).
    document: dict[str, Any]
    device: DeviceFacts

    def measured(self) -> dict[str, Any]:
        """A copy of the document with the device's figures (`explain --json`'s `device` object)."""
        return apply_device(copy.deepcopy(self.document), self.device)


def without_launches(document: dict[str, Any]) -> dict[str, Any]:
    """`document` without the launch lists and each launch's costs (`SEXPGPU_EXPLAIN` unset), in place, and
    returned."""
    for row in document["rows"]:
        row.pop("launches", None)
        row.pop("launch_costs", None)
    return document


# -- rows ---------------------------------------------------------------------------------------


def _rows(module: Operation, lowering: LoweringPassFacts, kernels: Mapping[str, Operation],
          launches: bool) -> list[dict[str, Any]]:
    by_title: dict[str, list[Operation]] = {}
    funcs = sorted(graph_funcs(module), key=lambda f: GRAPH_ORDER.get(func_kind(f) or "", len(GRAPH_ORDER)))
    for func in funcs:
        by_title.setdefault(graph_title(func), []).append(func)
    graph_facts = lowering.graphs or {}
    updates = lowering.updates
    patterns = lowering.patterns or {}
    rows = []
    for title, members in by_title.items():
        symbols = [f.attributes["sym_name"] for f in members]
        kind = func_kind(members[0]) or "unknown"
        merged = updates.get(members[0].attributes.get("group")) if kind == "update" else None
        sizes = sorted(size for s in symbols for size in graph_facts[s]["fused_groups"])
        row: dict[str, Any] = {
            "name": title,
            "kind": kind,
            "symbols": symbols,
            "graphs": merged["graphs"] if merged else len(members),
            "nodes": merged["nodes"] if merged else sum(graph_facts[s]["nodes"] for s in symbols),
            "kernels": sum(_device_launches(f) for f in members),
            "gemms": sum(graph_facts[s]["gemms"] for s in symbols),
            "fused_groups": sizes,
            "arena_bytes": max((lowering.arenas.get(s, 0) for s in symbols), default=0),
            "captured": None,
            "bytes": 0,
            "flops": 0,
            "launch_costs": [cost for f in members for cost in launch_costs(f, kernels)],
            "families": _update_families(title, members, merged, lowering) if kind == "update"
            else _pattern_families([patterns.get(s, {}) for s in symbols]),
        }
        row["bytes"] = sum(cost["bytes"] for cost in row["launch_costs"])
        row["flops"] = sum(cost["flops"] for cost in row["launch_costs"])
        if launches:
            row["launches"] = launch_list(members[0], kernels)
        rows.append(row)
    return rows


def _device_launches(func: Operation) -> int:
    return sum(op.name in ("kern.launch", "kern.gemm") for op in func.body.ops)


def family_display(family: str) -> str:
    """A family as the report names it: `layernorm backward`, `log-softmax`; the tail by its direction."""
    for tail in ("cross_entropy_", "attention_"):
        if family.startswith(tail):
            return family.removeprefix(tail)
    return family.replace("_backward", " backward").replace("_", "-")


def base_family(family: str) -> str:
    """The family a form belongs to, its backward included: `layernorm`, `cross-entropy`."""
    if family.startswith("cross_entropy"):
        return "cross-entropy"
    if family.startswith("attention"):
        return "attention"
    return family.removesuffix("_backward").replace("_", "-")


def _pattern_families(per_graph: Iterable[Mapping[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The report groups of a row's pattern facts (`match-patterns`), in the order their families first fired."""
    groups: dict[str, dict[str, Any]] = {}
    for families in per_graph:
        for family, entry in families.items():
            group = groups.setdefault(entry["group"], {"group": entry["group"], "kernels": [], "paths": [], "as": [],
                                                       "fell_back": []})
            if entry["fired"]:
                kernel = next((k for k in group["kernels"] if k["family"] == family), None)
                if kernel is None:
                    kernel = {"family": family, "base": base_family(family), "name": family_display(family),
                              "fired": 0}
                    group["kernels"].append(kernel)
                kernel["fired"] += entry["fired"]
            group["paths"].extend(p for p in entry["paths"] if p not in group["paths"])
            for form in entry["as"]:
                found = {"family": base_family(family), "form": form}
                if found not in group["as"]:
                    group["as"].append(found)
            group["fell_back"].extend({"family": family_display(family) if entry["group"] == "row programs"
                                       else f"{base_family(family)} {family_display(family)}", **fell}
                                      for fell in entry["fell_back"])
    return list(groups.values())


def _update_families(title: str, members: list[Operation], merged: Mapping[str, Any] | None,
                     lowering: LoweringPassFacts) -> list[dict[str, Any]]:
    """An optimizer group's update kernels: one multi-tensor update when its graphs merged, else one
    pointwise kernel per graph, with the reason `fuse` recorded."""
    fell_back = [{"family": f["family"], "path": f["path"], "reason": f["reason"], "loc": None}
                 for f in lowering.fell_back if f.get("graph") == title]
    name = "multi-tensor update" if merged else "pointwise"
    return [{"group": UPDATE_GROUP, "kernels": [{"family": "update", "base": "update", "name": name,
                                                 "fired": len(members)}],
             "paths": [], "as": [], "fell_back": fell_back}]


# -- launches -----------------------------------------------------------------------------------


def launch_list(func: Operation, kernels: Mapping[str, Operation]) -> list[dict[str, Any]]:
    """Every launch one call of `func` makes, in execution order: the kernel (its CUDA function; `gemm` for
    cuBLASLt), its grid and block (a GEMM's m, n, k and batch instead), shared memory, the shape and dtype of
    what it writes, and the model path of its region."""
    out: list[dict[str, Any]] = []
    for op in func.body.ops:
        path = op.attributes.get("path") or None
        if op.name == "kern.gemm":
            m, n, k = gemm_dims(op)
            result = op.results[0].type
            out.append({"kernel": "gemm", "symbol": None, "grid": None, "block": None, "shared": 0,
                        "gemm": {"m": m, "n": n, "k": k, "batch": op.attributes["batch"],
                                 "transpose_a": op.attributes["transpose_a"], "transpose_b": op.attributes["transpose_b"],
                                 "epilogue": op.attributes["epilogue"]},
                        "shape": list(result.shape), "dtype": result.dtype, "path": path})
        elif op.name == "kern.launch":
            attrs = kernels[op.attributes["kernel"].name].attributes
            result = op.results[0].type
            out.append({"kernel": attrs["function"], "symbol": attrs["sym_name"], "grid": list(attrs["grid"]),
                        "block": list(attrs["block"]), "shared": attrs["shared"], "gemm": None,
                        "shape": list(result.shape), "dtype": result.dtype, "path": path})
    return out


# -- run-wide lines -----------------------------------------------------------------------------


def _memory(lowering: LoweringPassFacts, rows: list[dict[str, Any]]) -> dict[str, Any]:
    largest = max(rows, key=lambda r: r["arena_bytes"], default=None)
    return {
        "persistent_bytes": lowering.persistent_bytes,
        "largest_arena": {"row": largest["name"], "bytes": largest["arena_bytes"]} if largest else None,
        "total_bytes": None,
        "free_bytes": None,
    }
