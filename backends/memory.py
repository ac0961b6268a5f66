"""Memory a run needs against what the machine gives it: clear errors instead of a MemoryError.

A run's parameters, gradients and optimizer states are known before anything
is allocated, so a run whose tensors alone exceed the machine's memory (or the
process's address-space limit) is refused up front, located at its largest
parameter. Allocations that fail later (an activation buffer, a kernel's
temporary) become errors naming what was being allocated and its size.
"""

from __future__ import annotations

import os
import resource

from ..byte_text import show_bytes
from ..diagnostics import Location, SxError


def available_bytes() -> int | None:
    """What this process may hold: the smaller of the physical memory and its address-space limit."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    return min(limits) if limits else None


def check_tensors_fit(tensors: list[tuple[str, int, Location | None]], what: str) -> None:
    """Refuse tensors (name, bytes, location) whose total exceeds the memory available, at the largest one."""
    total = sum(nbytes for _, nbytes, _ in tensors)
    limit = available_bytes()
    if limit is None or total <= limit or not tensors:
        return
    name, nbytes, loc = max(tensors, key=lambda t: t[1])
    raise SxError(
        f"{what} need {show_bytes(total)} ({total} bytes), more than the {show_bytes(limit)} of memory this "
        f"process may use; the largest, {name}, needs {show_bytes(nbytes)} of it",
        loc,
    )


def out_of_memory(what: str, nbytes: int, loc: Location | None, detail: str = "") -> SxError:
    """The error for an allocation of `nbytes` for `what` that failed."""
    limit = available_bytes()
    room = f"; this process may use {show_bytes(limit)}" if limit is not None else ""
    return SxError(f"out of memory: {what} needs {show_bytes(nbytes)} ({nbytes} bytes){detail}{room}", loc)


def check_training_tensors_fit(ops: list) -> None:
    """Refuse an experiment (its `exp` ops) whose parameters, gradients and optimizer states (f32
    master copies) exceed the memory available, before any of them is allocated."""
    states = {member: len(op.attributes.get("states") or {})
              for op in ops if op.name == "exp.group" for member in op.attributes["members"]}
    tensors = [(f"{op.attributes['path']} {list(op.attributes['type'].shape)}",
                op.attributes["type"].numel * 4 * (2 + states.get(op.attributes["path"], 0)), op.loc)
               for op in ops if op.name == "exp.param"]
    check_tensors_fit(tensors, "the parameters with their gradients and optimizer states")


def ran_out(err: MemoryError, loc: Location | None) -> SxError:
    """A MemoryError from an allocation no check foresaw (numpy's message says how much it wanted)."""
    return SxError(f"out of memory: {err or 'an allocation failed'}", loc)
