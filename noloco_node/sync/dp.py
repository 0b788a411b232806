"""Data-parallel baseline ("FSDP" in the reference, nothing sharded): every inner step, this
stage's clipped gradients are averaged over its replicas by the all-reduce, then Adam steps.

Clipping is per stage and before the all-reduce, as the reference (`train.py:175`). Stage 0's
driver takes the step at its batch boundary; stages > 0 take it when a batch worth of sequences
has been accumulated, before the batch's last gradient goes upstream (pipeline/runtime.py).

Replicas must stay bit-identical, so a round is applied only when it is whole: every replica of
the stage in the group (`outer.allreduce_group_size`, when known), every part of the mean
delivered, every member at this step. Otherwise the step is *skipped*: no Adam update, the
gradients dropped, the step counter advanced, so every replica stays at the same step and, when
the round failed for all of them (hivemind forms a group of all D or none), at the same weights.

A round can still fail for some members only (hivemind delivers part of the mean to one and the
whole to another), and no protocol over lossy links can make every member agree on that. So each
round also carries a fingerprint of every member's weights (a hash mapped into [0, 1)): when the
group's mean fingerprint is not this replica's own, the replicas have come apart, every member
sees it in the same round, and instead of stepping they average their weights, Adam moments and
counters back together (three more all-reduce rounds, keyed apart from the gradient rounds). A
replica that drifted is thus back in lockstep one round later: the state heals itself.

A round short of members is tried again while patience lasts, for the replica that is only late.
But hivemind can also form a group that one member's own matchmaking has already given up on: the
others get a partial mean, skip the round and move on, while that member sees a short group.
Waiting for them under the old round's key would take its whole patience (seen: 450 s, and a
convergence cell timed out). So before each retry a replica reads the stage's records: once any
other replica has finished this round (its inner step has reached it), nobody will join it again,
and the round is skipped at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import torch
from torch import Tensor

from noloco_node.config import OuterConfig
from noloco_node.pipeline.worker import StageWorker
from noloco_node.sync.ports import AllReduce, MethodTraits, OuterSync, StageProgress, SyncParts

log = logging.getLogger(__name__)
EXTRA_SHAPE = torch.Size([2])
"""The slot every round carries besides the gradients: (weights fingerprint, inner-step count)."""
RESYNC_KEYS = 1 << 30
"""Resync rounds match under keys of their own, far above any gradient round's step."""


def all_reduce_shapes(worker: StageWorker) -> list[torch.Size]:
    """The tensors one dp round averages: every trainable parameter's gradient, then the extra slot."""
    return [p.shape for p in worker.inner.params] + [EXTRA_SHAPE]


def weights_fingerprint(params: list[Tensor]) -> float:
    """A 16-bit hash of (a strided sample of) the weights' bytes, as k / 2^16 in [0, 1). Equal
    replicas give the same value, and so does the mean of them, exactly: hivemind averages this slot
    through float32 (seen: float64 hashes came back rounded, and identical replicas looked apart),
    and a mean of up to 64 such values needs at most 22 bits. Apart replicas differ from the mean
    by at least 2^-22, unless their hashes collide (1 in 65,536 per round; the next round looks again)."""
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)]
        digest.update(sample.to("cpu", torch.float32).numpy().tobytes())
    return (int.from_bytes(digest.digest(), "little") % 65536) / 65536.0


