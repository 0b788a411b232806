"""StageRuntime: the microbatch lifecycle of docs/architecture.md (Microbatch lifecycle) for one node.

It implements rpc's StageHandler: admits Forward/Backward calls (shape checks, bounded in-flight
window, BUSY back-pressure), queues compute on the compute thread, and pushes results on: the
forward to a random live replica of the next stage (retrying others, banning failures), the
gradient back to the recorded upstream hop. Stage 0's completions go to the driver.
"""

from __future__ import annotations

import asyncio
import logging
import time

from torch import Tensor

from noloco_node.codec.tensors import TensorSpec
from noloco_node.errors import (
    InvalidPayload,
    NodeError,
    PeerBusy,
    PeerUnavailable,
    ProtocolMismatch,
    UnknownMicrobatch,
)
from noloco_node.pipeline.call_checks import check_forward, check_gradient, check_reported
from noloco_node.pipeline.outage import ReceiverOutage
from noloco_node.pipeline.ports import BackwardCall, ForwardCall, Hop, MicrobatchKey
from noloco_node.pipeline.runtime_settings import RuntimeHooks, RuntimeSettings, StageNetwork, StageShape
from noloco_node.pipeline.tickets import RuntimeStats, Ticket
from noloco_node.pipeline.worker import NonFiniteValues, StageWorker
from noloco_node.runtime.compute import ComputeThread
from noloco_node.runtime.faults import FaultInjector

log = logging.getLogger(__name__)

# Waits before sending a gradient again to an upstream peer that is not in the DHT yet (each try
# looks it up afresh) or did not answer (its path may come back: a NAT audit's relay restarted, and
# gradients given up at once left stage 0 waiting out its whole microbatch timeout, 60 s).
BACKWARD_RETRIES_S = (0.5, 1.0, 2.0, 4.0, 8.0)


