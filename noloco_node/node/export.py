"""The trained model out of the swarm, as a standard Hugging Face model directory.

Stage checkpoints hold parameters under the whole `LlamaForCausalLM`'s names (model/stage.py),
so the stages of one run fit together into one state dict. The exported weights are the slow
weights phi (what the outer steps agree on) where a checkpoint holds them, else the fast weights
theta (the dp and none methods keep no phi). With several checkpoints of one stage, `average`
takes their mean; otherwise the newest is used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from noloco_node.config import NodeConfig

if TYPE_CHECKING:
    from noloco_node.dht.directory import PeerDirectory
    from noloco_node.rpc.outer_service import OuterClient
    from noloco_node.transport.links import Links

log = logging.getLogger(__name__)


class ExportError(ValueError):
    pass


STEPS_APART = 100
"""Replicas of one stage further apart than this many inner steps are named when exporting."""


def stage_weights(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """A stage's parameters from a checkpoint's tensors: phi if present, else theta."""
    for kind in ("phi", "theta"):
        found = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(kind + "/")}
        if found:
            return found, kind
    raise ExportError("the checkpoint holds neither phi/ nor theta/ tensors")


def gather_checkpoints(dirs: list[Path], *, num_stages: int, manifest_hash: str) -> dict[int, list[tuple[dict, Path]]]:
    """stage -> [(meta, weights file)] of every checkpoint of this run found in `dirs`."""
    found: dict[int, list[tuple[dict, Path]]] = {}
    metas_of = {directory: sorted(Path(directory).expanduser().glob("stage*.json")) for directory in dirs}
    empty = [str(directory) for directory, metas in metas_of.items() if not metas]
    if len(empty) == len(dirs) or any(not _default_slot(Path(d)) for d in empty):
        raise ExportError(
            f"{empty[0]} holds no node checkpoint (stage<N>.json); point --from-checkpoint at checkpoint.dir"
        )
    for directory in empty:  # a default folder of a node that never got to checkpoint (the glob finds it)
        log.info("passing over %s: no checkpoint in it", directory)
    for metas in metas_of.values():
        for meta_path in metas:
            meta = json.loads(meta_path.read_text())
            if meta.get("manifest_hash") != manifest_hash:
                raise ExportError(
                    f"{meta_path} is from another run or model (manifest {meta.get('manifest_hash')}, this "
                    f"config gives {manifest_hash}); pass the run's --config / --set"
                )
            found.setdefault(int(meta["stage"]), []).append((meta, meta_path.parent / meta["file"]))
    missing = [s for s in range(num_stages) if s not in found]
    if missing:
        raise ExportError(f"no checkpoint of stage(s) {missing}; every stage of the pipeline is needed")
    return found


def _default_slot(directory: Path) -> bool:
    """`join`'s own checkpoint folder (node/checkpoint_home.py), which a node that failed to start leaves behind."""
    from noloco_node.node.checkpoint_home import LOCK_NAME

    return (directory.expanduser() / LOCK_NAME).exists()


def merge_stages(per_stage: dict[int, list[dict[str, torch.Tensor]]], average: bool) -> dict[str, torch.Tensor]:
    """One state dict from each stage's replicas' weights: their mean, or the first."""
    merged: dict[str, torch.Tensor] = {}
    for stage in sorted(per_stage):
        replicas = per_stage[stage]
        for name in replicas[0]:
            if average:
                merged[name] = torch.stack([r[name].double() for r in replicas]).mean(0).to(replicas[0][name].dtype)
            else:
                merged[name] = replicas[0][name]
    return merged


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
            tensors, kind = stage_weights(load_file(str(path)))
            weights.append(tensors)
            kinds.add(kind)
            log.info("stage %d: %s from %s (inner step %s)", stage, kind, path, meta.get("inner_step"))
        per_stage[stage] = weights
    return merge_stages(per_stage, average), "+".join(sorted(kinds))


