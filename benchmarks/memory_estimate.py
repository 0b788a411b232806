"""The memory estimate (model/memory.py) against what a stage really peaks at.

Each case runs in a fresh process: it builds one stage with the node's own code (build.py,
StageWorker, InnerOptimizer, OuterState), replays the order of work the node's driver and runtime
give that stage (stage 0 keeps a whole batch's graphs, two batches' under overlap; later stages
keep inputs within max_in_flight and recompute; the last holds max_in_flight received inputs) for
a few inner steps with one outer exchange (stage 0 blocking at a step boundary, later stages in
the background across the next batch), and reports its peak: host RSS high-water mark (VmHWM)
minus the RSS before the stage was built on CPU, `torch.cuda.max_memory_allocated` on a GPU.

    python benchmarks/memory_estimate.py                        # the CPU table (tiny, small)
    python benchmarks/memory_estimate.py --case small:2:0:overlap --json   # one case
    python benchmarks/memory_estimate.py --device cuda --presets tiny,small,medium --seq-len 1024 --micro 4 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque


def _config(args, preset: str, stages: int, schedule: str):
    from noloco_node.config import load_config

    sets = [
        f"model.preset={preset}",
        f"model.seq_len={args.seq_len}",
        f"pipeline.num_stages={stages}",
        f"pipeline.batch_size={args.batch}",
        f"pipeline.microbatch_size={args.micro}",
        f"pipeline.max_in_flight={args.max_in_flight}",
        f"pipeline.schedule={schedule}",
        f"pipeline.activation_checkpointing={str(args.checkpointing).lower()}",
        f"outer.method={args.method}",
        f"pipeline.device={args.device}",
    ]
    if args.layers:
        sets.append(f"model.num_layers={args.layers}")
    return load_config(overrides=sets + list(args.set))


class Exchange:
    """One outer exchange as sync/noloco.py holds it: frozen snapshot, the partner's payload
    decoded (here: our own payload, which has the same size), applied at `finish`."""

    def __init__(self, state, cfg) -> None:
        from noloco_node.sync.snapshot import THETA, choose_payload, freeze, unpack
        from noloco_node.codec.tensors import decode

        o = cfg.outer
        self.state, self.payload = state, choose_payload(state, o.codec_phi, o.codec_delta)
        self.frozen = freeze(state, self.payload, o.codec_phi, o.codec_delta)
        received = {name: decode(spec, payload) for name, spec, payload in self.frozen.snapshot.tensors}
        self.peer = unpack(received, self.payload, list(state.params))
        self.theta = self.payload == THETA

    def finish(self) -> None:
        if self.theta:
            self.state.apply_noloco([self.peer], {n: v[1] for n, v in self.frozen.own.items()}, self.frozen.theta)
        else:
            self.state.apply_noloco_sent([self.peer], self.frozen.own, self.frozen.theta)
        self.frozen = self.peer = None


def _guarded(failure: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread
        failure.append(exc)


def _replay(worker, stage, cfg, state, steps: int) -> None:
    """The order of work the node gives this stage (module docstring)."""
    import torch

    p = cfg.pipeline
    b, t, h, v = p.microbatch_size, cfg.model.seq_len, stage.config.hidden_size, stage.config.vocab_size
    per_batch = p.batch_size // b
    overlap = p.schedule == "overlap"
    labels = lambda: torch.randint(0, v, (b, t))  # noqa: E731
    exchange_at = 1  # after the first inner step
    if stage.is_first and stage.is_last:
        for step in range(steps):
            for _ in range(per_batch):
                worker.forward_backward_whole(torch.randint(0, v, (b, t)), labels())
            worker.step()
            if step + 1 == exchange_at and state is not None:
                Exchange(state, cfg).finish()
        return
    if stage.is_last:  # up to max_in_flight received inputs wait for the compute thread
        pending = exchange = None
        for n in range(steps * per_batch):
            if pending is None or not pending:
                pending = deque(torch.randn(b, t, h) for _ in range(min(p.max_in_flight, steps * per_batch - n)))
            before = worker.inner_steps
            worker.forward_backward_last(pending.popleft(), labels())
            if worker.inner_steps != before:
                if exchange is not None:
                    exchange.finish()
                    exchange = None
                if worker.inner_steps == exchange_at and state is not None:
                    exchange = Exchange(state, cfg)  # in the background: computing goes on
        return
    window = per_batch * (2 if overlap else 1)
    if not stage.is_first:
        window = min(window, p.max_in_flight)
    total, issued, done, exchange = steps * per_batch, 0, 0, None
    kept: deque = deque()
    while done < total:
        batch_open = issued // per_batch <= done // per_batch + (1 if overlap else 0)
        while issued < total and len(kept) < window and batch_open:
            inputs = torch.randint(0, v, (b, t)) if stage.is_first else torch.randn(b, t, h)
            out = worker.forward(issued, inputs, keep_graph=stage.is_first)
            kept.append((issued, out.shape))
            issued += 1
            batch_open = issued // per_batch <= done // per_batch + (1 if overlap else 0)
        key, shape = kept.popleft()
        before = worker.inner_steps
        worker.backward(key, torch.randn(shape))
        done += 1
        if stage.is_first and done % per_batch == 0:
            worker.step()  # the driver's step, then its blocking outer hook
            if worker.inner_steps == exchange_at and state is not None:
                Exchange(state, cfg).finish()
        elif not stage.is_first and worker.inner_steps != before:
            if exchange is not None:
                exchange.finish()
                exchange = None
            if worker.inner_steps == exchange_at and state is not None:
                exchange = Exchange(state, cfg)
    if exchange is not None:
        exchange.finish()


def measure(args, preset: str, stages: int, stage_index: int, schedule: str) -> dict:
    """Build and run one stage in this process; returns the estimate and the measured peak."""
    import torch

    from noloco_node.model.build import build_run_stage, run_model
    from noloco_node.model.memory import estimate_for_run
    from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
    from noloco_node.optim.state import OuterState
    from noloco_node.pipeline.worker import StageWorker, WorkerSettings
    from noloco_node.runtime.compute import compute_device
    from noloco_node.runtime.memory import current_memory_bytes, peak_memory_bytes, tune_allocator

    torch.set_num_threads(args.threads)
    tune_allocator()  # as the node does (node/lifecycle.py)
    cfg = _config(args, preset, stages, schedule)
    device = compute_device(cfg.pipeline.device)
    llama, ranges = run_model(cfg, cfg.data.vocab_size)
    need = estimate_for_run(cfg, llama, ranges, stage_index, device.type)
    baseline = current_memory_bytes(device)
    started = time.monotonic()
    stage = build_run_stage(cfg, llama, ranges, stage_index).to(device)
    built = peak_memory_bytes(device) - baseline
    if device.type == "cpu":
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the build's peak is reported apart
            f.write("5")
    inner = cfg.inner
    optimizer = InnerOptimizer(
        stage.parameters(),
        InnerSchedule(lr_max=inner.lr, warmup_steps=inner.warmup_steps, total_steps=inner.total_steps),
    )
    state = (
        OuterState(stage.named_parameters(), alpha=cfg.outer.alpha, beta=cfg.outer.beta, gamma=cfg.outer.gamma)
        if cfg.outer.method == "noloco"
        else None
    )
    settings = WorkerSettings(
        batch_size=cfg.pipeline.batch_size,
        saved_ttl_s=1e9,
        auto_step=stage_index != 0,
        device=device,
        bf16_autocast=device.type == "cuda" and cfg.pipeline.bf16_autocast,
        stash_weights=schedule == "overlap" and not stage.is_last,
    )  # as the node sets it
    worker = StageWorker(stage, optimizer, settings, slow_weights=(lambda: state.phi) if state is not None else None)
    # On a thread of its own, as the node's compute thread (glibc gives it its own arena).
    failure: list[BaseException] = []
    thread = threading.Thread(target=_guarded, args=(failure, _replay, worker, stage, cfg, state, args.steps))
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    trained = peak_memory_bytes(device) - baseline
    return {
        "preset": preset,
        "layers": llama.num_hidden_layers,
        "stages": stages,
        "stage": stage_index,
        "schedule": schedule,
        "device": device.type,
        "seq_len": args.seq_len,
        "micro": args.micro,
        "batch": args.batch,
        "estimate": need.total,
        "parts": need.breakdown(),
        "peak": max(built, trained),
        "build_peak": built,
        "train_peak": trained,
        "seconds": round(time.monotonic() - started, 1),
    }


def cases(presets: list[str], schedules: list[str]) -> list[tuple[str, int, int, str]]:
    out = []
    for preset in presets:
        out.append((preset, 1, 0, schedules[0]))  # one stage: no stash, so both schedules run alike
        for schedule in schedules:
            out += [(preset, 3, s, schedule) for s in range(3)]
    return out


def run_case(args, case: tuple[str, int, int, str], timeout_s: float = 1800) -> dict:
    """One case in a fresh process (a peak is per process)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", ":".join(map(str, case)), "--json", *_common(args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"case {case} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _common(args) -> list[str]:
    out = [
        "--seq-len",
        str(args.seq_len),
        "--micro",
        str(args.micro),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--max-in-flight",
        str(args.max_in_flight),
        "--method",
        args.method,
        "--device",
        args.device,
        "--threads",
        str(args.threads),
    ]
    if args.layers:
        out += ["--layers", str(args.layers)]
    if args.checkpointing:
        out.append("--checkpointing")
    for item in args.set:
        out += ["--set", item]
    return out