class StageRuntime:
    def __init__(
        self,
        *,
        shape: StageShape,
        worker: StageWorker,
        compute: ComputeThread,
        network: StageNetwork,
        settings: RuntimeSettings,
        hooks: RuntimeHooks = RuntimeHooks(),
        faults: FaultInjector | None = None,
    ) -> None:
        self.shape, self.worker, self.compute = shape, worker, compute
        self.transport, self.directory = network.transport, network.directory
        self.router, self.me = network.router, network.me
        self.max_in_flight, self.send_deadline_s = settings.max_in_flight, settings.send_deadline_s
        self.delay_before_forward_s = settings.delay_before_forward_s
        self.routing, self.routing_seed, self.lockstep = settings.routing, settings.routing_seed, settings.lockstep
        self.lockstep_replicas = settings.lockstep_replicas
        self.hooks = hooks
        self.faults = faults or FaultInjector()
        self._last_hooked_step = 0
        self._method_step_lock = asyncio.Lock()
        self.in_flight: dict[MicrobatchKey, Ticket] = {}
        self.unreachable_at: dict[str, float] = {}  # next-stage replica -> when it last failed as unreachable
        self._probes: dict[str, asyncio.Task] = {}  # next-stage replica -> its health check under way
        self.stats = RuntimeStats()
        self.outage = ReceiverOutage(shape.stage + 1)
        self.accepting = True
        self._tasks: set[asyncio.Task] = set()

    # ---- pipeline.ports.StageHandler -------------------------------------------------------------
    def admit_forward(self, call: ForwardCall, spec: TensorSpec) -> Ticket:
        s = self.shape
        if call.target_stage != s.stage or s.is_first:
            raise ProtocolMismatch(f"this node serves stage {s.stage}, not stage {call.target_stage}")
        b, t, _ = check_forward(s, call, spec)
        # The last hop is the signed caller (rpc/stage_service.py checks): where its gradient goes.
        self.directory.saw_address(call.route[-1].peer_id, call.route[-1].address)
        key = call.key
        if (held := self.in_flight.get(key)) is not None:
            if held.route[-1].peer_id != call.route[-1].peer_id:
                # Not a strike: a key another caller sent first (a stranger may squat on an honest
                # sender's next key) must not get the honest sender banned.
                raise ProtocolMismatch(f"microbatch {key} is already in flight here, from another sender")
            raise InvalidPayload(f"microbatch {key} is already in flight here")
        if not self.accepting or len(self.in_flight) >= self.max_in_flight:
            self.stats.busy_answers += 1
            raise PeerBusy(f"{len(self.in_flight)}/{self.max_in_flight} microbatches in flight")
        import torch

        ticket = Ticket(
            key=key,
            route=list(call.route),
            labels=torch.tensor(list(call.labels), dtype=torch.int64).view(b, t),
            token_ids=torch.tensor(list(call.token_ids), dtype=torch.int64).view(b, t) if s.carries_token_ids else None,
        )
        self.in_flight[key] = ticket
        return ticket

    def release_forward(self, ticket: Ticket) -> None:
        self.in_flight.pop(ticket.key, None)

    async def accept_forward(self, ticket: Ticket, activations: Tensor) -> None:
        self.stats.forwards_received[ticket.route[-1].peer_id] += 1
        self._spawn(self._serve_forward(ticket, activations))

    def admit_backward(self, call: BackwardCall, spec: TensorSpec, caller: str = "") -> Ticket:
        if call.target_stage != self.shape.stage:
            raise ProtocolMismatch(f"this node serves stage {self.shape.stage}, not stage {call.target_stage}")
        key = call.key
        ticket = self.in_flight.get(key)
        expected = self.worker.output_shape(key)
        if ticket is None or expected is None:
            raise UnknownMicrobatch(f"no saved input for microbatch {key} (expired or never seen)")
        check_gradient(spec, expected)
        check_reported(call.loss, call.num_tokens, expected)
        if caller and not ticket.gradient_may_come_from(caller):
            # FAILED_PRECONDITION, not a strike: an honest replica whose accept we never saw (our
            # call timed out, we retried elsewhere) lands here too.
            raise UnknownMicrobatch(f"gradient for {key} from {caller[-8:]}, which the microbatch was not forwarded to")
        ticket.loss, ticket.num_tokens = call.loss, call.num_tokens
        return ticket

    async def accept_backward(self, ticket: Ticket, grad: Tensor) -> None:
        self._spawn(self._serve_backward(ticket, grad))

    # ---- lifecycle --------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release(self, key: MicrobatchKey) -> None:
        self.in_flight.pop(key, None)

    async def _serve_forward(self, ticket: Ticket, activations: Tensor) -> None:
        key = ticket.key
        try:
            if self.delay_before_forward_s > 0:
                await asyncio.sleep(self.delay_before_forward_s)
            await self.faults.hit("before_forward")
            if self.shape.is_last:
                before = self.worker.inner_steps
                grad, loss, tokens = await self.compute.run(
                    self.worker.forward_backward_last, activations, ticket.labels, token_ids=ticket.token_ids
                )
                self._release(key)
                await self._step_and_send_backward(before, ticket.route[-1], key, grad, loss, tokens)
                return
            output = await self.compute.run(self.worker.forward, key, activations, token_ids=ticket.token_ids)
            if await self.send_forward(key, ticket.route + [self.me], output, ticket.labels, ticket.token_ids) is None:
                await self.compute.run(self.worker.drop, key)
                self._release(key)
                self.stats.dropped_here += 1
        except Exception:  # noqa: BLE001 - top of a task: log, free the slot, keep serving
            log.exception("forward of %s failed", key)
            await self.compute.run(self.worker.drop, key)
            self._release(key)

    async def _serve_backward(self, ticket: Ticket, grad: Tensor) -> None:
        key = ticket.key
        if self.shape.is_first and self.hooks.stage0 is not None:
            await self.hooks.stage0.wait_turn(key)
        before = self.worker.inner_steps
        try:
            grad_input = await self.compute.run(self.worker.backward, key, grad)
        except KeyError:
            if self.shape.is_first:  # its driver gave the attempt up (a stop, a re-issue): expected
                log.info("gradient of %s came after its attempt was given up", key)
            else:
                log.warning("saved input of %s expired before its backward", key)
            self._release(key)
            return
        except NonFiniteValues as exc:  # counted and reported by the worker; upstream re-issues it
            log.warning("%s", exc)
            self._release(key)
            return
        except Exception:  # noqa: BLE001 - top of a task: log, free the slot, keep serving
            log.exception("backward of %s failed", key)
            self._release(key)
            return
        self._release(key)
        # Mid-backward: our gradients are accumulated, upstream has not been sent its gradient yet.
        if self.shape.is_first:
            await self._after_compute(before)
            await self.faults.hit("mid_backward")
            if self.hooks.stage0 is not None:
                self.hooks.stage0.completed(key, ticket.loss)
            return
        await self.faults.hit("mid_backward")
        await self._step_and_send_backward(before, ticket.route[-1], key, grad_input, ticket.loss, ticket.num_tokens)

    async def _step_and_send_backward(
        self, steps_before: int, upstream: Hop, key: MicrobatchKey, grad: Tensor, loss: float, tokens: int
    ) -> None:
        """Send the input gradient upstream with this stage's inner step out of its way: a step due
        (the batch's last gradient) is queued on the compute thread first, so it runs while the
        gradient travels and the upstream stage computes its backward. Still exact: upstream can
        issue batch k+1 only after this gradient, and any later compute here takes the step first
        (worker.step_if_due)."""
        stepping = self.compute.submit(self.worker.step_if_due) if self.worker.step_due else None
        if stepping is None:
            await self._after_compute(steps_before)
        await self._send_backward(upstream, key, grad, loss, tokens)
        if stepping is not None:
            await stepping
            await self._after_compute(steps_before)

    async def _after_compute(self, steps_before: int) -> None:
        if self.hooks.inner_step is not None and self.worker.sequences_since_step >= self.worker.batch_size:
            # Awaited before this microbatch's gradient goes upstream, as the local inner step is:
            # upstream cannot issue its next batch before this stage has stepped, so no microbatch
            # of batch k+1 is computed with the weights from before step k (lockstep DP).
            async with self._method_step_lock:
                while self.worker.sequences_since_step >= self.worker.batch_size:
                    await self.hooks.inner_step()
        # In the background: an outer step must not hold up the gradient that triggered it (that
        # would stall the upstream replica and desynchronise it from its own pairing partners).
        # Several tasks may see the same step happen (each read `steps_before` before the shared
        # compute thread ran); only the first reports it.
        step = self.worker.inner_steps
        if self.hooks.on_inner_step is not None and step > max(steps_before, self._last_hooked_step):
            self._last_hooked_step = step
            self._spawn(self.hooks.on_inner_step(step))

    async def send_forward(
        self,
        key: MicrobatchKey,
        route: list[Hop],
        output: Tensor,
        labels: Tensor,
        token_ids: Tensor | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> str | None:
        """Push to a live replica of the next stage (picked by the routing), retrying others until
        the deadline (in lockstep: the same one). Replicas in `avoid` (those that already lost this
        microbatch) are skipped while any other is available. `token_ids` go along only when the
        model has a residual subspace. Returns the peer id that accepted it, or None."""
        token_ids = token_ids if self.shape.carries_token_ids else None
        started = time.monotonic()
        deadline = started + self.send_deadline_s
        tried: set[str] = set(avoid)
        failed: dict[str, str] = {}
        delay = 0.05
        while time.monotonic() < deadline:
            candidates = await self.directory.replicas(self.shape.stage + 1)
            balanced = await self._balanced_receiver(candidates, key) if self._routes_balanced(tried) else None
            peer = balanced or (None if self.lockstep else self.router.pick(candidates, exclude=tried))
            self.outage.looked(key, listed=bool(candidates), started=started)
            if peer is None:
                # All tried once (or banned), or (lockstep) the stages' views differ for now: look again soon.
                tried.clear()
                delay = await _back_off(delay, deadline)
                continue
            if (ticket := self.in_flight.get(key)) is not None:
                ticket.sent_to.add(peer.peer_id)
            try:
                await self.transport.forward(
                    peer,
                    key=key,
                    route=route,
                    target_stage=self.shape.stage + 1,
                    activations=output,
                    labels=labels,
                    token_ids=token_ids,
                )
                self._forwarded(key, peer.peer_id, routed_balanced=balanced is peer)
                return peer.peer_id
            except PeerBusy:
                tried.add(peer.peer_id)
                failed[peer.peer_id] = "busy"
                if self.lockstep:  # the same receiver again, after a pause
                    delay = await _back_off(delay, deadline)
            except NodeError as exc:
                tried.add(peer.peer_id)
                failed[peer.peer_id] = str(exc)[:120]
                if self._forward_failed(key, peer.peer_id, exc):
                    delay = await _back_off(delay, deadline)
        self.outage.miss(key, self.send_deadline_s, started=started, failed=failed)
        return None

    async def hop_answers(self, peer_id: str) -> bool:
        """Whether a next-stage replica that holds microbatches of ours answers a health check (one
        check at a time per replica, however many wait on it); one that does not is marked
        unreachable, which ends the wait of every microbatch it holds (driver.py)."""
        probe = self._probes.get(peer_id)
        if probe is None or probe.done():
            probe = self._probes[peer_id] = asyncio.ensure_future(self.transport.answers(peer_id))
        answered = await asyncio.shield(probe)
        if not answered:
            self.unreachable_at[peer_id] = time.monotonic()
        return answered

    def _forwarded(self, key: MicrobatchKey, peer_id: str, *, routed_balanced: bool) -> None:
        ticket = self.in_flight.get(key)
        if ticket is not None:
            ticket.downstream = peer_id
        self.router.bans.clear(peer_id)
        self.outage.took()
        self.stats.forwards_sent += 1
        self.stats.routed_to[peer_id] += 1
        if routed_balanced:
            self.stats.routed_balanced += 1
        else:
            self.stats.routed_random += 1

    def _forward_failed(self, key: MicrobatchKey, peer_id: str, exc: NodeError) -> bool:
        """Counts the failure; returns whether to try the same receiver again after a pause
        (lockstep), else bans it so the next pick goes elsewhere."""
        self.stats.send_failures += 1
        if isinstance(exc, PeerUnavailable):  # the driver re-issues what it holds at once (driver.py)
            self.unreachable_at[peer_id] = time.monotonic()
        if self.lockstep:
            log.info("forward of %s to %s failed (%s); trying it again", key, peer_id[-8:], exc)
            return True
        duration = self.router.bans.ban(peer_id)
        log.info("forward of %s to %s failed (%s); banned for %.0f s", key, peer_id[-8:], exc, duration)
        return False

    def _routes_balanced(self, tried: set[str]) -> bool:
        """Balanced and fixed routing pick by sender index for a first attempt; a re-issue or a
        retry goes to anyone else, except in lockstep, where it goes to the same receiver."""
        return self.routing in ("balanced", "fixed") and (self.lockstep or not tried)

    async def _balanced_receiver(self, candidates: list, key: MicrobatchKey):
        senders = [r.peer_id for r in await self.directory.replicas(self.shape.stage)]
        if self.lockstep_replicas and not len(candidates) == len(senders) == self.lockstep_replicas:
            return None  # a partial view: its balanced choice would be another replica's (RuntimeSettings)
        if self.routing == "fixed":
            return self.router.pick_fixed(candidates, senders, self.me.peer_id)
        return self.router.pick_permuted(
            candidates,
            senders,
            self.me.peer_id,
            f"{self.routing_seed}:{key.sequence}:{self.shape.stage}",
            ignore_bans=self.lockstep,
        )

    async def _send_backward(self, upstream: Hop, key: MicrobatchKey, grad: Tensor, loss: float, tokens: int) -> None:
        for retry_in in (*BACKWARD_RETRIES_S, None):
            try:
                await self.transport.backward(
                    upstream.peer_id, key=key, target_stage=upstream.stage, grad=grad, loss=loss, num_tokens=tokens
                )
                self.stats.backwards_sent += 1
                return
            except PeerUnavailable as exc:
                # A peer that has just joined can be missing from a DHT lookup for a few seconds (seen:
                # a driver's first gradients lost 7 s after it announced, then its whole first batch
                # waited out the microbatch timeout), and a relayed path can be down for a few. The
                # gradient is worth a short wait; anything else (a refusal) is given up at once, and
                # so is everything once the node drains (a stop must not wait out the retries).
                if retry_in is None or not self.accepting:
                    self._backward_failed(upstream, key, exc)
                    return
                await asyncio.sleep(retry_in)
            except NodeError as exc:
                self._backward_failed(upstream, key, exc)
                return

    def _backward_failed(self, upstream: Hop, key: MicrobatchKey, exc: NodeError) -> None:
        # The upstream hop holds the saved input; without it the microbatch is lost and stage 0
        # re-issues it after its timeout.
        self.stats.send_failures += 1
        log.info("backward of %s to %s failed: %s", key, upstream.peer_id[-8:], exc)

    async def expire_saved(self) -> int:
        expired = await self.compute.run(self.worker.expire)
        for key in expired:
            self._release(key)
        self.stats.expired += len(expired)
        return len(expired)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting and wait (bounded) for the work in flight to finish."""
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        while (self._tasks or self.in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._tasks):
            task.cancel()


async def _back_off(delay: float, deadline: float) -> float:
    """Sleeps `delay` (never past `deadline`); returns the next, doubled up to a second."""
    await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
    return min(1.0, delay * 2)
