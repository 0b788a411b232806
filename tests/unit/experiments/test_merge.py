"""A re-run's cells replace the folder's cells of the same name; the rest of the folder is kept."""

import json
import math

from noloco_node.experiments.cell import outer_lag_steps
from noloco_node.experiments.merge import merge_rerun, read_cells
from noloco_node.experiments.outputs import write_outputs
from noloco_node.experiments.scenario import load_scenario

LINKS = [{"profile": {"name": "lan", "one_way_ms": 0, "jitter_ms": 0, "mbit": 0}, "rtt_ms": 0.1, "mbit": 900.0}]
SYNC = [
    {
        "method": "noloco",
        "profile": "lan",
        "n": 2,
        "repeat": 0,
        "median_s": 0.5,
        "max_s": 0.6,
        "mb_per_node": 1.0,
        "paired": 2,
        "solo": 0,
    }
]


def _cell(method: str, seed: int, loss: float | None) -> dict:
    name = f"{method}-D2-P2-lan-s{seed}"
    row = {
        "cell": name,
        "group": f"{method}-D2-P2-lan",
        "variant": "",
        "method": method,
        "replicas": 2,
        "stages": 2,
        "profile": "lan",
        "seed": seed,
        "status": "ok" if loss else "failed",
        "error": "" if loss else "TimeoutError",
    }
    if not loss:
        return {"row": row, "evals": [], "train": []}
    row |= {
        "steps": 10,
        "final_val_loss": loss,
        "final_eval_step": 10,
        "final_train_loss": loss,
        "wall_s": 9.0,
        "train_wall_s": 8.0,
        "bytes_per_node": 1e6,
        "idle_fraction": 0.2,
        "final_spread": 0.001,
        "spread_lr_pearson": 0.5,
        "outer_rounds": 4,
        "outer_paired": 4,
        "outer_solo": 0,
        "outer_partial": 0,
        "outer_skipped": 1,
        "outer_resynced": 0,
        "mb_issued": 8,
        "mb_completed": 8,
        "mb_reissued": 0,
        "mb_dropped": 0,
    }
    evals = [
        {"step": s, "val_loss": loss + (10 - s) / 10, "spread": 0.001, "wall_s": 0.8 * s, "lr": 1e-3} for s in (5, 10)
    ]
    return {"row": row, "evals": evals, "train": [{"step": 10, "train_loss": loss, "lr": 1e-3, "wall_s": 8.0}]}


def test_a_rerun_replaces_its_cells_and_keeps_the_rest(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('methods = ["noloco", "dp"]\nseeds = [0, 1]\nsteps = 10\neval_every = 5\n')
    scenario = load_scenario(path)
    folder, rerun = tmp_path / "folder", tmp_path / "rerun"
    folder.mkdir(), rerun.mkdir()
    old = [_cell("noloco", 0, 5.0), _cell("noloco", 1, 5.1), _cell("dp", 0, 4.9), _cell("dp", 1, None)]
    write_outputs(
        folder, scenario, old, SYNC, LINKS, command="noloco-node experiment s.toml --out folder", elapsed_s=600
    )
    (folder / "link_check.json").write_text(json.dumps(LINKS))  # written by run_experiment before the cells
    (folder / "cells" / "dp-D2-P2-lan-s1").mkdir(parents=True)
    (folder / "cells" / "dp-D2-P2-lan-s1" / "error.txt").write_text("old failure")
    new = [_cell("dp", 0, 4.8), _cell("dp", 1, 4.7)]
    new[0]["evals"][0]["wall_s"] = math.nan  # written as null, read back as not measured
    write_outputs(rerun, scenario, new, [], LINKS, command="rerun", elapsed_s=120)
    (rerun / "cells" / "dp-D2-P2-lan-s1" / "events").mkdir(parents=True)
    (rerun / "cells" / "dp-D2-P2-lan-s1" / "events" / "stage0-r0.jsonl").write_text("{}\n")

    groups = {g["group"]: g for g in merge_rerun(scenario, folder, rerun, ("dp re-run on 2026-11-26",))}

    assert groups["dp-D2-P2-lan"]["seeds"] == 2 and math.isclose(groups["dp-D2-P2-lan"]["val_loss"].mean, 4.75)
    assert math.isclose(groups["noloco-D2-P2-lan"]["val_loss"].mean, 5.05)  # kept
    rows = {c["row"]["cell"]: c["row"] for c in read_cells(folder)}
    assert [rows[n]["status"] for n in sorted(rows)] == ["ok"] * 4 and rows["dp-D2-P2-lan-s1"]["outer_skipped"] == 1
    assert not (folder / "cells" / "dp-D2-P2-lan-s1" / "error.txt").exists()
    assert (folder / "cells" / "dp-D2-P2-lan-s1" / "events" / "stage0-r0.jsonl").exists()
    report = (folder / "report.md").read_text()
    assert "## Re-runs" in report and "dp re-run on 2026-11-26" in report and "Total time 12.0 min" in report
    assert "Reproduce: `noloco-node experiment s.toml --out folder`" in report
    assert json.loads((folder / "link_check.json").read_text()) == LINKS
    assert (folder / "outer_sync.csv").read_text().count("\n") == 2  # the folder's own outer-sync row kept


def test_outer_lag_counts_the_steps_between_a_paired_rounds_boundary_and_its_update():
    history = [
        {"outcome": "paired", "inner_step": 5, "applied_at_step": 5},
        {"outcome": "paired", "inner_step": 10, "applied_at_step": 12},
        {"outcome": "solo", "inner_step": 15, "applied_at_step": 19},  # no exchange, no lag to measure
        {"outcome": "paired", "round": 4},
    ]  # a record from before the field existed
    assert outer_lag_steps(history) == 1.0
    assert math.isnan(outer_lag_steps([]))
