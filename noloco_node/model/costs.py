"""What a link costs a swarm: predicted time per inner step and per outer round, and the tokens/s
ratio against the same swarm on an unlimited link. Pure functions of the model's shape, the
device's speed, the codecs, H and the link (bandwidth, RTT); no torch, no network.

Notation: P stages, stage s holds `layers_s` decoder layers; a microbatch is b sequences of T
tokens (n = b T h activation elements); M = batch / b microbatches per inner step; W =
pipeline.max_in_flight; F = device TFLOP/s x MFU; B = link bandwidth (bytes/s, each direction, every
node on its own access link); r = RTT; c_a, c_g = bytes per element of the activation and gradient
codecs (wire/codec.py: none 4, bf16 2, int8 and fp8 1 + 4/64, int4 0.5 + 4/64); w = outer
payload bytes per parameter (theta, or phi and delta).

Compute per microbatch on stage s (model_costs: multiply-adds per token of the forward pass, causal
attention included): c_s = k_s * 2 * macs_s * b T / F, with k_s = 3 (forward and backward; stage 0
and the last stage, which keep their graph), 4 on a middle stage (it recomputes its forward in
backward), +1 with activation checkpointing.
Transfer per microbatch on node s's uplink: x_s = n (c_a [s < P-1] + c_g [s > 0]) / B (a middle
node sends activations down and gradients up on the same uplink).
A microbatch's round trip: L = sum_s c_s + (P - 1) (n c_a / B + n c_g / B + r).
Bottleneck interval: tau = max(max_s c_s, max_s x_s); the window of microbatches in flight
(Little's law) adds its own bound: tau' = max(tau, L / min(W', M')), W' = W past stage 0
(unbounded for P = 1), M' = M (exact) or 2M (overlap).
Inner step (GPipe's fill and drain): exact t = L + (M - 1) tau'; overlap (the next batch fills
while this one drains, two batches in flight) t = max(M tau', (L + (M - 1) tau') / 2).
Outer round (every H inner steps; the slowest stage's exchange): X = N_s w / B + 2 r (proposal,
then the snapshots both ways at once). Blocking: R = H t + X. Overlapped with the next H steps
(outer.overlap): R = max(H t, X, H M x_s + N_s w / B) (the exchange shares the uplink with the
pipeline's own traffic).
Ratio = H t_inf / R, t_inf the inner step with B = infinity and r = 0: 1 on an unlimited link,
never more, and falling as bandwidth falls or RTT grows. Overlapped never predicts less than
blocking: max(a, b, c) <= a + b whenever c <= a + b, which holds because t >= M x_s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Dense bf16 peak TFLOP/s from the vendors' datasheets (no sparsity); pass --device-tflops for others.
DEVICE_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0}
DEFAULT_MFU = 0.3  # the plain Hugging Face loop measured 0.31 on an H200 at `medium` (issue 27)


@dataclass(frozen=True)
class Link:
    mbit: float = math.inf  # each direction, per node
    rtt_ms: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8

    def seconds(self, nbytes: float) -> float:
        return 0.0 if math.isinf(self.mbit) else nbytes / self.bytes_per_s


@dataclass(frozen=True)
class PipelineCosts:
    """A pipeline's per-microbatch costs, from `pipeline_costs`."""

    stage_flops: tuple[float, ...]  # per microbatch, forward + backward (+ recompute)
    stage_params: tuple[int, ...]
    hop_elements: int  # b T h
    microbatches_per_batch: int
    max_in_flight: int
    schedule: str = "exact"
    activation_bytes: float = 2.0  # per element on the wire
    gradient_bytes: float = 2.0
    outer_bytes_per_param: float = 2.0
    inner_steps_per_outer: int = 50
    outer_overlap: bool = False


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


def codec_bytes_per_element(codec: str) -> float:
    """Wire bytes per element of a tensor codec (wire/codec.py), blockwise scales included."""
    from noloco_node.wire.codec import BLOCKWISE, DEFAULT_BLOCK, TensorSpec, expected_payload_bytes

    n = 1 << 16
    name = codec.split(":")[0]
    if name == "topk":
        return 8 * float(codec.split(":")[1])  # int32 index + fp32 value per element sent
    spec = TensorSpec(dtype="float32", shape=(n,), codec=name, block_size=DEFAULT_BLOCK if name in BLOCKWISE else 0)
    return expected_payload_bytes(spec) / n


