"""What every servicer checks of a request before it reads further: that it is for the run (and
stage) this node serves (FAILED_PRECONDITION otherwise), and that the peer it names as its sender
is the one that signed the call (INVALID_ARGUMENT otherwise; rpc/admission.py proves the
signer). Stage.Forward, Outer.Exchange and Outer.FetchState all ask these; each raises the node
error that rpc/status.py maps to the status code."""

from __future__ import annotations

from dataclasses import dataclass

from noloco_node.errors import InvalidPayload, ProtocolMismatch
from noloco_node.rpc.admission import CALLER
from noloco_node.wire.v1 import tensor_pb2


@dataclass(frozen=True)
class ServedRun:
    """The run (and stage) a servicer answers for."""

    run_id: str
    manifest_hash: str
    stage: int | None = None
    """None: the servicer leaves the stage to its handler (Stage's `target_stage`, pipeline/runtime.py)."""

    def check(self, run: tensor_pb2.RunIdentity, stage: int | None = None) -> None:
        """Raises ProtocolMismatch for a request of another run, manifest or stage."""
        if (
            run.run_id == self.run_id
            and run.manifest_hash == self.manifest_hash
            and (self.stage is None or stage == self.stage)
        ):
            return
        where = "" if self.stage is None else " stage {}"
        asked = f"run {run.run_id[:64]!r}/{run.manifest_hash[:64]!r}{where.format(stage)}"
        raise ProtocolMismatch(
            f"request for {asked}; this node serves run {self.run_id!r}/{self.manifest_hash!r}"
            f"{where.format(self.stage)}"
        )


def check_caller(named: str, what: str) -> None:
    """Raises InvalidPayload when `named`, the sender a request claims (`what` says where), is not
    the peer whose signature the call carries (an unsigned, anonymous call is not checked)."""
    caller = CALLER.get()
    if caller and named != caller:
        raise InvalidPayload(f"{what} names peer {named[-8:]!r}, but the call is signed by {caller[-8:]}")
