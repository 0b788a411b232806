"""What a link costs a swarm: predicted time per inner step and per outer round, and the tokens/s
ratio against the same swarm on an unlimited link. Pure functions of the model's shape, the
device's speed, the codecs, H and the link (bandwidth, RTT); no torch, no network.

Notation: P stages, stage s holds `layers_s` decoder layers; a microbatch is b sequences of T
tokens (n = b T h activation elements); M = batch / b microbatches per inner step; W =
pipeline.max_in_flight; F = device TFLOP/s x MFU; B = link bandwidth (bytes/s, each direction, every
node on its own access link; with an asymmetric line, B is the uplink and B_d the downlink);
r = RTT; c_a, c_g = bytes per element of the activation and gradient
codecs (codec/tensors.py: none 4, bf16 2, int8 and fp8 1 + 4/64, int4 0.5 + 4/64); w = outer
payload bytes per parameter (theta, or phi and delta); O = seconds a round costs whatever the
link (pairing through the DHT, freezing and applying the snapshot; 0 unless measured).

Compute per microbatch on stage s (model_costs: multiply-adds per token of the forward pass, causal
attention included): c_s = k_s * 2 * macs_s * b T / F, with k_s = 3 (forward and backward; stage 0
and the last stage, which keep their graph), 4 on a middle stage (it recomputes its forward in
backward), +1 with activation checkpointing; or c_s as measured (`stage_seconds`).
Transfer per microbatch on node s's uplink: x_s = ((n c_a + e) [s < P-1] + (n c_g + e) [s > 0]) / B
(a middle node sends activations down and gradients up on the same uplink), e = the bytes a
Forward or Backward call adds to its payload (gRPC and HTTP/2 headers with the call's signed
metadata, TLS records: 1.2-1.5 KB measured through a counting proxy; 15% of an int4 hop of 16 K
values, nothing at real sizes). On links that are per
connection (`Link.shared = False`: the netem relay limits each TCP connection and direction on its
own) a middle node's two sends do not share: x_s = max of the two, and the outer exchange does not
share with the pipeline either.
Received per microbatch on node s's downlink: y_s, the same with B_d and the directions turned.
A microbatch's round trip: L = sum_s c_s + (P - 1) (n c_a / B' + n c_g / B' + r), B' = min(B, B_d).
Bottleneck interval: tau = max(max_s c_s, max_s x_s, max_s y_s); the window of microbatches in flight
(Little's law) adds its own bound: tau' = max(tau, L / min(W', M')), W' = W past stage 0
(unbounded for P = 1), M' = M (exact) or 2M (overlap).
Inner step (GPipe's fill and drain): exact t = L + (M - 1) tau'; overlap (the next batch fills
while this one drains, two batches in flight) t = max(M tau', (L + (M - 1) tau') / 2).
Outer round (every H inner steps; the slowest stage's exchange): X = N_s w / B' + 2 r (proposal,
then the snapshots both ways at once). Blocking: R = H t + X + O. Overlapped with the next H
steps (outer.overlap): R = max(H t, X + O, H M x_s + N_s w / B) (on a shared link the exchange
shares the uplink with the pipeline's own traffic; the last term is dropped on per-connection links).
Ratio = R_inf / R, R_inf the same round with B = infinity and r = 0 (H t_inf + O blocking,
max(H t_inf, O) overlapped): 1 on an unlimited link, never more, and falling as bandwidth falls or
RTT grows. With O = 0, overlapped never predicts less than blocking: max(a, b, c) <= a + b whenever
c <= a + b, which holds because t >= M x_s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from noloco_node.codec.sizes import bytes_per_element
from noloco_node.model.memory import stage_params
from noloco_node.model.split import model_costs

# The loss price of a residual subspace (model/subspace.py): tokens a rank k = hidden / divisor needs
# to reach the held-out loss dense bf16 reaches at the end of its run, over dense bf16's tokens
# (benchmarks/time_to_loss.py on an H200: hidden 1024, 8 layers, 200 dense steps, 3 seeds; 2 of 3
# seeds reached it at d/8 and d/16: 0.569 and 0.570 M tokens against 0.410 M; docs/research.md, Time
# to loss). d/32 and d/64 did not reach it within 1.5x the tokens: not measured, so `plan` never
# recommends them. On `tiny` (hidden 128) no rank reached it within 1.5x; d/8 did at 1.78x.
SUBSPACE_TOKEN_PRICE: dict[int, float] = {8: 0.569 / 0.410, 16: 0.570 / 0.410}
SUBSPACE_PRICE_MIN_HIDDEN = 1024  # the price above holds from this width up; narrower models paid more
# Dense bf16 peak TFLOP/s from the vendors' datasheets (no sparsity); pass --device-tflops for others.
DEVICE_TFLOPS = {
    "h100": 989.0,
    "h200": 989.0,
    "a100": 312.0,
    # Home cards, bf16 with fp32 accumulate (what autocast's matmuls use), from NVIDIA's Ampere and
    # Ada whitepapers; a newcomer's 24 GB card had no name here.
    "rtx3090": 71.2,
    "rtx4080": 97.4,
    "rtx4090": 165.2,
}
DEFAULT_MFU = 0.3  # the plain Hugging Face loop measured 0.31 on an H200 at `medium` (issue 27)
# Wire bytes a Forward/Backward call adds to its payload: 1482 and 1215 per call (TLS, connection
# set-up amortised over 80 calls) measured through a counting proxy, P = 2, this repository's nodes.
CALL_OVERHEAD_BYTES = 1400.0


@dataclass(frozen=True)
class Link:
    mbit: float = math.inf  # each direction, per node (the uplink when `downlink_mbit` is set)
    rtt_ms: float = 0.0
    shared: bool = True
    """True: a node's sends share one access link (a home uplink). False: every connection has its
    own `mbit` each way (how the netem relay emulates links: benchmarks/wan_utilisation.py)."""
    downlink_mbit: float | None = None
    """A home line is asymmetric: what a node receives through (None: `mbit`, a symmetric link)."""

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8

    def seconds(self, nbytes: float) -> float:
        """Sending `nbytes` through the uplink."""
        return 0.0 if math.isinf(self.mbit) else nbytes / self.bytes_per_s

    def receive_seconds(self, nbytes: float) -> float:
        down = self.mbit if self.downlink_mbit is None else self.downlink_mbit
        return 0.0 if math.isinf(down) else nbytes * 8 / (down * 1e6)

    def transfer_seconds(self, nbytes: float) -> float:
        """One transfer between two nodes of this link: out of one's uplink, into the other's downlink."""
        return max(self.seconds(nbytes), self.receive_seconds(nbytes))


@dataclass(frozen=True)
class PipelineCosts:
    """A pipeline's per-microbatch costs, from `pipeline_costs`."""

    stage_flops: tuple[float, ...]  # per microbatch, forward + backward (+ recompute)
    stage_params: tuple[int, ...]
    hop_elements: int  # b T h (b T k with a residual subspace of rank k)
    microbatches_per_batch: int
    max_in_flight: int
    schedule: str = "exact"
    activation_bytes: float = 2.0  # per element on the wire
    gradient_bytes: float = 2.0
    outer_bytes_per_param: float = 2.0
    inner_steps_per_outer: int = 50
    outer_overlap: bool = False
    call_overhead_bytes: float = CALL_OVERHEAD_BYTES
    forward_extra_bytes: float = 0.0  # per forward call: the labels, and the token ids of a residual-subspace hop


