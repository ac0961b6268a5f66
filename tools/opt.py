"""`sexpgpu-opt`: run any pass pipeline on a `.sx` file or on textual IR.

    sexpgpu-opt mlp.sxir -p 'canonicalize,cse,dce' --timing
    sexpgpu-opt my-run.sx --variant smoke -p 'evaluate,autodiff,cse,dce'
    sexpgpu-opt errors.sxir --split-input-file --verify-diagnostics

Textual IR (any file not ending in `.sx`) is parsed and verified before the
pipeline runs; a `.sx` file is handed to the pipeline as text (its frontend
passes read it). The result is printed unless a dump pass wrote a report.
Exit status: 0 success, 1 diagnostics, 2 usage, 3 internal error.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import sys

from attrs import define, field

from ..diagnostics import Diagnostic, Location, SxError, UsageError, remember_source
from .common import add_selection_flags, end_process, guarded

_SPLIT_MARKER = {False: re.compile(r"^//\s*-----\s*$"), True: re.compile(r"^;+\s*-----\s*$")}
_EXPECTATION = re.compile(r"(?://|;+)\s*expected-(error|warning|note)(?:@([+-]\d+|above|below))?\s*\{\{(.*?)\}\}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sexpgpu-opt", description="Run a pass pipeline on a .sx file or on textual IR (.sxir)."
    )
    parser.add_argument("file", nargs="?", default="-", help="input file; '-' (the default) reads stdin")
    parser.add_argument("-p", "--pipeline", default="", metavar="PIPELINE",
                        help="comma-separated passes, e.g. 'canonicalize,cse,dce' or 'insert-casts{policy=bf16}'")
    parser.add_argument("-o", dest="output", metavar="OUT", help="write the result here instead of stdout")
    parser.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (stderr)")
    parser.add_argument("--print-ir-after", action="append", default=[], metavar="NAME",
                        help="print the IR after pass NAME (repeatable)")
    parser.add_argument("--print-ir-before", action="append", default=[], metavar="NAME",
                        help="print the IR before pass NAME (repeatable)")
    parser.add_argument("--verify-each", action="store_true", help="verify the IR after every pass")
    parser.add_argument("--timing", action="store_true", help="report each pass's wall time and op counts (stderr)")
    parser.add_argument("--split-input-file", action="store_true",
                        help="run each '// -----' (';; -----' in .sx) separated chunk on its own")
    parser.add_argument("--verify-diagnostics", action="store_true",
                        help="check the diagnostics against the file's expected-error/warning/note annotations")
    parser.add_argument("--list-passes", action="store_true", help="list the registered passes and exit")
    add_selection_flags(parser)
    return parser


@define
class Expectation:
    severity: str
    line: int
    message: str
    #: Where the annotation is written, for reporting it when unmet.
    written_at: int
    met: bool = False


@define
class ChunkResult:
    output: str = ""
    diagnostics: list[Diagnostic] = field(factory=list)
    #: The error that stopped the chunk, already rendered.
    failure: str | None = None


def list_passes() -> str:
    from ..passes import load_all
    from ..passes.manager import PASSES
    from ..targets import register_targets

    register_targets()
    load_all()
    width = max((len(n) for n in PASSES), default=0)
    return "".join(f"  {name:<{width}}  {PASSES[name].summary}\n" for name in sorted(PASSES))


def read_input(path: str, shown: str) -> str:
    """The text of the input file (`-`: standard input), remembered as the source of `shown`.

    Bytes that are not UTF-8 are a located error.
    """
    from ..frontend.reader import decode_source, read_source_bytes

    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            data = read_source_bytes(path)
        except OSError as err:
            raise UsageError(f"cannot read {path}: {err.strerror or err}") from None
    text = decode_source(data, shown)
    remember_source(shown, text, hashlib.sha256(data).hexdigest())
    return text


def split_chunks(text: str, is_sx: bool) -> list[str]:
    """The chunks between split markers, each padded with empty lines so line numbers stay the file's."""
    marker = _SPLIT_MARKER[is_sx]
    lines = text.split("\n")
    chunks, start = [], 0
    for i, line in enumerate(lines + [None]):
        if line is None or marker.match(line):
            chunks.append("\n" * start + "\n".join(lines[start:i]))
            start = i + 1
    return chunks


def expectations(text: str) -> list[Expectation]:
    """The `expected-error@+1 {{...}}` annotations of a chunk.

    As in MLIR, `@below` and `@above` name the nearest line after or before the
    annotation that is not itself a comment holding an annotation.
    """
    lines = text.split("\n")
    annotated = [line.lstrip().startswith(("//", ";")) and bool(_EXPECTATION.search(line)) for line in lines]

    def nearest_plain(index: int, step: int) -> int:
        while 0 <= index < len(lines) and annotated[index]:
            index += step
        return index + 1

    found = []
    for number, line in enumerate(lines, 1):
        for m in _EXPECTATION.finditer(line):
            where = m.group(2)
            if where == "below":
                target = nearest_plain(number, 1)
            elif where == "above":
                target = nearest_plain(number - 2, -1)
            else:
                target = number + (int(where) if where else 0)
            found.append(Expectation(m.group(1), target, m.group(3), number))
    return found


