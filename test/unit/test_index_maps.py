"""Index expressions (dialects/index_maps.py) against numpy, element by element."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from sexpgpu.dialects.index_maps import Expr, reshape_index, storage_offset


def value(expr: Expr, index: tuple[int, ...]) -> int:
    total = expr.const
    for t in expr.terms:
        digit = index[t.axis] // t.div
        total += t.coeff * (digit % t.mod if t.mod else digit)
    return total


def shapes(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    source = tuple(int(n) for n in rng.choice([1, 2, 3, 4, 6], size=rng.integers(1, 4)))
    count, target = int(np.prod(source)), []
    while count > 1:
        d = int(rng.choice([d for d in range(2, count + 1) if count % d == 0]))
        target.append(d)
        count //= d
    return source, tuple(target) or (1,)


def test_reshapes_read_the_elements_numpy_reads():
    """Where a reshape's index is expressible it is exact, and the storage offset of a reshaped
    buffer is its row-major position; those it cannot express are only ones a merged axis straddles."""
    rng = np.random.default_rng(0)
    expressed = 0
    for _ in range(300):
        source, target = shapes(rng)
        moved = reshape_index(source, target, [Expr.axis(target, a) for a in range(len(target))])
        if moved is None:
            continue
        expressed += 1
        array = np.arange(int(np.prod(source))).reshape(source)
        for index in itertools.product(*map(range, target)):
            assert array[tuple(value(e, index) for e in moved)] == array.reshape(target)[index]
        assert storage_offset(source, moved, target) == Expr.flat(target)
    assert expressed > 100


def test_a_padded_head_split_is_exact_where_its_guard_holds():
    """attention's gradient: [4, 64, 128] padded by 256 on the last axis, read from heads [4, 64, 4, 32]."""
    domain = (4, 64, 384)
    shifted = Expr.axis(domain, 2) + (-256)
    moved = reshape_index((4, 64, 4, 32), (4, 64, 128), [Expr.axis(domain, 0), Expr.axis(domain, 1), shifted])
    assert moved is not None
    for i2 in range(256, 384):
        assert [value(e, (1, 2, i2)) for e in moved] == [1, 2, (i2 - 256) // 32, (i2 - 256) % 32]


@pytest.mark.parametrize("divisor", [2, 3, 4, 8, 12])
def test_divmod_is_exact_or_refused(divisor):
    domain = (6, 8)
    expr = Expr.sum(domain, [Expr.axis(domain, 0, 8), Expr.axis(domain, 1)], const=4)
    split = expr.divmod(divisor)
    if split is None:
        return
    quotient, remainder = split
    for index in itertools.product(range(6), range(8)):
        assert (value(quotient, index), value(remainder, index)) == divmod(value(expr, index), divisor)


def test_maps_round_trip_through_attributes():
    domain = (3, 4, 5)
    expr = Expr.sum(domain, [Expr.axis(domain, 0, 20), Expr.axis(domain, 2)], const=7)
    attribute = expr.attribute()
    assert attribute == {"offset": 7, "strides": [20, 0, 1]}
    assert Expr.from_attribute(domain, attribute) == expr
