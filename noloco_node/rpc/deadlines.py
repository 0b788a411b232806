"""Deadlines that follow the link, applied to gRPC streams (the numbers come from
runtime/link_estimates.py): a total deadline from the payload's size at the peer's measured
bandwidth, and a progress deadline that cuts a stream moving no message for `stall_s` however
long its total deadline is, so a slow link is waited for and a stalled peer is not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from noloco_node.errors import PeerUnavailable
from noloco_node.runtime.link_estimates import RECEIVED, LinkDeadlines

T = TypeVar("T")

BUFFERED_BYTES = 16 << 20
"""What may still be on its way to a peer when gRPC has taken a call's last message: HTTP/2's
flow-control window (grown by BDP probing) and the kernel's socket buffers."""


class TransferTimedOut(PeerUnavailable):
    """A transfer stalled (no message within its progress deadline) or ran past its total deadline."""


async def within(awaitable: Awaitable[T], seconds: float, what: str) -> T:
    """`awaitable`'s result, or TransferTimedOut after `seconds`. Not asyncio.wait_for: on Python
    3.11 it returns a result that arrived as an enclosing deadline cancelled it, losing that one."""
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            return await awaitable
    except TimeoutError:
        raise TransferTimedOut(f"no progress for {seconds:.1f} s {what}") from None


class Progress:
    """When a stream last moved a message each way, and where its total deadline lies."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s, self.clock = stall_s, clock
        self.started = self.read = self.wrote = clock()
        self.sending = True
        self.deadline: float | None = None

    def stamp_read(self) -> None:
        self.read = self.clock()

    def stamp_wrote(self) -> None:
        self.wrote = self.clock()

    def set_total(self, seconds: float) -> None:
        """The whole transfer must end `seconds` after it started (known once both sizes are)."""
        self.deadline = self.started + seconds

    def check(self, *, reads_only: bool) -> float:
        """Seconds until the next deadline; raises TransferTimedOut when one passed. `reads_only`:
        only received messages count as progress (the partner's payload is due), else either way."""
        now = self.clock()
        last = self.read if reads_only else max(self.read, self.wrote)
        if now - last >= self.stall_s:
            raise TransferTimedOut(f"no message for {now - last:.1f} s (progress deadline {self.stall_s:.1f} s)")
        if self.deadline is not None and now >= self.deadline:
            raise TransferTimedOut(f"still running after {now - self.started:.1f} s, its derived deadline")
        until = last + self.stall_s
        return (min(until, self.deadline) if self.deadline is not None else until) - now


async def paced(messages: Iterable, progress: Progress) -> AsyncIterator:
    """`messages` as the request iterator of a client-streaming call, stamping each one written
    (gRPC asks for the next message once the last is out, flow control included)."""
    for message in messages:
        yield message
        progress.stamp_wrote()
    progress.sending = False


async def while_sending(
    call: Awaitable[T], progress: Progress, cancel: Callable[[], object], reply_s: float | None = None
) -> T:
    """Await a client-streaming call fed by `paced`: cut it (cancel, TransferTimedOut) when no
    message goes out for the progress deadline, or, with `reply_s`, when no reply comes within
    `reply_s` of the last message written (what is still buffered on its way, then the peer's
    answer: a stopped peer whose kernel took the bytes held each call for its whole total deadline,
    30 s, in a soak). Without `reply_s`, the call's own deadline rules once all is sent."""

    async def result() -> T:
        return await call

    waiter = asyncio.ensure_future(result())
    try:
        while True:
            left = None
            try:
                if progress.sending:
                    left = progress.check(reads_only=False)
                elif reply_s is not None:
                    waited = progress.clock() - progress.wrote
                    if waited >= reply_s:
                        raise TransferTimedOut(f"no reply {waited:.1f} s after the last message written")
                    left = reply_s - waited
            except TransferTimedOut:
                cancel()
                raise
            done, _ = await asyncio.wait({waiter}, timeout=left)
            if done:
                return waiter.result()
    finally:
        if not waiter.done():
            waiter.cancel()


@dataclass(frozen=True)
class ExchangeLimits:
    """One outer exchange's deadlines with one partner: `total_s(bytes both ways)` once the partner's
    manifest said its size, `stall_s` as the progress deadline; `observe(bytes, seconds)` is told
    how long the partner's payload took to arrive (a bandwidth sample)."""

    total_s: Callable[[int], float]
    stall_s: float
    observe: Callable[[int, float], None] | None = None


def exchange_limits(deadlines: LinkDeadlines, peer_id: str) -> ExchangeLimits:
    """Both sides of an exchange derive the same way from their own estimate of the partner."""
    return ExchangeLimits(
        total_s=lambda payload_bytes: deadlines.total_s(peer_id, payload_bytes),
        stall_s=deadlines.stall_s(peer_id),
        observe=lambda size, seconds: deadlines.estimates.observe(peer_id, size, seconds, RECEIVED),
    )


async def watch_exchange(
    receiver: asyncio.Task, sender: asyncio.Task, progress: Progress, received_all: asyncio.Event
) -> None:
    """Wait for `receiver`, cutting the exchange at its deadlines. Until the partner's payload is
    all in (`received_all`), only received messages count as progress; after, while its receipt is
    awaited, our own writes count too (the receipt follows our payload, which may still be going
    out over a slower uplink). A `sender` that failed ends the exchange with its error."""
    while not receiver.done():
        left = progress.check(reads_only=not received_all.is_set())
        pending = {receiver} if sender.done() else {receiver, sender}
        # Polled: the total deadline is only set once the partner's manifest is in.
        await asyncio.wait(pending, timeout=min(max(0.01, left), 0.25), return_when=asyncio.FIRST_COMPLETED)
        if sender.done() and not sender.cancelled() and sender.exception() is not None:
            raise sender.exception()
