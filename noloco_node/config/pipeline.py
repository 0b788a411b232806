"""The pipeline section: how the model is cut into stages, how microbatches are routed, batched,
scheduled and encoded between them, and when a node may move stage. Split from sections.py;
`noloco_node.config` exports it."""

from __future__ import annotations

from dataclasses import dataclass

from noloco_node.codec.names import PIPELINE_CODECS
from noloco_node.config.checks import _require


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    num_stages: int = 2
    """Pipeline stages the model is cut into; 1 = every node holds the whole model (no routing)."""
    stage: int | None = 0
    """The stage this node serves; None (or "auto") = the stage of a checkpoint found in
    checkpoint.dir, else the stage that sustains the least (a stage without replicas first), agreed
    with other joiners of the same moment through claims in the DHT (pipeline/stage_choice.py)."""
    batch_size: int = 8
    """B: sequences whose gradients one inner step accumulates, per replica."""
    microbatch_size: int = 1
    """Sequences per routed microbatch (the reference uses 1)."""
    routing: str = "capacity"
    """capacity: a random replica, drawn in proportion to its measured capacity (from its record;
    uniform until measured); random: each sender's own shuffled cycle over the live replicas, equal
    shares whatever their speed; fixed: always the next stage's replica at this sender's own index
    (D fixed pipelines, the paper's ablation of random routing); balanced: the reference's
    per-microbatch permutation (equal
    shares per replica while the stages' memberships match, else random). The all-reduce
    baselines (dp, diloco) always route balanced: every round's group is all D replicas at that
    round, so every replica must get exactly one batch per step."""
    max_in_flight: int = 8
    """Microbatches a node holds saved inputs for at once; beyond it, senders get BUSY."""
    activation_codec: str = "int8"
    """Wire codec of the forward activations: none (exact fp32, 4 bytes/value), bf16 (2), int8 (1.06),
    fp8 (e4m3, 1.06) or int4 (0.56); the blockwise ones carry one float32 scale per 64 values.
    int8 by default: inside the noise of bf16 in the loss-price reproduction at half the bytes
    (docs/experiments/loss_price/steps40); int4 halves them again at a small, seed-consistent price."""
    gradient_codec: str | None = None
    """Wire codec of the backward gradients, same choices; None = activation_codec. int4 rounds
    gradients stochastically (unbiased), activations to nearest."""
    deterministic: bool = False
    """Debug/oracle mode: microbatches issued one at a time in data order, no shuffling."""
    device: str = "auto"
    """Where this stage computes: auto (cuda if torch sees a GPU, else cpu), cpu, cuda or cuda:N."""
    bf16_autocast: bool = True
    """On a GPU, run the stage's compute under bf16 autocast (fp32 master weights, phi and m)."""
    layers_per_stage: tuple[int, ...] = ()
    """Decoder layers per stage, e.g. [7, 5]; empty = split by per-token compute cost (model/split.py)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory)."""
    overlap_result_copies: bool = True
    """On a GPU, copy each output and input gradient to the host on a stream of its own while the
    compute thread launches the next microbatch (pipeline/host_copies.py); false: the compute thread
    waits for each result before the next job, as before 2026-11-28 (a fallback, and the baseline
    benchmarks/gpu_stage.py's exact-waiting run measures against)."""
    compile: bool = False
    """Compile each decoder layer with torch.compile (inductor): norms, rotary embedding, SwiGLU and
    residual adds fused into fewer kernels, half a GPU stage's kernel time in eager mode. The first
    microbatches of each kind (forward, recompute, backward) wait while it compiles; needs a C++
    compiler on CPU. Measured with benchmarks/gpu_stage.py (--compile)."""
    schedule: str = "exact"
    """Stage 0's schedule. exact: a batch's microbatches all complete and the stage steps before
    the next batch starts (the oracle-equal mode). overlap: the next batch's forwards start while
    the current batch's gradients drain, so the pipeline never empties at a step boundary; those
    forwards see weights one inner step old (staleness bounded by 1): each stage keeps a copy of
    those weights for their backward, which waits for the step and gives the gradient at them
    (weight stashing). Not with outer.method = dp (lockstep)."""
    rebalance: bool | None = None
    """May this node move to another stage when that stage limits the swarm (pipeline/rebalance.py)?
    None = only if it chose its stage with 'auto'; true = also from a pinned stage; false = never."""
    rebalance_margin: float = 0.75
    """Move when the swarm sustains less than this share of what it would after the best single move
    (Petals: 0.75). Closer to 1 moves sooner; lower tolerates more imbalance."""
    rebalance_period_s: float = 120.0
    """How often a movable node checks the plan; a node that moved does not move again for 10
    periods, and nobody moves within 2 periods of any move."""

    def __post_init__(self) -> None:
        # One group per concern, in the order a bad config's first error has always been reported.
        self._check_stages()
        self._check_batches()
        self._check_rebalancing()
        self._check_in_flight_device_and_codecs()
        self._check_layers_per_stage()

    def _check_stages(self) -> None:
        _require(self.num_stages >= 1, "num_stages", f"must be >= 1, got {self.num_stages}", "use a positive integer")
        _require(
            self.stage is None or 0 <= self.stage < self.num_stages,
            "stage",
            f"{self.stage} is outside 0..{self.num_stages - 1}",
            "pick a stage index below num_stages, or 'auto'",
        )

    def _check_batches(self) -> None:
        _require(
            self.routing in ("capacity", "balanced", "random", "fixed"),
            "routing",
            f"unknown routing {self.routing!r}",
            "use capacity, balanced, random or fixed",
        )
        _require(
            self.batch_size >= 1 and self.microbatch_size >= 1,
            "batch_size",
            "batch_size and microbatch_size must be >= 1",
            "use positive integers",
        )
        _require(
            self.batch_size % self.microbatch_size == 0,
            "microbatch_size",
            f"batch_size {self.batch_size} is not a multiple of microbatch_size {self.microbatch_size}",
            "make batch_size a multiple of microbatch_size",
        )
        _require(
            self.schedule in ("exact", "overlap"),
            "schedule",
            f"unknown schedule {self.schedule!r}",
            "use exact or overlap",
        )

    def _check_rebalancing(self) -> None:
        _require(
            0.0 < self.rebalance_margin < 1.0,
            "rebalance_margin",
            f"must be in (0, 1), got {self.rebalance_margin}",
            "use e.g. 0.75",
        )
        _require(
            self.rebalance_period_s > 0,
            "rebalance_period_s",
            f"must be > 0, got {self.rebalance_period_s}",
            "use e.g. 120 (set pipeline.rebalance = false to pin the node)",
        )

    def _check_in_flight_device_and_codecs(self) -> None:
        _require(self.max_in_flight >= 1, "max_in_flight", f"must be >= 1, got {self.max_in_flight}", "use e.g. 8")
        _require(
            self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
            "device",
            f"unknown device {self.device!r}",
            "use auto, cpu, cuda or cuda:N",
        )
        _require(
            self.activation_codec in PIPELINE_CODECS,
            "activation_codec",
            f"unknown codec {self.activation_codec!r}",
            f"use one of {', '.join(PIPELINE_CODECS)}",
        )
        if self.gradient_codec is None:
            object.__setattr__(self, "gradient_codec", self.activation_codec)
        _require(
            self.gradient_codec in PIPELINE_CODECS,
            "gradient_codec",
            f"unknown codec {self.gradient_codec!r}",
            f"use one of {', '.join(PIPELINE_CODECS)}, or leave it unset to follow activation_codec",
        )

    def _check_layers_per_stage(self) -> None:
        _require(
            not self.layers_per_stage or len(self.layers_per_stage) == self.num_stages,
            "layers_per_stage",
            f"has {len(self.layers_per_stage)} entries but num_stages is {self.num_stages}",
            f"give one layer count per stage ({self.num_stages}), or leave it empty to split by cost",
        )
        _require(
            all(n >= 1 for n in self.layers_per_stage),
            "layers_per_stage",
            f"{list(self.layers_per_stage)} gives a stage no decoder layer",
            "give every stage >= 1 layer, or leave it empty to split by cost",
        )
