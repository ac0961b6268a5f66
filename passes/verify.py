"""`verify`: every op obeys its definition (operand counts, attributes, inferred types)."""

from __future__ import annotations

from attrs import define

from ..diagnostics import SxError
from ..dialects.core import Operation, VerifyError
from .manager import CompilationUnit, Pass, register_pass


class VerificationFailed(SxError):
    """Every verifier error of a module, reported together (located at the first)."""

    def __init__(self, errors: list[VerifyError]) -> None:
        super().__init__(errors[0].message, errors[0].loc, errors[0].notes)
        self.errors = errors

    def render(self) -> str:
        return "\n".join(err.render() for err in self.errors)


def verify_errors(root: Operation) -> list[VerifyError]:
    """The verifier errors of `root` and every op nested in it, in order (at most one per op)."""
    errors = []
    for op in root.walk():
        try:
            op.verify_one()
        except VerifyError as err:
            errors.append(err)
    return errors


def verify_module(root: Operation) -> None:
    """Raise `VerificationFailed` listing every verifier error, if there is any."""
    errors = verify_errors(root)
    if errors:
        raise VerificationFailed(errors)


@register_pass
@define
class VerifyPass(Pass):
    """Checks every op against its definition and reports all violations at once.

    Guarantees, when it returns: every op is registered, has the operand,
    result and region counts and the required attributes of its kind, result
    types equal the inferred ones, each `graph.func` ends with `graph.return`
    and uses no value before defining it. The IR is not changed.
    """

    name = "verify"
    summary = "check every op against its definition; report all errors"

    def run(self, unit: CompilationUnit) -> None:
        verify_module(unit.require_module(self.name))