def _same_file(loc: Location | None, path: str) -> bool:
    return loc is not None and (loc.file == path or os.path.abspath(loc.file) == os.path.abspath(path))


def check_expectations(path: str, expected: list[Expectation], produced: list[Diagnostic]) -> list[str]:
    """Match diagnostics to expectations; the complaints about the misses (empty when all match).

    An error is also matched at the location of its notes, so an error located
    in a `.sx` file is expected at the line of the IR op it came from. Notes
    are checked only against `expected-note`: an unexpected note is no complaint.
    """
    complaints = []
    unmatched = list(produced)
    for exp in expected:
        for diag in unmatched:
            if diag.severity != exp.severity or exp.message not in diag.message:
                continue
            at = [diag.loc]
            if diag.severity == "error":
                index = produced.index(diag) + 1
                while index < len(produced) and produced[index].severity == "note":
                    at.append(produced[index].loc)
                    index += 1
            if any(_same_file(loc, path) and loc.line == exp.line for loc in at):
                exp.met = True
                unmatched.remove(diag)
                break
        if not exp.met:
            complaints.append(
                f"{path}:{exp.written_at}: error: expected {exp.severity} \"{exp.message}\" at line {exp.line} "
                "was not produced"
            )
    for diag in unmatched:
        if diag.severity != "note":
            where = f"{diag.loc}: " if diag.loc else ""
            complaints.append(f"{where}error: unexpected {diag.severity}: {diag.message}")
    return complaints


@define
class Opt:
    """One invocation: the options and the input, run chunk by chunk."""

    args: argparse.Namespace

    def run_chunk(self, text: str, path: str, is_sx: bool) -> ChunkResult:
        """Parse (textual IR) and run the pipeline on one chunk; its diagnostics are those the unit collected.

        Under `--verify-diagnostics` warnings are not printed: they are checked.
        """
        from ..dialects.parser import parse_module
        from ..passes.manager import CompilationUnit, PassManager, parse_pipeline
        from ..passes.verify import verify_module

        args = self.args
        result = ChunkResult()
        report = io.StringIO()
        unit = CompilationUnit(path=path, text=text, variant=args.variant, sets=list(args.set), out=report)
        unit.diagnostics.echo = not args.verify_diagnostics
        result.diagnostics = unit.diagnostics.diagnostics
        manager = PassManager(
            parse_pipeline(args.pipeline),
            print_before=set(args.print_ir_before),
            print_after=set(args.print_ir_after),
            print_after_all=args.print_ir_after_all,
            verify_each=args.verify_each,
            timing=args.timing,
            log=sys.stderr,
        )
        try:
            if not is_sx:
                with unit.diagnostics.raising():
                    unit.module = parse_module(text, path, verify=False)
                    verify_module(unit.module)
            manager.run(unit)
        except SxError as err:
            result.failure = err.render()
            # What a dump pass wrote before the failure stays (print-values: the values of the forms before it).
            result.output = report.getvalue() if unit.dumped else ""
            return result
        final = manager.passes[-1].final_output(unit) if manager.passes and not unit.dumped else None
        result.output = report.getvalue() + ("" if unit.dumped else final if final is not None else unit.printable())
        return result

    def main(self) -> int:
        args = self.args
        if args.list_passes:
            sys.stdout.write(list_passes())
            return 0
        self.check_pass_names()
        path = "<stdin>" if args.file == "-" else args.file
        text = read_input(args.file, path)
        is_sx = path.endswith(".sx")
        chunks = split_chunks(text, is_sx) if args.split_input_file else [text]
        outputs, status = [], 0
        for chunk in chunks:
            result = self.run_chunk(chunk, path, is_sx)
            if args.verify_diagnostics:
                complaints = check_expectations(path, expectations(chunk), result.diagnostics)
                if complaints:
                    print("\n".join(complaints), file=sys.stderr)
                    status = 1
            elif result.failure is not None:
                sys.stdout.flush()
                print(result.failure, file=sys.stderr)
                status = 1
            if result.failure is None or result.output:
                outputs.append(result.output)
        self.write("// -----\n".join(outputs))
        return status

    def check_pass_names(self) -> None:
        from ..passes.manager import parse_pipeline, pass_names
        from ..targets import register_targets

        register_targets()
        parse_pipeline(self.args.pipeline)  # a usage error now rather than once per chunk
        known = set(pass_names())
        for name in [*self.args.print_ir_after, *self.args.print_ir_before]:
            if name not in known:
                raise UsageError(f"unknown pass '{name}' in --print-ir-after/--print-ir-before")

    def write(self, text: str) -> None:
        if self.args.output is None:
            sys.stdout.write(text)
            return
        try:
            with open(self.args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as err:
            raise UsageError(f"cannot write {self.args.output}: {err.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..dialects.core import tune_gc_for_large_ir

    tune_gc_for_large_ir()
    status = guarded(lambda: Opt(args).main())
    if argv is None:  # run as the process: it ends here, its IR with it
        end_process(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
