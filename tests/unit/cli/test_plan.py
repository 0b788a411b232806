"""`noloco-node plan` (fewest stages that fit, and what each needs), its link model (model/costs.py)
and `config show`'s resolved model."""

import json
import math

import pytest

from noloco_node.cli.main import main
from noloco_node.cli.plan import find_plan
from noloco_node.config import load_config
from noloco_node.model.build import resolve_llama_config, run_model
from noloco_node.model.costs import Link, pipeline_costs, predict

GIB = 1 << 30


def _plan(capsys, *args) -> tuple[int, dict]:
    code = main(["plan", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("memory_gib", [24, 80])
def test_plan_answers_for_large_with_the_fewest_stages_that_fit(capsys, memory_gib):
    code, report = _plan(capsys, "--preset", "large", "--memory-gib", str(memory_gib))
    assert code == 0 and report["fits"] and report["model"]["num_layers"] == 32
    stages = report["num_stages"]
    assert len(report["stages"]) == stages
    assert all(s["bytes"]["total"] <= 0.9 * memory_gib * GIB for s in report["stages"])
    covered = [layer for s in report["stages"] for layer in range(s["layers"][0], s["layers"][1] + 1)]
    assert covered == list(range(32))
    # no fewer stages fit with any of the settings plan tries
    cfg = load_config(overrides=["model.preset=large"])
    llama = resolve_llama_config(cfg.model, cfg.data.vocab_size)
    assert find_plan(cfg, llama, 0.9 * memory_gib * GIB, "cuda", max_stages=stages - 1) is None


def test_more_memory_needs_fewer_stages(capsys):
    small_card = _plan(capsys, "--preset", "large", "--memory-gib", "24")[1]["num_stages"]
    big_card = _plan(capsys, "--preset", "large", "--memory-gib", "80")[1]["num_stages"]
    assert big_card < small_card


def test_plan_turns_on_checkpointing_before_it_adds_a_stage(capsys):
    from noloco_node.cli.plan import Settings, with_settings
    from noloco_node.model.memory import estimate_for_run

    sets = ["model.preset=medium", "model.seq_len=2048", "pipeline.batch_size=16", "pipeline.microbatch_size=4"]
    cfg = load_config(overrides=sets)
    llama = resolve_llama_config(cfg.model, cfg.data.vocab_size)
    need = {}
    for checkpointing in (False, True):
        one = with_settings(cfg, 1, Settings(checkpointing, "exact", 8))
        need[checkpointing] = estimate_for_run(one, llama, [range(24)], 0, "cuda").total
    assert need[True] < need[False]
    between = (need[True] + need[False]) / 2 / 0.9 / GIB  # one stage fits only with checkpointing
    code, report = _plan(capsys, *[a for s in sets for a in ("--set", s)], "--memory-gib", f"{between:.3f}")
    assert code == 0 and report["num_stages"] == 1 and report["settings"]["pipeline.activation_checkpointing"] is True
    code, report = _plan(capsys, *[a for s in sets for a in ("--set", s)], "--memory-gib", f"{need[False] / 0.9 / GIB + 1:.3f}")
    assert report["num_stages"] == 1 and report["settings"]["pipeline.activation_checkpointing"] is False


def test_plan_says_when_nothing_fits_and_needs_a_speed_for_a_link(capsys):
    code, report = _plan(capsys, "--preset", "large", "--memory-gib", "1")
    assert code == 1 and not report["fits"] and "seq_len" in report["problem"]
    assert main(["plan", "--preset", "tiny", "--memory-gib", "8", "--link", "100"]) == 2
    assert "--device-tflops" in capsys.readouterr().err


def test_plan_with_a_link_predicts_the_ratio_per_schedule(capsys):
    code, report = _plan(capsys, "--preset", "medium", "--memory-gib", "80", "--link", "100", "--rtt", "30",
                         "--gpu", "h100")
    assert code == 0
    link = report["link"]
    for key in ("exact/outer_blocking", "exact/outer_overlap", "overlap/outer_blocking", "overlap/outer_overlap"):
        assert 0 < link[key]["ratio"] < 1
    assert link["exact/outer_overlap"]["ratio"] >= link["exact/outer_blocking"]["ratio"]


# ---- the link model -------------------------------------------------------------------------------
def _costs(**settings):
    cfg = load_config(overrides=["model.preset=medium", "pipeline.num_stages=2", "model.seq_len=1024"])
    config, ranges = run_model(cfg, 4096)
    base = dict(microbatch=4, seq_len=1024, microbatches_per_batch=4, max_in_flight=8, inner_steps_per_outer=50)
    base.update(settings)
    return pipeline_costs(config, ranges, **base)


@pytest.mark.parametrize("schedule", ["exact", "overlap"])
@pytest.mark.parametrize("overlap", [False, True])
def test_an_unlimited_link_loses_nothing(schedule, overlap):
    pred = predict(_costs(schedule=schedule, outer_overlap=overlap), tflops=989, link=Link(math.inf, 0.0))
    assert pred.ratio == 1.0 and pred.step_s == pred.step_unlimited_s and pred.outer_s == 0.0


@pytest.mark.parametrize("schedule", ["exact", "overlap"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_ratio_falls_as_the_link_slows_and_the_rtt_grows(schedule, overlap):
    costs = _costs(schedule=schedule, outer_overlap=overlap)
    ratios = [predict(costs, tflops=989, link=Link(mbit, 20)).ratio for mbit in (1e6, 1e4, 1e3, 100, 10)]
    assert all(a >= b for a, b in zip(ratios, ratios[1:])) and ratios[0] > 0.9 > 0.1 > ratios[-1]
    rtts = [predict(costs, tflops=989, link=Link(1000, rtt)).ratio for rtt in (0, 10, 100, 1000)]
    assert all(a >= b for a, b in zip(rtts, rtts[1:])) and rtts[0] > rtts[-1]


def test_an_overlapped_outer_exchange_never_predicts_less_than_a_blocking_one():
    for codec in ("bf16", "int8", "int4"):
        for mbit in (1e5, 1000, 100, 10, 1):
            for rtt in (0, 50):
                for schedule in ("exact", "overlap"):
                    kwargs = dict(schedule=schedule, activation_codec=codec)
                    blocking = predict(_costs(outer_overlap=False, **kwargs), tflops=989, link=Link(mbit, rtt))
                    overlapped = predict(_costs(outer_overlap=True, **kwargs), tflops=989, link=Link(mbit, rtt))
                    assert overlapped.ratio >= blocking.ratio, (codec, mbit, rtt, schedule)


def test_fewer_bytes_per_hop_predict_more_and_the_figures_add_up():
    bf16, int4 = (predict(_costs(activation_codec=c), tflops=989, link=Link(100, 30)) for c in ("bf16", "int4"))
    assert int4.ratio > bf16.ratio
    # medium, microbatch 4 x 1024 tokens: 8.4 M activation values, 16.8 MB in bf16 (issue 26's figure)
    assert bf16.extra["hop_bytes"] == 4 * 1024 * 2048 * 2
    assert bf16.uplink_s[0] == pytest.approx(4 * 1024 * 2048 * 2 * 8 / 100e6)
    assert bf16.outer_s == pytest.approx(bf16.extra["outer_bytes_per_stage"] * 8 / 100e6 + 0.06)


def test_config_show_prints_the_model_the_run_trains_and_its_split(capsys):
    assert main(["config", "show", "--set", "model.preset=small", "--set", "pipeline.num_stages=3"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["model"]["hidden_size"], shown["model"]["num_layers"], shown["model"]["num_heads"]) == (768, 12, 12)
    assert shown["model"]["intermediate_size"] == 3072 and shown["model_resolved"]["vocab_size"] == 4096
    stages = shown["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2] and sum(s["num_layers"] for s in stages) == 12
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 11
    assert sum(s["parameters"] for s in stages) == shown["model_resolved"]["parameters"]
