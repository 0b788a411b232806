"""What a node says it is doing: the `status` of its DHT record (dht/records.py). No torch.

A str Enum: a member equals its plain string, so records carry "serving" on the wire, records
read from the wire compare equal to the members, and JSON writes the string.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    JOINING = "joining"
    """Claiming a stage or building it (pipeline/stage_choice.py): not routed to yet."""
    SERVING = "serving"
    """Serving its stage."""
    MATCHING = "matching"
    """Serving, and looking for a partner for outer round `outer_round` (sync/noloco.py)."""
    LEAVING = "leaving"
    """Withdrawn: draining before it stops, or on its way to another stage; no longer routed to."""
