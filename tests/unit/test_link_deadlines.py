"""Deadlines that follow the link: the per-peer estimator (runtime/link_estimates.py), the deadline
formula (floor, ceiling, scaling with bytes, the default before any measurement), the [timeouts]
fields that set it, and the stream deadlines built on it (rpc/deadlines.py), with the outer
exchange run over in-memory queues: a slow partner finishes, a stalled one is cut at the
progress deadline."""

import asyncio
import time

import pytest
import torch

from noloco_node.config import ConfigError, load_config
from noloco_node.config.sections import TimeoutsConfig
from noloco_node.errors import PeerUnavailable
from noloco_node.rpc.deadlines import ExchangeLimits, Progress, TransferTimedOut, paced, while_sending, within
from noloco_node.rpc.outer_service import exchange_snapshots
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.link_estimates import RECEIVED, SENT, DeadlinePolicy, LinkDeadlines, LinkEstimates
from noloco_node.sync.ports import EncodedSnapshot, ExpectedTensor
from noloco_node.codec.tensors import encode

MB = 1_000_000


# ---- the estimator ----------------------------------------------------------------------------
def test_large_transfers_measure_bandwidth_and_small_ones_the_round_trip():
    links = LinkEstimates(alpha=1.0, min_sample_bytes=100_000)
    assert links.bytes_per_s("p") is None and links.rtt_s("p") is None
    links.observe("p", 1_000, 0.05, SENT)  # small: a round trip
    assert links.rtt_s("p") == pytest.approx(0.05) and links.bytes_per_s("p") is None
    links.observe("p", 10 * MB, 2.05, SENT)  # 2 s of payload after one round trip
    assert links.bytes_per_s("p", SENT) == pytest.approx(5 * MB)


def test_the_rtt_never_takes_more_than_half_a_sample():
    links = LinkEstimates(alpha=1.0, min_sample_bytes=100)
    links.observe_rtt("p", 5.0)  # a noisy round trip longer than the transfer itself
    links.observe("p", 1 * MB, 1.0, RECEIVED)
    assert links.bytes_per_s("p") == pytest.approx(2 * MB)


def test_moving_average_and_directions():
    links = LinkEstimates(alpha=0.5, min_sample_bytes=1)
    links.observe("p", 10 * MB, 1.0, SENT)
    links.observe("p", 10 * MB, 0.5, SENT)
    assert links.bytes_per_s("p", SENT) == pytest.approx(15 * MB)  # 0.5 x 20 + 0.5 x 10
    assert links.bytes_per_s("p", RECEIVED) == pytest.approx(15 * MB)  # only the other way is known
    links.observe("p", 1 * MB, 1.0, RECEIVED)  # an asymmetric link: slow towards us
    assert links.bytes_per_s("p", RECEIVED) == pytest.approx(1 * MB)
    assert links.bytes_per_s("p") == pytest.approx(1 * MB)  # both ways: the slower one
    with pytest.raises(ValueError, match="direction"):
        links.observe("p", 1, 1.0, "sideways")


def test_median_announced_and_stale_peers_forgotten():
    links = LinkEstimates(alpha=1.0, min_sample_bytes=1, max_peers=3)
    assert links.link_mbit_s() == 0.0
    for peer, rate in (("a", 1 * MB), ("b", 2 * MB), ("c", 8 * MB)):
        links.observe(peer, rate, 1.0, SENT)
    assert links.link_mbit_s() == pytest.approx(16.0)  # median 2 MB/s
    links.observe("d", 4 * MB, 1.0, SENT)  # a fourth peer: "a", heard from longest ago, goes
    assert set(links.summary()) == {"b", "c", "d"}
    assert links.summary()["d"] == {"sent_mbit_s": 32.0, "received_mbit_s": 0.0, "rtt_ms": 0.0, "samples": 1}