@dataclass(frozen=True)
class Prediction:
    compute_s: tuple[float, ...]  # per microbatch per stage
    uplink_s: tuple[float, ...]  # per microbatch per node
    step_s: float
    step_unlimited_s: float
    outer_s: float  # one exchange's transfer
    round_s: float  # H inner steps and the outer exchange
    ratio: float  # tokens/s on this link / on an unlimited one
    limited_by: str
    extra: dict = field(default_factory=dict)


def pipeline_costs(
    config,
    ranges: list[range],
    *,
    microbatch: int,
    seq_len: int,
    microbatches_per_batch: int,
    max_in_flight: int,
    schedule: str = "exact",
    checkpointing: bool = False,
    activation_codec: str = "bf16",
    gradient_codec: str | None = None,
    outer_payload: tuple[str, ...] = ("bf16",),
    inner_steps_per_outer: int = 50,
    outer_overlap: bool = False,
    subspace: int = 0,
) -> PipelineCosts:
    """The costs of the model `config` split into `ranges`, run with these settings; `subspace` is
    model.residual_subspace (hops of k values per token, plus the token ids as varints)."""
    embed, layer, head = model_costs(config, seq_len=seq_len)
    tokens, last = microbatch * seq_len, len(ranges) - 1
    flops, params = [], []
    for s, r in enumerate(ranges):
        macs = len(r) * layer + (embed if s == 0 else 0) + (head if s == last else 0)
        passes = (4 if 0 < s < last else 3) + (1 if checkpointing else 0)
        flops.append(passes * 2 * macs * tokens)
        params.append(stage_params(config, r, first=s == 0, last=s == last, subspace=subspace))
    id_bytes = (max(1, config.vocab_size - 1).bit_length() + 6) // 7  # protobuf varint of the largest id
    return PipelineCosts(
        stage_flops=tuple(flops),
        stage_params=tuple(params),
        hop_elements=tokens * (subspace or config.hidden_size),
        forward_extra_bytes=tokens * id_bytes * (2 if subspace else 1),  # labels (+ token ids)
        microbatches_per_batch=microbatches_per_batch,
        max_in_flight=max_in_flight,
        schedule=schedule,
        activation_bytes=bytes_per_element(activation_codec),
        gradient_bytes=bytes_per_element(gradient_codec or activation_codec),
        outer_bytes_per_param=sum(bytes_per_element(c) for c in outer_payload),
        inner_steps_per_outer=inner_steps_per_outer,
        outer_overlap=outer_overlap,
    )


