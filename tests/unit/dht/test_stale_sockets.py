"""A node's start removes the socket files libp2p daemons of killed processes left, and only those."""

import os
import socket
import time

import pytest

from noloco_node.dht.stale_sockets import remove_stale_sockets


def _bound(path, *, listening: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen(1)
    return sock


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_only_old_sockets_nobody_listens_on_go(tmp_path):
    dead = tmp_path / "hivemind-p2pclient-dead.sock"
    dead_daemon = tmp_path / "hivemind-p2pd-dead.sock"
    live = tmp_path / "hivemind-p2pclient-live.sock"
    young = tmp_path / "hivemind-p2pclient-young.sock"
    other_program = tmp_path / "someone-else.sock"
    not_a_socket = tmp_path / "hivemind-p2pclient-file.sock"
    socks = [_bound(dead, listening=False), _bound(dead_daemon, listening=False)]
    socks += [_bound(live, listening=True), _bound(young, listening=False), _bound(other_program, listening=False)]
    for sock in (socks[0], socks[1], socks[3], socks[4]):
        sock.close()  # the process that bound them is gone: the files stay, nobody listens
    not_a_socket.write_text("")
    for path in (dead, dead_daemon, live, other_program, not_a_socket):
        _age(path, 3600)
    try:
        assert remove_stale_sockets(tmp_path, min_age_s=60) == 2
        assert not dead.exists() and not dead_daemon.exists()
        assert live.exists() and young.exists() and other_program.exists() and not_a_socket.exists()
        assert remove_stale_sockets(tmp_path, min_age_s=60) == 0
        socks[2].setblocking(False)
        with pytest.raises(BlockingIOError):  # a socket a process holds is never dialled
            socks[2].accept()
    finally:
        socks[2].close()


def test_a_missing_directory_is_no_error(tmp_path):
    assert remove_stale_sockets(tmp_path / "absent") == 0
