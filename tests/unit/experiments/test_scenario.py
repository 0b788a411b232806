"""Scenario files, the grid they expand to, and the spread / correlation math of the report."""

import math
from pathlib import Path

import pytest
import torch

from noloco_node.config import ConfigError, load_config
from noloco_node.experiments.cell import cell_overrides
from noloco_node.experiments.evaluate import pearson, replica_spread, weight_spread
from noloco_node.experiments.scenario import load_scenario
from noloco_node.netem.relay import LinkProfile


def test_grid_is_the_product_of_its_axes(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        'methods = ["noloco", "dp"]\nreplicas = [2, 3]\nseeds = [0, 1]\n'
        '[[profiles]]\nname = "a"\none_way_ms = 5\nmbit = 0\n[[profiles]]\nname = "b"\none_way_ms = 0\nmbit = 10\n'
    )
    cells = load_scenario(path).cells()
    assert len(cells) == 2 * 2 * 2 * 2
    assert len({c.name for c in cells}) == len(cells)
    assert load_scenario(path, methods=["diloco"]).methods == ("diloco",)


@pytest.mark.parametrize(
    "text,field",
    [
        ('methods = ["gossip"]', "scenario.methods"),
        ("outer_sync_sizes = [1]", "scenario.outer_sync_sizes"),
        ("stepz = 3", "scenario.stepz"),
        ('[[profiles]]\nname = "x"\none_way_ms = 1\njitter_ms = 5\nmbit = 0', "scenario.profiles[0]"),
        ('[[profiles]]\nname = "home20"', "scenario.profiles[0]"),
        ('[[profiles]]\nname = "x"\none_way_ms = "10"\nmbit = 0', "scenario.profiles[0]"),
        ('steps = "ten"', "scenario.steps"),
        ("steps = 2.5", "scenario.steps"),
        ("steps = true", "scenario.steps"),
        ('replicas = "2"', "scenario.replicas"),
        ('seeds = "0,1"', "scenario.seeds"),
        ("seeds = [0, 1.5]", "scenario.seeds"),
        ('cell_timeout_s = "long"', "scenario.cell_timeout_s"),
        ("name = 3", "scenario.name"),
        ("methods = [1]", "scenario.methods"),
        ("overrides = 3", "scenario.overrides"),
        ('[[variants]]\n"outer.gamma" = 0.1', "scenario.variants[0]"),
        ('[[variants]]\nname = "a"\n[[variants]]\nname = "a"', "scenario.variants"),
        ('outer_sync_methods = ["dp"]', "scenario.outer_sync_methods"),
        # A researcher's audit: seeds [0, 0] ran two cells of one name, the second overwrote the
        # first's files and the group's error bar counted one seed twice; D = 1 ran NoLoCo all solo.
        ("seeds = [0, 0]", "scenario.seeds"),
        ('methods = ["dp", "dp"]', "scenario.methods"),
        ("replicas = [2, 2]", "scenario.replicas"),
        ("replicas = [1]", "scenario.replicas"),
        ('replicas = [1, 2]\nmethods = ["noloco", "none"]', "scenario.replicas"),
    ],
)
def test_bad_scenarios_name_the_field(tmp_path, text, field):
    path = tmp_path / "s.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    assert err.value.field == field


