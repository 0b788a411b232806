"""A node's page: what it contributes and how it is doing, from its stats and record."""

import dataclasses
import logging

import torch

from noloco_node.dashboard.node_view import LastProblem, NodeView, node_json, partners, training_flops_per_token

from ..node.stats_sample import DRIVER, WORK, sample_stats

STATS = sample_stats(work=dataclasses.replace(WORK, tokens=1000, inner_steps=7, bytes_sent=100, bytes_received=70))
RECORD = {
    "status": "serving",
    "version": "0.2.0",
    "run_id": "r",
    "manifest_hash": "m",
    "reach": "relayed",
    "link_mbit_s": 20.0,
    "memory_estimate_bytes": 10,
    "memory_peak_bytes": 8,
}


def test_node_json_counts_what_the_node_contributed_and_its_health():
    out = node_json(STATS, RECORD, online_s=5400.0, flops_per_token=6e6, method="noloco", last_error=None, now=1.0)
    c, h = out["contribution"], out["health"]
    assert out["schema"] == "noloco-node/node/1" and out["swarm_page"] == "/swarm"
    assert (
        c["flops"] == 6e9
        and c["hours_online"] == 1.5
        and c["microbatches_served"] == 7
        and c["microbatches_driven"] == 15
    )
    assert c["bytes_sent"] == 600 and c["outer_rounds"] == 2 and c["outer_paired"] == 1 and c["partners"] == {"p1": 1}
    assert h["reach"] == "relayed" and h["loss"] == 8.0 and h["attention"] == ["note"] and h["last_error"] is None
    later = node_json(
        dataclasses.replace(STATS, driver=dataclasses.replace(DRIVER, losses=[])),
        RECORD,
        online_s=1.0,
        flops_per_token=1.0,
        method="none",
        last_error=None,
    )
    assert later["health"]["loss"] is None


def test_partners_count_only_paired_rounds():
    assert partners(
        [{"outcome": "paired", "partner": "a"}, {"outcome": "solo", "partner": "b"}, {"outcome": "paired"}]
    ) == {"a": 1}


def test_flops_per_token_count_matrices_and_attention_not_the_embedding_lookup():
    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"hidden_size": 4})()
            self.layer_range = range(2)
            self.embed_tokens = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 8, bias=False)
            self.norm = torch.nn.LayerNorm(4)

    assert training_flops_per_token(Stage(), seq_len=16) == 6.0 * (32 + 2 * 16 * 4)


async def test_the_view_samples_loss_per_step_and_remembers_the_last_warning():
    stats = [STATS]
    with LastProblem() as problems:
        view = NodeView(lambda: (stats[0], RECORD), method="noloco", flops_per_token=1.0, poll_s=1.0, problems=problems)
        view.sample()
        view.sample()  # same step, same loss: one point
        stats[0] = dataclasses.replace(
            STATS,
            work=dataclasses.replace(STATS.work, inner_steps=8),
            driver=dataclasses.replace(DRIVER, losses=[5.0, 4.0, 3.5]),
        )
        view.sample()
        logging.getLogger("noloco_node.sync.noloco").warning("outer round %d went solo", 4)
        logging.getLogger("elsewhere").error("not ours")
        page = await view.node()
    history = await view.history_json()
    assert [p[1:] for p in history["loss"]] == [[7, 8.0], [8, 3.5]] and len(history["tokens_per_s"]) == 3
    assert page["health"]["last_error"]["message"] == "outer round 4 went solo"
    assert page["health"]["last_error"]["level"] == "warning"
    assert problems not in logging.getLogger("noloco_node").handlers
