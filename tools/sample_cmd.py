"""`sexpgpu sample RUN`: generate text from a trained run's checkpoint (see docs/verbs/sample.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..backends.sampling import sample
from ..diagnostics import SxError, UsageError, display_path
from .common import add_device_flag


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0 (0: greedy), got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run record (the --out directory of sexpgpu run) or one of its "
                                                   "checkpoints/step-N")
    parser.add_argument("--checkpoint", metavar="step-N", help="which checkpoint of RUN (default: the latest)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help='the text to continue (default: a newline, as nanoGPT)')
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 file")
    parser.add_argument("--tokens", type=_at_least(1), default=200, metavar="N", help="new tokens per sample (200)")
    parser.add_argument("--temperature", type=_temperature, default=0.8, metavar="T",
                        help="divides the logits; 0 picks the most likely token (greedy). Default 0.8")
    parser.add_argument("--top-k", type=_at_least(1), default=200, metavar="K",
                        help="draw among the K most likely tokens only (default 200)")
    parser.add_argument("--seed", type=_at_least(0), default=1337, metavar="S", help="fixes the draws (1337)")
    parser.add_argument("--samples", type=_at_least(1), default=1, metavar="N", help="how many samples (1)")
    add_device_flag(parser, "where the model runs")
    parser.add_argument("--force", action="store_true",
                        help="sample even when the experiment changed since the checkpoint was written")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document: the tokens and their log-probabilities (no streaming)")


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return "\n" if args.prompt is None else args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"cannot read {args.prompt_file}: no such file") from None
    except UnicodeDecodeError as err:
        raise SxError(f"{display_path(args.prompt_file)}: the prompt is not UTF-8 text ({err.reason} at byte "
                      f"{err.start})") from None
    except OSError as err:
        raise UsageError(f"cannot read {args.prompt_file}: {err.strerror or err}") from None


def run(args: argparse.Namespace) -> int:
    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    document = sample(args.run, _prompt_text(args), args.tokens, args.temperature, args.top_k, args.seed, args.samples,
                      args.device, args.checkpoint, args.force, on_text=None if args.json else stream)
    if args.json:
        print(json.dumps(document, indent=2))
    return 0
