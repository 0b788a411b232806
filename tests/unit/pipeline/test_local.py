"""The in-process D x P simulation: learning, routing, and each method's outer-step invariants."""

import torch

from noloco_node.config import load_config
from noloco_node.pipeline.local import LocalSimulation

VOCAB = 64


def config(method, stages=2, h=2, **extra):
    overrides = [f"outer.method={method}", f"pipeline.num_stages={stages}", f"outer.inner_steps_per_outer={h}",
                 "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=4", "model.num_heads=4",
                 "model.seq_len=16", "pipeline.batch_size=4", "pipeline.microbatch_size=2",
                 "inner.lr=1e-2", "inner.warmup_steps=1", "inner.total_steps=40"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_config(overrides=overrides)


def batches(num, seed):
    # A learnable sequence task: next token = (token + 1) mod VOCAB.
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        start = torch.randint(0, VOCAB, (4, 1), generator=gen)
        seq = (start + torch.arange(17)) % VOCAB
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def test_noloco_learns_routes_everywhere_and_counts_solo_steps():
    sim = LocalSimulation(config("noloco"), num_replicas=3, vocab_size=VOCAB)
    for step in range(20):
        sim.train_step(batches(3, seed=step))
    assert sum(sim.losses[-3:]) / 3 < 0.6 * sum(sim.losses[:3]) / 3
    # 10 outer rounds x 2 stages x 3 replicas: each round one pair (2 members) and one solo.
    assert sim.outer_rounds == {"paired": 40, "solo": 20}
    routes = sim.routes()
    assert all(len(received) == 3 for received in routes.values())
    assert sim.replica_spread() > 0


def test_diloco_leaves_every_replica_on_the_same_phi():
    sim = LocalSimulation(config("diloco"), num_replicas=3, vocab_size=VOCAB)
    for step in range(2):
        sim.train_step(batches(3, seed=step))
    for row in sim.replicas:
        for name in row[0].outer.phi:
            for other in row[1:]:
                torch.testing.assert_close(other.outer.phi[name], row[0].outer.phi[name], atol=1e-6, rtol=0)
    assert sim.replica_spread() < 1e-6


def test_dp_keeps_replicas_identical_every_step():
    sim = LocalSimulation(config("dp"), num_replicas=2, vocab_size=VOCAB)
    sim.train_step(batches(2, seed=0))
    assert sim.replica_spread() < 1e-7


def test_none_lets_replicas_drift():
    sim = LocalSimulation(config("none"), num_replicas=2, vocab_size=VOCAB)
    for step in range(3):
        sim.train_step(batches(2, seed=step))
    assert sim.replica_spread() > 1e-4
