"""Across seeds: group statistics, loss at equal wall time, and verdicts that respect the noise."""

import math

from noloco_node.experiments.aggregate import Stat, compare, loss_at_time, stat, summarize_groups, verdict


def _cell(group: str, seed: int, losses: list[float], times: list[float], status: str = "ok") -> dict:
    evals = [
        {"step": 10 * i, "val_loss": v, "wall_s": t, "spread": 0.01 * i} for i, (v, t) in enumerate(zip(losses, times))
    ]
    row = {
        "cell": f"{group}-s{seed}",
        "group": group,
        "variant": "",
        "method": group.split("-")[0],
        "replicas": 2,
        "stages": 2,
        "profile": "lan",
        "seed": seed,
        "status": status,
        "final_val_loss": losses[-1],
        "final_eval_step": evals[-1]["step"],
        "train_wall_s": times[-1],
        "final_spread": evals[-1]["spread"],
        "spread_lr_pearson": 0.9,
        "bytes_per_node": 1e6,
        "outer_bytes_per_round": math.nan,
        "delta_rel_error": math.nan,
        "idle_fraction": 0.1,
    }
    return {"row": row, "evals": evals, "train": [{"step": 10 * i, "lr": 1e-3} for i in range(len(losses))]}


def test_stat_is_mean_and_sample_std_ignoring_missing_values():
    s = stat([1.0, 2.0, 3.0, math.nan])
    assert (s.mean, s.n) == (2.0, 3) and math.isclose(s.std, 1.0)
    assert stat([]).n == 0 and str(stat([])) == "n/a"
    assert str(stat([5.0])).endswith("(1 seed)")


def test_loss_at_time_interpolates_and_refuses_to_extrapolate():
    evals = [{"val_loss": 6.0, "wall_s": 0.0}, {"val_loss": 4.0, "wall_s": 10.0}]
    assert loss_at_time(evals, 5.0) == 5.0
    assert loss_at_time(evals, 10.0) == 4.0
    assert math.isnan(loss_at_time(evals, 11.0))


def test_groups_compare_at_the_latest_time_every_cell_reached():
    cells = [_cell("fast-D2", s, [6.0, 5.0, 4.0], [0.0, 5.0, 10.0]) for s in range(3)]
    cells += [_cell("slow-D2", s, [6.0, 4.6, 3.8], [0.0, 20.0, 40.0]) for s in range(3)]
    cells.append(_cell("slow-D2", 3, [9.0], [0.0], status="failed"))
    groups = {g["group"]: g for g in summarize_groups(cells)}
    assert groups["slow-D2"]["seeds"] == 3 and groups["slow-D2"]["cells"] == 4
    assert groups["fast-D2"]["equal_time_s"] == 10.0
    assert math.isclose(groups["fast-D2"]["val_loss_equal_time"].mean, 4.0)
    assert math.isclose(groups["slow-D2"]["val_loss_equal_time"].mean, 6.0 - 1.4 * 10 / 20)  # 5.3
    assert groups["slow-D2"]["val_loss"].mean < groups["fast-D2"]["val_loss"].mean  # lower at equal steps


def test_a_difference_is_claimed_only_outside_twice_its_standard_error():
    a, b = Stat(4.0, 0.1, 3), Stat(4.05, 0.1, 3)
    diff, se, outside = compare(a, b)
    assert math.isclose(diff, -0.05) and math.isclose(se, math.sqrt(2 * 0.01 / 3)) and outside is False
    assert "inside the noise" in verdict("x", a, "y", b, "loss")
    assert compare(Stat(4.0, 0.01, 3), Stat(4.5, 0.01, 3))[2] is True
    assert "x is lower, outside the noise" in verdict("x", Stat(4.0, 0.01, 3), "y", Stat(4.5, 0.01, 3), "loss")
    assert compare(Stat(4.0, 0.0, 1), b)[2] is None and "no verdict" in verdict("x", Stat(4.0, 0.0, 1), "y", b, "loss")


def test_paired_differences_resolve_a_price_the_seed_noise_hides():
    from noloco_node.experiments.aggregate import paired, paired_verdict

    base = {0: 5.50, 1: 5.60, 2: 5.55}  # seeds 0.05 apart
    worse = {0: 5.52, 1: 5.621, 2: 5.569, 3: 9.0}  # about +0.02 on every seed; seed 3 has no partner
    unpaired = compare(stat([worse[s] for s in base]), stat(base.values()))
    assert unpaired[2] is False  # 0.02 is inside the seed-to-seed noise
    diffs = paired(worse, base)
    assert diffs.n == 3 and math.isclose(diffs.mean, 0.02, abs_tol=1e-12)
    assert "base is lower, outside the noise" in paired_verdict("worse", "base", diffs, "loss")
    same = paired({0: 1.0, 1: 2.01, 2: 2.99}, {0: 1.0, 1: 2.0, 2: 3.0})
    assert "inside the noise" in paired_verdict("a", "b", same, "loss")
    assert "no verdict" in paired_verdict("a", "b", paired({0: 1.0}, {0: 2.0, 1: 3.0}), "loss")


def test_groups_keep_each_seeds_loss_and_the_new_columns():
    cells = [_cell("noloco-D2", s, [6.0, 5.0 + 0.1 * s], [0.0, 5.0]) for s in range(2)]
    for c in cells:
        c["row"] |= {"pipeline_bytes_per_node": 2e6, "outer_lag_steps": 1.5}
    (group,) = summarize_groups(cells)
    assert group["val_loss_by_seed"] == {0: 5.0, 1: 5.1}
    assert group["pipeline_bytes_per_node"].mean == 2e6 and group["outer_lag_steps"].mean == 1.5
