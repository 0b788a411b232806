"""Which decoder layers each pipeline stage holds, what a layer costs per token, and which layers a
residual subspace constrains: pure functions of the model's shape, no torch."""

from __future__ import annotations

FREE_FINAL_LAYERS = 1
"""The last decoder layers that stay dense under a residual subspace (model/subspace.py)."""


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous decoder-layer ranges, one per stage, as even as possible.

    When num_layers is not a multiple of num_stages, the extra layers go to the stages after
    stage 0 (which also carries the token embedding), starting with stage 1.

    >>> [list(r) for r in stage_layer_ranges(5, 2)]
    [[0, 1], [2, 3, 4]]
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} decoder layers into {num_stages} stages: every stage needs >= 1 layer"
        )
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if 1 <= s <= extra else 0) for s in range(num_stages)]
    if extra and num_stages == 1:
        sizes = [num_layers]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def per_token_costs(
    *, hidden: int, intermediate: int, kv_hidden: int, vocab: int, seq_len: int
) -> tuple[float, float, float]:
    """(embedding, one decoder layer, final norm + LM head): multiply-adds per token of the forward
    pass (backward is ~2x of each, so the proportions hold for a training step).

    A layer: q and o projections (2 h^2), k and v (2 h kv), SwiGLU (3 h I), and attention scores
    and values over on average T/2 earlier positions (2 * T/2 * h). The embedding is a lookup (h);
    the head is h V plus the norm (h)."""
    layer = 2 * hidden * hidden + 2 * hidden * kv_hidden + 3 * hidden * intermediate + seq_len * hidden
    return float(hidden), float(layer), float(hidden * vocab + hidden)


def model_costs(config, *, seq_len: int) -> tuple[float, float, float]:
    """(embedding, one decoder layer, final norm + LM head) per token of a model given by its
    LlamaConfig (`per_token_costs`; only its sizes are read)."""
    heads = config.num_attention_heads
    kv_hidden = config.hidden_size * (config.num_key_value_heads or heads) // heads
    return per_token_costs(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        kv_hidden=kv_hidden,
        vocab=config.vocab_size,
        seq_len=seq_len,
    )


def constrained_layers(num_layers: int) -> range:
    """The decoder layers whose output projections live in the subspace (all but the last FREE_FINAL_LAYERS)."""
    return range(max(0, num_layers - FREE_FINAL_LAYERS))


def balanced_layer_ranges(
    num_layers: int, num_stages: int, *, embed_cost: float, layer_cost: float, head_cost: float
) -> list[range]:
    """Contiguous ranges (>= 1 layer each) minimising the most expensive stage, where stage 0 also
    pays `embed_cost` and the last stage `head_cost` per token. Among equally good splits the one
    that puts layers earliest wins, so every node computes the same split.

    >>> [len(r) for r in balanced_layer_ranges(4, 2, embed_cost=0, layer_cost=1, head_cost=2)]
    [3, 1]
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} decoder layers into {num_stages} stages: every stage needs >= 1 layer"
        )

    def cost(stage: int, layers: int) -> float:
        return (
            layers * layer_cost + (embed_cost if stage == 0 else 0.0) + (head_cost if stage == num_stages - 1 else 0.0)
        )

    # best[s][n]: the smallest possible maximum stage cost placing the first n layers on stages 0..s.
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    choice = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for n in range(1, num_layers + 1):
        best[0][n] = cost(0, n)
        choice[0][n] = n
    for s in range(1, num_stages):
        for n in range(s + 1, num_layers + 1):
            for last in range(n - s, 0, -1):  # more layers on this stage first: ties keep layers early
                value = max(best[s - 1][n - last], cost(s, last))
                if value < best[s][n] - 1e-9 * max(1.0, value):
                    best[s][n], choice[s][n] = value, last
    sizes, n = [], num_layers
    for s in range(num_stages - 1, -1, -1):
        sizes.append(choice[s][n])
        n -= choice[s][n]
    sizes.reverse()
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def ranges_from_counts(counts: list[int] | tuple[int, ...], num_layers: int, num_stages: int) -> list[range]:
    """Ranges from explicit layer counts per stage; raises ValueError saying what is wrong."""
    if len(counts) != num_stages:
        raise ValueError(f"has {len(counts)} entries but the pipeline has {num_stages} stages")
    if any(c < 1 for c in counts):
        raise ValueError(f"{list(counts)} gives a stage no decoder layer; every stage needs >= 1")
    if sum(counts) != num_layers:
        raise ValueError(f"{list(counts)} sums to {sum(counts)} but the model has {num_layers} decoder layers")
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges
