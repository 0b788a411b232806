"""The trained model out of the swarm, as a standard Hugging Face model directory.

Stage checkpoints hold parameters under the whole `LlamaForCausalLM`'s names (model/stage.py),
so the stages of one run fit together into one state dict. The exported weights are the slow
weights phi (what the outer steps agree on) where a checkpoint holds them, else the fast weights
theta (the dp and none methods keep no phi). With several checkpoints of one stage, `average`
takes their mean; otherwise the newest is used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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


def check_out_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse an --out that cannot be written, or one that holds files, unless they are an earlier
    export and `overwrite`: before anything is fetched or written (a live export downloads every
    stage first; an audit's own config.json was replaced without a word)."""
    import tempfile

    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; name a folder (it is made if missing)")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        earlier = (out / "config.json").is_file() and any(out.glob("model*.safetensors"))
        listed = ", ".join(held[:4]) + (" ..." if len(held) > 4 else "")
        if not earlier:
            raise ExportError(f"--out {out} holds files that are not a model ({listed}); name a new folder")
        if not overwrite:
            raise ExportError(f"--out {out} holds an earlier export ({listed}); pass --overwrite to replace it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ExportError(f"cannot write to --out {out} ({exc.strerror or exc}); name a folder you can write") from None


def write_model_dir(out: Path, llama_config, weights: dict[str, torch.Tensor], tokenizer) -> Path:
    """`config.json`, safetensors weights and the tokenizer: what from_pretrained(out) reads. The
    model's special tokens are the tokenizer's (Llama's defaults name ids this tokenizer gives
    other tokens), its longest input the run's sequence length."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per file written: noise in a terminal and in logs
    llama_config = llama_config.__class__.from_dict(llama_config.to_dict())
    for which in ("bos", "eos", "pad"):
        setattr(llama_config, f"{which}_token_id", getattr(tokenizer, f"{which}_token_id", None))
    tokenizer.model_max_length = llama_config.max_position_embeddings
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config)
    expected = set(model.state_dict())
    if set(weights) != expected:
        raise ExportError(
            f"the stages' weights do not make the whole model: missing {sorted(expected - set(weights))[:5]}, "
            f"unexpected {sorted(set(weights) - expected)[:5]}"
        )
    model.load_state_dict({k: v.contiguous() for k, v in weights.items()}, assign=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        _readable_like_the_rest(out)
    except OSError as exc:
        raise ExportError(
            f"could not write the model to {out} ({exc.strerror or exc}); free space or name another --out"
        ) from None
    return out


def write_run_model(config: NodeConfig, weights: dict[str, torch.Tensor], tokenizer, out: Path) -> Path:
    """The run's stages' weights as a plain Llama model directory (a residual-subspace model's
    weights written out dense)."""
    from noloco_node.model.build import resolve_llama_config

    llama = resolve_llama_config(config.model, len(tokenizer))
    if config.model.residual_subspace:
        from noloco_node.model.stage import residual_subspace
        from noloco_node.model.subspace import dense_weights

        subspace = residual_subspace(llama, config.run.seed, config.model.residual_subspace)
        weights = dense_weights(weights, subspace, llama.num_hidden_layers)
    return write_model_dir(out, llama, weights, tokenizer)


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
                raise ExportError(
                    f"no replica of stage {stage} gave its state ({'; '.join(errors)}): wait until a node serves "
                    f"stage {stage}, or export from the nodes' checkpoints (--from-checkpoint DIR ...)"
                )
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
