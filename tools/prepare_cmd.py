"""`sexpgpu prepare TEXT... --tokenizer gpt2|bytes --out DIR`: text to token files (see docs/verbs/prepare.md)."""

from __future__ import annotations

import argparse
import sys

from ..backends.preparing import DEFAULT_VAL, FORMATS, prepare
from ..backends.tokenizers import tokenizer_named
from ..diagnostics import display_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", nargs="+", metavar="TEXT", help="UTF-8 text files, each a document, in order")
    parser.add_argument("--tokenizer", required=True, choices=("gpt2", "bytes"),
                        help="gpt2 (GPT-2's BPE through tiktoken) or bytes (one id per byte)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write train.bin and val.bin")
    parser.add_argument("--val", type=float, default=DEFAULT_VAL, metavar="FRACTION",
                        help=f"the fraction of lines, at the end, for val.bin (default {DEFAULT_VAL})")
    parser.add_argument("--format", choices=FORMATS, default="nanogpt",
                        help="nanogpt: a headerless token stream (default); llmc: llm.c's 1 KiB header first")


def run(args: argparse.Namespace) -> int:
    result = prepare(args.text, tokenizer_named(args.tokenizer), args.out, args.val, args.format,
                     stream=sys.stderr, interactive=sys.stderr.isatty())
    if result.dtype == "u32":
        how = "llm.c's uint32 header, magic 20240801 version 7" if result.format == "llmc" else "read them with :dtype u32"
        print(f"the {result.tokenizer} vocabulary does not fit uint16: the tokens are uint32 ({how})", file=sys.stderr)
    for path, count in result.files.values():
        print(f"wrote {display_path(str(path))}: {count:,} {result.dtype} tokens ({result.format})")
    print(f"{sum(count for _, count in result.files.values()):,} tokens in {result.seconds:.1f}s, "
          f"{result.tokens_per_s:,.0f} tok/s")
    return 0
