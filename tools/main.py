"""`sexpgpu`: the verbs a researcher runs on an experiment file."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

from .common import add_selection_flags, end_process, guarded

#: verb → (module under sexpgpu.tools providing `add_arguments(parser)` (optional) and `run(args) -> int`, help)
VERBS = {
    "check": ("check_cmd", "read, evaluate and verify every graph"),
    "knobs": ("knobs_cmd", "list the knobs, their defaults and each variant's values"),
    "eval": ("eval_cmd", "evaluate every top-level form and print its value"),
    "explain": ("explain_cmd", "the target-independent account of one file"),
    "diff": ("diff_cmd", "what differs between two files or two selections"),
    "ir": ("ir_cmd", "the whole experiment as a JSON document"),
    "run": ("run_cmd", "train the experiment"),
    "plot": ("plot_cmd", "plot the metrics of a run record as a PNG"),
    "sample": ("sample_cmd", "generate text from a run's checkpoint"),
    "prepare": ("prepare_cmd", "encode text files into train.bin and val.bin token files"),
}

#: Verbs that compile a module, report on it and end: run as the process (`sexpgpu VERB ...`), they
#: keep the cyclic collector off, since the module lives until the process exits (a collection
#: would only re-traverse it: a third of `check`'s time on GPT-2 small), and end the process
#: without tearing the module down (`end_process`).
_ONE_SHOT = {"check", "explain", "ir", "diff"}

#: Verbs that take no experiment selection.
_NO_SELECTION = {"plot", "sample", "prepare"}


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen verb's module is imported, so `--help` stays fast."""
    parser = argparse.ArgumentParser(prog="sexpgpu", description="Compile and run deep-learning experiments written as S-expressions.")
    from ..version import __version__

    parser.add_argument("--version", action="version", version=f"sexpgpu {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        mod = importlib.import_module(f"sexpgpu.tools.{module}") if verb == chosen else None
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
        else:
            p.add_argument("file", help="the experiment (.sx)")
        if verb not in _NO_SELECTION:
            add_selection_flags(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    one_shot_process = False

    def body() -> int:
        nonlocal one_shot_process
        words = sys.argv[1:] if argv is None else argv
        chosen = next((w for w in words if not w.startswith("-")), None)
        args = build_parser(chosen).parse_args(words)
        from ..dialects.core import tune_gc_for_large_ir

        tune_gc_for_large_ir()  # as sexpgpu-opt does: every verb builds a large, long-lived IR
        if argv is None and args.verb in _ONE_SHOT:
            one_shot_process = True
            gc.disable()
        module = importlib.import_module(f"sexpgpu.tools.{VERBS[args.verb][0]}")
        return module.run(args)

    status = guarded(body)
    if one_shot_process:
        end_process(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