# ---- the deadline formula ---------------------------------------------------------------------
def test_deadline_scales_with_bytes_between_floor_and_ceiling():
    policy = DeadlinePolicy(assumed_bytes_per_s=1 * MB, slack=3.0, ceiling_s=600.0, stall_s=10.0)
    assert policy.total_s(1_000, floor_s=30.0, bytes_per_s=10 * MB) == 30.0  # small payload: the floor
    assert policy.total_s(200 * MB, floor_s=30.0, bytes_per_s=10 * MB) == pytest.approx(60.0)
    assert policy.total_s(400 * MB, floor_s=30.0, bytes_per_s=10 * MB) == pytest.approx(120.0)  # twice the bytes
    assert policy.total_s(400 * MB, floor_s=30.0, bytes_per_s=10 * MB, rtt_s=0.5) == pytest.approx(121.0)
    assert policy.total_s(10_000 * MB, floor_s=30.0, bytes_per_s=10 * MB) == 600.0  # the ceiling
    assert policy.total_s(10 * MB, floor_s=900.0, bytes_per_s=10 * MB) == 900.0  # a floor above it stays
    # before any measurement: the assumed rate
    assert policy.total_s(100 * MB, floor_s=5.0) == pytest.approx(300.0)


def test_a_2gb_exchange_over_100_mbit_gets_its_time_and_a_stall_is_still_cut_fast():
    timeouts = TimeoutsConfig()
    policy = DeadlinePolicy.from_timeouts(timeouts)
    deadlines = LinkDeadlines(LinkEstimates(alpha=1.0), policy, floor_s=timeouts.match_s)
    deadlines.estimates.observe("p", 125 * MB, 10.0, RECEIVED)  # 100 Mbit/s, measured
    both_ways = 2 * 2_000 * MB
    assert deadlines.total_s("p", both_ways) >= both_ways / (12.5 * MB)  # 320 s: never cut on time
    assert deadlines.total_s("p", both_ways) <= timeouts.deadline_ceiling_s
    assert deadlines.stall_s("p") == timeouts.stall_s  # a 1 MiB chunk takes 0.08 s: the stall rule stays 10 s


def test_unmeasured_peer_gets_the_slower_of_assumed_and_our_median():
    policy = DeadlinePolicy(assumed_bytes_per_s=1 * MB, slack=2.0, ceiling_s=10_000.0, stall_s=5.0)
    deadlines = LinkDeadlines(LinkEstimates(alpha=1.0, min_sample_bytes=1), policy, floor_s=1.0)
    assert deadlines.rate("new") == 1 * MB
    deadlines.estimates.observe("fast", 100 * MB, 1.0, SENT)
    assert deadlines.rate("new") == 1 * MB  # our other links are fast: still the assumed rate
    deadlines.estimates.observe("slow", 1_000_000, 4.0, SENT)
    deadlines.estimates.observe("slower", 1_000_000, 5.0, SENT)
    assert deadlines.rate("new") == pytest.approx(250_000)  # median of 100 MB/s, 250 kB/s, 200 kB/s
    assert deadlines.total_s("new", 1 * MB) == pytest.approx(8.0)
    # the progress deadline stretches to one whole chunk's time on a very slow link
    assert deadlines.stall_s("slower") == pytest.approx(2.0 * (1 << 20) / 200_000)
    assert deadlines.floored(50.0).total_s("new", 1 * MB) == 50.0


