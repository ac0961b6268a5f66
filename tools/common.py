"""What every command-line program shares: the error boundary and selection flags."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from ..diagnostics import SxError, UsageError

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


def guarded(body: Callable[[], int]) -> int:
    """Run a command body: user errors print their diagnostic and give 1, usage errors 2, bugs 3."""
    try:
        return body()
    except SxError as err:
        sys.stdout.flush()
        print(err.render(), file=sys.stderr)
        return 1
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
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
