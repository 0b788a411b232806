"""Will a stage fit? A stage's peak training memory, from the model's config and the run's settings
alone, before anything is allocated: a node that cannot hold its stage refuses to start with the
numbers and the fix, and `noloco-node plan` finds a split that fits. It models what runs
(model/stage.py, pipeline/worker.py and driver.py, sync/snapshot.py), part by part; checked against
measured peaks by `benchmarks/memory_estimate.py` (host RSS on CPU, max_memory_allocated on CUDA).

State, per parameter: the fp32 weights (4 bytes), their gradient (4), Adam's two moments (8), and
phi and m (8) for noloco/diloco, or the worker's repair copy of theta (4) for dp/none.
Weight stash (`pipeline.schedule = overlap`, every stage but the last): a forward runs on a copy of
the weights at their version then; at a step boundary the draining batch's copy and the next
batch's copy are both alive: two copies (8 bytes).

Activations, per token of a microbatch (b x T tokens), per decoder layer, saved for backward with
SDPA attention (flash / memory-efficient kernels: no T^2 scores are kept):
  fp32 (CPU):           4 * (8h + 2kv + 4I) bytes: two RMSNorm inputs and outputs and their
                        normalised values, q, k, v, the attention output, SwiGLU's gate, act, up,
                        product (measured: exactly these tensors, 104 h bytes at I = 4h).
  bf16 autocast (CUDA): 32h + 4kv + 8I: the residual stream and the norms stay fp32 (16h); every
                        linear saves its own bf16 cast of its input (q, k, v: 6h; gate, up: 4h);
                        RoPE promotes q and k to fp32, SDPA saves its bf16 casts (2h + 4kv) and
                        output (2h), o_proj its contiguous copy (2h); the MLP's four tensors 8I.
  eager attention adds the softmax of a * T scores: 4aT bytes (fp32), 6aT (autocast, + its cast).
Activation checkpointing keeps each layer's fp32 input (4h) instead, and recomputes one layer at a
time. The last stage adds the final norm (12h fp32, 10h autocast) and its loss, which never makes
the whole logits (model/losses.py): it keeps the gradients it computed for the backward (4h per
token; 4Vh, 2Vh as a bf16 cast) and, while it runs, one chunk's logits (at most 12 bytes per
entry) and the weight gradient's fp32 sum (4Vh). (Whole logits took 4V and 16V at the peak.)
Under autocast the graphs hold bf16 casts of the matmul weights (2 bytes per matmul parameter),
one per weight version, shared by every graph built on it (pipeline/weight_casts.py): one, or two
under the overlap schedule's stash (the draining batch's version and the next one's). The node cast
once per graph before (M casts on stage 0, measured so on an H200).

Who keeps what: stage 0 keeps the graph of every microbatch it has issued (the driver issues a
whole batch at once: M = batch / microbatch graphs; 2M under overlap, whose next batch is issued
while the current one drains; max_in_flight does not bound it). Past stage 0 a forward keeps only
its fp32 input (b T h 4 bytes, at most `max_in_flight` of them) and its backward recomputes one
graph at a time (a middle stage) or runs forward and backward at once (the last stage). On top of
the kept or recomputed graphs, a backward's working set: two layers' worth of activations (the
recomputed or kept layer and the gradients of its tensors). Adam's step allocates a temporary the
size of the weights (foreach sqrt of the second moment) when no graph is alive.

Outer exchange (noloco, every H steps): the frozen fp32 theta (4), our own values as the partner
decodes them (4 per tensor sent: theta, or phi and delta), the payload out and in (codec bytes
each), the partner's decoded values (4 per tensor), and while freezing, one tensor's temporaries
(12 bytes per element of the largest, and its error check's float64 chunk). On a GPU the first two
and the temporaries live on the device, the rest on the host. A stage > 0 runs the exchange in the
background while it keeps computing, as does any stage with `outer.overlap`: it adds to the
training peak. Stage 0's blocking exchange runs between batches: there the peak is the larger of
the compute and the exchange (plus the next batch's graphs under overlap). dp and diloco hold a
sent and a received copy (8 bytes).

On the host (CPU nodes; RSS is the measure) three effects of glibc's heap, measured with the
node's allocator settings (runtime/memory.tune_allocator) and its compute thread: the first outer
step replaces phi and m from the compute thread while their first blocks stay with the main
thread's arena, never trimmed (8 bytes per parameter kept); the exchange's freed blocks, one per
parameter, do not take the next batch's larger tensors, so the exchange adds to the compute peak
on stage 0 too; and the first training steps page in library code and the thread's arena
(CPU_RUNTIME_BYTES).

The peak is state + stash + saved inputs (+ retained heap and runtime on CPU) + the larger of
(weight casts + activations) and Adam's temporary, + the exchange as above. Measured against it
(benchmarks/memory_estimate.py): on an H200, max_memory_allocated for `small` and `medium` (seq
1024, 4 microbatches of 4, P = 1 and each stage of P = 3, both schedules) is 0.85-0.98 of the
estimate; on CPU the peak RSS for `small` is 0.85-0.94 of it, and for `tiny`, whose 20-50 MiB of
state is within glibc's run-to-run noise of +-20 MiB, 0.7-1.15. The CUDA caching allocator's slack,
the CUDA context and the process's own baseline come on top: the check keeps `headroom` of
what is free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from noloco_node.codec.names import parse_outer_codec
from noloco_node.codec.sizes import bytes_per_element
from noloco_node.config import ConfigError
from noloco_node.model.loss_chunks import chunk_tokens
from noloco_node.model.split import constrained_layers
from noloco_node.runtime.memory import available_bytes

GIB = 1 << 30
# Measured on CPU (benchmarks/memory_estimate.py, `tiny` at 16 tokens, where nothing else is
# large): a process's RSS grows by 19-21 MiB on its first training steps whatever the model.
CPU_RUNTIME_BYTES = 24 << 20


@dataclass(frozen=True)
class Workload:
    """How a stage is run: everything besides the model's shape that sets its memory."""

    microbatch: int
    seq_len: int
    microbatches_per_batch: int = 1
    max_in_flight: int = 8
    schedule: str = "exact"
    checkpointing: bool = False
    autocast: bool = False  # bf16 autocast: a CUDA device with pipeline.bf16_autocast
    attention: str = "sdpa"
    method: str = "noloco"
    outer_overlap: bool = False
    outer_payload: tuple[str, ...] = ("bf16",)  # codec of each tensor sent per parameter (theta; or phi, delta)
    host_heap: bool = True  # the stage computes on the host (its RSS is the measure): glibc's retention counts
    subspace: int = 0  # model.residual_subspace: k-wide output projections and hops, and the frozen tables


