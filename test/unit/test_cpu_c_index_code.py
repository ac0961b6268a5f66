"""The C of an index expression in `cpu-c`'s kernels (`backends/cpu_c/kernels.py`, `index_code`).

A loop over a flat index that it decomposes into several domain axes (`k = i1 * 128 + i2` of a column sum
whose kept axes are 1 and 2) reads an operand laid out row-major over those axes as the flat index itself,
times one factor: the compiler then sees a contiguous access and vectorizes it with plain loads (through
`% 128` and `/ 128` GCC saw none and gathered). Any other read keeps the decomposed indices.
"""

from __future__ import annotations

from sexpgpu.backends.cpu_c.kernels import index_code, row_major_expr
from sexpgpu.dialects.index_maps import Expr, Term

SIZES = (16, 64, 128)


def expr(*terms: tuple[int, int], const: int = 0, sizes: tuple[int, ...] = SIZES) -> Expr:
    """`const + Σ coeff · i_axis` over `sizes`."""
    return Expr(sizes, tuple(Term(axis, 1, 0, coeff) for axis, coeff in terms), const)


def test_a_row_major_read_of_the_decomposed_axes_is_the_flat_index() -> None:
    assert index_code(expr((0, 8192), (1, 128), (2, 1)), flat=("k", [1, 2])) == "i0 * 8192LL + k"
    assert index_code(row_major_expr(SIZES), flat=("k", [1, 2])) == "i0 * 8192LL + k"


def test_a_read_with_wider_strides_is_the_flat_index_times_a_factor() -> None:
    assert index_code(expr((1, 384), (2, 3), const=5), flat=("k", [1, 2])) == "5LL + k * 3LL"


def test_a_transposed_read_keeps_its_indices() -> None:
    transposed = expr((1, 1), (2, 64))
    assert index_code(transposed, flat=("k", [1, 2])) == "i1 + i2 * 64LL"


def test_a_read_of_some_of_the_axes_keeps_its_indices() -> None:
    assert index_code(expr((0, 8192), (2, 1)), flat=("k", [1, 2])) == "i0 * 8192LL + i2"
    assert index_code(expr((1, 128), (2, 1), (2, 1)), flat=("k", [1, 2])) == "i1 * 128LL + i2 + i2"


def test_divided_or_wrapped_indices_keep_their_form() -> None:
    wrapped = Expr(SIZES, (Term(1, 1, 0, 128), Term(2, 2, 0, 1)))
    assert index_code(wrapped, flat=("k", [1, 2])) == "i1 * 128LL + (i2 / 2LL)"


def test_an_axis_of_one_element_adds_nothing_to_the_run() -> None:
    sizes = (16, 1, 128)
    assert index_code(expr((0, 128), (2, 1), sizes=sizes), flat=("k", [1, 2])) == "i0 * 128LL + k"


def test_one_axis_or_no_flat_index_is_read_as_written() -> None:
    assert index_code(expr((0, 8192), (2, 1)), flat=("k", [2])) == "i0 * 8192LL + i2"
    assert index_code(expr((1, 128), (2, 1))) == "i1 * 128LL + i2"
    assert index_code(expr()) == "0LL"
