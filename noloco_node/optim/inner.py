"""Inner optimization: Adam, per-stage gradient clipping, warmup + cosine schedule. Pure torch."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerSchedule:
    """Linear warmup to lr_max, then cosine to lr_max * min_lr_ratio at total_steps (reference §3)."""

    lr_max: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1

    def lr_at(self, step: int) -> float:
        """LR used by inner step `step` (1-based), exactly as the reference's scheduler."""
        if step < 1:
            raise ValueError(f"inner steps count from 1, got {step}")
        elapsed = step - 1
        lr_min = self.lr_max * self.min_lr_ratio
        if elapsed < self.warmup_steps:
            return self.lr_max * (elapsed + 1) / self.warmup_steps
        if elapsed < self.total_steps:
            progress = (elapsed - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
            return lr_min + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr_max - lr_min)
        return lr_min


class InnerOptimizer:
    """Adam on one stage's parameters, stepped on the node's own inner-step counter.

    One inner step = clip this stage's accumulated gradients to `clip_norm`, set the LR for the
    step, step Adam, zero the gradients. Adam moments are never reset or averaged by outer steps.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        schedule: InnerSchedule,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_norm: float = 1.0,
        fused: bool | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.schedule = schedule
        self.clip_norm = clip_norm
        # On a GPU (fused = None), the fused kernel: one launch for the whole stage instead of
        # several per tensor, and a step it skips by itself. The CPU keeps the reference's kernel.
        self.fused = bool(self.params) and all(p.is_cuda for p in self.params) if fused is None else fused
        self.adam = _SkippingAdam(
            self.params, lr=schedule.lr_at(1), betas=betas, eps=eps, weight_decay=weight_decay, fused=self.fused or None
        )
        self.step_count = 0
        self.skipped_steps = 0  # steps whose gradients were not finite: Adam did not step
        self.weights_finite = True  # after the last step: whether every weight it stepped is finite

    def export_moments(self, names: dict[int, str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Adam moments as 'adam_exp_avg/<name>' / 'adam_exp_avg_sq/<name>' copies, and each
        parameter's Adam step; `names` maps id(param) to its name."""
        tensors, steps = {}, {}
        for param, state in self.adam.state.items():
            name = names[id(param)]
            tensors[f"adam_exp_avg/{name}"] = state["exp_avg"].detach().clone()
            tensors[f"adam_exp_avg_sq/{name}"] = state["exp_avg_sq"].detach().clone()
            steps[name] = float(state["step"])
        return tensors, steps

    def import_moments(self, named_params, tensors: dict[str, torch.Tensor], steps: dict[str, float]) -> None:
        """Inverse of export_moments; parameters without saved moments are left untouched."""
        for name, param in named_params:
            if f"adam_exp_avg/{name}" in tensors:
                self.adam.state[param] = {
                    "step": self.step_tensor(param, steps.get(name, 0.0)),
                    "exp_avg": tensors[f"adam_exp_avg/{name}"].to(param.device, param.dtype, copy=True),
                    "exp_avg_sq": tensors[f"adam_exp_avg_sq/{name}"].to(param.device, param.dtype, copy=True),
                }

    def step_tensor(self, param: torch.Tensor, value: float) -> torch.Tensor:
        """Adam's per-parameter step count as torch keeps it: on the parameter's device for the
        fused kernel (seen on an H200: a CPU step there fails the step), on the CPU otherwise."""
        return torch.tensor(float(value), dtype=torch.float32, device=param.device if self.fused else "cpu")

    def clip_gradients(self) -> float:
        """Clip this stage's gradients to clip_norm; returns the norm before clipping."""
        return float(self._gradient_norm(clip=True))

    def step(self, *, clip: bool = True) -> tuple[float, float]:
        """Take one inner step; returns (lr used, gradient norm before clipping).

        A step whose gradients are not finite is skipped: the gradients are dropped, Adam and the
        weights are untouched, `skipped_steps` counts it, and the step counter still advances so
        the schedule and the outer rounds stay in step with the other replicas. The norm is
        then NaN or inf. `weights_finite` says whether the weights are finite after the step.

        The host reads the device once per step, after Adam's kernels are queued: the fused kernel
        skips a non-finite step on the device by itself (`found_inf`), so the host does not wait
        for the backward to finish before it launches the step, and the weights' check is one norm
        over all of them (a flag per tensor was two hundred small kernels and a read a step)."""
        lr = self.schedule.lr_at(self.step_count + 1)
        for group in self.adam.param_groups:
            group["lr"] = lr
        norm = self._gradient_norm(clip=clip)
        if self.fused:
            self.adam.step_unless((~torch.isfinite(norm)).to(torch.float32))
        elif torch.isfinite(norm):  # the unfused step cannot skip by itself; off a GPU the read is free
            self.adam.step()
        self.adam.zero_grad(set_to_none=True)
        # One norm over every weight (multi-tensor kernels); NaN or inf where any value is.
        weights = (
            torch.nn.utils.get_total_norm([p.detach() for p in self.params]) if self.params else norm.new_zeros(())
        )
        norm_value, weights_value = torch.stack([norm.float(), weights.float()]).tolist()
        if not math.isfinite(norm_value):
            self.skipped_steps += 1
        # A norm past float32's range (weights near 1e19) counts as not finite: broken all the same.
        self.weights_finite = math.isfinite(weights_value)
        self.step_count += 1
        return lr, norm_value

    def gradient_norm(self) -> float:
        return float(self._gradient_norm(clip=False))

    def _gradient_norm(self, *, clip: bool) -> torch.Tensor:
        """The gradients' total norm, a tensor on their device that the host has not read
        (clipped to clip_norm with `clip`)."""
        with_grads = [p for p in self.params if p.grad is not None]
        if not with_grads:
            return torch.zeros((), device=self.params[0].device if self.params else "cpu")
        if clip:
            return torch.nn.utils.clip_grad_norm_(with_grads, self.clip_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in with_grads])


class _SkippingAdam(torch.optim.Adam):
    """torch's Adam; its fused kernel can be told, on the device, to skip a step (as GradScaler
    tells it: `found_inf`, 1.0 to skip), which leaves the weights, the moments and the step count
    as they were."""

    def step_unless(self, found_inf: torch.Tensor) -> None:
        self.found_inf = found_inf
        self.step()
