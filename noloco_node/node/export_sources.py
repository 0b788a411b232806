"""Where `export --from-checkpoint` finds a stage's weights: a node's checkpoint.dir (stage<N>.json
naming its file: node/checkpoint.py) or its `--out` folder of `--save-weights` (stage<N>-<peer>.safetensors
and the outer state beside it, their metadata saying whose they are: node/outputs.py). phi where a
file holds it, else theta (the dp and none methods keep no phi)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from noloco_node.config import NodeConfig
from noloco_node.node.export import ExportError, merge_stages

log = logging.getLogger("noloco_node.node.export")

CHECKPOINT_META = re.compile(r"stage(\d+)\.json")
SAVED_WEIGHTS = re.compile(r"stage(\d+)-(?!step)[^.]+\.safetensors")


def stage_weights(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """A stage's parameters from a checkpoint's tensors: phi if present, else theta."""
    for kind in ("phi", "theta"):
        found = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(kind + "/")}
        if found:
            return found, kind
    raise ExportError("the checkpoint holds neither phi/ nor theta/ tensors")


def gather_checkpoints(dirs: list[Path], *, num_stages: int, manifest_hash: str) -> dict[int, list[tuple[dict, Path]]]:
    """stage -> [(meta, weights file)] of every checkpoint of this run found in `dirs`: a node's
    checkpoint.dir (stage<N>.json naming its file) or its `--out` folder of `--save-weights`
    (stage<N>-<peer>.safetensors, the outer state beside it)."""
    found: dict[int, list[tuple[dict, Path]]] = {}
    entries_of = {Path(directory).expanduser(): _entries(Path(directory).expanduser()) for directory in dirs}
    empty = [directory for directory, entries in entries_of.items() if not entries]
    if len(empty) == len(dirs) or any(not _default_slot(d) for d in empty):
        raise ExportError(_why_empty(empty[0]))
    for directory in empty:  # a default folder of a node that never got to checkpoint (the glob finds it)
        log.info("passing over %s: no checkpoint in it", directory)
    for entries in entries_of.values():
        for meta, weights in entries:
            if meta.get("manifest_hash") != manifest_hash:
                raise ExportError(
                    f"{meta['_source']} is from another run or model (run {meta.get('run_id')!r}, manifest "
                    f"{meta.get('manifest_hash')}; this config gives {manifest_hash}); pass the run's --config / --set"
                )
            found.setdefault(int(meta["stage"]), []).append((meta, weights))
    missing = [s for s in range(num_stages) if s not in found]
    if missing:
        raise ExportError(f"no checkpoint of stage(s) {missing}; every stage of the pipeline is needed")
    return found


def _entries(directory: Path) -> list[tuple[dict, Path]]:
    """(meta, weights file) of the checkpoints and saved weights in `directory`; each meta names
    its `_source` file (and `_outer`, a saved weights' outer state, where there is one)."""
    entries = []
    for meta_path in sorted(directory.glob("stage*.json")):
        if not CHECKPOINT_META.fullmatch(meta_path.name):
            continue  # a node's stats file (stage<N>-<peer>.json)
        try:
            meta = json.loads(meta_path.read_text())
            weights = meta_path.parent / meta["file"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ExportError(f"{meta_path} is not a readable checkpoint ({exc}); move it aside") from None
        entries.append(({**meta, "_source": meta_path}, weights))
    for weights in sorted(directory.glob("stage*.safetensors")):
        if not SAVED_WEIGHTS.fullmatch(weights.name):
            continue  # a checkpoint's own file (stage<N>-step<K>, named in its JSON), or an outer state
        whose = _saved_metadata(weights)
        if whose is None:
            continue  # weights an older version saved: nothing says whose they are
        outer = weights.with_name(weights.name.removesuffix(".safetensors") + ".outer.safetensors")
        entries.append(
            ({**whose, "_source": weights, "_saved": True, "_outer": outer if outer.is_file() else None}, weights)
        )
    return entries


def _saved_metadata(path: Path) -> dict | None:
    from noloco_node.node.outputs import WEIGHTS_METADATA

    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(WEIGHTS_METADATA)
        return None if text is None else dict(json.loads(text))
    except (OSError, ValueError, TypeError, SafetensorError):  # damaged: nothing says whose it is
        return None


def _why_empty(directory: Path) -> str:
    if not directory.exists():
        return f"{directory} does not exist; point --from-checkpoint at the nodes' checkpoint.dir"
    if not directory.is_dir():
        return f"{directory} is a file; point --from-checkpoint at the folder that holds it (checkpoint.dir)"
    if any(directory.glob("stage*-*.json")):
        return (
            f"{directory} holds node stats files but no weights (the nodes ran without --save-weights); "
            "point --from-checkpoint at their checkpoint.dir"
        )
    return f"{directory} holds no node checkpoint (stage<N>.json); point --from-checkpoint at checkpoint.dir"


def load_stage_weights(meta: dict, path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """phi (else theta) of one checkpoint or saved weights; ExportError naming a damaged file."""
    if meta.get("_outer") is not None:
        phi = {k.split("/", 1)[1]: v for k, v in _read(meta["_outer"], meta).items() if k.startswith("phi/")}
        if phi:
            return phi, "phi"
    if meta.get("_saved"):
        return _read(path, meta), "theta"  # saved weights: the stage's own names, no prefix
    return stage_weights(_read(path, meta))


def _read(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:  # safetensors' own errors are not OSErrors
        raise ExportError(
            f"{path} cannot be read ({exc}); it is damaged or incomplete: export from another replica's "
            f"checkpoint of stage {meta.get('stage')}, or from the live swarm (--initial-peers)"
        ) from None


def _default_slot(directory: Path) -> bool:
    """`join`'s own checkpoint folder (node/checkpoint_home.py), which a node that failed to start leaves behind."""
    from noloco_node.node.checkpoint_home import LOCK_NAME

    return (directory.expanduser() / LOCK_NAME).exists()


def weights_from_checkpoints(
    dirs: list[Path], config: NodeConfig, manifest_hash: str, *, average: bool = False
) -> tuple[dict[str, torch.Tensor], str]:
    found = gather_checkpoints(dirs, num_stages=config.pipeline.num_stages, manifest_hash=manifest_hash)
    per_stage, kinds = {}, set()
    for stage, entries in found.items():
        entries = sorted(entries, key=lambda e: -int(e[0].get("inner_step", 0)))
        chosen = entries if average else entries[:1]
        weights = []
        for meta, path in chosen:
            tensors, kind = load_stage_weights(meta, path)
            weights.append(tensors)
            kinds.add(kind)
            log.info(
                "stage %d: %s from %s (inner step %s, outer round %s)",
                stage,
                kind,
                meta.get("_outer") or path,
                meta.get("inner_step"),
                meta.get("outer_round"),
            )
        per_stage[stage] = weights
    return merge_stages(per_stage, average), "+".join(sorted(kinds))
