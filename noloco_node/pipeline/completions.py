"""Where stage 0's runtime (which receives each microbatch's last gradient) and its driver (which
issued the microbatch and waits for it) meet. Built once and handed to both constructors."""

from __future__ import annotations

import asyncio

from noloco_node.pipeline.ports import MicrobatchKey


class Stage0Completions:
    """Pending microbatches and, under the overlap schedule, the per-batch backward gates."""

    def __init__(self, *, gated: bool = False) -> None:
        """`gated` (the overlap schedule): a backward of batch k+1 arriving before step k waits for
        it (`wait_turn`)."""
        self._pending: dict[MicrobatchKey, asyncio.Future] = {}
        self._batch_of: dict[int, int] = {}  # sequence -> batch index within this run
        self._gates: dict[int, asyncio.Event] = {}
        self.gated = gated

    # ---- the driver's side ------------------------------------------------------------------
    def expect(self, key: MicrobatchKey) -> asyncio.Future:
        """A future that gets the microbatch's loss when its last gradient has been applied here."""
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        return future

    def forget(self, key: MicrobatchKey) -> None:
        self._pending.pop(key, None)

    def assign(self, sequence: int, batch: int) -> None:
        self._batch_of[sequence] = batch

    def unassign(self, sequence: int) -> None:
        self._batch_of.pop(sequence, None)

    def open_gate(self, batch: int) -> None:
        """Batch `batch` may take its backwards (the step before it has been taken)."""
        self._gates.pop(batch - 1, None)
        self._gates.setdefault(batch, asyncio.Event()).set()

    # ---- the runtime's side -----------------------------------------------------------------
    def completed(self, key: MicrobatchKey, loss: float) -> None:
        future = self._pending.get(key)
        if future is not None and not future.done():
            future.set_result(loss)

    async def wait_turn(self, key: MicrobatchKey) -> None:
        """Overlap: a backward of batch k+1 arriving before step k waits for it, so the gradients
        of two batches never mix in one step."""
        if not self.gated:
            return
        batch = self._batch_of.get(key.sequence)
        if batch is not None:
            await self._gates.setdefault(batch, asyncio.Event()).wait()
