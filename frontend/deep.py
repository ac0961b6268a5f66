"""The deep-thread runner: analysed code runs on a thread with a large stack.

Analysed .sx code recurses in Python a few frames per .sx call and per nested form, so
a deep recursion or a deeply nested form needs far more stack than the main thread has.
`run_deep` runs a body on a thread whose stack and recursion limit fit the evaluator's
bounds (`limits.MAX_CALL_DEPTH`, `limits.MAX_NESTING`), and hands it Ctrl-C while it
runs (`sexpgpu.interruption`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from ..diagnostics import SxError
from ..interruption import handed_over, start_worker, taken_here
from .limits import MAX_CALL_DEPTH, MAX_NESTING

#: Python frames the analysed code may use: a few per .sx call and per nested form, with room to spare.
_PYTHON_RECURSION_LIMIT = max(MAX_CALL_DEPTH * 12, MAX_NESTING * 8) + 10_000
#: Stack of the evaluation thread: room for `_PYTHON_RECURSION_LIMIT` frames (see `_STACK_BYTES_PER_FRAME`).
_THREAD_STACK_BYTES = 1024 * 1024 * 1024
#: Stack sizes tried for the evaluation thread, largest first: a smaller one when the process
#: may not map the larger (`ulimit -v`), with a recursion limit in proportion.
_STACK_SIZES = (_THREAD_STACK_BYTES, 256 << 20, 64 << 20, 16 << 20)
#: Bytes of thread stack to allow per frame of Python's recursion limit. Python-to-Python calls
#: take none; a recursion through C takes some (`=` on nested lists: about 280 bytes a frame,
#: measured on CPython 3.11), so this leaves a margin of seven.
_STACK_BYTES_PER_FRAME = 2 << 10
#: How long the calling thread waits on the evaluation thread between checks for signals.
_JOIN_SLICE_SECONDS = 0.05


def run_deep(body: Callable[[], Any]) -> Any:
    """Run `body` where deep recursion of analysed code fits (a thread with a large stack).

    Ctrl-C interrupts it (`sexpgpu.interruption`): while the thread runs, an interrupt is
    raised in it, so a long evaluation stops and the `KeyboardInterrupt` reaches the caller
    once the thread has ended; one that came while the thread was starting or finishing is
    raised in the caller then.
    """
    if getattr(_deep, "active", False):
        return body()
    result: list = []
    error: list[BaseException] = []

    def target() -> None:
        _deep.active = True
        try:
            with taken_here():
                result.append(body())
        except BaseException as e:  # handed to the calling thread as is
            error.append(e)

    old_limit = sys.getrecursionlimit()
    with handed_over():
        try:
            thread = _start_deep_thread(target, old_limit)
            # Joined in slices: a SIGINT that lands just before an untimed join blocks runs only the
            # C-level handler, and the Python one waits for this thread's next bytecode for ever
            # (reproduced under load: the Ctrl-C test hung in `join` with no handler run).
            while thread.is_alive():
                thread.join(_JOIN_SLICE_SECONDS)
        finally:
            # Only once the thread has ended: the limit is the process's, and lowering it under
            # a thread deep in its recursion aborts the process.
            sys.setrecursionlimit(old_limit)
    if error:
        raise error[0]
    return result[0]


def _stack_sizes() -> list[int]:
    """The stack sizes to try: under a virtual-memory limit, none over a quarter of it (the rest is the heap's)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return list(_STACK_SIZES)
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return list(_STACK_SIZES)
    return [size for size in _STACK_SIZES if size <= limit // 4] or [_STACK_SIZES[-1]]


def _start_deep_thread(target: Callable[[], None], old_limit: int) -> threading.Thread:
    """Start `target` on a daemon thread with the largest stack the process can have."""
    old_size = threading.stack_size()
    sizes = _stack_sizes()
    try:
        for size in sizes:
            thread = threading.Thread(target=target, name="sx-eval", daemon=True)
            limit = min(_PYTHON_RECURSION_LIMIT, size // _STACK_BYTES_PER_FRAME)
            sys.setrecursionlimit(max(old_limit, limit))
            try:
                threading.stack_size(size)
                start_worker(thread)
            except (RuntimeError, ValueError, MemoryError):
                if size == sizes[-1]:
                    raise SxError(
                        "cannot start the evaluator: the process may not map a thread stack of "
                        f"{size >> 20} MiB (is the virtual memory limit, ulimit -v, too low?)"
                    ) from None
                continue
            return thread
    finally:
        threading.stack_size(old_size)
    raise AssertionError("unreachable")


_deep = threading.local()
