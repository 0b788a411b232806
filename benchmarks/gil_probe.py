"""How much a piece of host work holds back another Python thread of its process through the GIL.
On a GPU node that other thread is the compute thread launching the stage's kernels, and the work
is the event loop's share of a hop.

A probe thread counts in a pure-Python loop. Alone (the main thread asleep) it counts at its idle
rate; while the main thread runs `fn`, it counts only while `fn` leaves the GIL free (a torch op
or a large numpy copy releases it; protobuf's parse and serialisation, a memoryview copy and Python
code hold it). lost = 1 - rate during `fn` / idle rate: the share of `fn`'s time the other thread
could not run. Work that holds the GIL throughout reads about 0.5, not 1: two threads that both want
it take turns every switch interval (5 ms). The probe runs only while it measures, so timings taken
outside it are not disturbed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def share_lost_to_gil(fn: Callable[[], object], repeats: int, calibrate_s: float = 0.2) -> float:
    """The share of `fn`'s time another thread that wants the GIL loses to it (module docstring)."""
    fn()  # warm-up
    count, stopped = [0], threading.Event()

    def spin() -> None:
        while not stopped.is_set():
            count[0] += 1

    def rate(run: Callable[[], object]) -> float:
        start_count, start = count[0], time.perf_counter()
        run()
        return (count[0] - start_count) / (time.perf_counter() - start)

    probe = threading.Thread(target=spin, daemon=True)
    probe.start()
    try:
        idle = rate(lambda: time.sleep(calibrate_s))
        busy = rate(lambda: [fn() for _ in range(repeats)])
    finally:
        stopped.set()
        probe.join(timeout=5)
    return min(1.0, max(0.0, 1.0 - busy / idle)) if idle > 0 else float("nan")
