"""An experiment's folder and what is written into it: checked before any cell runs, never a new
run mixed into an earlier one, the finished cells kept when the run is stopped, and tables that
say what was not measured instead of crashing or writing numbers that were not."""

import json
import math
import signal

import pytest

from noloco_node.config import ConfigError
from noloco_node.experiments import runner
from noloco_node.experiments.outputs import prepare_out, write_outputs
from noloco_node.experiments.process_group import Interrupted
from noloco_node.experiments.scenario import load_scenario
from tests.unit.experiments.test_merge import LINKS, _cell


def _scenario(tmp_path, text: str = ""):
    path = tmp_path / "s.toml"
    path.write_text('methods = ["noloco", "dp"]\nseeds = [0, 1]\nsteps = 10\neval_every = 5\n' + text)
    return load_scenario(path)


def test_a_typo_in_the_overrides_is_named_before_any_cell_runs(tmp_path):
    with pytest.raises(ConfigError) as err:
        runner.check_cell_configs(_scenario(tmp_path, '[overrides]\n"inner.lrr" = 0.1\n'))
    assert err.value.field == "inner.lrr" and "[overrides]" in str(err.value) and "did you mean 'lr'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        runner.check_cell_configs(_scenario(tmp_path, '[[variants]]\nname = "fast"\n"outer.gama" = 0.1\n'))
    assert "[[variants]] 'fast'" in str(err.value)


def test_the_output_folder_is_refused_when_it_is_a_file_unwritable_or_holds_an_earlier_run(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_out(tmp_path / "afile", overwrite=False)
    with pytest.raises(ConfigError, match="cannot write"):
        prepare_out(tmp_path / "afile" / "out", overwrite=False)
    earlier = tmp_path / "earlier"
    (earlier / "cells" / "noloco-D2-P2-lan-s0").mkdir(parents=True)
    for name in ("scenario.json", "results.csv", "report.md", "notes.txt"):
        (earlier / name).write_text("x")
    with pytest.raises(ConfigError, match="--overwrite"):
        prepare_out(earlier, overwrite=False)
    assert (earlier / "results.csv").exists()
    prepare_out(earlier, overwrite=True)
    assert sorted(p.name for p in earlier.iterdir()) == ["notes.txt"]  # the run's files only


def test_a_stopped_run_keeps_the_finished_cells_tables_and_report(tmp_path, monkeypatch):
    scenario = _scenario(tmp_path)
    finished = []

    def fake_cell(scenario, cell, out_dir):
        if len(finished) == 2:
            raise Interrupted(signal.SIGINT)
        finished.append(cell.name)
        return _cell(cell.method, cell.seed, 5.0 + cell.seed)

    monkeypatch.setattr(runner, "run_cell", fake_cell)
    monkeypatch.setattr(runner, "_checked_link", lambda profile: LINKS[0])
    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        runner.run_experiment(scenario, out, "noloco-node experiment s.toml")
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith(finished[0]) and rows[2].startswith(finished[1])
    report = (out / "report.md").read_text()
    assert "**Not a whole run**: stopped by SIGINT after 2 of 4 cells" in report
    assert (out / "validation_loss.png").exists()


def test_failed_groups_single_seeds_and_solo_rounds_are_reported_as_such(tmp_path):
    scenario = _scenario(tmp_path)
    solo = _cell("diloco", 0, 5.0)
    solo["row"] |= {"outer_rounds": 7, "outer_paired": 2, "outer_solo": 5}
    solo["evals"][0]["lr"] = math.nan  # not measured
    cells = [_cell("noloco", 0, None), _cell("noloco", 1, None), solo, _cell("dp", 0, 4.0)]  # noloco: all failed
    write_outputs(tmp_path, scenario, cells, [], LINKS, command="c", elapsed_s=1.0)
    report = (tmp_path / "report.md").read_text()
    assert "diloco-D2-P2-lan-s0: 5 of 7 outer rounds went solo" in report
    assert "Validation loss at step ?: no data for noloco" in report
    groups = (tmp_path / "groups.csv").read_text().splitlines()
    diloco = dict(zip(groups[0].split(","), groups[2].split(",")))
    assert diloco["group"] == "diloco-D2-P2-lan" and diloco["val_loss_mean"] == "5" and diloco["val_loss_std"] == ""
    curves = json.loads((tmp_path / "curves.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert curves[2]["evals"][0]["lr"] is None
