"""The zygote (experiments/zygote.py) and its client (experiments/preloaded.py) with real processes.
The zygote here preloads next to nothing, so each test takes a second, not a torch import; the
children run `python -m json.tool`, which reads its stdin to the end: a pipe the test holds keeps
it running while the test looks at it through /proc."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from noloco_node.experiments import preloaded
from noloco_node.experiments.preloaded import PreloadedProcess, Zygote, ZygoteUnavailable, preloadable, std_fds

pytestmark = pytest.mark.timeout(60)


def start(cmd, **popen_kwargs):
    return subprocess.Popen(cmd, process_group=0, **popen_kwargs)


@pytest.fixture
def zygote():
    z = Zygote(dict(os.environ), start, preload=("json",))
    yield z
    z.close()


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while preloaded._alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Child:
    """`python -m json.tool` (or `argv`) forked by the zygote; it runs until `finish` closes its stdin."""

    def __init__(
        self, zygote: Zygote, tmp_path: Path, pgid: int = 0, argv: tuple[str, ...] = ("-m", "json.tool")
    ) -> None:
        self.out = tmp_path / f"out-{time.monotonic_ns()}.txt"
        read, self.stdin = os.pipe()
        with open(self.out, "w") as out:
            self.proc, self.pgid = zygote.spawn(
                list(argv),
                dict(os.environ, MARK="zygote-test"),
                str(tmp_path),
                pgid,
                (read, out.fileno(), out.fileno()),
            )
        os.close(read)

    def finish(self, text: str) -> int:
        os.write(self.stdin, text.encode())
        os.close(self.stdin)
        return self.proc.wait(timeout=10)


def test_a_forked_child_runs_with_the_requested_fds_env_cwd_and_title(zygote, tmp_path):
    child = Child(zygote, tmp_path)
    pid = child.proc.pid
    assert child.proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.proc.wait(timeout=0.2)
    assert os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"{sys.executable} -m json.tool".encode())
    assert child.pgid == pid == os.getpgid(pid)  # pgid 0: it leads a group of its own
    assert child.finish('{"a": [1, 2]}') == 0
    assert json.loads(child.out.read_text()) == {"a": [1, 2]}

    code = "import os, sys; print(os.environ['MARK'], os.getcwd(), sys.argv[1:], sys.stdin.read())"
    shown = Child(zygote, tmp_path, argv=("-m", "timeit", "-n", "1", "-r", "1", code))
    assert shown.finish("to stdin") == 0
    assert shown.out.read_text().startswith(f"zygote-test {tmp_path} ['-n', '1', '-r', '1', {code!r}] to stdin")


def test_exit_codes_and_signals_come_back_as_popen_gives_them(zygote, tmp_path):
    bad = Child(zygote, tmp_path)
    assert bad.finish("{not json") == 1
    assert "Expecting property name" in bad.out.read_text()  # its stderr went to the file too

    killed = Child(zygote, tmp_path)
    killed.proc.kill()
    assert killed.proc.wait(timeout=10) == -signal.SIGKILL
    assert killed.proc.returncode == -signal.SIGKILL
    killed.proc.kill()  # on an exited process: nothing, as Popen does


def test_children_join_a_given_group_and_lead_their_own_when_it_is_gone(zygote, tmp_path):
    leader = Child(zygote, tmp_path)
    member = Child(zygote, tmp_path, pgid=leader.pgid)
    assert member.pgid == leader.pgid == os.getpgid(member.proc.pid)
    assert leader.finish("1") == 0 and member.finish("2") == 0
    late = Child(zygote, tmp_path, pgid=leader.pgid)  # every member has exited: setpgid is refused
    assert late.pgid == late.proc.pid
    late.finish("3")


def test_a_dead_zygote_takes_its_children_down(tmp_path):
    zygote = Zygote(dict(os.environ), start, preload=("json",))
    child = Child(zygote, tmp_path)
    zygote.proc.kill()
    zygote.proc.wait()
    assert wait_gone(child.proc.pid), Path(f"/proc/{child.proc.pid}/status").read_text()  # PR_SET_PDEATHSIG
    assert child.proc.wait(timeout=5) == 255  # its status died with the zygote
    with pytest.raises(ZygoteUnavailable):
        Child(zygote, tmp_path)
    zygote.close()


def test_closing_the_launcher_side_ends_the_zygote(tmp_path):
    zygote = Zygote(dict(os.environ), start, preload=("json",))
    zygote.close()
    assert zygote.proc.wait(timeout=10) == 0


def test_a_zygote_that_cannot_import_says_why():
    with pytest.raises(ZygoteUnavailable, match="No module named 'no_such_module_for_the_zygote'"):
        Zygote(dict(os.environ), start, preload=("no_such_module_for_the_zygote",))


def test_only_noloco_modules_with_file_output_go_to_the_zygote(tmp_path):
    node = [sys.executable, "-m", "noloco_node", "join"]
    assert preloadable(node, {"stdout": 3, "stderr": subprocess.STDOUT, "env": {}, "stdin": subprocess.DEVNULL})
    assert preloadable([sys.executable, "-m", "noloco_node.experiments.outer_peer"], {})
    assert not preloadable(node, {"stdout": subprocess.PIPE})  # the launcher reads it: a real pipe
    assert not preloadable(node, {"start_new_session": True})  # a Popen option the zygote does not offer
    assert not preloadable(["ip", "netns", "exec", "ns", *node], {})
    assert not preloadable([sys.executable, "-m", "json.tool"], {})
    # gRPC and hivemind read their log levels when they load: the zygote loaded them quiet.
    assert not preloadable([sys.executable, "-m", "noloco_node", "--log-level", "DEBUG", "join"], {})
    assert not preloadable([sys.executable, "-m", "noloco_node", "--log-level=debug", "join"], {})
    assert preloadable([sys.executable, "-m", "noloco_node", "--log-level", "WARNING", "join"], {})

    with open(tmp_path / "log", "w") as log:
        fds, opened = std_fds({"stdin": subprocess.DEVNULL, "stdout": log, "stderr": subprocess.STDOUT})
        assert fds[1] == fds[2] == log.fileno() and fds[0] == opened[0]
        os.close(opened[0])


def test_a_process_group_forks_noloco_commands_and_execs_the_rest(tmp_path, monkeypatch):
    from noloco_node.experiments import process_group

    zygote = Zygote(dict(os.environ), process_group._start_zygote, preload=("noloco_node.cli.main",))
    monkeypatch.setattr(process_group._zygotes, "get", lambda env, start: zygote)
    group = process_group.ProcessGroup()
    try:
        with open(tmp_path / "version", "w") as out:
            forked = group.spawn(
                [sys.executable, "-m", "noloco_node", "--version"], stdout=out, stderr=subprocess.STDOUT
            )
        execd = group.spawn(["sleep", "30"])
        assert isinstance(forked, PreloadedProcess) and isinstance(execd, subprocess.Popen)
        assert forked.wait(timeout=10) == 0 and (tmp_path / "version").read_text().startswith("noloco-node ")
        assert os.getpgid(execd.pid) == group.pgid  # the forked one led the group, the exec'd one joined
    finally:
        group.drain(grace_s=5)
        zygote.close()
    assert execd.returncode == -signal.SIGTERM


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root and iproute2")
def test_a_child_asked_to_runs_inside_a_network_namespace(zygote, tmp_path):
    name = f"zygote-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        read, write = os.pipe()
        with open(tmp_path / "out", "w") as out:
            proc, _ = zygote.spawn(
                ["-m", "json.tool"], dict(os.environ), str(tmp_path), 0, (read, out.fileno(), out.fileno()), netns=name
            )
        os.close(read)
        target, ours = os.stat(f"/run/netns/{name}").st_ino, os.stat("/proc/self/ns/net").st_ino
        deadline = time.monotonic() + 10  # the fork returns before the child has set itself up
        while (inside := os.stat(f"/proc/{proc.pid}/ns/net").st_ino) != target and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inside == target != ours
        os.close(write)
        assert proc.wait(timeout=10) == 1  # empty stdin is not JSON: it ran, in there
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=10)
