"""Where a Ctrl-C goes: to the thread doing the program's work, never lost on the way.

The command-line layer owns Ctrl-C (`tools/common.py`): its SIGINT handler says what an
interrupt means (the first stops the work and the command exits 130, "interrupted"; a
second, or work that does not stop within a grace period, ends the process at once) and
calls `interrupt()` to deliver one. This module says where it goes.

The work is the main thread's until the main thread hands it to a worker thread
(`handed_over`, around starting and joining the worker: the evaluator's deep-stack thread,
`frontend/deep.py`). From then until the worker has ended, an interrupt is the worker's:
raised in it as `KeyboardInterrupt` while it takes them (`taken_here`), kept until it does
when it has not started to, and raised in the main thread once the worker has ended if the
worker never took it. The main thread itself is never interrupted while it waits for the
worker, so it cannot stop waiting (and lower the recursion limit, or finalize the
interpreter) under a worker deep in its recursion, which aborts the process.

Signal handlers run in the main thread between bytecodes, and the worker only lets the main
thread run at its own eval-breaker checks, so the state here is plain global stores the GIL
keeps whole: no lock (a handler waiting for one that the interrupted main thread holds would
wait for ever).
"""

from __future__ import annotations

import ctypes
import functools
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The main thread has handed the work to a worker: interrupts are the worker's.
_handed = False
#: The worker's thread id while it takes interrupts.
_worker: int | None = None
#: An interrupt came while the work was handed over (taken by the worker or not yet).
_pending = False


def interrupt() -> None:
    """Deliver one Ctrl-C to the work. Call it from the main thread (a SIGINT handler)."""
    global _pending
    if not _handed:
        raise KeyboardInterrupt
    _pending = True
    if _worker is not None:
        _raise_in(_worker, KeyboardInterrupt)


def _raise_in(ident: int, exception: type[BaseException] | None) -> None:
    """Raise `exception` in thread `ident` at its next check (None: drop one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exception) if exception else None)


def _handle_sigint(signum: int, frame: Any) -> None:
    interrupt()


@contextmanager
def handed_over() -> Iterator[None]:
    """While this lasts, Ctrl-C is for the worker thread the caller starts and waits for.

    Raises `KeyboardInterrupt` at the end when an interrupt came that the worker never took
    (it came before the worker started, or after it finished). Called from another thread
    than the main one, it changes nothing: only the main thread gets signals.
    """
    global _handed, _pending, _worker
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Python's own handler would raise in this thread, which is waiting, not working.
    default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if default:
        signal.signal(signal.SIGINT, _handle_sigint)
    _handed, _pending = True, False
    try:
        yield
    finally:
        _handed, _worker = False, None
        if default:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if _pending:
        _pending = False
        raise KeyboardInterrupt


class taken_here:  # noqa: N801  (used as a `with` statement, as contextlib's are)
    """The calling worker thread takes the work's interrupts while this lasts.

    An interrupt that came before it started is raised at once. On leaving, one raised in the
    thread but not yet delivered is dropped: `handed_over` raises it in the main thread.
    """

    def __enter__(self) -> None:
        global _worker
        ident = threading.get_ident()
        # Made before the thread is published: from then on it may be interrupted at any check,
        # and dropping an interrupt on the way out must be one call into C, without a check.
        self._drop = functools.partial(ctypes.pythonapi.PyThreadState_SetAsyncExc, ctypes.c_ulong(ident),
                                       ctypes.py_object(_Dropped))
        _worker = ident
        if _pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        global _worker
        _worker = None
        # The drop puts `_Dropped` in the place of an interrupt not yet delivered, and takes it here
        # at once: taking an asynchronous exception is what clears the interpreter's note that one
        # is pending. Dropping with none (NULL) leaves that note set for the rest of the process
        # (CPython 3.11), so every later call and loop iteration stops to look for one: about 10%
        # slower, and under a profiler (cProfile) a function's first instruction loops for ever.
        try:
            self._drop()
            _take_pending()
        except _Dropped:
            pass


class _Dropped(Exception):
    """What replaces an interrupt a worker dropped on its way out, taken there at once."""


def _take_pending() -> None:
    """A Python call, whose first instruction takes a pending asynchronous exception."""


def start_worker(thread: threading.Thread) -> None:
    """Start `thread` with SIGINT blocked in it, so the system delivers every SIGINT to the
    main thread, where Python runs signal handlers (one delivered to another thread would
    not wake the main thread while it waits)."""
    if not hasattr(signal, "pthread_sigmask"):  # not a Unix
        thread.start()
        return
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
