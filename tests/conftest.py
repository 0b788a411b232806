"""Test-wide settings: nothing may reach a model or data hub, and caches stay per session."""

import atexit
import logging
import os
import shutil
import tempfile

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "HF_DATASETS_CACHE" not in os.environ:  # one per test process, removed when it ends (650 were left in /tmp)
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="noloco-hf-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
# One torch thread per test process (read by torch when it loads, so before any test imports it).
# Two workers already keep the 2 cores busy, beside the integration tests' node processes: with
# torch's default of a thread per core, each parallel op waits for a thread the OS has parked. A
# 24-step training test took 35.5 s at two threads against 1.5 s at one beside three busy loops
# (0.4 s either way on an idle machine), and once ran past the 120 s timeout under load;
# tests/unit/node + model, alternating, beside other work: 262, 143 s at two threads, 100, 53 s at one.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _state_home_per_test(tmp_path_factory, monkeypatch):
    """`join` keeps checkpoints under $XDG_STATE_HOME by default: every test gets its own, so no
    node of a test resumes from another test's (or the user's) checkpoint of the same run id."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """A test that runs a command in-process (cli.main) points the root logger at the stderr pytest
    captures for that test; left so, later tests' logs go to a closed file ("Logging error")."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# The longest tests run first, so that the two workers finish together: run last, a 3-minute test
# kept one worker busy while the other sat idle (xdist's worksteal only moves tests not yet started).
# Measured in clean-clone CI runs (--durations); the unit tier fills in behind them.
LONGEST_FIRST = (
    "test_nat.py",
    "test_nat_bootstrap_restart.py",
    "test_lifecycle.py",
    "test_experiment.py",
    "test_link_deadlines.py",
    "test_memory.py",
    "test_export.py",
    "test_admission.py",
    "test_chaos.py",
    "test_hostile_input.py",
    "test_rebalance.py",
    "test_demo_noloco.py",
    "test_capacity_routing.py",
    "test_first_hour.py",
    "test_metrics.py",
    "test_subspace_swarm.py",
    "test_integrity.py",
    "test_launcher_signals.py",
    "test_state_transfer.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    def rank(item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(name)
        return (1, 0) if "integration" in item.path.parts else (2, 0)

    items.sort(key=rank)  # stable: a file's tests keep their order


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most 4. Integration tests start up
    to 9 node processes each; more workers than that on a big machine only add contention."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


# ---- where the suite's CPU goes --------------------------------------------------------------------
# CI runs on 2 cores, so the suite's length is its CPU time over two: each test's CPU seconds, its own
# and its reaped child processes' (the nodes it started), are recorded and the largest printed at the
# end, under xdist too (they travel in the report's user_properties).
import resource  # noqa: E402

import pytest  # noqa: E402


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu_seconds()
    item.user_properties.append(("cpu_start", start))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown":
        start = dict(item.user_properties).get("cpu_start")
        if start is not None:
            report.user_properties.append(("cpu_s", _cpu_seconds() - start))


_CPU: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        cpu = dict(report.user_properties).get("cpu_s")
        if cpu is not None:
            _CPU[report.nodeid] = cpu


def pytest_terminal_summary(terminalreporter):
    if not _CPU:
        return
    total = sum(_CPU.values())
    terminalreporter.write_sep("=", f"CPU seconds per test (own + node processes): {total:.0f} s in all")
    for nodeid, cpu in sorted(_CPU.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{cpu:8.1f}s  {nodeid}")
