"""`noloco-node plan` with a link: the run settings the link asks for, together (cli/plan_together.py)."""

import json

import pytest
import torch

from noloco_node.cli.main import main

HOME = ["--preset", "medium", "--memory-gib", "24", "--uplink", "20", "--downlink", "100", "--rtt", "40"]
SPEED = ["--device-tflops", "165"]


def _plan(capsys, *args) -> dict:
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _plan_row(report: dict) -> dict:
    link = report["link"]
    return link[f"{report['settings']['pipeline.schedule']}/{link['outer']}"]


def test_a_home_uplink_gets_the_levers_together_and_plan_with_them_predicts_the_same(capsys):
    """medium on 24 GB cards at 20 Mbit/s up: the dense round does not hide and a subspace pays,
    together many times the configured run's tokens/s; planned with exactly those settings as
    --set flags, plan's own prediction is the one `together` gave."""
    report = _plan(capsys, *HOME, *SPEED)
    together = report["link"]["together"]
    settings = together["settings"]
    assert {"outer.codec_phi", "outer.codec_delta", "model.residual_subspace"} <= set(settings)
    assert settings["model.residual_subspace"] in (2048 // 8, 2048 // 16)
    assert together["configured_ratio"] == _plan_row(report)["ratio"]
    assert together["ratio"] > 5 * together["configured_ratio"]
    assert together["tokens_per_s_vs_configured"] > 5 and together["subspace_token_price"] > 1
    assert all(step["why"] and step["price"] for step in together["steps"])
    assert {k: v for step in together["steps"] for k, v in step["settings"].items()} == settings

    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    again = _plan(capsys, *HOME, *SPEED, *sets)
    assert again["num_stages"] == together["num_stages"]
    assert _plan_row(again)["ratio"] == together["ratio"]
    assert again["link"]["together"] is None or again["link"]["together"]["ratio"] >= together["ratio"]


def test_one_stage_never_gets_hop_settings(capsys):
    """The whole model on one card sends no hops: no subspace, no hop codec; the round still."""
    report = _plan(capsys, "--preset", "medium", "--memory-gib", "80", "--uplink", "20", "--gpu", "h100")
    assert report["num_stages"] == 1
    settings = report["link"]["together"]["settings"]
    assert "outer.codec_phi" in settings
    assert not {"model.residual_subspace", "pipeline.activation_codec", "pipeline.gradient_codec"} & set(settings)


def test_a_link_that_loses_nothing_asks_for_nothing(capsys):
    report = _plan(
        capsys, "--preset", "medium", "--memory-gib", "80", "--link", "1000000", "--rtt", "0", "--gpu", "h100"
    )
    assert _plan_row(report)["ratio"] > 0.99 and report["link"]["together"] is None
    assert (
        main(["plan", "--preset", "medium", "--memory-gib", "80", "--link", "1000000", "--rtt", "0", "--gpu", "h100"])
        == 0
    )
    assert "together: nothing more pays on this link" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine reads its own card's memory")
def test_a_named_card_is_planned_as_a_card_not_as_this_machines_cpu(capsys):
    """A newcomer's plan on a CPU machine with --gpu h100 said 'device: cpu' beside an H100's speed."""
    assert main(["plan", "--preset", "medium", "--link", "20", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert "--memory-gib" in err and "no GPU" in err
    report = _plan(capsys, "--preset", "medium", "--memory-gib", "24", "--link", "20", "--gpu", "rtx4090")
    assert report["device"] == "cuda" and report["link"]["device_tflops"] == 165.2