def write_model_dir(out: Path, llama_config, weights: dict[str, torch.Tensor], tokenizer) -> Path:
    """`config.json`, safetensors weights and the tokenizer: what from_pretrained(out) reads."""
    from transformers import LlamaForCausalLM

    llama_config = llama_config.__class__.from_dict(llama_config.to_dict())
    if getattr(tokenizer, "bos_token_id", None) is not None:
        llama_config.bos_token_id = tokenizer.bos_token_id
    if getattr(tokenizer, "eos_token_id", None) is not None:
        llama_config.eos_token_id = tokenizer.eos_token_id
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config)
    expected = set(model.state_dict())
    if set(weights) != expected:
        raise ExportError(
            f"the stages' weights do not make the whole model: missing {sorted(expected - set(weights))[:5]}, "
            f"unexpected {sorted(set(weights) - expected)[:5]}"
        )
    model.load_state_dict({k: v.contiguous() for k, v in weights.items()}, assign=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _readable_like_the_rest(out)
    return out


def _readable_like_the_rest(out: Path) -> None:
    """safetensors writes its weights 0600 (a private temporary file renamed) while the other
    files follow the umask: give the weights the mode config.json got, so whoever may read the
    model directory (another user, a web server) can load it (a newcomer's export)."""
    mode = (out / "config.json").stat().st_mode & 0o777
    for weights in out.glob("*.safetensors"):
        weights.chmod(mode)


def expected_state(
    llama_config, layer_range: range, stage: int, num_stages: int, subspace_rank: int = 0
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors a donor's FetchState may send for one stage (phi, m, Adam moments), from the
    model's config alone (on the meta device: nothing is allocated), in subspace coordinates
    where the model has a residual subspace of `subspace_rank`."""
    from transformers import LlamaForCausalLM

    from noloco_node.model.subspace import subspace_shape

    with torch.device("meta"):
        full = LlamaForCausalLM(llama_config)
    out = {}
    for name, param in full.named_parameters():
        parts = name.split(".")
        mine = (
            (name.startswith("model.embed_tokens") and stage == 0)
            or (name.startswith(("model.norm", "lm_head")) and stage == num_stages - 1)
            or (parts[:2] == ["model", "layers"] and int(parts[2]) in layer_range)
        )
        if mine:
            shape = subspace_shape(name, tuple(param.shape), subspace_rank, llama_config.num_hidden_layers)
            for kind in ("phi", "momentum", "adam_exp_avg", "adam_exp_avg_sq"):
                out[f"{kind}/{name}"] = (shape, torch.float32)
    return out


async def fetch_replicas(
    config: NodeConfig, manifest_hash: str, llama_config, ranges: list[range], *, every_replica: bool, timeout_s: float
) -> dict[int, list[tuple[str, dict[str, torch.Tensor], dict]]]:
    """stage -> [(peer id, phi, counters)] fetched over FetchState from live replicas: one per
    stage (the furthest trained that answers), or every replica with `every_replica`."""
    from noloco_node.rpc.outer_service import OuterClient

    p = config.pipeline
    directory, links = await _join_as_client(config, manifest_hash)
    # The largest stage's state in bytes (float32): the bound on what a donor may send us.
    rank = config.model.residual_subspace
    max_bytes = 4 * max(
        sum(_numel(shape) for shape, _ in expected_state(llama_config, r, i, p.num_stages, rank).values())
        for i, r in enumerate(ranges)
    )
    client = OuterClient(
        run_id=config.run.run_id, manifest_hash=manifest_hash, max_bytes=max_bytes, dialer=links.dialer
    )
    found: dict[int, list[tuple[str, dict[str, torch.Tensor], dict]]] = {}
    try:
        for stage in range(p.num_stages):
            expected = expected_state(llama_config, ranges[stage], stage, p.num_stages, rank)
            replicas = await _live_replicas(directory, stage, config.run.run_id, manifest_hash)
            fetched, errors = await _fetch_stage(
                client,
                replicas,
                stage,
                requester=links.peer_id,
                timeout_s=timeout_s,
                expected=expected,
                every_replica=every_replica,
            )
            if fetched:
                found[stage] = fetched
            if stage not in found:
                raise ExportError(f"no replica of stage {stage} gave its state: {'; '.join(errors)}")
            if every_replica and errors:
                raise ExportError(f"--average needs every replica of stage {stage}; these failed: {'; '.join(errors)}")
    finally:
        await client.close()
        await links.close()
        await directory.shutdown()
    return found


async def _join_as_client(config: NodeConfig, manifest_hash: str) -> tuple[PeerDirectory, Links]:
    """A client-mode directory of the run and links that dial its peers, NATed replicas too."""
    from noloco_node import __version__
    from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
    from noloco_node.node.joining import contact_lookup
    from noloco_node.rpc.security import read_swarm_key
    from noloco_node.rpc.stage_service import GRPC_OPTIONS
    from noloco_node.transport.links import Links

    swarm_key = read_swarm_key(config.security)
    directory = await PeerDirectory.start(
        DirectoryIdentity(config.run.run_id, manifest_hash, __version__, config.pipeline.num_stages),
        initial_peers=list(config.network.initial_peers),
        host=config.network.host,
        client_mode=True,
        startup_timeout_s=config.timeouts.startup_s,
        swarm_key=swarm_key,
        max_skew_s=config.security.max_clock_skew_s,
    )
    links = Links(
        directory.key,  # libp2p proves this key: calls over the bridge must be signed with it
        swarm_key=swarm_key,
        max_skew_s=config.security.max_clock_skew_s,
        lookup=contact_lookup(directory),
        options=GRPC_OPTIONS,
    )
    await links.dial_over(directory.p2p)
    return directory, links


async def _live_replicas(directory: PeerDirectory, stage: int, run_id: str, manifest_hash: str) -> list[str]:
    """The peer ids of `stage`'s live replicas, the furthest trained first (their records' inner
    steps; a random order among equals). A replica that joined afresh beside one that trained on
    is the worst model the swarm has: a newcomer's audit exported one and was told nothing."""
    import random

    records = await directory.replicas(stage, fresh=True)
    if not records:
        raise ExportError(
            f"no live replica of stage {stage} in run {run_id!r} with this model "
            f"(manifest {manifest_hash}); is the swarm up, and is this its --config?"
        )
    random.shuffle(records)
    records.sort(key=lambda r: -r.inner_step)
    steps = [r.inner_step for r in records]
    if len(steps) > 1 and steps[0] - steps[-1] > STEPS_APART:
        log.warning(
            "stage %d: its replicas are %d inner steps apart (%s): taking the furthest first",
            stage,
            steps[0] - steps[-1],
            ", ".join(f"{r.peer_id[-8:]} at {r.inner_step}" for r in records),
        )
    return [r.peer_id for r in records]


async def _fetch_stage(
    client: OuterClient,
    replicas: list[str],
    stage: int,
    *,
    requester: str,
    timeout_s: float,
    expected: dict,
    every_replica: bool,
) -> tuple[list[tuple[str, dict[str, torch.Tensor], dict]], list[str]]:
    """[(peer id, phi, counters)] from `replicas` in turn (the first that answers, or each one with
    `every_replica`), and an error line for each replica that failed."""
    from noloco_node.errors import NodeError

    fetched, errors = [], []
    for peer in replicas:
        try:
            tensors, counters = await client.fetch_state(
                peer, stage=stage, requester=requester, timeout_s=timeout_s, expected=expected
            )
        except NodeError as exc:
            errors.append(f"{peer[-8:]}: {exc}")
            continue
        phi = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("phi/")}
        fetched.append((peer, phi, counters))
        log.info(
            "stage %d: phi of %s (inner step %s, outer round %s)",
            stage,
            peer[-8:],
            counters.get("inner_step"),
            counters.get("outer_round"),
        )
        if not every_replica:
            break
    return fetched, errors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
