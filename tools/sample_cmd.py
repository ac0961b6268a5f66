"""`sexpgpu sample RUN`: generate text from a trained run's checkpoint (see docs/verbs/sample.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..backends.sampling import Sampler, locate_run
from ..diagnostics import SxError, UsageError, display_path
from .common import add_device_flag

#: What separates samples in the text output (nanoGPT's sample.py prints the same line).
SEPARATOR = "---------------"


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
    from ..devices import open_device

    source = locate_run(args.run, args.checkpoint)
    sampler = Sampler(source, open_device(args.device, "sample"), force=args.force)
    prompt = sampler.encode_prompt(_prompt_text(args))
    top_k = args.top_k if args.temperature > 0 else None
    samples: list[dict[str, Any]] = []
    for index in range(args.samples):
        stream = sampler.tokenizer.streamer()
        if not args.json:
            text = "".join(stream(token) for token in prompt)
            sys.stdout.write(text)
            sys.stdout.flush()
        tokens, log_probs = [], []
        for token, log_prob in sampler.generate(prompt, args.tokens, args.temperature, top_k, args.seed, index):
            tokens.append(token)
            log_probs.append(log_prob)
            if not args.json:
                sys.stdout.write(stream(token))
                sys.stdout.flush()
        if not args.json:
            sys.stdout.write(f"\n{SEPARATOR}\n")
        samples.append({"tokens": tokens, "logprobs": log_probs, "text": sampler.tokenizer.decode(tokens)})
    if args.json:
        document = {
            "run": display_path(str(source.run_dir)),
            "checkpoint": display_path(str(sampler.checkpoint.path)),
            "step": sampler.checkpoint.step,
            "device": args.device,
            "tokenizer": sampler.tokenizer_name,
            "window": sampler.window,
            "settings": {"tokens": args.tokens, "temperature": args.temperature, "top_k": top_k, "seed": args.seed},
            "prompt": {"text": sampler.tokenizer.decode(prompt), "tokens": prompt},
            "samples": samples,
        }
        print(json.dumps(document, indent=2))
    return 0
