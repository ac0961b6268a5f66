"""`build-updates`: one update graph per parameter, and the gradient-clipping graphs.

For every `exp.group` and every member parameter it appends

    graph.func @"update/<group>/<path>" {kind = "update", group, param = path}

with inputs `param` (role param), `grad` (role grad), the optimizer states
(role state) and `step` (role step, a scalar f32 holding the 1-based step
number), returning the new parameter and the new states under their input
names. The arithmetic is exactly torch.optim's (single-tensor path):

    adamw   p <- p * (1 - lr * weight_decay)                   (decoupled decay first)
            m <- m + (1 - b1) * (g - m)                        (torch's lerp)
            v <- v * b2 + (1 - b2) * g * g
            p <- p - (lr / (1 - b1^s)) * m / (sqrt(v) / sqrt(1 - b2^s) + eps)
            returns ["param", "m", "v"]
    sgd     g <- g + weight_decay * p                          (coupled, as torch does)
            momentum <- momentum * mu + g                      (dampening 0; zero-initialized
                                                                equals torch's clone on step 1)
            d = g + mu * momentum if nesterov else momentum
            p <- p - lr * d
            returns ["param", "momentum"], or ["param"] when mu = 0

`lr` is the group's schedule evaluated from `step` inside the graph
(`schedules.build_schedule`). Missing hyperparameters take torch's defaults
(`exp.OPTIMIZER_DEFAULTS`).

Several microbatches: a step's gradients arrive summed over its microbatches
(`accumulate`, `stack`); the step's gradient, that of the mean loss, is the
sum times 1/microbatches, and the first op on each gradient multiplies by
that splat constant (`grad_scale`): in the clip graph of a clipping group
(which writes the gradients back, scaled and clipped), else in the update
graph. No pass over the gradients of its own: the product is the same f32
multiply a separate scaling pass would store, so the results are
bit-identical to scaling first.

Clipping: groups with `clip` set get a graph with every member gradient in
(`grad/<path>`, role grad) and the clipped gradients out under the same names,
plus the total norm as `norm` -- torch.nn.utils.clip_grad_norm_ over those
gradients (scaled by `grad_scale` first, with several microbatches):
`total = sqrt(sum_p ||g_p||^2)`, `g *= min(1, clip / (total + 1e-6))`.
When every group clips at one value the norm is global: one graph
`@"clip/all"`; otherwise each clipping group gets `@"clip/<group>"`. A clip
graph's attributes are `{kind = "clip", groups = [names], max_norm}`, and
`grad_scale` (1/microbatches) with several microbatches.

Each exp.group gains `states = {name = elements summed over members}`. Every
graph and op built here carries the exp.group's location.
"""

from __future__ import annotations

from typing import Any

from attrs import define

from ..diagnostics import Location, SxError
from ..dialects.core import Builder, Operation, Region, TensorType, Value
from ..dialects.exp import CLIP_EPS, OPTIMIZER_DEFAULTS, OPTIMIZERS
from .manager import CompilationUnit, Pass, register_pass
from .schedules import SCALAR, build_schedule, scalar_const
from .variants import run_microbatches


def new_graph(module: Operation, name: str, attributes: dict[str, Any], loc: Location | None) -> Builder:
    """Append an empty `graph.func @name` to the module; a builder at the end of its body."""
    func = Operation.create(
        "graph.func", attributes={"sym_name": name, **attributes}, regions=[Region.with_block()], loc=loc
    )
    module.body.append(func)
    return Builder(func.body, loc=loc)


def graph_input(b: Builder, name: str, role: str, type_: TensorType) -> Value:
    return b.create("graph.input", (), {"name": name, "role": role}, result_types=[type_]).result


def splat(b: Builder, value: float, type_: TensorType) -> Value:
    return b.create("graph.const", (), {"value": float(value)}, result_types=[type_]).result


