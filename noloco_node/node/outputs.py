"""What a node writes when it stops: its stats file (node/stats.py) and, on request, its weights."""

from __future__ import annotations

import json
from pathlib import Path

from noloco_node.runtime.files import atomic_write_text
from noloco_node.sync.transfer import counters_json, export_state

WEIGHTS_METADATA = "noloco_node"
"""The safetensors metadata key whose JSON says whose weights a file holds (run, manifest, stage,
inner step, outer round): what `export --from-checkpoint` reads to take them."""


def write_outputs(node, out_dir: Path) -> None:
    """The stats JSON (and, with save_weights, theta and the outer state) under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"stage{node.stage_index}-{node.peer_id[-8:]}"
    atomic_write_text(out_dir / f"{name}.json", json.dumps(node.read_stats().to_dict(), indent=1))
    if not node.outputs.save_weights:
        return
    from safetensors.torch import save_file

    parts = node.parts
    whose = {
        "run_id": node.config.run.run_id,
        "manifest_hash": node.manifest_hash,
        "stage": node.stage_index,
        "inner_step": parts.worker.inner_steps,
        "outer_round": parts.outer_state.round if parts.outer_state is not None else 0,
    }
    save_file(
        {k: v.detach().contiguous() for k, v in parts.stage.state_dict().items()},
        str(out_dir / f"{name}.safetensors"),
        metadata={WEIGHTS_METADATA: json.dumps(whose)},
    )
    if parts.outer_state is not None:
        tensors, counters = export_state(parts.outer_state, parts.worker.inner, inner_step=parts.worker.inner_steps)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(out_dir / f"{name}.outer.safetensors"),
            metadata={"counters": counters_json(counters), WEIGHTS_METADATA: json.dumps(whose)},
        )