def pipeline_costs(config, ranges: list[range], *, microbatch: int, seq_len: int, microbatches_per_batch: int,
                   max_in_flight: int, schedule: str = "exact", checkpointing: bool = False,
                   activation_codec: str = "bf16", gradient_codec: str | None = None,
                   outer_payload: tuple[str, ...] = ("bf16",), inner_steps_per_outer: int = 50,
                   outer_overlap: bool = False) -> PipelineCosts:
    """The costs of the model `config` split into `ranges`, run with these settings."""
    from noloco_node.model.build import model_costs
    from noloco_node.model.memory import stage_params

    embed, layer, head = model_costs(config, seq_len=seq_len)
    tokens, last = microbatch * seq_len, len(ranges) - 1
    flops, params = [], []
    for s, r in enumerate(ranges):
        macs = len(r) * layer + (embed if s == 0 else 0) + (head if s == last else 0)
        passes = (4 if 0 < s < last else 3) + (1 if checkpointing else 0)
        flops.append(passes * 2 * macs * tokens)
        params.append(stage_params(config, r, first=s == 0, last=s == last))
    return PipelineCosts(stage_flops=tuple(flops), stage_params=tuple(params), hop_elements=tokens * config.hidden_size,
                         microbatches_per_batch=microbatches_per_batch, max_in_flight=max_in_flight, schedule=schedule,
                         activation_bytes=codec_bytes_per_element(activation_codec),
                         gradient_bytes=codec_bytes_per_element(gradient_codec or activation_codec),
                         outer_bytes_per_param=sum(codec_bytes_per_element(c) for c in outer_payload),
                         inner_steps_per_outer=inner_steps_per_outer, outer_overlap=outer_overlap)


def inner_step_seconds(costs: PipelineCosts, flops_per_s: float, link: Link) -> tuple[float, tuple, tuple, str]:
    """(seconds per inner step, compute per stage, uplink per node, what limits it)."""
    p = len(costs.stage_flops)
    compute = tuple(f / flops_per_s for f in costs.stage_flops)
    fwd = link.seconds(costs.hop_elements * costs.activation_bytes)
    bwd = link.seconds(costs.hop_elements * costs.gradient_bytes)
    uplink = tuple((fwd if s < p - 1 else 0.0) + (bwd if s > 0 else 0.0) for s in range(p))
    rtt = link.rtt_ms / 1e3
    round_trip = sum(compute) + (p - 1) * (fwd + bwd + rtt)
    m = costs.microbatches_per_batch
    issued = m * (2 if costs.schedule == "overlap" else 1)
    window = issued if p == 1 else min(costs.max_in_flight, issued)
    tau = max(max(compute), max(uplink))
    interval = max(tau, round_trip / window)
    if interval > tau * (1 + 1e-9):
        limit = "the in-flight window (pipeline.max_in_flight) against the round trip"
    elif max(uplink) > max(compute):
        limit = "the link (activations and gradients per microbatch)"
    else:
        limit = "compute"
    if costs.schedule == "overlap":
        step = max(m * interval, (round_trip + (m - 1) * interval) / 2)
    else:
        step = round_trip + (m - 1) * interval
    return step, compute, uplink, limit


def predict(costs: PipelineCosts, *, tflops: float, mfu: float = DEFAULT_MFU, link: Link = Link()) -> Prediction:
    """Predicted inner step, outer round and tokens/s ratio against an unlimited link (module docstring)."""
    if tflops <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"need device TFLOP/s > 0 and 0 < MFU <= 1, got {tflops} and {mfu}")
    flops_per_s = tflops * 1e12 * mfu
    step, compute, uplink, limit = inner_step_seconds(costs, flops_per_s, link)
    unlimited, *_ = inner_step_seconds(costs, flops_per_s, Link())
    h = costs.inner_steps_per_outer
    outer_bytes = max(costs.stage_params) * costs.outer_bytes_per_param
    outer = link.seconds(outer_bytes) + 2 * link.rtt_ms / 1e3
    if costs.outer_overlap:
        shared = max(h * costs.microbatches_per_batch * x + link.seconds(n * costs.outer_bytes_per_param)
                     for x, n in zip(uplink, costs.stage_params))
        round_s = max(h * step, outer, shared)
    else:
        round_s = h * step + outer
    if round_s - h * step > 0.5 * round_s:
        limit = "the outer exchange"
    ratio = h * unlimited / round_s if round_s > 0 else 1.0
    return Prediction(compute_s=compute, uplink_s=uplink, step_s=step, step_unlimited_s=unlimited, outer_s=outer,
                      round_s=round_s, ratio=min(1.0, ratio), limited_by=limit,
                      extra={"outer_bytes_per_stage": outer_bytes,
                             "hop_bytes": costs.hop_elements * costs.activation_bytes})
