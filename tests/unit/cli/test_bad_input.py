"""Bad input a newcomer types: one line naming the fix, the documented exit code (2 for a bad flag
or config value), never a traceback. The real console script, as a subprocess."""

import os
import socket
import subprocess

import pytest

from .test_cli import SCRIPT, run_cli


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"


def cases(tmp_path, taken_port):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[run]\nrun_id = 1\n")
    return [
        (["config", "show", "--config", str(tmp_path)], "is a directory"),
        (["config", "show", "--config", str(binary)], "not UTF-8"),
        (["join", "--stage", "0", "--steps", "-5"], "argument --steps: '-5' is not a whole number >= 0"),
        (["join", "--wait-replicas", "0"], "argument --wait-replicas"),
        (["demo", "--steps", "-5"], "--steps, --replicas and --stages must be whole numbers >= 1"),
        (
            ["join", "--stagee", "1"],
            "noloco-node join: error: unrecognized arguments: --stagee 1; did you mean --stage?",
        ),
        (["join", "--initial-peer", "M"], "unrecognized arguments: --initial-peer M; did you mean --initial-peers?"),
        (
            ["demo", "--replica", "3"],
            "noloco-node demo: error: unrecognized arguments: --replica 3; did you mean --replicas?",
        ),
        (["status", "--qqq"], "unrecognized arguments: --qqq; `noloco-node status --help` lists its flags"),
        (
            ["join", "--stage", "0", "--initial-peers", PEER, "--set", "data.tokenizer=/nonexistent/tok"],
            "or leave it unset for the run's own tokenizer",
        ),
        (
            ["join", "--stage", "0", "--initial-peers", PEER[:-2]],
            "is not a peer id (a character mistyped or missing?)",
        ),
        # 198.18.0.0/15 is for tests; nothing here owns this address, so it cannot be bound.
        (
            ["join", "--host", "198.18.0.77", "--stage", "0"],
            "flag '--host': cannot listen on '198.18.0.77'",
        ),
        (
            ["join", "--port", str(taken_port), "--stage", "0"],
            f"flag '--port': port {taken_port} on 127.0.0.1 is in use",
        ),
        (["bootstrap", "--port", str(taken_port), "--identity", str(tmp_path / "b.key")], "flag '--port'"),
        (["status"], "config field 'network.initial_peers'"),
        (["join", "--stage", "auto"], "config field 'network.initial_peers'"),
        (["doctor"], "config field 'network.initial_peers'"),
        # host:port for a multiaddr: refused at once, not after a 16 s wait as an unreachable swarm
        (["join", "--initial-peers", "127.0.0.1:31330"], "is not a multiaddr with a peer id"),
        (["bootstrap", "--initial-peers", "127.0.0.1:31330"], "is not a multiaddr with a peer id"),
    ]


def test_each_bad_input_exits_2_with_one_line_naming_the_fix(tmp_path, taken_port):
    for args, expected in cases(tmp_path, taken_port):
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.returncode, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr, (args, result.stderr)
        message = [line for line in result.stderr.splitlines() if not line.startswith(("usage:", " "))]
        assert len(message) == 1, (args, result.stderr)


def test_a_reader_that_closes_the_pipe_early_is_not_an_error(tmp_path):
    """`noloco-node status --json | head`: head exits, the next write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [SCRIPT, "config", "show"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(write_end)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("content", [None, b"", b"not a key at all"])
def test_an_identity_file_that_cannot_be_used_is_one_line_with_the_fix(tmp_path, capsys, content):
    """Seen: a folder, an empty file or a swarm key given as --identity gave a 20-line traceback."""
    from noloco_node.cli.main import main

    path = tmp_path / "boot.key"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert main(["bootstrap", "--identity", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(path) in err
    assert ("is a folder" in err) if content is None else ("remove this one to create a new identity" in err)