class DataParallelSync(OuterSync):
    # Every replica takes every inner step together, after the all-reduce: routed balanced and in
    # lockstep, the step the sync's own (stage 0's driver and stages > 0's runtime call it).
    traits = MethodTraits(
        "dp",
        syncs=True,
        takes_inner_step=True,
        lockstep=True,
        balanced_routing=True,
        all_reduce_shapes=all_reduce_shapes,
    )

    def __init__(
        self,
        worker: StageWorker,
        config: OuterConfig,
        parts: SyncParts,
        *,
        all_reduce: AllReduce,
        timeout_s: float,
        patience_s: float = 0.0,
        progress: StageProgress | None = None,
    ) -> None:
        """`timeout_s` bounds one attempt at a round; a round whose group is short of members is
        tried again under the same key until `patience_s` has passed (a replica one timeout behind
        the others would otherwise never meet them again: seen in the convergence reproduction,
        every round from step 10 on failed for all four replicas of a stage, one of them a timeout
        ahead of the rest). Keep it below the microbatch timeout: a later stage waits here before
        it sends the batch's last gradient upstream. `progress` tells when the others have moved past a
        round this replica is still retrying (module docstring); without it, patience alone ends it."""
        super().__init__()
        self.worker, self.parts, self.all_reduce, self.timeout_s = worker, parts, all_reduce, timeout_s
        self.patience_s, self.progress = patience_s, progress
        self.compute = parts.compute
        self.group_size = config.allreduce_group_size  # 0 = unknown: any group of two or more is whole

    async def at_boundary(self, inner_step: int) -> None:
        return None  # the all-reduce is the inner step itself

    @property
    def bytes_sent(self) -> int:
        return self.all_reduce.bytes_sent

    @property
    def bytes_received(self) -> int:
        """An all-reduce member receives what it sends (each sends its part of the others' chunks
        and gets theirs of its own)."""
        return self.all_reduce.bytes_sent

    async def close(self) -> None:
        await asyncio.to_thread(self.all_reduce.shutdown)

    def _whole(self, group: int, same: bool, complete: bool) -> bool:
        return complete and same and (group == self.group_size if self.group_size else group > 1)

    async def inner_step(self) -> float:
        """One inner step: all-reduce this batch's clipped gradients and, when the round is whole and
        the replicas agree, step Adam; returns the lr of the step (applied or skipped)."""
        start = time.monotonic()
        step = self.worker.inner_steps + 1
        grads, extra = await self.compute.run(self._gradients_and_extra)
        (means, group, same, complete), left_behind = await self._mean(grads + [extra], step, start)
        c = self.counters
        c.rounds += 1
        c.mixed_rounds += not same
        c.partial_rounds += not complete
        whole = self._whole(group, same, complete)
        apart = whole and float(means[-1][0]) != float(extra[0])
        if whole and not apart:
            lr = await self.compute.run(self.worker.step_with, means[:-1])
            outcome = "paired"
            c.paired += 1
        else:
            lr = await self.compute.run(self.worker.skip_step)
            outcome = "skipped"
            c.skipped += 1
            if apart:
                outcome = "resynced" if await self._resync(step) else "apart"
        c.history.append(
            {
                "round": step,
                "outcome": outcome,
                "group": group,
                "same_round": same,
                "complete": complete,
                "left_behind": left_behind,
                "seconds": time.monotonic() - start,
            }
        )
        if outcome != "paired":
            log.warning("dp step %d %s (group %d, same round %s, complete %s)", step, outcome, group, same, complete)
        return lr

    async def _mean(
        self, tensors: list[Tensor], step: int, start: float
    ) -> tuple[tuple[list[Tensor], int, bool, bool], bool]:
        """The round's all-reduce, tried again while the group is short, patience is left and no
        other replica has finished the round; returns the last attempt and whether the others had
        moved on without this replica."""
        while True:
            left = self.patience_s - (time.monotonic() - start)
            attempt_s = max(1.0, min(self.timeout_s, left)) if self.patience_s > 0 else self.timeout_s
            began = time.monotonic()
            result = await self.all_reduce.mean(tensors, attempt_s, step)
            group = result[1]
            short = group < self.group_size if self.group_size else group < 2
            left = self.patience_s - (time.monotonic() - start)
            if not short or left < 1.0:
                return result, False
            if await self._others_finished(step):
                log.warning(
                    "dp step %d: another replica of the stage has finished this round without us; skipping it", step
                )
                return result, True
            log.info("dp step %d: group of %d, waiting for the rest (%.0f s of patience left)", step, group, left)
            # An attempt can come back short at once (the group formed without us, or we are the one
            # missing): pause before the next, or the retries spin and starve the event loop.
            await asyncio.sleep(max(0.0, min(0.5, attempt_s) - (time.monotonic() - began)))

    async def _others_finished(self, step: int) -> bool:
        """Whether any other replica of this stage announces an inner step of `step` or more: it
        has applied or skipped this round, so the round's group will never form again."""
        if self.progress is None:
            return False
        try:
            steps = await self.progress.inner_steps(self.parts.stage, timeout_s=min(self.timeout_s, 10.0))
        except Exception as exc:  # noqa: BLE001 - a failed lookup only means we keep waiting
            log.info("dp step %d: could not read the stage's progress (%s)", step, exc or type(exc).__name__)
            return False
        return any(inner >= step for peer, inner in steps.items() if peer != self.parts.peer_id)

    def _gradients_and_extra(self) -> tuple[list[Tensor], Tensor]:
        grads = self.worker.take_gradients()
        fingerprint = weights_fingerprint(self.worker.inner.params)
        return grads, torch.tensor([fingerprint, float(self.worker.inner_steps)], dtype=torch.float64)

    async def _resync(self, step: int) -> bool:
        """Average weights, then Adam's two moments, then (Adam step, inner step) counts, over the
        whole group. Any round that is not whole leaves the rest for the next detection."""
        for part in range(3):
            tensors, extra = await self.compute.run(self._resync_tensors, part)
            means, group, same, complete = await self.all_reduce.mean(
                tensors + [extra], self.timeout_s, RESYNC_KEYS + 3 * step + part
            )
            if not self._whole(group, same, complete):
                log.warning("dp step %d: resync round %d was not whole; the replicas stay apart for now", step, part)
                return False
            await self.compute.run(self._load_resynced, part, means)
        self.counters.resynced += 1
        return True

    def _resync_tensors(self, part: int) -> tuple[list[Tensor], Tensor]:
        params, state = self.worker.inner.params, self.worker.inner.adam.state
        if part == 0:
            tensors = [p.detach().to("cpu", torch.float64) for p in params]
        else:
            key = "exp_avg" if part == 1 else "exp_avg_sq"
            tensors = [
                state[p][key].detach().to("cpu", torch.float64)
                if p in state
                else torch.zeros(p.shape, dtype=torch.float64)
                for p in params
            ]
        adam_step = max((float(s["step"]) for s in state.values()), default=0.0)
        return tensors, torch.tensor([adam_step, float(self.worker.inner_steps)], dtype=torch.float64)

    def _load_resynced(self, part: int, means: list[Tensor]) -> None:
        params, state = self.worker.inner.params, self.worker.inner.adam.state
        with torch.no_grad():
            for p, mean in zip(params, means[:-1]):
                if part == 0:
                    p.copy_(mean.to(p.device, p.dtype))
                    continue
                entry = state.setdefault(
                    p,
                    {
                        "step": self.worker.inner.step_tensor(p, 0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    },
                )
                entry["exp_avg" if part == 1 else "exp_avg_sq"].copy_(mean.to(p.device, p.dtype))
            if part == 2:  # counts: every member rounds the same mean to the same whole number
                adam_step, inner_step = (round(float(v)) for v in means[-1])
                for p, entry in state.items():
                    entry["step"] = self.worker.inner.step_tensor(p, adam_step)
                self.worker.inner.step_count = inner_step
