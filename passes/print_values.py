"""`print-values`: what `sexpgpu eval` prints, written to `unit.out`.

Evaluates the unit's .sx file under its selection (the prelude first) and
writes every top-level form's value, one per line, as each form finishes: a
defining form prints `name = value`, several values `#<values ...>`. It is
the `eval` verb's own code (`frontend.evaluator.eval_file_lines`), so
`sexpgpu-opt f.sx -p print-values` prints the bytes `sexpgpu eval f.sx` does,
and a form that fails prints its diagnostic after the values before it. Like
`evaluate`, it reads the file itself: put it first in a pipeline.
"""

from __future__ import annotations

from typing import ClassVar

from attrs import define

from ..diagnostics import SxError
from ..frontend.evaluator import eval_file_lines
from .manager import CompilationUnit, Pass, register_pass


@register_pass
@define
class PrintValuesPass(Pass):
    """Writes each top-level form's value as `sexpgpu eval` prints it.

    Guarantees: the output is byte for byte what `sexpgpu eval` prints for
    the same file and selection; the unit is unchanged.
    """

    name: ClassVar[str] = "print-values"
    summary: ClassVar[str] = "dump every top-level form's value, one per line (the eval verb)"

    def run(self, unit: CompilationUnit) -> None:
        if unit.path is None:
            raise SxError("print-values: the unit has no .sx file to evaluate")
        out = unit.out
        # The unit's output is dumped even when a later form fails: the values before it stay printed.
        unit.dumped = True
        eval_file_lines(unit.path, variant=unit.variant, sets=list(unit.sets), on_line=lambda line: out.write(line + "\n"),
                        text=unit.text)