def inner_step_seconds(costs: PipelineCosts, compute: tuple[float, ...], link: Link) -> tuple[float, tuple, str]:
    """(seconds per inner step, uplink per node, what limits it), given each stage's compute
    seconds per microbatch."""
    p = len(costs.stage_flops)
    fwd_bytes = costs.hop_elements * costs.activation_bytes + costs.call_overhead_bytes + costs.forward_extra_bytes
    bwd_bytes = costs.hop_elements * costs.gradient_bytes + costs.call_overhead_bytes
    fwd, bwd = link.seconds(fwd_bytes), link.seconds(bwd_bytes)
    join = (lambda a, b: a + b) if link.shared else max
    uplink = tuple(join(fwd if s < p - 1 else 0.0, bwd if s > 0 else 0.0) for s in range(p))
    downlink = tuple(
        join(link.receive_seconds(fwd_bytes) if s > 0 else 0.0, link.receive_seconds(bwd_bytes) if s < p - 1 else 0.0)
        for s in range(p)
    )
    rtt = link.rtt_ms / 1e3
    round_trip = sum(compute) + (p - 1) * (link.transfer_seconds(fwd_bytes) + link.transfer_seconds(bwd_bytes) + rtt)
    m = costs.microbatches_per_batch
    issued = m * (2 if costs.schedule == "overlap" else 1)
    window = issued if p == 1 else min(costs.max_in_flight, issued)
    tau = max(max(compute), max(uplink), max(downlink))
    interval = max(tau, round_trip / window)
    if interval > tau * (1 + 1e-9) and window < issued:
        limit = "the in-flight window (pipeline.max_in_flight) against the round trip"
    elif interval > tau * (1 + 1e-9):  # a larger max_in_flight would not help: the step issues no more
        limit = "the in-flight window: one step's microbatches (batch_size / microbatch_size) against the round trip"
    elif max(uplink) > max(compute) or max(downlink) > max(compute):
        limit = "the link (activations and gradients per microbatch)"
    else:
        limit = "compute"
    if costs.schedule == "overlap":
        step = max(m * interval, (round_trip + (m - 1) * interval) / 2)
    else:
        step = round_trip + (m - 1) * interval
    return step, uplink, limit


def round_seconds(
    costs: PipelineCosts, step: float, uplink: tuple, link: Link, overhead_s: float
) -> tuple[float, float]:
    """(one exchange's transfer, the whole round: H inner steps and the exchange)."""
    h = costs.inner_steps_per_outer
    outer = link.transfer_seconds(max(costs.stage_params) * costs.outer_bytes_per_param) + 2 * link.rtt_ms / 1e3
    if not costs.outer_overlap:
        return outer, h * step + outer + overhead_s
    shared = (
        max(
            (
                h * costs.microbatches_per_batch * x + link.seconds(n * costs.outer_bytes_per_param)
                for x, n in zip(uplink, costs.stage_params)
            ),
            default=0.0,
        )
        if link.shared
        else 0.0
    )
    return outer, max(h * step, outer + overhead_s, shared)


def _what_limits(step_limit: str, lost_in_steps: float, lost_to_outer: float, round_s: float) -> str:
    """What costs the most of a round against compute alone: the inner steps' time on the link
    (`step_limit` says how), or the outer exchange's exposed time (blocking, or too long to hide)."""
    if max(lost_in_steps, lost_to_outer) < 0.01 * round_s:
        return "compute"
    if lost_to_outer > lost_in_steps:
        return "the outer exchange"
    if step_limit == "compute":  # every interval is compute's, but each hop's time adds to fill and drain
        return "the hops' time in the pipeline's fill and drain"
    return step_limit


