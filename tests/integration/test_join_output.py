"""What a `join` without a terminal (systemd, Docker: output to a file) says about training: a step
line every log.every_steps inner steps, one closing summary (at --steps and at SIGTERM), and no
third-party noise such as gRPC's fork_posix line."""

import json
import re
import time

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEP0 = re.compile(
    r"noloco_node\.training: step (\d+)/12 \| loss (\d+\.\d{3}) \| lr (\d\.\de[-+]\d\d) \| "
    r"(\d+) tok/s \| in flight \d+ \| outer off \| sent \d+(\.\d)? [kMG]?B recv \d+(\.\d)? [kMG]?B$"
)
SUMMARY0 = re.compile(
    r"noloco_node\.training: summary: stage 0 \| 12/12 steps \| \d+\.\d s \(first step after \d+\.\d s\) \| "
    r"(\d+) tok/s mean while training \| "
    r"loss (\d+\.\d{3}) -> (\d+\.\d{3}) \| outer off \| .* \| dropped (\d+) of (\d+) microbatches$"
)
STEP1 = re.compile(
    r"noloco_node\.training: step (\d+) \| served (\d+) microbatches \| lr \d\.\de[-+]\d\d \| \d+ tok/s \| "
)
SUMMARY1 = re.compile(
    r"noloco_node\.training: summary: stage 1 \| 12 steps \| .* \| served 24 microbatches \| "
    r"outer off \| .* \| dropped 0 microbatches$"
)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def inner_step(ready_file) -> int:
    return json.loads(ready_file.read_text())["inner_step"] if ready_file.exists() else -1


def test_join_off_a_terminal_logs_step_lines_and_a_summary(tmp_path, make_swarm):
    # A networked stage 0 always sends its activations on, so the smallest pipeline is two stages.
    overrides = tiny_overrides(tmp_path, **{"run.run_id": "output-test", "log.every_steps": 4})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)  # stopped (SIGTERM, then SIGKILL) by the fixture whatever happens here
    stage1 = swarm.start_node(1, 0)
    swarm.wait_ready([stage1])
    driver = swarm.start_node(0, 0, "--steps", "12")
    swarm.wait_exit([driver], timeout_s=240)
    text = driver.log_file.read_text()
    assert driver.proc.returncode == 0, text[-3000:]

    lines = text.splitlines()
    steps = [m for m in map(STEP0.search, lines) if m]
    assert [int(m.group(1)) for m in steps] == [4, 8, 12], text[-3000:]
    assert all(float(m.group(2)) > 0 and float(m.group(3)) > 0 and int(m.group(4)) > 0 for m in steps), text[-3000:]
    summaries = [m for m in map(SUMMARY0.search, lines) if m]
    assert len(summaries) == 1 and sum("summary:" in line for line in lines) == 1, text[-3000:]
    tokens_per_s, first, last, dropped, issued = summaries[0].groups()
    assert float(last) == float(steps[-1].group(2)) and float(first) > float(last), text[-3000:]
    # 12 steps x batch 4 / microbatch 2, every one answered by the one live stage 1.
    assert (int(dropped), int(issued), int(tokens_per_s) > 0) == (0, 24, True), text[-3000:]

    # Stage 1 has no --steps: its lines come from polling, its summary from SIGTERM. The ready
    # file is written after the step-line check in the same poll, so at 12 the last line is out.
    wait_for(lambda: inner_step(stage1.ready_file) >= 12, 60, "stage 1 to report its 12th step")
    assert swarm.terminate(stage1.proc, grace_s=60) == 0
    text1 = stage1.log_file.read_text()
    served = [(int(m.group(1)), int(m.group(2))) for m in map(STEP1.search, text1.splitlines()) if m]
    assert len(served) >= 2 and served[-1][0] == 12 and served == sorted(served), text1[-3000:]
    assert len([m for m in map(SUMMARY1.search, text1.splitlines()) if m]) == 1, text1[-3000:]
    assert text1.count("summary:") == 1, text1[-3000:]

    for output in (text, text1):
        assert "fork_posix" not in output and "skipping fork() handlers" not in output, output[-3000:]
