"""Learning-rate schedules as graph ops on the step input of an update graph.

A schedule is a function of `s`, the 1-based step number (a scalar
`tensor<f32>`); `build_schedule` emits it as scalar graph ops so the update
graph computes its own learning rate every step. Hyperparameter arithmetic
(`peak / warmup`, `floor * peak`, ...) is emitted unfolded: `fold-constants`
turns it into constants. The schedules, with `floor` a fraction of `peak`:

    constant       {kind = "constant", value}          lr(s) = value
    linear-warmup  {kind = "linear-warmup", peak, warmup}
                   lr(s) = peak * min(s, warmup) / warmup       (peak when warmup = 0)
    warmup-cosine  {kind = "warmup-cosine", peak, warmup, steps, floor = 0}
                   lr(s) = peak * s / warmup                    for s <= warmup
                         = low + (peak - low) * (1 + cos(pi * p)) / 2   otherwise,
                   where low = floor * peak and p = (min(s, steps) - warmup) / (steps - warmup)
    cosine         {kind = "cosine", peak, steps, floor = 0}
                   warmup-cosine with warmup = 0

warmup-cosine is nanoGPT's `get_lr(it)` (linear warmup from 0, cosine decay to
`min_lr = floor * peak` at `lr_decay_iters = steps`, flat after) evaluated at
`it = s`: the ramp starts from 0 at step 0, so the first step already moves
with `peak / warmup`, and the cosine reaches `low` exactly at `s = steps`.
A plain float is a constant schedule.
"""

from __future__ import annotations

import math
from typing import Any

from ..diagnostics import Location, SxError
from ..dialects.core import Builder, TensorType, Value

SCALAR = TensorType((), "f32")
KINDS = ("constant", "linear-warmup", "cosine", "warmup-cosine")


def scalar_const(b: Builder, value: float) -> Value:
    """A scalar f32 constant."""
    return b.create("graph.const", (), {"value": float(value)}, result_types=[SCALAR]).result


def _field(spec: dict[str, Any], key: str, loc: Location | None, default: float | None = None) -> float:
    if key in spec:
        return float(spec[key])
    if default is None:
        raise SxError(f"schedule '{spec.get('kind')}' needs '{key}'", loc)
    return default


def build_schedule(
    b: Builder, step: Value, spec: dict[str, Any] | float, loc: Location | None = None
) -> Value:
    """Emit the learning rate at `step` (scalar f32, 1-based) for the schedule `spec`; returns a scalar."""
    if isinstance(spec, (int, float)):
        return scalar_const(b, spec)
    kind = spec.get("kind")
    if kind == "constant":
        return scalar_const(b, _field(spec, "value", loc))
    if kind == "linear-warmup":
        peak, warmup = _field(spec, "peak", loc), _field(spec, "warmup", loc)
        if warmup <= 0:
            return scalar_const(b, peak)
        clamped = b.value("graph.minimum", step, scalar_const(b, warmup))
        return b.value(
            "graph.mul", clamped, b.value("graph.div", scalar_const(b, peak), scalar_const(b, warmup))
        )
    if kind in ("cosine", "warmup-cosine"):
        peak, steps = _field(spec, "peak", loc), _field(spec, "steps", loc)
        warmup = _field(spec, "warmup", loc) if kind == "warmup-cosine" else 0.0
        floor = _field(spec, "floor", loc, 0.0)
        if steps <= warmup:
            raise SxError(f"schedule '{kind}' needs steps ({steps:g}) > warmup ({warmup:g})", loc)
        return _warmup_cosine(b, step, peak, warmup, steps, floor)
    raise SxError(f"unknown schedule kind '{kind}' (known: {', '.join(KINDS)})", loc)


def _warmup_cosine(b: Builder, step: Value, peak: float, warmup: float, steps: float, floor: float) -> Value:
    def const(value: float) -> Value:
        return scalar_const(b, value)

    low = b.value("graph.mul", const(floor), const(peak))
    # p = (clamp(s, warmup, steps) - warmup) / (steps - warmup)
    clamped = b.value("graph.minimum", b.value("graph.maximum", step, const(warmup)), const(steps))
    span = b.value("graph.sub", const(steps), const(warmup))
    progress = b.value("graph.div", b.value("graph.sub", clamped, const(warmup)), span)
    angle = b.value("graph.mul", const(math.pi), progress)
    half_cos = b.value("graph.mul", const(0.5), b.value("graph.add", const(1.0), b.value("graph.cos", angle)))
    decayed = b.value(
        "graph.add", low, b.value("graph.mul", half_cos, b.value("graph.sub", const(peak), low))
    )
    if warmup <= 0:
        return decayed
    ramp = b.value("graph.mul", step, b.value("graph.div", const(peak), const(warmup)))
    return b.value("graph.where", b.value("graph.le", step, const(warmup)), ramp, decayed)
