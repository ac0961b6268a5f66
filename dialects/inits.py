"""Parameter initialisers: what an `exp.param`'s `init` attribute means, and the values it gives.

A parameter's initial value is a function of (run seed, path) only: its numbers
come from numpy's Philox generator keyed by the first 16 bytes of
``blake2b(f"{seed}:{path}")``, so adding or reordering parameters never
changes the others. The frontend makes `Init`s (`(normal 0.02)`, `zeros`, ...),
lowering writes them as `init = {kind = "normal", std = 0.02}`, and whatever
runs the experiment (a training driver, the Python API) reads them back here,
without the frontend.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from attrs import define, field

from ..float_text import shortest_float
from .core import Operation

if TYPE_CHECKING:
    import numpy as np

@define(frozen=True)
class Init:
    """A parameter initializer: `normal`, `uniform`, `zeros`, `ones` or `constant`, with its numbers."""

    kind: str
    args: dict[str, float] = field(factory=dict)

    def __sx_repr__(self) -> str:
        # The numbers as the value printer writes a float (`1e16`, not `1e+16`).
        inner = " ".join(shortest_float(v).replace("e+", "e") for v in self.args.values())
        return f"#<init {self.kind}{' ' + inner if inner else ''}>"

    def as_attribute(self) -> dict[str, Any]:
        """The `init` attribute of an `exp.param`."""
        return {"kind": self.kind, **self.args}

    @classmethod
    def from_attribute(cls, attribute: Mapping[str, Any]) -> Init:
        args = dict(attribute)
        return cls(str(args.pop("kind")), args)


def seed_key(seed: int, path: str) -> int:
    """The 128-bit Philox key of a parameter: a stable hash of the run seed and its path."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "little")


def initial_value(init: Init, shape: tuple[int, ...], seed: int, path: str) -> np.ndarray:
    """The f32 initial value of the parameter at `path` for the run seed `seed`."""
    import numpy as np  # here, not at the top: `sexpgpu check` needs no numpy

    if init.kind == "zeros":
        return np.zeros(shape, np.float32)
    if init.kind == "ones":
        return np.ones(shape, np.float32)
    if init.kind == "constant":
        return np.full(shape, init.args["value"], np.float32)
    rng = np.random.Generator(np.random.Philox(key=seed_key(seed, path)))
    if init.kind == "normal":
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(init.args["std"])).astype(np.float32)
    if init.kind == "uniform":
        return rng.uniform(init.args["lo"], init.args["hi"], shape).astype(np.float32)
    raise ValueError(f"unknown init {init.kind}")


def initial_params(params: Iterable[Operation], seed: int) -> dict[str, np.ndarray]:
    """The initial value of each `exp.param` op's parameter for the run seed, by path, in their order."""
    return {
        str(op.attributes["path"]): initial_value(
            Init.from_attribute(op.attributes["init"]), tuple(op.attributes["type"].shape), seed,
            str(op.attributes["path"]),
        )
        for op in params
    }
