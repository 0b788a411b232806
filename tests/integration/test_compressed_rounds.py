"""The compressed outer exchange between real processes (codec_phi = slice:0.01, codec_delta =
topk:0.02+int2, the smallest measured in docs/experiments/outer_compression): D = 4 replicas of one stage
(P = 1) train with NoLoCo, pair over gRPC, and each round's snapshot, counted on the wire (tensor
headers and payloads, as the outer client counts them), is at most 2% of the same stage's fp32
phi + Delta."""

import pytest

from noloco_node.config import load_config

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
REPLICAS, STEPS, H = 4, 8, 2


def test_four_replicas_pair_with_compressed_rounds_in_two_percent_of_fp32(tmp_path, make_swarm):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "model.hidden_size": 128,
            "model.intermediate_size": 256,
            "model.num_layers": 2,
            "pipeline.num_stages": 1,
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": H,
            "inner.total_steps": STEPS,
            "timeouts.match_s": 6.0,
            "outer.codec_phi": "slice:0.01",
            "outer.codec_delta": "topk:0.02+int2",
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    nodes = [swarm.start_node(0, r, "--steps", str(STEPS), "--wait-replicas", str(REPLICAS)) for r in range(REPLICAS)]
    swarm.wait_ready(nodes)
    swarm.wait_exit(nodes, timeout_s=240)
    assert all(n.proc.returncode == 0 for n in nodes), [n.log_file.read_text()[-3000:] for n in nodes]
    swarm.stop()

    stats = swarm.node_stats()
    params = None
    partners = set()
    for node in nodes:
        s = stats[node.info["peer_id"]]
        assert s["inner_steps"] == STEPS
        history = s["outer_history"]
        paired = [h for h in history if h["outcome"] == "paired"]
        assert len(history) == STEPS // H and paired, history
        partners.update((s["peer_id"], h["partner"]) for h in paired)
        per_round = s["bytes_sent_outer"] / len(paired)  # only paired rounds send
        if params is None:
            params = _stage_params(overrides)
        fp32 = 8 * params  # phi and Delta, 4 bytes per parameter each
        print(
            f"\n{s['peer_id'][-8:]}: {per_round:.0f} B per round on the wire, {per_round / fp32:.4%} of fp32 "
            f"phi + Delta ({fp32} B); payload {s['outer_bytes_per_round']}; {len(paired)}/{len(history)} paired"
        )
        assert per_round <= 0.02 * fp32, (per_round, fp32)
        assert s["outer_bytes_per_round"]["fp32_fraction"] < 0.02
    assert len({frozenset(p) for p in partners}) >= 2  # the pairs change between rounds


def _stage_params(overrides: list[str]) -> int:
    """The one stage's parameters: transformers' own count of the whole Llama."""
    from transformers import LlamaForCausalLM

    from noloco_node.model.build import resolve_llama_config

    config = load_config(overrides=overrides)
    return LlamaForCausalLM(resolve_llama_config(config.model, config.data.vocab_size)).num_parameters()
