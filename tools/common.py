"""What every command-line program shares: the error boundary, Ctrl-C, and selection flags."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from ..diagnostics import UsageError
from ..interruption import interrupt

ISSUES_URL = "the sexpgpu issue tracker"


def knob_assignment(text: str) -> str:
    """`--set` takes KNOB=VALUE; anything else is a wrong command line (exit 2), not an experiment error."""
    name, eq, _ = text.partition("=")
    if not eq or not name.strip():
        raise argparse.ArgumentTypeError(f"expected KNOB=VALUE, got '{text}'")
    return text


def add_selection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", metavar="NAME", help="select a variant defined with defvariant")
    parser.add_argument(
        "--set", dest="set", action="append", default=[], type=knob_assignment, metavar="KNOB=VALUE",
        help="override a knob (repeatable)",
    )


def add_device_flag(parser: argparse.ArgumentParser, purpose: str) -> None:
    from ..backends.devices import DEVICES, default_device

    parser.add_argument("--device", choices=DEVICES, default=default_device(),
                        help=f"{purpose} (default: $SEXPGPU_DEVICE or cpu)")


#: Seconds the work has, after a Ctrl-C, to stop before the process ends without it.
INTERRUPT_GRACE = 3.0
def positive_count(text: str) -> int:
    """`--ranks` takes a count ≥ 1; anything else is a wrong command line (exit 2)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a rank count ≥ 1, got '{text}'")
    return int(text)


def add_ranks_flag(parser: argparse.ArgumentParser, purpose: str) -> None:
    parser.add_argument("--ranks", type=positive_count, metavar="N", help=purpose)


def requested_ranks(args: argparse.Namespace) -> int:
    """How many data-parallel ranks a command line asks for: `--ranks`, else one per `SEXPGPU_DEVICES`
    id on a GPU (docs/distributed.md)."""
    text = os.environ.get("SEXPGPU_DEVICES") or ""
    ids = [part for part in text.split(",") if part.strip()]
    if args.device != "cpu" and len(ids) > 1:
        if args.ranks is not None and args.ranks != len(ids):
            raise UsageError(f"--ranks {args.ranks}, but SEXPGPU_DEVICES={text} names {len(ids)} devices: "
                             "a GPU rank runs on each")
        return len(ids)
    return args.ranks or 1


def guarded(body: Callable[[], int]) -> int:
    """Run a command body: user errors print their diagnostic and give 1, usage errors 2, bugs 3,
    Ctrl-C 130 (see `ctrl_c`)."""
    with ctrl_c():
        try:
            return _reported(body)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


def _reported(body: Callable[[], int]) -> int:
    # Imported here, under `ctrl_c`: a Ctrl-C while the command starts is handled too.
    from ..diagnostics import SxError, UsageError

    try:
        return body()
    except SxError as err:
        sys.stdout.flush()
        print(err.render(), file=sys.stderr)
        return 1
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except RecursionError:
        print("error: the program nests too deeply (recursion limit reached)", file=sys.stderr)
        return 1
    except Exception:
        sys.stdout.flush()
        print("internal error: this is a bug in sexpgpu, not in your file; please report it to "
              f"{ISSUES_URL} with the trace below", file=sys.stderr)
        traceback.print_exc()
        return 3


@contextmanager
def ctrl_c() -> Iterator[None]:
    """Ctrl-C while a command runs, the one mechanism: the first interrupts the work, wherever it
    runs (`sexpgpu.interruption`), and the command ends "interrupted" with status 130; a second,
    or work that has not stopped `INTERRUPT_GRACE` seconds after the first, ends the process at
    once with that status. Left as it is where Ctrl-C is ignored (`nohup`), or set by the program
    embedding the command, and outside the main thread.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    deadline: list[threading.Timer] = []

    def on_sigint(signum: int, frame: Any) -> None:
        if deadline:
            _end_interrupted()
        timer = threading.Timer(INTERRUPT_GRACE, _end_interrupted)
        timer.daemon = True
        deadline.append(timer)
        timer.start()
        interrupt()

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for timer in deadline:
            timer.cancel()


def end_process(status: int) -> NoReturn:
    """End a one-shot command's process with `status`, its output flushed, without tearing its IR down:
    freeing a module of tens of thousands of ops object by object takes a tenth of `check`'s time on
    GPT-2 small, and the system frees the whole process at once. mypy ends so (`util.hard_exit`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (a closed pipe): nothing more to say
            pass
    os._exit(status)


def _end_interrupted() -> None:
    """End the process now, as an interrupted command: without finalizing the interpreter
    under work that may still run (deep in a recursion, finalizing aborts the process)."""
    os.write(2, b"interrupted\n")
    os._exit(130)