@dataclass(frozen=True)
class StageMemory:
    params: int
    weights: int
    gradients: int
    optimizer: int  # Adam's two moments
    outer: int  # phi and m (noloco, diloco) or the repair copy of theta (dp, none)
    stash: int = 0
    weight_casts: int = 0
    saved_inputs: int = 0
    activations: int = 0  # kept or recomputed graphs plus a backward's working set
    exchange: int = 0  # outer exchange in flight, on this device
    exchange_host: int = 0  # its host-side part on a GPU node (payloads, decoded partner values)
    exchange_adds: bool = True  # whether the exchange can coincide with the training peak
    step_temporaries: int = 0  # Adam's step: a temporary the size of the weights (foreach sqrt)
    retained: int = 0  # host heap that glibc keeps after the first outer step (module docstring)
    runtime: int = 0  # on CPU: library code paged in and the compute thread's allocator arena
    boundary_activations: int = 0  # graphs alive at a blocking exchange (stage 0, overlap schedule)
    subspace_tables: int = 0  # a residual subspace's frozen embedding (V x d float32) and basis U, on every stage
    parts: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def state_bytes(self) -> int:
        """Weights, gradients, Adam, and phi and m (or the repair copy)."""
        return self.weights + self.gradients + self.optimizer + self.outer

    @property
    def saved_inputs_bytes(self) -> int:
        return self.saved_inputs

    @property
    def activation_bytes(self) -> int:
        return self.activations + self.weight_casts

    @property
    def total(self) -> int:
        fixed = self.state_bytes + self.stash + self.saved_inputs + self.retained + self.runtime + self.subspace_tables
        computing = max(self.weight_casts + self.activations, self.step_temporaries)
        if self.exchange_adds:
            return fixed + computing + self.exchange
        return fixed + max(computing, self.boundary_activations + self.exchange)

    def breakdown(self) -> dict[str, int]:
        """Each part in bytes, for tables and JSON."""
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "adam": self.optimizer,
            "outer_state": self.outer,
            "weight_stash": self.stash,
            "weight_casts": self.weight_casts,
            "saved_inputs": self.saved_inputs,
            "activations": self.activations,
            "step_temporaries": self.step_temporaries,
            "outer_exchange": self.exchange,
            "heap_retained": self.retained,
            "runtime": self.runtime,
            "subspace_tables": self.subspace_tables,
            "total": self.total,
        }