def predict(
    costs: PipelineCosts,
    *,
    tflops: float | None = None,
    mfu: float = DEFAULT_MFU,
    link: Link = Link(),
    stage_seconds: tuple[float, ...] | None = None,
    round_overhead_s: float = 0.0,
) -> Prediction:
    """Predicted inner step, outer round and tokens/s ratio against an unlimited link (module
    docstring). The device's speed is `tflops` x `mfu`, or each stage's measured compute seconds
    per microbatch (`stage_seconds`, forward and backward); `round_overhead_s` is O."""
    if stage_seconds is not None:
        if len(stage_seconds) != len(costs.stage_flops) or min(stage_seconds) <= 0:
            raise ValueError(f"need one compute time > 0 per stage ({len(costs.stage_flops)}), got {stage_seconds}")
        compute = tuple(stage_seconds)
    elif tflops is None or tflops <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"need device TFLOP/s > 0 and 0 < MFU <= 1, got {tflops} and {mfu}")
    else:
        compute = tuple(f / (tflops * 1e12 * mfu) for f in costs.stage_flops)
    step, uplink, limit = inner_step_seconds(costs, compute, link)
    unlimited, unlimited_uplink, _ = inner_step_seconds(costs, compute, Link())
    h = costs.inner_steps_per_outer
    outer, round_s = round_seconds(costs, step, uplink, link, round_overhead_s)
    _, round_unlimited = round_seconds(costs, unlimited, unlimited_uplink, Link(), round_overhead_s)
    limit = _what_limits(limit, h * (step - unlimited), round_s - h * step, round_s)
    ratio = round_unlimited / round_s if round_s > 0 else 1.0
    return Prediction(
        compute_s=compute,
        uplink_s=uplink,
        step_s=step,
        step_unlimited_s=unlimited,
        outer_s=outer,
        round_s=round_s,
        ratio=min(1.0, ratio),
        limited_by=limit,
        extra={
            "outer_bytes_per_stage": max(costs.stage_params) * costs.outer_bytes_per_param,
            "hop_bytes": costs.hop_elements * costs.activation_bytes,
            "round_unlimited_s": round_unlimited,
            # the busiest stage's compute over the round: the device's busy share
            "busy": min(1.0, h * costs.microbatches_per_batch * max(compute) / round_s),
        },
    )


@dataclass(frozen=True)
class Option:
    """Settings a volunteer can pick for a link, named as in the config; unset fields are the config's defaults."""

    activation_codec: str = "int8"
    gradient_codec: str = "int8"
    outer_overlap: bool = True
    outer_codec: str = "bf16"
    schedule: str = "exact"

    def settings(self) -> dict[str, object]:
        return {
            "pipeline.activation_codec": self.activation_codec,
            "pipeline.gradient_codec": self.gradient_codec,
            "outer.overlap": self.outer_overlap,
            "outer.codec": self.outer_codec,
            "pipeline.schedule": self.schedule,
        }


# The defaults before the loss price set them (bf16 hops, blocking exchange): issue 26's reference,
# from which the WAN benchmark's link profiles are set.
BF16_BLOCKING = Option("bf16", "bf16", False, "bf16")
# The defaults first, then fewer bytes: the loss price grows down the list (docs/volunteer.md has it).
# fp8 sends as many bytes as int8 and predicts the same.
OPTIONS = (
    Option(),
    Option(outer_codec="int8"),
    Option("int4", "int8", outer_codec="int8"),
    Option("int4", "int4", outer_codec="int8"),
    Option("int4", "int4", outer_codec="int8", schedule="overlap"),
)


def choose(
    costs_for, *, link: Link, target: float = 0.9, **speed
) -> tuple[int, list[tuple[Option, Prediction, float]]]:
    """Each of OPTIONS with its prediction on `link` and its tokens/s relative to the defaults on an
    unlimited link (the same tokens per round: R_inf of the defaults / R); and the index of the first
    reaching `target`, else of the best. `costs_for(option)` builds its PipelineCosts; `speed` is
    predict's tflops and mfu (or stage_seconds)."""
    baseline = predict(costs_for(OPTIONS[0]), link=Link(), **speed).round_s
    rows = []
    for option in OPTIONS:
        pred = predict(costs_for(option), link=link, **speed)
        rows.append((option, pred, baseline / pred.round_s))
    reaching = [i for i, (_, _, relative) in enumerate(rows) if relative >= target]
    best = max(range(len(rows)), key=lambda i: (rows[i][2], -i))
    return (reaching[0] if reaching else best), rows
