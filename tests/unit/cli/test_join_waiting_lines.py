"""`join` says in its log when it starts and stops waiting for a stage's replica, once each, also
off a terminal (a newcomer's first node, its output in a file, said nothing for three minutes)."""

import argparse
import logging

from noloco_node.cli.join import _JoinReporter
from noloco_node.config import build_config


def test_one_line_when_waiting_starts_and_one_when_it_ends(caplog):
    reporter = _JoinReporter(build_config({"log": {"progress": "off"}}), argparse.Namespace())
    with caplog.at_level(logging.INFO, logger="noloco_node.cli.join"):
        for what in (None, "a stage-0 replica", "a stage-0 replica", "a stage-0 replica", None, None):
            reporter._say_waiting(what)
    assert [r.getMessage() for r in caplog.records] == [
        "waiting for a stage-0 replica: nothing trains until one joins the swarm",
        "no longer waiting for a stage-0 replica",
    ]


def test_a_stage_0_that_trained_every_step_does_not_say_it_waits(caplog):
    """A newcomer's stage 0 joining a finished run logged "trained all 600 inner steps; serving"
    and then "waiting for a stage-1 replica: nothing trains until one joins"."""
    from types import SimpleNamespace

    reporter = _JoinReporter(build_config({"log": {"progress": "off"}}), argparse.Namespace())
    reporter.node = SimpleNamespace(done_at_step=600)
    with caplog.at_level(logging.INFO, logger="noloco_node.cli.join"):
        reporter._say_waiting("a stage-1 replica")
    assert not caplog.records