def test_timeouts_fields_are_validated_with_the_field_and_the_fix():
    config = load_config(overrides=["timeouts.assumed_mbit_s=2", "timeouts.stall_s=4"])
    policy = DeadlinePolicy.from_timeouts(config.timeouts)
    assert policy.assumed_bytes_per_s == 250_000 and policy.stall_s == 4.0 and policy.slack == 3.0
    for override, field, fix in (
        ("timeouts.assumed_mbit_s=0", "timeouts.assumed_mbit_s", "uplink"),
        ("timeouts.deadline_slack=0.5", "timeouts.deadline_slack", "e.g. 3"),
        ("timeouts.deadline_ceiling_s=20", "timeouts.deadline_ceiling_s", "at least rpc_s"),
        ("timeouts.stall_s=0", "timeouts.stall_s", "positive"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[override])
        assert info.value.field == field and fix in str(info.value), (override, str(info.value))


# ---- stream deadlines ----------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_deadline_counts_reads_only_while_payload_is_due():
    clock = Clock()
    progress = Progress(5.0, clock)
    progress.set_total(60.0)
    clock.now += 4.0
    progress.stamp_wrote()  # our writes go on...
    clock.now += 2.0
    with pytest.raises(TransferTimedOut, match="no message for 6.0 s"):
        progress.check(reads_only=True)  # ...but the partner sent nothing for 6 s
    assert progress.check(reads_only=False) == pytest.approx(3.0)  # either way: our write 2 s ago
    progress.stamp_read()
    clock.now = progress.started + 60.0
    progress.stamp_read()
    with pytest.raises(TransferTimedOut, match="derived deadline"):
        progress.check(reads_only=True)


def test_within_raises_transfer_timed_out_which_is_a_peer_failure():
    async def main():
        with pytest.raises(TransferTimedOut) as info:
            await within(asyncio.sleep(5), 0.05, "waiting")
        assert isinstance(info.value, PeerUnavailable)
        assert await within(asyncio.sleep(0, result=7), 1.0, "waiting") == 7

    asyncio.run(main())


class SlowCall:
    """A client-streaming call whose transport takes `per_message_s` per message (or hangs)."""

    def __init__(self, messages, per_message_s: float, hang_after: int | None = None) -> None:
        self.messages, self.per_message_s, self.hang_after = messages, per_message_s, hang_after
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __await__(self):
        return self._run().__await__()

    async def _run(self):
        sent = 0
        async for _ in self.messages:
            if self.hang_after is not None and sent >= self.hang_after:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.per_message_s)
            sent += 1
        return sent


def test_a_slow_sender_finishes_and_a_stuck_one_is_cut_at_the_progress_deadline():
    async def main():
        progress = Progress(0.3)
        call = SlowCall(paced(range(10), progress), per_message_s=0.1)  # 1 s in all, > 3x the stall limit
        assert await while_sending(call, progress, call.cancel) == 10 and not call.cancelled
        progress = Progress(0.3)
        call = SlowCall(paced(range(10), progress), per_message_s=0.05, hang_after=3)
        start = time.monotonic()
        with pytest.raises(TransferTimedOut):
            await while_sending(call, progress, call.cancel)
        assert call.cancelled and 0.3 <= time.monotonic() - start < 1.5

    asyncio.run(main())


class SentThenSilent:
    """A call whose messages all go out (a stopped peer's kernel takes them) and whose reply comes
    after `reply_after_s` (never, by default)."""

    def __init__(self, messages, reply_after_s: float = 3600.0) -> None:
        self.messages, self.reply_after_s, self.cancelled = messages, reply_after_s, False

    def cancel(self) -> None:
        self.cancelled = True

    def __await__(self):
        return self._run().__await__()

    async def _run(self):
        async for _ in self.messages:
            pass
        await asyncio.sleep(self.reply_after_s)
        return "ack"


def test_a_peer_that_takes_every_message_and_never_answers_is_cut_at_the_reply_deadline():
    # A soak's SIGSTOPped replica held each Forward for its whole total deadline (30 s) and the
    # pipeline with it; the live replica beside it was never tried.
    async def main():
        progress = Progress(0.2)
        call = SentThenSilent(paced(range(3), progress))
        start = time.monotonic()
        with pytest.raises(TransferTimedOut, match="no reply"):
            await while_sending(call, progress, call.cancel, reply_s=0.5)
        assert call.cancelled and 0.5 <= time.monotonic() - start < 2.0
        progress = Progress(0.2)
        call = SentThenSilent(paced(range(3), progress), reply_after_s=0.1)
        assert await while_sending(call, progress, call.cancel, reply_s=1.0) == "ack" and not call.cancelled

    asyncio.run(main())


