"""Which decoder layers each pipeline stage holds: a pure function, no torch."""

from __future__ import annotations


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
        raise ValueError(f"cannot split {num_layers} decoder layers into {num_stages} stages: every stage needs >= 1 layer")
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if 1 <= s <= extra else 0) for s in range(num_stages)]
    if extra and num_stages == 1:
        sizes = [num_layers]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges
