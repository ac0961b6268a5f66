"""The GPT of `examples/tiny-gpt.sx` (and of the spec's `examples/gpt.sx`) written independently in PyTorch, as the language's meaning says.

Used by `test_torch_reference.py` (same losses from the same parameters and
batches), by `benchmarks/cpu_train.py` (the eager baseline) and by
`benchmarks/gpu_train.py` (PyTorch eager and torch.compile on a GPU). The
optimizer is `torch.optim.AdamW` with the experiment group's hyperparameters,
the learning rate set every step from the group's warmup-cosine schedule, and
`clip_grad_norm_` when the group clips.

The defaults are the CPU tests' exact f32 arithmetic: the masked-softmax
attention written out and the single-tensor AdamW. On a GPU the benchmark asks
for what llm.c's `train_gpt2.py` runs: `attention="sdpa"` (PyTorch's fused
causal attention, the same function), `fused=True` (the fused AdamW kernel),
`autocast=torch.bfloat16` (bf16 compute, f32 master weights: sexpgpu's
`precision bf16`) and `compile()` (torch.compile of the loss and its backward).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def schedule_lr(spec: Any, step: int) -> float:
    """The learning rate of `passes/schedules.py` at the 1-based step."""
    if not isinstance(spec, dict):
        return float(spec)
    kind = spec["kind"]
    if kind == "constant":
        return float(spec["value"])
    peak = float(spec["peak"])
    if kind == "linear-warmup":
        warmup = float(spec["warmup"])
        return peak if warmup == 0 else peak * min(step, warmup) / warmup
    warmup = float(spec.get("warmup", 0)) if kind == "warmup-cosine" else 0.0
    steps = float(spec["steps"])
    if step <= warmup:
        return peak * step / warmup
    low = float(spec.get("floor", 0)) * peak
    progress = (min(step, steps) - warmup) / (steps - warmup)
    return low + (peak - low) * (1 + math.cos(math.pi * progress)) / 2


class TorchGPT:
    """The tiny-gpt (or gpt.sx) model and its optimizers over a dict of parameters named by sexpgpu's paths."""

    def __init__(self, params: dict[str, np.ndarray], heads: int, groups: dict[str, Any] | list[dict[str, Any]],
                 *, device: str = "cpu", attention: str = "masked", fused: bool = False,
                 autocast: torch.dtype | None = None) -> None:
        if attention not in ("masked", "sdpa"):
            raise ValueError(f"attention {attention!r} is not masked or sdpa")
        self.device = torch.device(device)
        self.params = {path: torch.tensor(np.array(value), device=self.device, requires_grad=True)
                       for path, value in params.items()}
        self.heads = heads
        self.attention = attention
        self.autocast = autocast
        #: What `train_step` calls for a microbatch's loss: `_loss`, or its torch.compile'd form after `compile()`.
        self.loss_fn = self._loss
        self.layers = len({p.split(".")[2] for p in params if p.startswith("model.blocks.")})
        if isinstance(groups, dict):
            groups = [groups]
        # One torch parameter group per optimizer group (a lone group without `members` takes every parameter).
        torch_groups = []
        #: per group: (its learning-rate spec, its clip or None, its parameters)
        self.groups: list[tuple[Any, Any, list[torch.Tensor]]] = []
        for group in groups:
            hyper = group["hyper"]
            members = [self.params[m] for m in group["members"]] if "members" in group else list(self.params.values())
            self.groups.append((hyper["lr"], group.get("clip"), members))
            torch_groups.append({"params": members, "lr": schedule_lr(hyper["lr"], 1), "betas": tuple(hyper["betas"]),
                                 "eps": hyper["eps"], "weight_decay": hyper["weight_decay"]})
        self.optimizer = torch.optim.AdamW(torch_groups, fused=True) if fused else \
            torch.optim.AdamW(torch_groups, foreach=False)

    @classmethod
    def from_experiment(cls, exp: Any, params: dict[str, np.ndarray], **options: Any) -> TorchGPT:
        """From a `backends.training.TrainingPlan` of tiny-gpt.sx, gpt.sx or gpt2-small.sx (any number of
        optimizer groups); `options` as for the constructor."""
        groups = [op.attributes for op in exp.module.body.ops if op.name == "exp.group"]
        heads = int(exp.knobs()["heads"][0])
        return cls(params, heads, groups, **options)

    def compile(self, **options: Any) -> None:
        """Run the loss (and, through AOTAutograd, its backward) under torch.compile from now on."""
        self.loss_fn = torch.compile(self._loss, **options)

    def _linear(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.params[f"{prefix}.weight"]
        bias = self.params.get(f"{prefix}.bias")
        return y + bias if bias is not None else y

    def _layernorm(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.params[f"{prefix}.weight"], self.params[f"{prefix}.bias"]
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)

    def _attention(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        hd = width // self.heads
        q, k, v = self._linear(f"{prefix}.qkv", x).split(width, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # its scale is 1/sqrt(hd) too
        else:
            mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
            probs = torch.softmax(q @ k.transpose(-1, -2) * (1.0 / math.sqrt(hd)) + mask, dim=-1)
            mixed = probs @ v
        merged = mixed.transpose(1, 2).reshape(b, t, width)
        return self._linear(f"{prefix}.proj", merged)

    def loss(self, tokens: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of a batch of records (`[batch, seq + 1]` token ids)."""
        if isinstance(tokens, np.ndarray):
            tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        tokens = tokens.to(self.device, torch.int64, non_blocking=True)
        if self.autocast is None:
            return self.loss_fn(tokens)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return self.loss_fn(tokens)

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.params["model.embed.table"][inputs] + self.params["model.pos"]
        for i in range(self.layers):
            block = f"model.blocks.{i}"
            x = x + self._attention(f"{block}.attn", self._layernorm(f"{block}.norm1", x))
            hidden = F.gelu(self._linear(f"{block}.mlp.fc", self._layernorm(f"{block}.norm2", x)))
            x = x + self._linear(f"{block}.mlp.proj", hidden)
        # tiny-gpt.sx names the output projection `head`, the spec's gpt.sx `proj` (without bias).
        head = "model.head" if "model.head.weight" in self.params else "model.proj"
        logits = self._linear(head, self._layernorm("model.norm", x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def train_step(self, microbatches: list[np.ndarray] | np.ndarray, step: int) -> float:
        """One step over the microbatches (the gradient of their mean loss); returns that mean loss."""
        if isinstance(microbatches, np.ndarray):
            microbatches = [microbatches]
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for tokens in microbatches:
            loss = self.loss(tokens)
            (loss / len(microbatches)).backward()
            losses.append(loss.detach())
        for (lr, clip, members), group in zip(self.groups, self.optimizer.param_groups):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(members, float(clip), foreach=False)
            group["lr"] = schedule_lr(lr, step)
        self.optimizer.step()
        # One device-to-host copy a step (reading each microbatch's loss would wait for the device each time).
        return float(torch.stack(losses).double().sum()) / len(microbatches)
