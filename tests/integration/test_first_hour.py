"""The first hour of a volunteer and an operator, as the docs tell it, in real processes on
127.0.0.1: the documented `join` (taken from README.md and docs/volunteer.md, not copied here)
trains with no other flag, its first stage-0 node waits for a stage-1 replica instead of dying, a
swarm outlives the restart of its only bootstrap and the loss of one of two, and Ctrl-C or SIGTERM
to a process group (as a terminal and systemd send them) ends `join` and `bootstrap` within their
drain time, with no traceback.

Each process runs in a process group of its own (ProcessGroup: signalled as a terminal would, and
always drained at teardown, grandchildren such as p2pd included)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from noloco_node.transport.identity import NodeIdentity

from .volunteer_procs import (
    STARTUP_S,
    DRAIN_S,
    as_run,
    assert_clean,
    cli,
    documented,
    free_port,
    ready,
    start_bootstrap,
    start_join,
    status_lists_every_replica,
    tiny_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]


def test_the_documented_join_trains_a_first_stage_0_waits_and_group_signals_stop_cleanly(tmp_path, procs):
    config = tiny_config(tmp_path)
    maddr = start_bootstrap(procs, tmp_path, "bootstrap", free_port())
    # The preflight the docs put first passes against a fresh swarm.
    doctor = subprocess.run(
        as_run(documented("doctor"), [maddr], "--config", str(config)), capture_output=True, text=True, timeout=120
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr[-2000:]
    # With no node up yet, the bootstrap itself dials our address (it answers probes over libp2p).
    assert "[ok  ] reach" in doctor.stdout and "[ok  ] clock" in doctor.stdout, doctor.stdout
    doc = documented("join")
    first, first_ready = start_join(procs, tmp_path, "first", as_run(doc, [maddr], "--config", str(config)))
    # Alone in the swarm, `auto` gives it stage 0; it waits for a stage-1 replica, saying so, well
    # past timeouts.startup_s (the old behaviour: TimeoutError and exit 1 after it).
    wait_for(
        lambda: ready(first_ready).get("waiting_for") == "a stage-1 replica",
        60,
        "the first node never said it waits for a stage-1 replica",
        first,
    )
    assert ready(first_ready)["stage"] == 0
    time.sleep(STARTUP_S + 3)
    assert first.alive() and ready(first_ready)["inner_step"] == 0

    second, second_ready = start_join(procs, tmp_path, "second", as_run(doc, [maddr], "--config", str(config)))
    wait_for(lambda: ready(second_ready).get("stage") == 1, 60, "the second node did not take stage 1", first, second)
    wait_for(
        lambda: ready(first_ready).get("inner_step", 0) >= 3 and ready(second_ready).get("served", 0) >= 6,
        90,
        "the documented join did not train (stage-0 steps and stage-1 microbatches)",
        first,
        second,
    )
    assert ready(first_ready)["waiting_for"] is None
    # Said in its log too, not only on a terminal's progress line (systemd, Docker, a log file).
    assert "waiting for a stage-1 replica: nothing trains until one joins the swarm" in first.text(), first.text()
    assert "no longer waiting for a stage-1 replica" in first.text(), first.text()[-3000:]
    # The container healthcheck's command asks the node's own gRPC health service.
    health = subprocess.run(
        cli("health", "--address", ready(first_ready)["address"]), capture_output=True, text=True, timeout=60
    )
    assert health.returncode == 0 and health.stdout.startswith("serving"), health.stdout + health.stderr

    # Ctrl-C in the terminal of each (SIGINT to its process group), SIGTERM as systemd sends it.
    bound = DRAIN_S + 5 + 5  # drain + the 5 s, + a loaded CI machine's process exit
    first_s = first.stop_like_a_terminal(signal.SIGINT, bound)
    second_s = second.stop_like_a_terminal(signal.SIGTERM, bound)
    boot_s = procs[0].stop_like_a_terminal(signal.SIGINT, 10)
    print(f"stopped in: join SIGINT {first_s:.1f} s, join SIGTERM {second_s:.1f} s, bootstrap SIGINT {boot_s:.1f} s")
    assert first.proc.returncode == 0 and second.proc.returncode == 0 and procs[0].proc.returncode == 0
    for p in (first, second, procs[0]):
        assert_clean(p)
    assert "summary: stage 0" in first.text()
    gone = subprocess.run(
        cli("health", "--address", ready(first_ready)["address"]), capture_output=True, text=True, timeout=60
    )
    assert gone.returncode == 1 and gone.stderr.startswith("not serving"), gone.stdout + gone.stderr


def test_a_restarted_bootstrap_rejoins_the_swarm_it_lost(tmp_path, procs):
    config = tiny_config(tmp_path)
    port = free_port()
    maddr = start_bootstrap(procs, tmp_path, "bootstrap", port)
    s1, s1_ready = start_join(
        procs, tmp_path, "s1", cli("join", "--config", str(config), "--initial-peers", maddr, "--stage", "1")
    )
    s0, s0_ready = start_join(
        procs, tmp_path, "s0", cli("join", "--config", str(config), "--initial-peers", maddr, "--stage", "0")
    )
    wait_for(lambda: ready(s0_ready).get("inner_step", 0) >= 3, 90, "the swarm did not train", s0, s1)

    procs[0].group.signal(signal.SIGKILL)  # the only bootstrap dies
    procs[0].proc.wait(timeout=10)
    step = ready(s0_ready)["inner_step"]
    wait_for(lambda: ready(s0_ready)["inner_step"] >= step + 3, 60, "training stopped with the bootstrap", s0, s1)

    again = start_bootstrap(procs, tmp_path, "bootstrap", port)  # same identity, same port
    assert again == maddr
    new, new_ready = start_join(
        procs, tmp_path, "s1-new", cli("join", "--config", str(config), "--initial-peers", maddr, "--stage", "1")
    )
    wait_for(
        lambda: ready(new_ready).get("served", 0) >= 2,
        60,
        "a replica that joined through the restarted bootstrap received no microbatch",
        s0,
        s1,
        new,
    )
    status_lists_every_replica(config, maddr, [s0_ready, s1_ready, new_ready])


def test_a_swarm_with_two_bootstraps_outlives_one(tmp_path, procs):
    """A cold start of two bootstraps given one shared list of both (operator.md): the first up
    finds the other down and starts alone, and neither refuses its own address in the list."""
    config = tiny_config(tmp_path)
    ports = {name: free_port() for name in ("bootstrap-a", "bootstrap-b")}
    listed = [
        f"/ip4/127.0.0.1/tcp/{port}/p2p/{NodeIdentity.load_or_create(str(tmp_path / f'{name}.key')).peer_id}"
        for name, port in ports.items()
    ]
    a = start_bootstrap(procs, tmp_path, "bootstrap-a", ports["bootstrap-a"], "--initial-peers", *listed)
    assert "starting alone" in (tmp_path / "bootstrap-a.log").read_text()
    b = start_bootstrap(procs, tmp_path, "bootstrap-b", ports["bootstrap-b"], "--initial-peers", *listed)
    assert [a, b] == listed
    both = ["--initial-peers", a, b]
    # Each node knows one bootstrap only: they meet because the bootstraps linked.
    s1, s1_ready = start_join(
        procs, tmp_path, "s1", cli("join", "--config", str(config), "--initial-peers", a, "--stage", "1")
    )
    s0, s0_ready = start_join(
        procs, tmp_path, "s0", cli("join", "--config", str(config), "--initial-peers", b, "--stage", "0")
    )
    wait_for(lambda: ready(s0_ready).get("inner_step", 0) >= 2, 90, "the swarm did not train", s0, s1)

    procs[0].stop_like_a_terminal(signal.SIGTERM, 10)  # bootstrap a, for good
    assert_clean(procs[0])
    new, new_ready = start_join(procs, tmp_path, "s1-new", cli("join", "--config", str(config), *both, "--stage", "1"))
    wait_for(
        lambda: ready(new_ready).get("served", 0) >= 2,
        60,
        "a joiner given both bootstraps, one of them gone, received no microbatch",
        s0,
        s1,
        new,
    )
    status_lists_every_replica(config, b, [s0_ready, s1_ready, new_ready])


def test_a_joiner_that_auto_takes_stage_0_of_a_running_swarm_trains_at_once(tmp_path, procs):
    """Seen by an operator: the stage-1 replica dialled a new stage-0 replica by its joining claim
    (no address, no certificate), every backward of its first microbatches failed, and it waited
    out the 60 s microbatch timeout before its first step (then lagged its stage for good)."""
    config = tiny_config(tmp_path)
    maddr = start_bootstrap(procs, tmp_path, "bootstrap", free_port())
    join = ["join", "--config", str(config), "--initial-peers", maddr]
    s1a, s1a_ready = start_join(procs, tmp_path, "s1a", cli(*join, "--stage", "1"))
    s1b, s1b_ready = start_join(procs, tmp_path, "s1b", cli(*join, "--stage", "1"))
    s0, s0_ready = start_join(procs, tmp_path, "s0", cli(*join, "--stage", "0"))
    wait_for(lambda: ready(s0_ready).get("inner_step", 0) >= 3, 90, "the swarm did not train", s0, s1a, s1b)
    new, new_ready = start_join(procs, tmp_path, "s0-new", cli(*join, "--stage", "auto"))  # stage 0 is the weakest
    wait_for(lambda: ready(new_ready).get("status") in ("serving", "matching"), 90, "the joiner never served", new)
    assert ready(new_ready)["stage"] == 0
    started = ready(new_ready)["inner_step"]
    # Well inside the 60 s a microbatch whose gradient never came back waits before its re-issue.
    wait_for(
        lambda: ready(new_ready)["inner_step"] >= started + 2,
        40,
        "the new stage-0 replica's first microbatches got no gradients back",
        new,
        s1a,
        s1b,
    )
    for log in ("s1a.log", "s1b.log"):
        assert "publishes no usable certificate" not in (tmp_path / log).read_text()