# ---- the outer exchange over in-memory streams ----------------------------------------------
def _snapshot(seed: int, numel: int) -> tuple[EncodedSnapshot, list[ExpectedTensor]]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    spec, payload = encode(x, "none")
    return EncodedSnapshot([("w", spec, payload)]), [ExpectedTensor("w", tuple(x.shape), "float32")]


class Pipe:
    """One direction of a stream: messages arrive `delay_s` apart at the reader."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.delay_s = delay_s

    async def write(self, message) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await self.queue.put(message)

    async def read(self):
        return await self.queue.get()


async def _pair(limits: ExchangeLimits, *, delay_s: float, faults_b: FaultInjector | None = None):
    a_to_b, b_to_a = Pipe(delay_s), Pipe(delay_s)
    (mine_a, expected), (mine_b, _) = _snapshot(1, 300_000), _snapshot(2, 300_000)  # 1.2 MB: 2 chunks each
    side_a = exchange_snapshots(b_to_a.read, a_to_b.write, mine_a, expected, "none", 1 << 24, limits=limits)
    side_b = exchange_snapshots(
        a_to_b.read, b_to_a.write, mine_b, expected, "none", 1 << 24, faults=faults_b, limits=limits
    )
    return await asyncio.gather(side_a, side_b, return_exceptions=True)


def test_exchange_slower_than_a_fixed_deadline_completes_under_a_derived_one():
    samples = []
    limits = ExchangeLimits(
        total_s=lambda size: 3.0 * size / 2e6,
        stall_s=0.5,
        observe=lambda size, seconds: samples.append((size, seconds)),
    )

    async def main():
        start = time.monotonic()
        got_a, got_b = await _pair(limits, delay_s=0.2)  # 4 messages each way, 0.2 s apart
        return got_a, got_b, time.monotonic() - start

    got_a, got_b, seconds = asyncio.run(main())
    assert isinstance(got_a, dict) and isinstance(got_b, dict), (got_a, got_b)
    torch.testing.assert_close(got_a["w"], torch.randn(300_000, generator=torch.Generator().manual_seed(2)))
    assert seconds > 0.5  # longer than the progress deadline as a whole: only progress counts
    assert [size for size, _ in samples] == [1_200_000, 1_200_000] and all(s > 0.3 for _, s in samples)


def test_partner_that_stops_sending_is_cut_at_the_progress_deadline():
    limits = ExchangeLimits(total_s=lambda size: 60.0, stall_s=0.5)

    async def main():
        start = time.monotonic()
        # b stops at its 3rd write (its first chunk) for far longer than the total deadline's rest
        got_a, got_b = await asyncio.wait_for(
            _pair(limits, delay_s=0.0, faults_b=FaultInjector(["exchange_write:stall=30@3"])), 10
        )
        return got_a, got_b, time.monotonic() - start

    got_a, got_b, seconds = asyncio.run(main())
    assert isinstance(got_a, TransferTimedOut) and "progress deadline 0.5" in str(got_a)
    assert 0.5 <= seconds < 2.0  # cut at its 0.5 s progress deadline, not the 60 s total


# ---- what the swarm sees ------------------------------------------------------------------------
def test_records_carry_the_measured_link_and_old_records_still_validate():
    from noloco_node.cli.status import _mbit
    from noloco_node.dht.records import StageRecord
    from noloco_node.runtime.throughput import ThroughputMeter

    old = dict(
        peer_id="p",
        address="127.0.0.1:1",
        stage=0,
        inner_step=0,
        outer_round=0,
        status="serving",
        tokens_per_s=0.0,
        version="0",
        manifest_hash="m",
        run_id="r",
        updated_at=1.0,
    )
    assert StageRecord.parse_obj(old).link_mbit_s == 0.0  # a record from before the field
    meter = ThroughputMeter()
    meter.links.observe("q", 10 * MB, 2.0, SENT)
    record = StageRecord.parse_obj({**old, **meter.record_fields()})
    assert record.link_mbit_s == pytest.approx(40.0)
    with pytest.raises(ValueError):
        StageRecord.parse_obj({**old, "link_mbit_s": -1.0})
    assert _mbit(0.0) == "-" and _mbit(record.link_mbit_s) == "40"


def test_a_state_donor_takes_no_bandwidth_sample_from_its_own_buffered_writes():
    """A donor's writes return once buffered, not once delivered: 1.2 MB 'sent' in no time must not
    become a rate for the requester, or every later exchange with it gets only the floor (seen
    at 0.6 Mbit/s: the donor measured ~4000 Mbit/s and cut each exchange at match_s)."""
    from noloco_node.rpc.checks import ServedRun
    from noloco_node.rpc.outer_service import OuterServicer
    from noloco_node.wire.v1 import outer_pb2

    class Donor:
        async def export_state(self):
            return {"phi": torch.zeros(300_000)}, '{"inner_step": 0, "outer_round": 0}'

    class BufferedContext:  # every write returns at once, as into a socket buffer
        def __init__(self) -> None:
            self.written = 0

        async def write(self, message) -> None:
            self.written += 1

        def time_remaining(self) -> float | None:
            return None  # the caller set no deadline

        async def abort(self, code, details):
            raise AssertionError(f"aborted: {code} {details}")

    policy = DeadlinePolicy(assumed_bytes_per_s=0.6e6 / 8)
    deadlines = LinkDeadlines(LinkEstimates(), policy, floor_s=5.0)
    servicer = OuterServicer(
        None,
        peer_id="donor",
        run=ServedRun("r", "h", 0),
        max_bytes=1 << 24,
        deadlines=deadlines,
        donor=Donor(),
    )
    context = BufferedContext()
    request = outer_pb2.FetchStateRequest(stage=0, peer_id="joiner")
    request.run.run_id, request.run.manifest_hash = "r", "h"
    asyncio.run(servicer.FetchState(request, context))
    assert context.written >= 3  # manifest, header, chunks: the state went out
    assert deadlines.estimates.bytes_per_s("joiner") is None
    # so a 1 MB exchange with the joiner still gets its time at the assumed 0.6 Mbit/s (x 3), not the floor
    assert deadlines.total_s("joiner", 1_000_000) == pytest.approx(3 * 1_000_000 / (0.6e6 / 8))


def test_small_hops_on_a_slow_link_are_measured_by_default():
    """33 KB hops over 0.6 Mbit/s take ~0.45 s: the default estimator must take them as bandwidth
    samples, or a run with small (int4) hops never learns its link and keeps the assumed 5 Mbit/s."""
    links = LinkEstimates()
    links.observe_rtt("p", 0.05)
    for _ in range(5):
        links.observe("p", 33_000, 33_000 * 8 / 0.6e6 + 0.05, "sent")
    rate = links.bytes_per_s("p", "sent")
    assert rate is not None and 0.4 < rate * 8 / 1e6 < 0.7, rate  # measured: about the link's 0.6 Mbit/s


class EndedPipe(Pipe):
    """A stream the partner ended: reads see its end, writes fail."""

    async def write(self, message) -> None:
        raise PeerUnavailable("the partner ended the exchange")

    async def read(self):
        return None


def test_both_directions_failing_raise_once_and_report_nothing_else():
    reports: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context))
        ended = EndedPipe()
        mine, expected = _snapshot(1, 1000)
        with pytest.raises(PeerUnavailable):
            await exchange_snapshots(ended.read, ended.write, mine, expected, "none", 1 << 20)
        await asyncio.sleep(0.05)
        import gc

        gc.collect()  # an exception nobody retrieved is reported when its task is collected
        await asyncio.sleep(0)

    asyncio.run(main())
    assert reports == []