def state_names(optimizer: str, hyper: dict[str, Any]) -> list[str]:
    """The optimizer states one parameter carries, in graph input / output order."""
    if optimizer == "adamw":
        return ["m", "v"]
    return ["momentum"] if float(hyper.get("momentum", 0.0)) != 0.0 else []


@define
class BuildUpdates(Pass):
    """Builds the update graph of every parameter and the clip graphs; sets `states` on exp.group.

    Guarantees: each member of each group has exactly one `update/<group>/<path>`
    graph whose outputs are the new param and states; graphs verify.
    """

    name = "build-updates"
    summary = "one optimizer update graph per parameter (schedules inside), clip graphs, group states"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        params = {op.attributes["path"]: op for op in module.body.ops if op.name == "exp.param"}
        existing = {op.attributes["sym_name"] for op in module.body.ops if op.name == "graph.func"}
        groups = [op for op in module.body.ops if op.name == "exp.group"]
        for group in groups:
            self._check(group, params, existing)
        microbatches = run_microbatches(module)
        grad_scale = 1.0 / microbatches if microbatches > 1 else None
        self._build_clips(module, groups, params, grad_scale)
        for group in groups:
            # A clipping group's gradients are scaled by its clip graph, before their norm.
            scale = grad_scale if group.attributes.get("clip") is None else None
            optimizer = group.attributes["optimizer"]
            hyper = {**OPTIMIZER_DEFAULTS[optimizer], **group.attributes.get("hyper", {})}
            names = state_names(optimizer, hyper)
            counts = dict.fromkeys(names, 0)
            for path in group.attributes["members"]:
                type_ = params[path].attributes["type"]
                for state in names:
                    counts[state] += type_.numel
                self._build_update(module, group, path, type_, hyper, names, scale)
            group.attributes["states"] = counts

    @staticmethod
    def _check(group: Operation, params: dict[str, Operation], existing: set[str]) -> None:
        name, optimizer = group.attributes["name"], group.attributes["optimizer"]
        if optimizer not in OPTIMIZERS:
            raise SxError(f"group '{name}': unknown optimizer '{optimizer}' (known: {', '.join(OPTIMIZERS)})",
                          group.loc)
        if "lr" not in group.attributes.get("hyper", {}):
            raise SxError(f"group '{name}' has no learning rate", group.diagnostic_loc)
        for path in group.attributes["members"]:
            if path not in params:
                raise SxError(f"group '{name}' names parameter '{path}', which has no exp.param", group.diagnostic_loc)
            if f"update/{name}/{path}" in existing:
                raise SxError(f"the update graph of '{path}' in group '{name}' already exists", group.diagnostic_loc)

    @staticmethod
    def _build_update(
        module: Operation,
        group: Operation,
        path: str,
        type_: TensorType,
        hyper: dict[str, Any],
        states: list[str],
        grad_scale: float | None,
    ) -> None:
        gname = group.attributes["name"]
        b = new_graph(
            module, f"update/{gname}/{path}", {"kind": "update", "group": gname, "param": path}, group.loc
        )
        p = graph_input(b, "param", "param", type_)
        g = graph_input(b, "grad", "grad", type_)
        state = {s: graph_input(b, s, "state", type_) for s in states}
        step = graph_input(b, "step", "step", SCALAR)
        lr = build_schedule(b, step, hyper["lr"], group.loc)

        def full(scalar: Value) -> Value:
            return b.value("graph.broadcast", scalar, shape=list(type_.shape))

        def const(value: float) -> Value:
            return splat(b, value, type_)

        if grad_scale is not None:
            g = b.value("graph.mul", g, const(grad_scale))
        wd = float(hyper["weight_decay"])
        if group.attributes["optimizer"] == "adamw":
            b1, b2 = (float(x) for x in hyper["betas"])
            if wd != 0.0:
                keep = b.value(
                    "graph.sub", scalar_const(b, 1.0), b.value("graph.mul", lr, scalar_const(b, wd))
                )
                p = b.value("graph.mul", p, full(keep))
            one_minus_b1 = b.value("graph.sub", const(1.0), const(b1))
            m = b.value(
                "graph.add",
                state["m"],
                b.value("graph.mul", one_minus_b1, b.value("graph.sub", g, state["m"])),
            )
            one_minus_b2 = b.value("graph.sub", const(1.0), const(b2))
            v = b.value(
                "graph.add",
                b.value("graph.mul", state["v"], const(b2)),
                b.value("graph.mul", one_minus_b2, b.value("graph.mul", g, g)),
            )
            bias1 = b.value(
                "graph.sub", scalar_const(b, 1.0), b.value("graph.pow", scalar_const(b, b1), step)
            )
            bias2 = b.value(
                "graph.sub", scalar_const(b, 1.0), b.value("graph.pow", scalar_const(b, b2), step)
            )
            step_size = b.value("graph.div", lr, bias1)
            denom = b.value(
                "graph.add",
                b.value("graph.div", b.value("graph.sqrt", v), full(b.value("graph.sqrt", bias2))),
                const(float(hyper["eps"])),
            )
            p = b.value("graph.sub", p, b.value("graph.mul", full(step_size), b.value("graph.div", m, denom)))
            outputs = [p, m, v]
        else:
            mu = float(hyper["momentum"])
            if wd != 0.0:
                g = b.value("graph.add", g, b.value("graph.mul", const(wd), p))
            direction = g
            outputs = []
            if mu != 0.0:
                buf = b.value("graph.add", b.value("graph.mul", state["momentum"], const(mu)), g)
                direction = (
                    b.value("graph.add", g, b.value("graph.mul", const(mu), buf))
                    if hyper["nesterov"]
                    else buf
                )
                outputs = [buf]
            p = b.value("graph.sub", p, b.value("graph.mul", full(lr), direction))
            outputs = [p, *outputs]
        b.create("graph.return", outputs, {"names": ["param", *states]})

    @staticmethod
    def _build_clips(module: Operation, groups: list[Operation], params: dict[str, Operation],
                     grad_scale: float | None) -> None:
        clipping = [g for g in groups if g.attributes.get("clip") is not None]
        if not clipping:
            return
        values = {float(g.attributes["clip"]) for g in clipping}
        if len(clipping) == len(groups) and len(values) == 1:
            sets = [("all", clipping)]
        else:
            sets = [(g.attributes["name"], [g]) for g in clipping]
        for name, members in sets:
            paths = [path for g in members for path in g.attributes["members"]]
            if not paths:
                continue
            max_norm = float(members[0].attributes["clip"])
            attrs = {"kind": "clip", "groups": [g.attributes["name"] for g in members], "max_norm": max_norm}
            if grad_scale is not None:
                attrs["grad_scale"] = grad_scale
            b = new_graph(module, f"clip/{name}", attrs, members[0].loc)
            grads = [
                graph_input(b, f"grad/{path}", "grad", params[path].attributes["type"]) for path in paths
            ]
            if grad_scale is not None:
                grads = [b.value("graph.mul", g, splat(b, grad_scale, g.type)) for g in grads]
            squares = []
            for g in grads:
                axes = list(range(g.type.rank))
                norm = b.value(
                    "graph.sqrt", b.value("graph.sum", b.value("graph.mul", g, g), axes=axes, keep=False)
                )
                squares.append(b.value("graph.mul", norm, norm))
            total_sq = squares[0]
            for sq in squares[1:]:
                total_sq = b.value("graph.add", total_sq, sq)
            total = b.value("graph.sqrt", total_sq)
            coef = b.value(
                "graph.div", scalar_const(b, max_norm), b.value("graph.add", total, scalar_const(b, CLIP_EPS))
            )
            coef = b.value("graph.minimum", coef, scalar_const(b, 1.0))
            clipped = [
                b.value("graph.mul", g, b.value("graph.broadcast", coef, shape=list(g.type.shape)))
                for g in grads
            ]
            b.create("graph.return", [*clipped, total], {"names": [f"grad/{p}" for p in paths] + ["norm"]})


register_pass(BuildUpdates)
