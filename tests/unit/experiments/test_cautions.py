"""Cells a report must not read as the method at full strength: a researcher's audit found a DiLoCo
cell whose stage-1 replica got 79 of 160 microbatches, took 19 of 20 inner steps, missed the last
all-reduce, and was reported `ok` without a word."""

from noloco_node.experiments.cell import _nodes_short
from noloco_node.experiments.verdicts import _short_cautions


def test_a_node_short_of_the_steps_is_named_by_stage_replica_and_steps():
    by_slot = {(0, 0): "QmA", (0, 1): "QmB", (1, 0): "QmC", (1, 1): "QmD"}
    stats = {
        "QmA": {"inner_steps": 20},
        "QmB": {"inner_steps": 20},
        "QmC": {"inner_steps": 20},
        "QmD": {"inner_steps": 19},
    }
    assert _nodes_short(stats, by_slot, 20) == "s1r1:19"
    assert _nodes_short({**stats, "QmD": {"inner_steps": 20}}, by_slot, 20) == ""


def test_the_report_cautions_about_a_cell_with_a_short_node_and_only_then():
    short = {"row": {"cell": "diloco-D2-P2-s0", "status": "ok", "steps": 20, "nodes_short": "s1r1:19"}}
    full = {"row": {"cell": "diloco-D2-P2-s1", "status": "ok", "steps": 20, "nodes_short": ""}}
    [caution] = _short_cautions([short, full])
    assert caution.startswith("Caution: diloco-D2-P2-s0: node(s) s1r1:19") and "missed the outer rounds" in caution


def test_the_spread_lr_verdict_says_when_the_spread_was_sampled_at_several_points_of_the_round():
    """Evaluations every 4 steps with rounds every 5 sample a sawtooth of the spread; a researcher's
    audit saw a D = 2 run 'agree' with the paper through that phase alone."""
    from noloco_node.experiments.aggregate import stat
    from noloco_node.experiments.scenario import Scenario
    from noloco_node.experiments.verdicts import _pearson_verdicts

    group = {"group": "noloco-D2-P2", "method": "noloco", "variant": "", "pearson": stat([0.93, 0.94])}
    sawtooth = Scenario(steps=40, eval_every=4, overrides={"outer.inner_steps_per_outer": 5})
    [line] = _pearson_verdicts([group], sawtooth)
    assert "sampled at 5 different points of the outer round (eval_every 4, H = 5)" in line
    one_phase = Scenario(steps=40, eval_every=10, overrides={"outer.inner_steps_per_outer": 5})
    [line] = _pearson_verdicts([group], one_phase)
    assert "sampled at" not in line
