"""Fault specs and when the injector fires them."""

import asyncio
import time

import pytest

from noloco_node.config import ConfigError, load_config
from noloco_node.runtime.faults import Fault, FaultInjector, FaultSpecError, InjectedFault, parse_fault


def test_parse_every_form():
    assert parse_fault("mid_backward:crash@3") == Fault("mid_backward", "crash", 0.0, 3, None)
    assert parse_fault("during_exchange:delay=0.5") == Fault("during_exchange", "delay", 0.5)
    assert parse_fault("before_forward:error%0.25") == Fault("before_forward", "error", 0.0, None, 0.25)
    assert parse_fault("during_state_transfer:stall=2@1") == Fault("during_state_transfer", "stall", 2.0, 1, None)


@pytest.mark.parametrize(
    "spec, why",
    [
        ("nowhere:crash", "unknown point"),
        ("mid_backward:explode", "unknown action"),
        ("mid_backward:stall", "needs =SECONDS"),
        ("mid_backward:crash@0", "counts from 1"),
        ("mid_backward:crash%2", "probability"),
        ("mid_backward", "not POINT:ACTION"),
    ],
)
def test_bad_specs_say_why(spec, why):
    with pytest.raises(FaultSpecError, match=why):
        parse_fault(spec)


def test_config_names_the_field():
    with pytest.raises(ConfigError, match="faults.inject"):
        load_config(overrides={"faults": {"inject": ["mid_backward:explode"]}})
    assert load_config(overrides={"faults": {"inject": ["mid_backward:crash@3"]}}).faults.inject == (
        "mid_backward:crash@3",
    )


def test_nth_fires_once_and_only_there():
    faults = FaultInjector(["before_forward:error@2"])

    async def hits():
        outcomes = []
        for _ in range(4):
            try:
                await faults.hit("before_forward")
                outcomes.append("ok")
            except InjectedFault:
                outcomes.append("error")
        await faults.hit("mid_backward")  # no fault there
        return outcomes

    assert asyncio.run(hits()) == ["ok", "error", "ok", "ok"]
    assert faults.fired == [("before_forward", "error")]


def test_probability_is_seeded_and_roughly_p():
    faults = FaultInjector(["mid_backward:delay=0%0.3"], seed=1)
    for _ in range(1000):
        faults.hit_sync("mid_backward")
    assert 230 < len(faults.fired) < 370


def test_sync_stall_sleeps():
    faults = FaultInjector(["mid_backward:stall=0.05"])
    start = time.monotonic()
    faults.hit_sync("mid_backward")
    assert time.monotonic() - start >= 0.05


def test_crash_exits_the_process_with_its_code():
    import subprocess
    import sys

    code = (
        "from noloco_node.runtime.faults import FaultInjector\n"
        "f = FaultInjector(['mid_backward:crash@2'])\nf.hit_sync('mid_backward')\nf.hit_sync('mid_backward')\n"
        "raise SystemExit(0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 17


def test_poison_only_at_send_snapshot():
    import math

    assert math.isnan(FaultInjector(["send_snapshot:poison"]).poison())
    assert FaultInjector(["send_snapshot:poison=1000000"]).poison() == 1e6
    assert FaultInjector([]).poison() is None
    for bad in ("mid_backward:poison", "send_snapshot:crash"):
        with pytest.raises(FaultSpecError, match="poison is the only action"):
            parse_fault(bad)
