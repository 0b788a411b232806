"""join's log lines without a terminal: the step line, the summary, when they are logged, and
what they read from a node."""

import logging
from dataclasses import replace

import pytest

from noloco_node.config import ConfigError, load_config
from noloco_node.node.reporting import Snapshot, TrainingLog, format_bytes, step_line, summary_line
from noloco_node.node.stats import training_snapshot

from .node.stats_sample import sample_stats

PAIRED = {"rounds": 5, "paired": 4, "solo": 1, "rejected": 0, "timed_out": 0}


def stage0(**kw) -> Snapshot:
    values = dict(
        stage=0,
        step=40,
        tokens=64_000,
        lr=3e-4,
        loss=5.1234,
        first_loss=8.3012,
        in_flight=3,
        outer=PAIRED,
        last_round={"round": 4, "outcome": "paired", "partner": "x"},
        bytes_sent=1_234_567,
        bytes_received=1_100_000,
        dropped=0,
        issued=800,
    )
    values.update(kw)
    return Snapshot(**values)


def test_format_bytes_picks_a_readable_unit():
    assert [format_bytes(n) for n in (0, 999, 1234, 1_234_567, 2.5e9, 5e12)] == [
        "0 B",
        "999 B",
        "1.2 kB",
        "1.2 MB",
        "2.5 GB",
        "5000.0 GB",
    ]


def test_stage0_step_line_has_every_field_in_order():
    assert step_line(stage0(), total=200, tokens_per_s=812.4) == (
        "step 40/200 | loss 5.123 | lr 3.0e-04 | 812 tok/s | in flight 3 | outer paired (round 4) | "
        "sent 1.2 MB recv 1.1 MB"
    )


def test_later_stage_shows_microbatches_served_instead_of_a_loss():
    snap = Snapshot(stage=2, step=7, tokens=10, lr=1e-3, served=28, outer=PAIRED, last_round=None)
    line = step_line(snap, total=None, tokens_per_s=3.0)
    assert line.startswith("step 7 | served 28 microbatches | lr 1.0e-03 | 3 tok/s")
    assert "loss" not in line and "outer no round yet" in line


def test_step_line_before_any_loss_and_without_an_outer_method():
    line = step_line(stage0(loss=None, lr=None, outer=None, last_round=None), total=None, tokens_per_s=0)
    assert line.startswith("step 40 | loss - | lr - | 0 tok/s") and "outer off" in line


def test_stage0_summary():
    assert summary_line(stage0(step=200), total=200, wall_s=80.0) == (
        "summary: stage 0 | 200/200 steps | 80.0 s | 800 tok/s mean | loss 8.301 -> 5.123 | outer 5 rounds: "
        "4 paired, 1 solo, 0 rejected | sent 1.2 MB (pipeline + outer) recv 1.1 MB (pipeline + outer) | dropped 0 "
        "of 800 microbatches"
    )


def test_later_stage_summary_and_a_stopped_early_stage0():
    later = summary_line(Snapshot(stage=1, step=3, tokens=30, lr=None, served=12, dropped=2), total=None, wall_s=10.0)
    assert later == (
        "summary: stage 1 | 3 steps | 10.0 s | 3 tok/s mean | served 12 microbatches | outer off | "
        "sent 0 B (pipeline) recv 0 B (pipeline) | dropped 2 microbatches"
    )
    early = summary_line(stage0(step=0, loss=None, first_loss=None, issued=0), total=12, wall_s=1.0)
    assert "0/12 steps" in early and "loss -" in early


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_training_log_logs_each_multiple_once_with_the_rate_since_the_last_line(caplog):
    clock = Clock()
    report = TrainingLog(4, total=12, clock=clock)
    caplog.set_level(logging.INFO, logger="noloco_node.training")
    assert [report.step(stage0(step=s, tokens=s * 100)) for s in (1, 2, 3)] == [None, None, None]
    clock.now += 2.0
    assert " 200 tok/s" in report.step(stage0(step=4, tokens=400))
    assert report.step(stage0(step=4, tokens=400)) is None  # the same step polled again
    clock.now += 1.0
    # A polled stage may first see a step past the multiple: one line, and the next is due at 12.
    assert "step 9/12" in report.step(stage0(step=9, tokens=900))
    assert not report.due(11) and report.due(12)
    clock.now += 7.0
    summary = report.summary(stage0(step=12, tokens=1200))
    assert summary.startswith("summary: stage 0 | 12/12 steps | 10.0 s | 120 tok/s mean |")
    assert report.summary(stage0(step=12)) is None  # once, however shutdown reaches it
    messages = [r.getMessage() for r in caplog.records if r.name == "noloco_node.training"]
    assert len(messages) == 3 and all(r.levelno == logging.INFO for r in caplog.records)


