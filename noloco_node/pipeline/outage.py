"""Says once that the next stage stopped taking microbatches, and once that it takes them again.

When the only replica of the next stage leaves, every microbatch in flight finds no receiver: a
warning each, every send deadline, buried the one fact a volunteer needs (stage S has nobody) in
a screen of microbatch keys. The first miss warns, later ones are debug, the first send that lands
afterwards says the stage is back and how many microbatches had missed it."""

from __future__ import annotations

import logging
import time

from noloco_node.pipeline.ports import MicrobatchKey

log = logging.getLogger(__name__)

NOTICE_S = 5.0
"""How long a send waits on a stage that lists no replica before the outage is told."""


class ReceiverOutage:
    def __init__(self, stage: int) -> None:
        self.stage = stage  # the stage microbatches are sent to
        self.missed = 0  # sends that found no receiver in this outage
        self.since: float | None = None

    def miss(self, key: MicrobatchKey, deadline_s: float, *, started: float, failed: dict[str, str]) -> None:
        """A microbatch no replica of the stage took within `deadline_s` of monotonic time
        `started`; `failed`: why each replica that was tried refused it or did not answer."""
        self.missed += 1
        if self.since is not None:
            log.debug("no replica of stage %d took microbatch %s within %.0f s", self.stage, key, deadline_s)
            return
        self.since = started
        if failed:  # replicas were listed: they failed, nobody is missing (a soak's frozen replica)
            why = "; ".join(f"{peer[-8:]}: {reason}" for peer, reason in list(failed.items())[:3])
            log.warning(
                "no replica of stage %d took microbatch %s within %.0f s: the %d tried failed (%s); "
                "microbatches wait (said again when one takes them)",
                self.stage,
                key,
                deadline_s,
                len(failed),
                why,
            )
            return
        log.warning(
            "no replica of stage %d took microbatch %s within %.0f s: microbatches wait for one "
            "(a node serving stage %d fixes it; said again when one takes them)",
            self.stage,
            key,
            deadline_s,
            self.stage,
        )

    def looked(self, key: MicrobatchKey, *, listed: bool, started: float) -> None:
        """A send (begun at monotonic time `started`) looked the stage up: `listed` whether the
        lookup named any replica."""
        waited_s = time.monotonic() - started
        if listed or waited_s < NOTICE_S or self.since is not None:
            return
        self.since = started
        log.warning(
            "stage %d lists no replica: microbatch %s has waited %.0f s for one, and microbatches wait "
            "until a node serves stage %d (said again when one takes them)",
            self.stage,
            key,
            waited_s,
            self.stage,
        )

    def took(self) -> None:
        """A send landed: ends an outage, saying so."""
        if self.since is None:
            return
        missed = f" ({self.missed} sends had found no replica)" if self.missed else ""
        log.info("stage %d takes microbatches again after %.0f s%s", self.stage, time.monotonic() - self.since, missed)
        self.since, self.missed = None, 0
