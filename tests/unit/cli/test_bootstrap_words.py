"""What a bootstrap host and a joiner read: the printed join command, and why a join failed."""

import asyncio

from noloco_node.cli.bootstrap import join_lines, typed_program
from noloco_node.dht.daemon import bootstrap_failure

MADDR = "/ip4/127.0.0.1/tcp/31340/p2p/QmTW5SvQ3c9iqsNAatdwQRrZ9g8L18B9DzsP3oFYQKu9hN"


def test_a_keyed_bootstraps_join_command_carries_the_key():
    assert join_lines([MADDR], None) == [f"  noloco-node join --initial-peers {MADDR} --stage auto"]
    assert join_lines([MADDR], "my keys/swarm.key") == [
        f"  noloco-node join --initial-peers {MADDR} --swarm-key 'my keys/swarm.key' --stage auto"
    ]


def test_a_bootstrap_given_a_config_prints_it_in_the_join_command():
    """Without it a newcomer joined run 'local' beside the swarm's run and waited alone for ever."""
    assert join_lines([MADDR], None, "run.toml", ["run.run_id=my run"]) == [
        f"  noloco-node join --config run.toml --set 'run.run_id=my run' --initial-peers {MADDR} --stage auto"
    ]


def test_the_join_line_runs_the_program_as_the_host_typed_it():
    """After scripts/setup.sh there is no `noloco-node` on PATH: the docs' `.venv/bin/noloco-node`
    is what a newcomer copies; an absolute path is only this machine's."""
    assert typed_program(".venv/bin/noloco-node") == ".venv/bin/noloco-node"
    assert typed_program("/home/host/noloco/.venv/bin/noloco-node") == "noloco-node"
    assert typed_program("/x/noloco_node/__main__.py") == "noloco-node"
    line = join_lines([MADDR], None, program=".venv/bin/noloco-node")[0]
    assert line.startswith("  .venv/bin/noloco-node join --initial-peers ") and line.endswith(" --stage auto")


def test_doctor_fails_when_the_swarms_peers_serve_another_run():
    from noloco_node.cli.doctor import _run_check
    from noloco_node.rpc.diagnostics import other_run

    errors = ["QmAbc: FAILED_PRECONDITION this node serves run 'newcomer'", "QmDef: timed out"]
    assert other_run(errors) == "newcomer" and other_run(["QmDef: timed out"]) is None
    check = _run_check("local", "newcomer")
    assert check.outcome == "fail" and "--config" in check.fix and "run.run_id=newcomer" in check.fix


def test_a_failed_join_is_said_in_the_users_words_not_hiveminds():
    dial = RuntimeError("Daemon failed to start: 2026/11/29 02:49:50 failed to connect to bootstrap peers")
    ping = RuntimeError(
        "DHTNode bootstrap failed: none of the initial_peers responded to a ping. "
        "(set ensure_bootstrap_success=False to ignore)"
    )
    assert "could be connected to" in bootstrap_failure(dial, 30) and "Daemon" not in bootstrap_failure(dial, 30)
    assert "none of them answered" in bootstrap_failure(ping, 30)
    assert "ensure_bootstrap_success" not in bootstrap_failure(ping, 30)
    assert bootstrap_failure(asyncio.TimeoutError(), 30) == "no answer within timeouts.startup_s (30 s)"
    assert bootstrap_failure(OSError("No such file"), 30) == "No such file"


def test_the_join_line_carries_the_runs_settings_not_this_machines():
    overrides = ["network.metrics_port=47003", "run.run_id=r", "checkpoint.dir=/srv/b", "pipeline.num_stages=3"]
    line = join_lines([MADDR], None, None, overrides + ["security.identity_file=b.key", "pipeline.stage=1"])[0]
    assert "--set run.run_id=r --set pipeline.num_stages=3 --initial-peers" in line
    assert "metrics_port" not in line and "checkpoint" not in line and "identity" not in line
    assert "pipeline.stage" not in line


def test_the_join_lines_for_other_machines_come_first_and_the_loopback_one_says_so():
    """A NAT audit's volunteer copied the first printed line, 127.0.0.1, and waited a minute for an error."""
    public = MADDR.replace("127.0.0.1", "198.18.0.1")
    lines = join_lines([MADDR, public], None)
    assert lines[0] == f"  noloco-node join --initial-peers {public} --stage auto"
    assert lines[1] == f"  noloco-node join --initial-peers {MADDR} --stage auto   # on this machine only"
