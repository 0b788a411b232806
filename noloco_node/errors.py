"""Errors a node reports: each carries a short code, a message and a hint that says what to do.

`rpc/status.py` is the only place that maps these to and from gRPC status codes.
"""

from __future__ import annotations


class NodeError(Exception):
    code = "node-error"
    hint = ""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    def explain(self) -> str:
        return f"{self}" + (f"\n  fix: {self.hint}" if self.hint else "")


class PeerBusy(NodeError):
    code = "peer-busy"
    hint = "the peer's in-flight window is full; try another replica"


class PeerUnavailable(NodeError):
    code = "peer-unavailable"
    hint = "the peer did not answer; it is banned for a while and another replica is tried"


class PeerUnknown(PeerUnavailable):
    code = "peer-unknown"
    hint = (
        "no live record of the peer was found in the DHT; a peer that has just joined can take a few seconds to appear"
    )


class TooLarge(NodeError):
    code = "too-large"
    hint = "the message exceeds this node's size limit"


class InvalidPayload(NodeError):
    code = "invalid-payload"


class PoisonedPayload(InvalidPayload):
    """Values that would corrupt the stage (non-finite, or far outside its running range): the
    sender is banned at once (`security.ban_after_poisoned`), not after `ban_after_invalid` strikes."""

    code = "poisoned-payload"
    hint = "the sender's values are non-finite or far outside this stage's recent range; check its model and codec"


class ProtocolMismatch(NodeError):
    code = "protocol-mismatch"
    hint = "every peer of a run needs the same run_id, config manifest and software version"


class UnknownMicrobatch(NodeError):
    code = "unknown-microbatch"


class NothingToTopUp(NodeError):
    """A state top-up (Outer.FetchState, STATE_ENCODING_TOP_UP) for a parameter the donor holds
    no record of having sent the caller whole (never sent, cut, or dropped from its ledger)."""

    code = "nothing-to-top-up"
    hint = "copy those parameters first (STATE_ENCODING_COMPACT or _DENSE); the copy stays as it was"


class BootstrapError(NodeError):
    code = "bootstrap-failed"
    hint = (
        "check that the bootstrap peer is running and that --initial-peers is the exact multiaddr it printed "
        "(/ip4/HOST/tcp/PORT/p2p/PEER_ID), and that the port is open"
    )


class UnreachableAddress(NodeError):
    code = "unreachable"
    hint = (
        "peers cannot dial the address this node announces. Behind NAT or a firewall: forward the gRPC port "
        "(network.port, fix it with --port) to this machine and pass the public host:port with --announce-addr; "
        "`noloco-node doctor` checks it before you join"
    )


class DataError(ValueError):
    """The run's data or tokenizer cannot be used: the message begins with the config field to fix
    (`data.path`, `data.tokenizer`, `data.holdout_fraction`, or `data` for the corpus as a whole).
    A bad input, like a bad config value: the command line reports it in one line and exits 2."""


class IdentityError(ValueError):
    """An identity file that cannot be used; the message says which and what to do (the command
    line prints it as one line, as a bad config value)."""
