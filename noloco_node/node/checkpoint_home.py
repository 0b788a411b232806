"""Where `join` keeps a node's checkpoints when the config names no directory: a slot of its own
under the user's state directory, `$XDG_STATE_HOME/noloco-node/<run_id>/<config>/node-<n>`
(`~/.local/state/...` by default; <config> a fingerprint of the config, so that another model under
the same run id never meets this one's checkpoints), n the lowest slot no running node holds, or,
for `--stage S`, the free slot holding S's checkpoint (never one holding only other stages'), and
for `--stage auto` on a machine whose stopped nodes left checkpoints of several stages, the free
slot holding a stage the swarm has no replica of (`join` asks the swarm first: cli/join.py).

A slot is held by an exclusive `flock` on its lock file for the life of the process, so two nodes
started on one machine never share a directory, and a node started again after the last one
stopped (or was killed: the kernel drops the lock with the process) gets the same slot back and
resumes from its checkpoint."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path
from typing import Sequence

from noloco_node.config import ConfigError

LOCK_NAME = ".held-by-a-running-node"
MAX_SLOTS = 64


def state_home() -> Path:
    """The XDG state directory of noloco-node (created on first use by the slot)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / "noloco-node"


def config_fingerprint(config) -> str:
    """Tells apart configs that share a run id (a `--set model.seq_len=64` is another model): the
    manifest's config part, and the paths of its data, tokenizer and model files, whose contents the
    manifest hash itself checks when a checkpoint is resumed."""
    data, model = config.data, config.model
    return config.manifest_hash(
        f"data:{data.path}", f"tokenizer:{data.tokenizer}", f"model-files:{model.config}|{model.init_from}"
    )[:12]


def run_directory(run_id: str, fingerprint: str, home: Path | None = None) -> Path:
    """The config's folder under the state home; characters outside [A-Za-z0-9_.-] become `_`."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id).lstrip(".") or "_"
    return (home or state_home()) / safe / fingerprint


class CheckpointSlot:
    """One node's checkpoint directory, held until `release()` (or the process ends)."""

    def __init__(self, directory: Path, lock_fd: int, *, named: bool = False) -> None:
        self.directory, self._lock_fd = directory, lock_fd
        self.named = named  # the config's checkpoint.dir, not a slot of the state home

    @classmethod
    def claim(
        cls,
        run_id: str,
        fingerprint: str,
        *,
        home: Path | None = None,
        slots: int = MAX_SLOTS,
        prefer: Sequence[Path] = (),
        avoid: Sequence[Path] = (),
    ) -> CheckpointSlot:
        """The first free slot of `prefer` (slots of this run and config), else the lowest free
        slot not in `avoid` (a new one past them if need be); ConfigError naming checkpoint.dir
        when none can be had."""
        run_dir = run_directory(run_id, fingerprint, home)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                "checkpoint.dir",
                f"cannot create the default checkpoint folder {run_dir}: {e.strerror}",
                "set checkpoint.dir to a writable folder, or checkpoint.auto = false for no checkpoints",
            ) from None
        preferred = [Path(p) for p in prefer if Path(p).parent == run_dir]
        avoided = {Path(p) for p in avoid}
        numbered = (run_dir / f"node-{n}" for n in range(slots))
        for directory in [*preferred, *(d for d in numbered if d not in avoided)]:
            directory.mkdir(exist_ok=True)
            if (fd := _lock(directory)) is not None:
                return cls(directory, fd)
        raise ConfigError(
            "checkpoint.dir",
            f"all {slots} default checkpoint folders under {run_dir} are held by running nodes",
            "set checkpoint.dir for this node",
        )

    @staticmethod
    def free_slots(run_id: str, fingerprint: str, *, home: Path | None = None) -> list[Path]:
        """The existing slots of this run and config that no running node holds, lowest first."""
        run_dir = run_directory(run_id, fingerprint, home)
        found = sorted(run_dir.glob("node-*"), key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else MAX_SLOTS)
        free = []
        for directory in found:
            if directory.is_dir() and (fd := _lock(directory)) is not None:
                os.close(fd)  # only looked: the claim takes it for good
                free.append(directory)
        return free

    @classmethod
    def hold(cls, directory: Path) -> CheckpointSlot:
        """A folder the config names (checkpoint.dir), held as a slot is: two nodes given one folder
        overwrote and pruned each other's checkpoints (a newcomer's audit lost a stop checkpoint)."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = _lock(directory)
        except OSError as e:
            raise ConfigError(
                "checkpoint.dir", f"cannot use {directory}: {e.strerror}", "set checkpoint.dir to a writable folder"
            ) from None
        if fd is None:
            raise ConfigError(
                "checkpoint.dir",
                f"{directory} is held by another running node of this machine",
                "give each node its own folder (or leave checkpoint.dir unset: each node then gets one)",
            )
        return cls(directory, fd, named=True)

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the only descriptor drops the flock
            self._lock_fd = -1

    def __enter__(self) -> CheckpointSlot:
        return self

    def __exit__(self, *_exc) -> None:
        self.release()


def unserved_first(stages_by_slot: dict[Path, list[int]], served: set[int]) -> list[Path]:
    """The free slots whose one checkpointed stage no live replica serves, lowest first: there our
    weights are the stage's only copy, and the lowest free slot may hold a stage others serve."""
    return [slot for slot, stages in stages_by_slot.items() if len(stages) == 1 and stages[0] not in served]


def stage_slots_first(stages_by_slot: dict[Path, list[int]], stage: int, saved_step) -> tuple[list[Path], list[Path]]:
    """For a node pinned to `stage`: (the free slots holding a checkpoint of it, furthest trained
    first; the free slots holding only other stages' checkpoints, which it must not take: it would
    start from its initial weights beside them, and a later `--stage auto` would resume those)."""
    mine = sorted((s for s, stages in stages_by_slot.items() if stage in stages), key=lambda s: -saved_step(s))
    others = [s for s, stages in stages_by_slot.items() if stages and stage not in stages]
    return mine, others


def _lock(directory: Path) -> int | None:
    """An fd holding the slot's exclusive lock, or None when a running node holds it."""
    fd = os.open(directory / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