def layer_params(config) -> tuple[int, int]:
    """(matmul parameters, norm parameters) of one decoder layer."""
    h, i = config.hidden_size, config.intermediate_size
    kv = _kv_hidden(config)
    return 2 * h * h + 2 * h * kv + 3 * h * i, 2 * h


def stage_params(config, layer_range: range, *, first: bool, last: bool, subspace: int = 0) -> int:
    """Parameters of a stage; with a residual subspace of rank `subspace`, the output projections of
    its constrained layers and the embedding hold k-wide coordinates (model/subspace.py)."""
    matmul, norms = layer_params(config)
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    dense = len(layer_range) * (matmul + norms) + (v * h if first else 0) + ((v * h + h) if last else 0)
    if not subspace:
        return dense
    constrained = len(set(layer_range) & set(constrained_layers(config.num_hidden_layers)))
    return dense - constrained * (h - subspace) * (h + i) - (v * (h - subspace) if first else 0)


def _matmul_params(config, layers: int, last: bool) -> int:
    """Parameters autocast casts to bf16 (every linear; not the embedding or the norms)."""
    return layers * layer_params(config)[0] + (config.vocab_size * config.hidden_size if last else 0)


def _kv_hidden(config) -> int:
    heads = config.num_attention_heads
    return config.hidden_size * (config.num_key_value_heads or heads) // heads


def layer_activation_bytes_per_token(config, *, autocast: bool, attention: str, seq_len: int) -> int:
    """Bytes one decoder layer saves for backward per token (module docstring)."""
    h, i, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    kv = _kv_hidden(config)
    saved = 32 * h + 4 * kv + 8 * i if autocast else 4 * (8 * h + 2 * kv + 4 * i)
    if attention == "eager":
        saved += (6 if autocast else 4) * a * seq_len
    return saved


def _graph_bytes(config, layers: int, tokens: int, w: Workload, *, last: bool) -> tuple[int, int]:
    """(bytes one microbatch's graph keeps, bytes its backward needs on top at most)."""
    h, v = config.hidden_size, config.vocab_size
    per_layer = tokens * layer_activation_bytes_per_token(
        config, autocast=w.autocast, attention=w.attention, seq_len=w.seq_len
    )
    kept = layers * tokens * 4 * h if w.checkpointing else layers * per_layer
    # A layer's backward: the gradients of its saved tensors next to them (measured up to ~2x one
    # layer's activations); with checkpointing, the recomputed layer and then those gradients.
    working = 2 * per_layer
    if last:
        kept += tokens * (10 if w.autocast else 12) * h  # the final norm
        kept += tokens * 4 * h + v * h * (2 if w.autocast else 4)  # the loss's gradients, kept for backward
        working = max(working, 12 * min(tokens, chunk_tokens(v)) * v + 4 * v * h)  # a chunk; the weight's fp32 sum
    return kept, working