def test_one_replica_is_a_scenario_for_method_none_only(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('replicas = [1]\nmethods = ["none"]\n')
    assert [c.replicas for c in load_scenario(path).cells()] == [1]


def test_variants_cross_the_grid_and_group_cells_by_everything_but_the_seed(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        'methods = ["noloco"]\nseeds = [0, 1, 2]\n[[variants]]\nname = "fixed"\n"pipeline.routing" = "fixed"\n'
        '[[variants]]\nname = "random"\n"pipeline.routing" = "random"\n'
    )
    scenario = load_scenario(path)
    cells = scenario.cells()
    assert [c.name for c in cells[:4]] == [
        "noloco-fixed-D2-P2-lan-s0",
        "noloco-fixed-D2-P2-lan-s1",
        "noloco-fixed-D2-P2-lan-s2",
        "noloco-random-D2-P2-lan-s0",
    ]
    assert len({c.group for c in cells}) == 2
    overrides = cell_overrides(scenario, cells[3])
    assert "pipeline.routing=random" in overrides and "run.seed=0" in overrides
    assert scenario.sync_methods() == ("noloco",)
    assert scenario.to_dict()["variants"][0] == {"name": "fixed", "pipeline.routing": "fixed"}


@pytest.mark.parametrize("name", ["convergence", "routing", "scaling", "gamma_codec", "loss_price"])
def test_the_reproduction_scenarios_load(name):
    scenario = load_scenario(Path(__file__).parents[3] / "examples" / f"{name}.toml")
    assert scenario.paper and scenario.sync_methods()
    for cell in scenario.cells():  # every cell's node config is valid
        load_config(overrides=cell_overrides(scenario, cell))


def test_profile_rejects_negative_values():
    with pytest.raises(ValueError):
        LinkProfile("x", one_way_ms=-1)


def test_weight_spread_is_the_rms_deviation_from_the_replica_mean():
    a = [{"w": torch.tensor([1.0, 1.0])}, {"v": torch.tensor([0.0])}]
    b = [{"w": torch.tensor([3.0, 1.0])}, {"v": torch.tensor([2.0])}]
    # deviations: w: (+-1, 0), v: (+-1): sum of squares 2 + 0 + 2 = 4 over D x params = 2 x 3
    assert weight_spread([a, b]) == pytest.approx(math.sqrt(4 / 6))
    assert weight_spread([a, a]) == 0.0


def test_replica_spread_counts_every_stage_with_two_replicas_even_when_another_has_one():
    a = [{"w": torch.tensor([1.0, 1.0])}, {"v": torch.tensor([0.0])}]
    b = [{"w": torch.tensor([3.0, 1.0])}, {"v": torch.tensor([2.0])}]
    # Stage by stage, the same columns give weight_spread's figure.
    assert replica_spread([[a[0], b[0]], [a[1], b[1]]]) == pytest.approx(weight_spread([a, b]))
    # Stage 0 with one replica, stage 1 with two apart: the spread is stage 1's, not 0.
    assert replica_spread([[a[0]], [a[1], b[1]]]) == pytest.approx(1.0)
    assert replica_spread([[a[0]], [a[1]]]) == 0.0


def test_pearson():
    assert pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 2, 3], [5, 5, 5]))


def test_chaos_profile_fields():
    from noloco_node.experiments.scenario import Scenario

    assert Scenario().chaos_action is None
    profile = Scenario(chaos_action="stall", chaos_every_s=5.0).chaos_profile()
    assert profile.action == "stall" and profile.every_s == 5.0
    with pytest.raises(ConfigError, match="chaos_action"):
        Scenario(chaos_action="explode")


def test_final_snapshots_stand_at_the_last_step_when_every_node_wrote_one(tmp_path):
    from noloco_node.experiments.evaluate import _index, evaluation_points

    columns = [["aaaaaaaa", "bbbbbbbb"], ["cccccccc", "dddddddd"]]
    for stage, peer in ((0, "aaaaaaaa"), (1, "bbbbbbbb"), (0, "cccccccc"), (1, "dddddddd")):
        for step in (0, 5, 10):
            if (peer, step) != ("dddddddd", 10):  # this stage-1 replica ended at step 9
                (tmp_path / f"stage{stage}-{peer}-step{step}.safetensors").touch()
        (tmp_path / f"stage{stage}-{peer}-final.safetensors").touch()
    points = evaluation_points(_index(tmp_path), columns, final_step=10)
    assert [(step, final) for step, _, final in points] == [(0, False), (5, False), (10, True)]
    assert points[-1][1][(1, "dddddddd")].name == "stage1-dddddddd-final.safetensors"
    (tmp_path / "stage1-dddddddd-final.safetensors").unlink()  # a node that left no final snapshot
    points = evaluation_points(_index(tmp_path), columns, final_step=10)
    assert [(step, final) for step, _, final in points] == [(0, False), (5, False), (10, False)]
