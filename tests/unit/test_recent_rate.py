"""Tokens per second "now" falls to 0 within a window of the last step (a newcomer saw an idle
node at 500 tok/s fourteen minutes after it finished)."""

from noloco_node.runtime.recent_rate import RecentRate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_follows_the_last_minute_and_falls_to_zero_when_the_counter_stops():
    clock = Clock()
    rate = RecentRate(window_s=60.0, clock=clock)
    total = 0
    for _ in range(120):  # 100 tokens a second for two minutes, read every second
        clock.now += 1.0
        total += 100
        assert abs(rate.rate(total) - 100.0) < 1e-9
    for second in range(1, 61):  # stopped: the rate falls as the window slides off the training
        clock.now += 1.0
        assert abs(rate.rate(total) - 100.0 * (60 - second) / 60) < 1e-9
    clock.now += 600.0
    assert rate.rate(total) == 0.0
    assert len(rate._samples) <= 62


def test_reads_less_than_a_second_apart_add_no_sample_and_rare_reads_still_measure_a_window():
    clock = Clock()
    rate = RecentRate(window_s=60.0, clock=clock)
    for i in range(900):
        clock.now += 0.001
        rate.rate(i)
    assert len(rate._samples) == 1  # only the start's
    clock.now += 300.0  # read again five minutes on: the rise since the start, over the time since
    assert abs(rate.rate(3999) - 3999 / 300.9) < 1e-6
    clock.now += 61.0
    assert rate.rate(3999) == 0.0
