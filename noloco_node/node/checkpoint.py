"""Node checkpoints: fast weights, slow weights, outer momentum, Adam moments and counters in
safetensors, plus a small JSON that names the file. Written atomically (temp file + rename, the
JSON last), so a crash mid-write leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from noloco_node.optim.inner import InnerOptimizer
from noloco_node.optim.state import OuterState
from noloco_node.runtime.files import atomic_write


def collect(stage: nn.Module, inner: InnerOptimizer, outer: OuterState | None) -> tuple[dict[str, Tensor], dict]:
    """A consistent copy of the node's training state (run it on the compute thread)."""
    tensors = {f"theta/{n}": p.detach().to("cpu", copy=True).contiguous() for n, p in stage.named_parameters()}
    moments, adam_steps = inner.export_moments({id(p): n for n, p in stage.named_parameters()})
    tensors.update({k: v.to("cpu").contiguous() for k, v in moments.items()})
    if outer is not None:
        tensors.update({k: v.detach().to("cpu", copy=True).contiguous() for k, v in outer.state_dict().items()})
    counters = {
        "inner_step": inner.step_count,
        "outer_round": outer.round if outer is not None else 0,
        "adam_steps": adam_steps,
    }
    return tensors, counters


def save(directory: Path, stage_index: int, tensors: dict[str, Tensor], counters: dict, identity: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    _set_aside_another_runs(directory, stage_index, identity)
    step = counters["inner_step"]
    weights = directory / f"stage{stage_index}-step{step}.safetensors"
    atomic_write(weights, lambda tmp: save_file(tensors, str(tmp)))
    meta = {**identity, **counters, "stage": stage_index, "file": weights.name, "saved_at": time.time()}
    atomic_write(directory / f"stage{stage_index}.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    for old in directory.glob(f"stage{stage_index}-step*.safetensors"):
        if old != weights:
            old.unlink(missing_ok=True)
    return weights


def of_run(meta: dict, run_id: str, manifest_hash: str) -> bool:
    """Whether a checkpoint's JSON says it belongs to this run and manifest."""
    return (meta.get("run_id"), meta.get("manifest_hash")) == (run_id, manifest_hash)


def _set_aside_another_runs(directory: Path, stage_index: int, identity: dict) -> None:
    """A checkpoint of this stage from another run or manifest is never written over: it moves to
    `other-<its manifest>/` beside ours (a node started with another config in the same folder
    once replaced a run's 961 trained steps with its own step 0)."""
    meta = saved_meta(directory, stage_index)
    if meta is None or of_run(meta, identity["run_id"], identity["manifest_hash"]):
        return
    aside = directory / f"other-{str(meta.get('manifest_hash', 'unknown'))[:16]}"
    aside.mkdir(exist_ok=True)
    weights = directory / str(meta.get("file", ""))
    if weights.name and weights.is_file():
        weights.replace(aside / weights.name)
    (directory / f"stage{stage_index}.json").replace(aside / f"stage{stage_index}.json")
    logging.getLogger(__name__).warning(
        "the checkpoint of stage %d in %s belongs to run %s / manifest %s: moved to %s, not written over",
        stage_index,
        directory,
        meta.get("run_id"),
        meta.get("manifest_hash"),
        aside,
    )


def stages_in(directory: Path, run_id: str, manifest_hash: str) -> list[int]:
    """Stages that `directory` holds a checkpoint of for this run and manifest (what `--stage auto`
    resumes; a checkpoint of another config it would only ignore)."""
    stages = []
    for meta_path in sorted(directory.glob("stage*.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if of_run(meta, run_id, manifest_hash) and isinstance(meta.get("stage"), int):
            stages.append(meta["stage"])
    return sorted(set(stages))


def saved_meta(directory: Path, stage_index: int) -> dict | None:
    """The JSON beside this stage's checkpoint (no tensors read), or None when there is none."""
    try:
        return json.loads((directory / f"stage{stage_index}.json").read_text())
    except (OSError, ValueError):
        return None


class DamagedCheckpoint(ValueError):
    """A checkpoint whose JSON or weights cannot be read (a disk that filled or failed mid-copy)."""


def load(directory: Path, stage_index: int) -> tuple[dict[str, Tensor], dict] | None:
    meta_path = directory / f"stage{stage_index}.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        return load_file(str(directory / meta["file"])), meta
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise DamagedCheckpoint(f"{exc}") from None


def set_aside_damaged(directory: Path, stage_index: int) -> Path:
    """Move a damaged checkpoint of this stage (its JSON and the file it names) to `damaged-<time>/`
    beside it: never deleted, never read again."""
    aside = directory / f"damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(exist_ok=True)
    meta_path = directory / f"stage{stage_index}.json"
    meta = saved_meta(directory, stage_index) or {}
    weights = directory / str(meta.get("file", ""))
    for path in (weights, meta_path):
        if path.name and path.is_file():
            path.replace(aside / path.name)
    return aside


def restore(
    stage: nn.Module, inner: InnerOptimizer, outer: OuterState | None, tensors: dict[str, Tensor], meta: dict
) -> None:
    """Put a checkpoint back (on the compute thread): theta, then phi and m, Adam, counters."""
    with torch.no_grad():
        for name, param in stage.named_parameters():
            param.copy_(tensors[f"theta/{name}"])
    if outer is not None and any(k.startswith("phi/") for k in tensors):
        thetas = {n: p.detach().clone() for n, p in stage.named_parameters()}
        outer.load_state_dict(tensors, round_index=int(meta["outer_round"]))  # sets theta <- phi ...
        with torch.no_grad():
            for name, param in stage.named_parameters():  # ... so put the checkpointed theta back
                param.copy_(thetas[name])
    inner.import_moments(stage.named_parameters(), tensors, meta["adam_steps"])
    inner.step_count = int(meta["inner_step"])


class Checkpointer:
    """Saves this node's training state every `every_steps` inner steps (and when asked), and
    resumes from the directory's checkpoint of its stage if one belongs to this run."""

    def __init__(
        self,
        directory: Path,
        every_steps: int,
        *,
        identity: dict,
        compute,
        stage: nn.Module,
        inner: InnerOptimizer,
        outer: OuterState | None,
    ) -> None:
        """`identity`: {run_id, manifest_hash, peer_id}, written with every checkpoint."""
        self.directory, self.every_steps, self.identity = directory, every_steps, identity
        self.compute, self.stage, self.inner, self.outer = compute, stage, inner, outer
        self.last_saved: dict = {}  # the counters of the last checkpoint written

    def due(self, inner_step: int) -> bool:
        return inner_step % self.every_steps == 0

    async def save(self, stage_index: int, microbatches: dict | None = None) -> Path:
        """`microbatches`: stage 0's driver accounting, taken between batches (every microbatch so
        far is completed or dropped), so a restarted driver carries it on."""
        import asyncio

        tensors, counters = await self.compute.run(collect, self.stage, self.inner, self.outer)
        if microbatches is not None:
            counters["microbatches"] = microbatches
        path = await asyncio.to_thread(save, self.directory, stage_index, tensors, counters, self.identity)
        self.last_saved = counters
        return path

    async def saved_step(self, stage_index: int) -> int | None:
        """The inner step of this run's checkpoint of `stage_index` here, or None."""
        import asyncio

        meta = await asyncio.to_thread(saved_meta, self.directory, stage_index)
        if meta is None or not of_run(meta, self.identity["run_id"], self.identity["manifest_hash"]):
            return None
        return int(meta.get("inner_step", 0))

    async def resume(self, stage_index: int) -> dict | None:
        """Restore this stage's checkpoint if it is this run's; {inner_step, outer_round, file,
        microbatches} or None."""
        import asyncio

        try:
            found = await asyncio.to_thread(load, self.directory, stage_index)
        except DamagedCheckpoint as exc:
            aside = await asyncio.to_thread(set_aside_damaged, self.directory, stage_index)
            logging.getLogger(__name__).warning(
                "the checkpoint of stage %d in %s cannot be read (%s): moved to %s; this node takes the "
                "stage's state from a live replica if one serves it, else starts from the run's initial weights",
                stage_index,
                self.directory,
                exc,
                aside,
            )
            return None
        if found is None:
            return None
        tensors, meta = found
        if not of_run(meta, self.identity["run_id"], self.identity["manifest_hash"]):
            logging.getLogger(__name__).warning(
                "ignoring the checkpoint in %s: it belongs to run %s / manifest %s",
                self.directory,
                meta.get("run_id"),
                meta.get("manifest_hash"),
            )
            return None
        await self.compute.run(restore, self.stage, self.inner, self.outer, tensors, meta)
        return {
            "inner_step": int(meta["inner_step"]),
            "outer_round": int(meta["outer_round"]),
            "file": meta["file"],
            "microbatches": meta.get("microbatches"),
        }