def row(r: dict) -> str:
    mib = 1 << 20
    return (
        f"{r['preset']:<7} {r['layers']:>3} {r['stages']:>2} {r['stage']:>2} {r['schedule']:<8} "
        f"{r['estimate'] / mib:>9.1f} "
        f"{r['peak'] / mib:>9.1f} {r['estimate'] / max(1, r['peak']):>6.2f} {r['build_peak'] / mib:>8.1f} "
        f"{r['parts']['activations'] / mib:>8.1f}"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", help="PRESET:STAGES:STAGE:SCHEDULE, run in this process")
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--schedules", default="exact,overlap")
    p.add_argument("--layers", type=int, default=0, help="override the preset's decoder layers (a reduced model)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-in-flight", type=int, default=8)
    p.add_argument("--method", default="noloco", choices=["noloco", "none"])
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="any other config field")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.case:
        preset, stages, stage, schedule = args.case.split(":")
        result = measure(args, preset, int(stages), int(stage), schedule)
        print(json.dumps(result) if args.json else row(result))
        return 0
    print(
        f"device {args.device}, seq {args.seq_len}, microbatch {args.micro}, batch {args.batch}, "
        f"max_in_flight {args.max_in_flight}, {args.method}; MiB"
    )
    print(
        f"{'preset':<7} {'L':>3} {'P':>2} {'s':>2} {'schedule':<8} {'estimate':>9} {'measured':>9} {'ratio':>6} "
        f"{'build':>8} {'act est':>8}"
    )
    results = []
    for case in cases(args.presets.split(","), args.schedules.split(",")):
        results.append(run_case(args, case))
        print(row(results[-1]), flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