def test_the_summary_rate_counts_from_the_first_tokens_not_the_wait_before_them():
    # A researcher's audit: 10 steps after 9.5 s of waiting for the swarm read 320 tok/s "mean"
    # where the node trained at ~900.
    clock = Clock()
    report = TrainingLog(0, total=10, clock=clock)
    report.observe(0, 0)
    clock.now += 9.5
    report.observe(512, 1)  # the first step's tokens are in
    clock.now += 5.0
    report.observe(5120, 10)
    summary = report.summary(stage0(step=10, tokens=5120))
    assert summary.startswith(
        "summary: stage 0 | 10/10 steps | 14.5 s (first step after 9.5 s) | 922 tok/s mean while training |"
    )


def test_the_summary_rate_ends_at_the_last_trained_tokens_not_the_idle_serving_after_them():
    # An audit's node trained 80 steps at ~2,700 tok/s, served idle for 5 minutes and read
    # "230 tok/s mean while training".
    clock = Clock()
    report = TrainingLog(0, total=10, clock=clock)
    report.observe(512, 1)
    clock.now += 5.0
    report.observe(5120, 10)
    for _ in range(30):  # idle ticks: the tokens no longer grow
        clock.now += 10.0
        report.observe(5120, 10)
    summary = report.summary(stage0(step=10, tokens=5120))
    assert "| 922 tok/s mean while training |" in summary and "305.0 s" in summary


def test_a_resumed_node_counts_only_this_sessions_steps_and_a_move_keeps_the_whole_session():
    # A NAT audit: a resumed stage-1 node's summary read "340 steps" when it trained none, and one
    # that copied its stage's state again summed up only the 35 s after that move.
    clock = Clock()
    report = TrainingLog(0, total=None, clock=clock)
    report.observe(0, 340)
    clock.now += 30.0
    resumed = report.summary(Snapshot(stage=1, step=340, tokens=0, lr=None))
    assert resumed.startswith("summary: stage 1 | 340 steps (0 this session) | 30.0 s |"), resumed
    report = TrainingLog(0, total=600, clock=clock)
    report.observe(0, 100)
    report.observe(6400, 150)  # 50 steps trained, then the move: a copy at the stage's step 230
    clock.now += 300.0
    report.moved(total=600)
    report.observe(0, 230)
    clock.now += 35.0
    line = report.summary(stage0(step=260, tokens=1920))
    assert line.startswith("summary: stage 0 | 260/600 steps (80 this session) | 335.0 s |"), line
    assert "since its move 35 s before the end" in line


def test_every_steps_zero_logs_no_step_lines_but_the_summary():
    report = TrainingLog(0, total=None)
    assert not report.due(10**6) and report.step(stage0(step=10**6)) is None
    assert report.summary(stage0()) is not None


def test_snapshot_of_stage0_takes_loss_and_lr_from_the_driver():
    snap = training_snapshot(sample_stats(stage=0, driver=True, outer=True))
    assert (snap.loss, snap.first_loss, snap.lr, snap.step, snap.tokens) == (6.25, 7.5, 2e-3, 8, 512)
    assert snap.in_flight == 2
    assert (snap.bytes_sent, snap.bytes_received, snap.dropped, snap.issued) == (1500, 700, 1, 16)
    assert snap.outer["rounds"] == 2 and snap.outer["paired"] == 1 and snap.last_round["outcome"] == "solo"
    assert snap.round_bytes.mean == 400.0


def test_snapshot_between_the_workers_step_and_the_drivers_loss_reports_the_logged_step():
    # The worker counts step 9 on the compute thread; the driver logs step 9's loss when the loop
    # resumes it. A step line polled in between used to read "step 9" beside step 8's loss, and
    # the summary then ended on a loss no step line showed.
    stats = sample_stats(stage=0, driver=True, outer=True)
    ahead = replace(stats, work=replace(stats.work, inner_steps=9))
    snap = training_snapshot(ahead)
    assert (snap.step, snap.loss) == (8, 6.25)
    report = TrainingLog(9, total=None)
    assert report.due(ahead.work.inner_steps) and report.step(snap) is None and report.due(9)


def test_snapshot_of_a_later_stage_without_outer_method():
    snap = training_snapshot(sample_stats(stage=1, driver=False, outer=False))
    assert (snap.loss, snap.lr, snap.served, snap.dropped, snap.issued) == (None, 5e-4, 7, 2, None)
    assert snap.outer is None and snap.last_round is None


@pytest.mark.parametrize("value", ["-1", "2.5"])
def test_every_steps_must_be_a_non_negative_integer(value):
    with pytest.raises(ConfigError, match="log.every_steps"):
        load_config(overrides=[f"log.every_steps={value}"])
    assert load_config(overrides=["log.every_steps=0"]).log.every_steps == 0