def estimate_stage(config, layer_range: range, *, first: bool, last: bool, work: Workload) -> StageMemory:
    """The peak memory of one stage run as `work` says, part by part (module docstring)."""
    params = stage_params(config, layer_range, first=first, last=last, subspace=work.subspace)
    outer = work.method in ("noloco", "diloco")
    overlap = work.schedule == "overlap" and not last  # weight stashing (the node turns it on)
    tokens = work.microbatch * work.seq_len
    layers = len(layer_range)
    graph, working = _graph_bytes(config, layers, tokens, work, last=last)
    cast_copy = 2 * _matmul_params(config, layers, last) if work.autocast else 0
    versions = 2 if overlap else 1  # the stash: the draining batch's weights and the next batch's
    if first and not last:
        graphs = work.microbatches_per_batch * (2 if overlap else 1)
        saved = 0
    else:
        graphs = 1
        saved = 0 if first else work.max_in_flight * tokens * 4 * (work.subspace or config.hidden_size)
    h = config.hidden_size
    largest = max(h * config.intermediate_size, config.vocab_size * h if first or last else 0)
    exchange_device, exchange_host = _exchange_bytes(params, largest, work)
    # On the host the exchange's freed blocks (one per parameter) are too small for the next batch's
    # activations, which glibc then places in fresh memory: there the exchange always adds.
    blocking = first and not work.outer_overlap and work.method == "noloco" and not work.host_heap
    return StageMemory(
        params=params,
        weights=4 * params,
        gradients=4 * params,
        optimizer=8 * params,
        outer=(8 if outer else 4) * params,
        stash=(8 * params if overlap else 0),
        weight_casts=versions * cast_copy,
        saved_inputs=saved,
        activations=graphs * graph + working,
        exchange=exchange_device + (0 if work.autocast else exchange_host),
        exchange_host=exchange_host if work.autocast else 0,
        exchange_adds=not blocking,
        step_temporaries=4 * params,
        retained=(8 * params if outer and work.host_heap else 0),
        runtime=CPU_RUNTIME_BYTES if work.host_heap else 0,
        boundary_activations=(work.microbatches_per_batch * graph + cast_copy if overlap and first else 0),
        subspace_tables=(4 * config.vocab_size * h + 8 * h * work.subspace if work.subspace else 0),
    )


NORM_CHUNK = 1 << 22  # optim/norms.CHUNK (that module imports torch; this one does not)


def _exchange_bytes(params: int, largest: int, work: Workload) -> tuple[int, int]:
    """(device part, host part) of an outer exchange in flight."""
    if work.method in ("dp", "diloco"):
        return 8 * params, 0
    if work.method != "noloco":
        return 0, 0
    sent = len(work.outer_payload)
    wire = sum(bytes_per_element(c) for c in work.outer_payload)
    # freeze, one tensor at a time: Delta, the codec's float32 working copy and its payload, and
    # the wire's error measured in float64 a chunk at a time (optim/norms.py, CHUNK elements)
    per_tensor = 12 * largest + 8 * min(largest, NORM_CHUNK)
    return (4 + 4 * sent) * params + per_tensor, int((2 * wire + 4 * sent) * params)


def estimate(
    config,
    layer_range: range,
    *,
    first: bool,
    last: bool,
    outer: bool,
    max_in_flight: int,
    microbatch: int,
    seq_len: int,
    checkpointing: bool,
    graphs: int = 1,
    weight_stash: bool = False,
    autocast: bool = False,
) -> StageMemory:
    """`estimate_stage` with the older keyword form: `graphs` microbatches per batch on stage 0,
    `weight_stash` for the overlap schedule, `outer` for noloco (else none)."""
    work = Workload(
        microbatch=microbatch,
        seq_len=seq_len,
        microbatches_per_batch=max(1, graphs),
        max_in_flight=max_in_flight,
        schedule="overlap" if weight_stash else "exact",
        checkpointing=checkpointing,
        autocast=autocast,
        method="noloco" if outer else "none",
    )
    return estimate_stage(config, layer_range, first=first, last=last, work=work)


