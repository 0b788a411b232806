"""Stage compute for one node, run on its compute thread: forward without a graph and save the
input; on backward, recompute from the saved input with grad enabled (stage-level activation
checkpointing, as the reference), backpropagate, accumulate, and step the inner optimizer every
`batch_size` sequences. Saved inputs expire after a TTL so a lost peer cannot leak memory.

Integrity (optim/integrity.py): a non-finite loss is never backpropagated, a non-finite output or
input gradient is never handed on, an inner step with non-finite gradients is skipped, and
weights found non-finite after a step are restored from the last good slow weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import Tensor

from noloco_node.errors import NodeError
from noloco_node.model.stage import LlamaStage
from noloco_node.optim.inner import InnerOptimizer
from noloco_node.optim.integrity import repair_weights
from noloco_node.pipeline.host_copies import HostCopy, HostValue
from noloco_node.pipeline.transfers import Transfers
from noloco_node.pipeline.weight_casts import Stash, WeightCasts, matmul_weight_names, weights_version
from noloco_node.runtime.compute import Later, then
from noloco_node.runtime.faults import FaultInjector

log = logging.getLogger(__name__)


class NonFiniteValues(NodeError):
    """This stage computed a non-finite value from a microbatch; the microbatch is dropped here."""

    code = "non-finite"


@dataclass
class Saved:
    inputs: Tensor
    created: float
    token_ids: Tensor | None = None  # a residual-subspace stage after 0 rebuilds its input from them
    output: Tensor | None = None  # the autograd graph, when kept instead of recomputed
    stash: Stash | None = None  # the weight copy the graph was built on (stash_weights)


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    batch_size: int
    """Sequences per inner step (the node's local batch)."""
    saved_ttl_s: float
    """Saved inputs older than this are dropped (a lost downstream peer cannot leak memory)."""
    auto_step: bool
    """Step the inner optimizer every `batch_size` sequences (stages > 0); stage 0's driver steps itself."""
    defer_step: bool = False
    """Leave an auto step due (`step_due`) for the caller to take once the batch's last input
    gradient is on its way upstream (pipeline/runtime.py), so the step overlaps the upstream stage's
    backward instead of delaying it. Any compute that comes first takes the due step before it
    starts, so the order of work is the same either way."""
    stash_weights: bool = False
    """The overlap schedule, on every stage that has a backward apart from its forward: a forward
    runs on a copy of the weights taken at their current version, and its backward (kept graph on
    stage 0, recompute past it) on that same copy. An inner step can come between the two (it
    updates the parameters in place, which would void a graph built on them and change a
    recompute), and the backward is still the exact gradient at the weights the forward saw (weight
    stashing, as PipeDream), added into the parameters' gradients at the next step. One copy per
    weight version, shared by its microbatches."""
    device: torch.device | str = "cpu"
    bf16_autocast: bool = False
    """bf16 autocast for the stage's compute (the assembly: a GPU with pipeline.bf16_autocast);
    weights, phi and m stay fp32 masters, the matmul weights cast once per version
    (pipeline/weight_casts.py)."""
    compute_delay_s: float = 0.0
    """faults.compute_delay_s: emulates a slower device."""
    host_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
    """(activations, gradients): the dtype a GPU stage copies its results to the host in.
    bfloat16 when that direction's wire codec is bf16: cast on the device, the copy moves half the
    bytes and the codec sends the same bits it would have made from float32."""
    device_codecs: tuple[str | None, str | None] = (None, None)
    """(activations, gradients): a blockwise codec (int8, fp8, int4 to nearest) the stage encodes its
    results with where it computed them, handing the transport an EncodedTensor: the host copies
    the payload and does no codec work. None: a tensor of host_dtypes, encoded by the transport."""
    results_later: bool = False
    """Results still on their way to the host are returned as `Later` (runtime/compute.py): the
    compute thread launches the next job while the device finishes and copies this one's
    (pipeline/host_copies.py). The node's assembly sets it; else the worker waits for them."""


class StageWorker:
    """Not thread-safe by design: every method runs on the node's single compute thread."""

    def __init__(
        self,
        stage: LlamaStage,
        inner: InnerOptimizer,
        settings: WorkerSettings,
        *,
        faults: FaultInjector | None = None,
        slow_weights: Callable[[], dict[str, Tensor] | None] | None = None,
        emit: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stage, self.inner = stage, inner
        self.device = torch.device(settings.device)
        self.autocast = settings.bf16_autocast
        self.batch_size, self.saved_ttl_s, self.auto_step = (
            settings.batch_size,
            settings.saved_ttl_s,
            settings.auto_step,
        )
        self.defer_step, self.stash_weights = settings.defer_step, settings.stash_weights
        self.compute_delay_s = settings.compute_delay_s
        self.transfers = Transfers(self.device, settings.host_dtypes, settings.device_codecs)
        self.results_later = settings.results_later
        self.clock = clock
        self.saved: dict[Hashable, Saved] = {}
        self.sequences_since_step = 0
        self.sequences_total = 0
        self.tokens_total = 0
        self.last_lr = 0.0
        self.faults = faults or FaultInjector()
        self.emit = emit or (lambda event, **fields: None)  # the node's event stream (thread-safe)
        self.params = dict(stage.named_parameters())
        self.casts = WeightCasts(matmul_weight_names(stage) if self.autocast else ())
        # Where bad weights are restored from: phi when the method keeps one, else (dp, none) a
        # copy of theta this worker refreshes every 10 good steps.
        self.slow_weights = slow_weights or (lambda: None)
        self._own_copy = None if slow_weights is not None else self._copy_theta()
        self.dropped_non_finite = 0
        self._drops_lock = threading.Lock()
        self.repairs = 0
        self.step_due = False
        self._stash: tuple[int, Stash] | None = None
        self._stashes_with_gradients: list[Stash] = []

    def forward(
        self, key: Hashable, inputs: Tensor, *, token_ids: Tensor | None = None, keep_graph: bool = False
    ) -> HostValue | Later:
        """Forward without a graph, keeping `inputs` for the backward's recompute; or, with
        `keep_graph`, keep the autograd graph instead: safe when no inner step can happen before
        this microbatch's backward (stage 0 in exact mode, whose driver steps between batches), or
        with stash_weights (the graph is built on a copy of the weights)."""
        self.step_if_due()
        self._slow_down()
        inputs = self.transfers.input_to_device(inputs)
        saved = Saved(inputs, self.clock(), None if token_ids is None else self.transfers.to_device(token_ids))
        self.saved[key] = saved
        saved.stash = self._current_stash() if self.stash_weights else None
        if keep_graph:
            with self._autocast():
                saved.output = self._run_stage(inputs, saved.stash, saved.token_ids)
            return self._to_host(saved.output.detach(), 0)
        with torch.no_grad(), self._autocast():
            return self._to_host(self._run_stage(inputs, saved.stash, saved.token_ids), 0, finite=(key, "output"))

    def forward_backward_last(
        self, inputs: Tensor, labels: Tensor, token_ids: Tensor | None = None
    ) -> tuple[HostValue, float, int] | Later:
        """Last stage: loss (token mean, scaled by b/B for accumulation), backward; returns
        (grad w.r.t. inputs, unscaled loss, tokens). The loss is read once, to check it before the
        backward (the one wait on the device here): the backward is launched and left running."""
        self.step_if_due()
        self._slow_down(2)
        x = self.transfers.input_to_device(inputs).detach().requires_grad_()
        token_ids = None if token_ids is None else self.transfers.to_device(token_ids)
        with self._autocast():
            loss = self._run_stage(x, None, token_ids, labels=self.transfers.to_device(labels))
        loss_value = self._finite_loss(loss, "last stage")  # before backward: the accumulated gradients stay clean
        (loss * (inputs.shape[0] / self.batch_size)).backward()
        self._count(inputs.shape[0], labels.numel())
        tokens = labels.numel()
        return then(self._to_host(x.grad, 1), lambda grad: (grad, loss_value, tokens))

    def forward_backward_whole(self, inputs: Tensor, labels: Tensor) -> tuple[float, int]:
        """A single-stage swarm (P = 1): the whole model here, from token ids to loss and back;
        returns (unscaled loss, tokens)."""
        self.step_if_due()
        self._slow_down(2)
        with self._autocast():
            loss = self._run_stage(self.transfers.to_device(inputs), None, labels=self.transfers.to_device(labels))
        loss_value = self._finite_loss(loss, "whole model")
        (loss * (inputs.shape[0] / self.batch_size)).backward()
        self._count(inputs.shape[0], labels.numel())
        return loss_value, labels.numel()

    def backward(self, key: Hashable, grad_output: Tensor) -> HostValue | Later | None:
        """Recompute from the saved input and backpropagate `grad_output`; returns the input
        gradient, or None on stage 0 (whose input is token ids)."""
        self.step_if_due()
        saved = self.saved.pop(key)
        self._slow_down()
        inputs, grad_output = saved.inputs, self.transfers.to_device(grad_output)
        if saved.output is not None:
            saved.output.backward(grad_output.to(saved.output.dtype))
            grad_input = None if self.stage.is_first else inputs.grad
        else:
            x = inputs if self.stage.is_first else inputs.detach().requires_grad_()
            with self._autocast():
                output = self._run_stage(x, saved.stash, saved.token_ids)
            output.backward(grad_output.to(output.dtype))
            grad_input = None if self.stage.is_first else x.grad
        if saved.stash is not None and not any(saved.stash is s for s in self._stashes_with_gradients):
            self._stashes_with_gradients.append(saved.stash)
        self._count(inputs.shape[0], inputs.shape[0] * inputs.shape[1])
        if grad_input is None:
            return None
        return self._to_host(grad_input, 1, finite=(key, "input gradient"))

    def _run_stage(
        self, inputs: Tensor, stash: Stash | None, token_ids: Tensor | None = None, *, labels: Tensor | None = None
    ) -> Tensor:
        """The stage's output, or with `labels` (last stage) its loss."""
        weights = stash.run_on if stash is not None else self.casts.current(self.params)
        if weights is None:
            return self.stage(inputs, token_ids, labels)
        return torch.func.functional_call(self.stage, weights, (inputs, token_ids, labels))

    def _current_stash(self) -> Stash:
        # A stale copy is never reused: version counters move with every in-place change.
        version = weights_version(self.params.values())
        if self._stash is None or self._stash[0] != version:
            self._stash = (version, self.casts.stash(self.params))
        return self._stash[1]

    def _take_stash_gradients(self) -> None:
        """Before a step: the gradients accumulated on weight copies join the parameters' own, once
        per copy and step rather than once per microbatch. They are all this step's: the overlap
        schedule holds a batch's backwards until the previous step is taken."""
        for stash in self._stashes_with_gradients:
            for name, copy in stash.leaves.items():
                if copy.grad is None:
                    continue
                param = self.params[name]
                if param.grad is None:
                    param.grad = copy.grad
                else:
                    param.grad.add_(copy.grad)
                copy.grad = None
        self._stashes_with_gradients.clear()

    def _finite_loss(self, loss: Tensor, key: str) -> float:
        value = float(loss.detach())
        if not math.isfinite(value):
            self._drop_non_finite(key, "loss")
        return value

    def _drop_non_finite(self, key, what: str) -> None:
        with self._drops_lock:  # also the waiter thread's, for results checked once on the host
            self.dropped_non_finite += 1
        self.emit("non_finite", what=what, microbatch=str(key), inner_step=self.inner_steps)
        raise NonFiniteValues(f"{what} of {key} is not finite; the microbatch is dropped here")

    def _slow_down(self, passes: int = 1) -> None:
        if self.compute_delay_s > 0:  # on the compute thread: it really costs capacity, as a slow device does
            time.sleep(self.compute_delay_s * passes)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _to_host(
        self, tensor: Tensor, direction: int, *, finite: tuple[Hashable, str] | None = None
    ) -> HostValue | Later:
        """A result on its way to the wire (`direction` 0: activations, 1: gradients), as the
        transport takes it (pipeline/transfers.py); with `finite` = (microbatch, what), a result
        that is not finite is dropped once it is on the host (_drop_non_finite). With
        `results_later`, that wait is left to the caller."""
        copy = self.transfers.to_host(tensor, direction, check_finite=finite is not None)
        if self.results_later:
            return Later(lambda: self._arrived(copy, finite))
        return self._arrived(copy, finite)

    def _arrived(self, copy: HostCopy, finite: tuple[Hashable, str] | None) -> HostValue:
        result, is_finite = copy.wait()
        if not is_finite:
            self._drop_non_finite(*finite)
        return result

    def _count(self, sequences: int, tokens: int) -> None:
        self.sequences_since_step += sequences
        self.sequences_total += sequences
        self.tokens_total += tokens
        # Step before the caller sends the input gradient on: the gradient is already computed,
        # and the upstream stage must not issue the next batch before this stage has stepped.
        if self.auto_step and self.sequences_since_step >= self.batch_size:
            if self.defer_step:
                self.step_due = True
            else:
                self.step()

    def step_if_due(self) -> bool:
        """Take the auto step left due (defer_step); whether there was one."""
        if not self.step_due:
            return False
        self.step_due = False
        self.step()
        return True

    def step(self) -> float:
        self.casts.release()
        self._take_stash_gradients()
        self._inject_faults()
        self.last_lr, norm = self.inner.step()
        self.sequences_since_step = max(0, self.sequences_since_step - self.batch_size)
        self._after_step(norm)
        return self.last_lr

    def _inject_faults(self) -> None:
        if self.faults.poison("inner_step") is not None:  # tests: a step whose gradients went NaN
            for p in self.inner.params:
                p.grad = torch.full_like(p, float("nan"))
        scale = self.faults.poison("weights")  # tests: weights that went bad anyway (the step's check finds them)
        if scale is not None:
            with torch.no_grad():
                for p in self.params.values():
                    p.mul_(scale)

    def _after_step(self, norm: float) -> None:
        step = self.inner_steps
        if not math.isfinite(norm):
            log.warning(
                "inner step %d skipped: gradient norm %s (%d skipped so far)", step, norm, self.inner.skipped_steps
            )
            self.emit("inner_step_skipped", inner_step=step, grad_norm=str(norm), skipped=self.inner.skipped_steps)
        if not self.inner.weights_finite:
            source = self.slow_weights() if self._own_copy is None else self._own_copy
            done = repair_weights(self.params, source, self.inner.adam.state)
            self.repairs += 1
            log.error(
                "inner step %d: weights went non-finite; restored from %s",
                step,
                done or "nothing (no finite copy): this replica is dropping its microbatches",
            )
            self.emit("weights_repaired", inner_step=step, source=done)
        elif self._own_copy is not None and step % 10 == 0:
            self._own_copy = self._copy_theta()

    def _copy_theta(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def take_gradients(self) -> list[Tensor]:
        """Data-parallel: clip this stage's accumulated gradients (per stage, before any
        all-reduce, as the reference), hand them out, and start the next accumulation."""
        self.inner.clip_gradients()
        grads = [
            (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).to("cpu", copy=True)
            for p in self.inner.params
        ]
        for p in self.inner.params:
            p.grad = None
        self.sequences_since_step = max(0, self.sequences_since_step - self.batch_size)
        return grads

    def step_with(self, grads: list[Tensor]) -> float:
        """Data-parallel: one Adam step on the given (averaged) gradients; gradients accumulated
        meanwhile for the next step are kept."""
        self.casts.release()
        pending = [p.grad for p in self.inner.params]
        for p, g in zip(self.inner.params, grads):
            p.grad = g.to(p.device, p.dtype)
        self._inject_faults()
        self.last_lr, norm = self.inner.step(clip=False)
        for p, g in zip(self.inner.params, pending):
            p.grad = g
        self._after_step(norm)
        return self.last_lr

    def skip_step(self) -> float:
        """Data-parallel: a round that was not whole (sync/dp.py): no update, the gradients already
        taken are dropped, and the step counter advances with the other replicas'."""
        self.last_lr = self.inner.schedule.lr_at(self.inner.step_count + 1)
        self.inner.step_count += 1
        return self.last_lr

    def output_shape(self, key: Hashable) -> tuple[int, ...] | None:
        saved = self.saved.get(key)
        if saved is None:
            return None
        return tuple(saved.inputs.shape[:2]) + (self.stage.boundary_width,)

    def drop(self, key: Hashable) -> bool:
        return self.saved.pop(key, None) is not None

    def expire(self) -> list[Hashable]:
        """Drop saved inputs older than the TTL; returns their keys."""
        cutoff = self.clock() - self.saved_ttl_s
        old = [k for k, s in self.saved.items() if s.created < cutoff]
        for key in old:
            del self.saved[key]
        return old

    @property
    def inner_steps(self) -> int:
        return self.inner.step_count