def workload_for(cfg, device_type: str) -> Workload:
    """The Workload of a run's NodeConfig on a device of `device_type` ('cpu' or 'cuda')."""
    p, o = cfg.pipeline, cfg.outer
    # theta alone travels when gamma == beta with one dense codec (sync/snapshot.py choose_payload)
    same_dense = o.codec_phi == o.codec_delta and parse_outer_codec(o.codec_delta).dense
    payload = (o.codec_phi,) if o.gamma == o.beta and same_dense else (o.codec_phi, o.codec_delta)
    return Workload(
        microbatch=p.microbatch_size,
        seq_len=cfg.model.seq_len,
        microbatches_per_batch=p.batch_size // p.microbatch_size,
        max_in_flight=p.max_in_flight,
        schedule=p.schedule,
        checkpointing=p.activation_checkpointing,
        autocast=device_type == "cuda" and p.bf16_autocast,
        attention=cfg.model.attn_implementation,
        host_heap=device_type == "cpu",
        method=o.method,
        outer_overlap=bool(getattr(o, "overlap", False)),
        outer_payload=payload,
        subspace=cfg.model.residual_subspace,
    )


def estimate_for_run(cfg, config, ranges: list[range], stage_index: int, device_type: str) -> StageMemory:
    """The estimate for stage `stage_index` of a run's NodeConfig on a `device_type` device."""
    last = stage_index == len(ranges) - 1
    return estimate_stage(
        config, ranges[stage_index], first=stage_index == 0, last=last, work=workload_for(cfg, device_type)
    )


def check_fits(cfg, config, ranges: list[range], stage_index: int, device, *, headroom: float = 0.9):
    """Refuse (ConfigError) a stage whose estimated peak training memory exceeds `headroom` of what
    `device` has free, saying how much it needs and what to change; returns the estimate
    (a StageMemory: `.total` is the node's `memory_estimate_bytes`)."""
    p = cfg.pipeline
    need = estimate_for_run(cfg, config, ranges, stage_index, device.type)
    free = available_bytes(device)
    if free is None or need.total <= headroom * free:
        return need
    fixes = ["more stages (pipeline.num_stages, or fewer layers here with pipeline.layers_per_stage)"]
    if not p.activation_checkpointing:
        fixes.append("pipeline.activation_checkpointing = true")
    if p.schedule == "overlap" and need.stash:
        fixes.append("pipeline.schedule = exact")
    if p.max_in_flight > 1 and need.saved_inputs_bytes > 0.1 * need.total:
        fixes.append("a smaller pipeline.max_in_flight")
    fixes.append("a smaller model (model.preset)")
    raise ConfigError(
        "model",
        f"stage {stage_index} needs about {describe(need)}, but {device} has {free / GIB:.2f} GiB free",
        "use " + ", or ".join(fixes) + " (`noloco-node plan` finds the fewest stages that fit)",
    )


def describe(m: StageMemory) -> str:
    kept = (
        "weights, gradients, Adam, phi and m"
        if m.outer == 2 * m.weights
        else "weights, gradients, Adam and a repair copy"
    )
    text = (
        f"{m.total / GIB:.2f} GiB ({m.params:,} parameters: {m.state_bytes / GIB:.2f} GiB for {kept}; "
        f"{m.saved_inputs / GIB:.2f} GiB of saved inputs; {m.activation_bytes / GIB:.2f} GiB of activations"
    )
    if m.stash:
        text += f"; {m.stash / GIB:.2f} GiB of weight copies (overlap schedule)"
    if m.exchange:
        text += f"; {m.exchange / GIB:.2f} GiB for an outer exchange"
    return text + ")"
