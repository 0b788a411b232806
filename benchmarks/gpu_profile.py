"""Where a pipeline stage's time goes on a GPU: the in-process P = 2 swarm (node/in_process.py, both
stages in this process on the one GPU, bf16 codec on the in-memory twin of the transport) trained
under torch.profiler for a few steps after warm-up, and the trace read back into a compact breakdown.

Per stage (the thread that launched the work: its compute thread, or the autograd engine's device
thread while only that stage was inside a backward):
  kernels       GPU kernel time and count, and the top kernels by time
  memcpy        host<->device copies: time, count and bytes per direction
  syncs         calls that block the host on the GPU (stream/device/event synchronize, blocking
                memcpy) and the host seconds spent blocked in them
  jobs          each compute job (forward, backward, forward_backward_last, step...): count, host
                wall seconds, and the kernel time it launched
Swarm-wide: the GPU's busy time (union of kernels and copies) against the profiled wall time, the
idle gaps, the event loop thread's host time (the codec of the in-memory transport, labels), and
on the last stage the LM head + loss (fwd + bwd) against one decoder layer, timed with events.

Each compute job is labelled with torch.profiler.record_function by wrapping the compute thread's
job runner in this benchmark (instrumentation only; the node's code is not changed), so the same
script profiles an older copy of the package (PYTHONPATH) for a before/after comparison.

    python benchmarks/gpu_profile.py --preset medium [--schedule exact] [--json F] [--trace F.json.gz]
    python benchmarks/gpu_profile.py --device cpu --preset tiny   # a dry run of the logic
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gzip
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_stage import config_for, flops_per_token  # noqa: E402
from noloco_node.model.build import run_model  # noqa: E402
from noloco_node.node.in_process import InProcessSwarm  # noqa: E402
from noloco_node.node.manifest import load_run_inputs  # noqa: E402

JOB_PREFIX = "job:"
# Jobs whose backward the autograd engine may run on its own device thread (CUDA).
BACKWARD_JOBS = ("backward", "forward_backward_last", "forward_backward_whole")
TRACE_KEEPS = (
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
    "cuda_runtime",
    "cuda_driver",
    "cuda_sync",
    "user_annotation",
    "gpu_user_annotation",
)
# Runtime calls that block the host until the GPU has caught up.
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpy2D",
    "cudaStreamWaitEvent_blocking",
)


def label_jobs(node) -> None:
    """Every job this node's compute thread runs is a record_function range "job:s<stage>.<fn>"."""
    compute, stage = node.parts.compute, node.stage
    timed = compute._timed

    def labelled(fn, *args, **kwargs):
        with record_function(f"{JOB_PREFIX}s{stage}.{getattr(fn, '__name__', 'job')}"):
            return timed(fn, *args, **kwargs)

    compute._timed = labelled


async def thread_ids(swarm) -> dict[int, str]:
    """OS thread id -> "s<stage>" for each compute thread, "s<stage>.wait" for the thread that waits
    for its results (runtime/compute.py); "loop" for this one."""
    ids = {threading.get_native_id(): "loop"}
    for node in swarm.nodes:
        ids[await node.parts.compute.run(threading.get_native_id)] = f"s{node.stage}"
        waiter = node.parts.compute._waiter.submit(threading.get_native_id)
        ids[await asyncio.wrap_future(waiter)] = f"s{node.stage}.wait"
    return ids


def all_threads_config():
    """The compute threads started before the profiler: without profile_all_threads (torch >= 2.10?)
    only this thread's ops are recorded (kernels and CUDA runtime calls still are, from CUPTI)."""
    from torch._C._profiler import _ExperimentalConfig

    for kwargs in ({"profile_all_threads": True, "enable_cuda_sync_events": True}, {"profile_all_threads": True}, {}):
        try:
            return _ExperimentalConfig(**kwargs)
        except TypeError:
            continue
    return None


def union_seconds(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """(covered microseconds, the gaps between covered stretches) of [start, end) intervals."""
    covered, gaps, end = 0.0, [], None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            covered += e - s
            end = e
        elif e > end:
            covered += e - end
            end = e
    return covered, gaps


def analyse(trace: dict, threads: dict[int, str]) -> dict:
    """The breakdown (module docstring) from a chrome trace of the profiled steps. Times in ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    jobs = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(JOB_PREFIX)]
    if not jobs:
        return {"error": "no labelled compute jobs in the trace"}
    t0, t1 = min(e["ts"] for e in jobs), max(e["ts"] + e["dur"] for e in jobs)
    wall_us = t1 - t0
    jobs_by_tid: dict[int, list] = defaultdict(list)
    for e in jobs:
        jobs_by_tid[e["tid"]].append(e)
    for lst in jobs_by_tid.values():
        lst.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in lst] for tid, lst in jobs_by_tid.items()}

    def job_at(tid, ts):
        lst = jobs_by_tid.get(tid)
        if not lst:
            return None
        i = bisect.bisect_right(starts[tid], ts) - 1
        return lst[i] if i >= 0 and ts <= lst[i]["ts"] + lst[i]["dur"] else None

    def owner(tid, ts) -> tuple[str, dict | None]:
        """(stage label, job) that launched work at host time ts on thread tid."""
        if tid in jobs_by_tid:
            job = job_at(tid, ts)
            return threads.get(tid, f"tid{tid}"), job
        if threads.get(tid) == "loop":
            return "loop", None
        if threads.get(tid, "").endswith(".wait"):  # a stage's waiter: its syncs are that stage's
            return threads[tid].removesuffix(".wait"), None
        # Another thread (the autograd engine's): the one stage inside a backward job then.
        inside = [
            (t, j)
            for t in jobs_by_tid
            if (j := job_at(t, ts)) is not None and j["name"].split(".", 1)[1] in BACKWARD_JOBS
        ]
        if len(inside) == 1:
            return threads.get(inside[0][0], f"tid{inside[0][0]}"), inside[0][1]
        return ("shared" if inside else "other"), None

    runtime = {
        e["args"]["correlation"]: e
        for e in events  # the launch (runtime or driver API) of each GPU event
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    stages: dict[str, dict] = defaultdict(
        lambda: {
            "kernel_ms": 0.0,
            "kernels": 0,
            "memcpy": defaultdict(lambda: [0, 0.0, 0]),
            "sync_ms": 0.0,
            "syncs": Counter(),
            "top": Counter(),
            "jobs": defaultdict(lambda: [0, 0.0, 0.0]),
        }
    )
    device_intervals = []
    job_kernel_us: Counter = Counter()
    for e in events:
        cat = e.get("cat")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        if not t0 <= e["ts"] <= t1:
            continue
        device_intervals.append((e["ts"], e["ts"] + e["dur"]))
        launch = runtime.get(e.get("args", {}).get("correlation"))
        who, job = owner(launch["tid"], launch["ts"]) if launch else ("other", None)
        s = stages[who]
        if cat == "kernel":
            s["kernel_ms"] += e["dur"] / 1e3
            s["kernels"] += 1
            s["top"][e["name"][:90]] += e["dur"] / 1e3
            if job is not None:
                job_kernel_us[id(job)] += e["dur"]
        elif cat == "gpu_memcpy":
            kind = e["name"].replace("Memcpy ", "").split(" ")[0]  # HtoD, DtoH, DtoD
            row = s["memcpy"][kind]
            row[0] += 1
            row[1] += e["dur"] / 1e3
            row[2] += int(e.get("args", {}).get("bytes", 0))
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in SYNC_CALLS and t0 <= e["ts"] <= t1:
            who, _ = owner(e["tid"], e["ts"])
            stages[who]["sync_ms"] += e["dur"] / 1e3
            stages[who]["syncs"][e["name"]] += 1
    for tid, lst in jobs_by_tid.items():
        for job in lst:
            row = stages[threads.get(tid, f"tid{tid}")]["jobs"][job["name"].split(".", 1)[1]]
            row[0] += 1
            row[1] += job["dur"] / 1e3
            row[2] += job_kernel_us[id(job)] / 1e3
    loop_tid = next((t for t, name in threads.items() if name == "loop"), None)
    loop_ops = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("tid") == loop_tid and e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1
    ]
    loop_us, _ = union_seconds(loop_ops)
    busy_us, gaps = union_seconds(device_intervals)
    gaps_ms = sorted((g / 1e3 for g in gaps), reverse=True)
    out = {
        "wall_ms": wall_us / 1e3,
        "gpu": {
            "busy_ms": busy_us / 1e3,
            "busy_fraction": busy_us / wall_us if wall_us else 0.0,
            "idle_ms": (wall_us - busy_us) / 1e3,
            "gaps_over_0.1ms": sum(g > 0.1 for g in gaps_ms),
            "gap_ms_over_0.1ms": sum(g for g in gaps_ms if g > 0.1),
            "largest_gaps_ms": [round(g, 2) for g in gaps_ms[:5]],
        },
        "loop_host_ms": loop_us / 1e3,
        "stages": {},
    }
    for who, s in sorted(stages.items()):
        out["stages"][who] = {
            "kernel_ms": round(s["kernel_ms"], 2),
            "kernels": s["kernels"],
            "memcpy": {
                k: {"count": c, "ms": round(ms, 2), "MB": round(b / 1e6, 1)} for k, (c, ms, b) in s["memcpy"].items()
            },
            "sync_ms": round(s["sync_ms"], 2),
            "syncs": dict(s["syncs"]),
            "jobs": {
                k: {"count": c, "wall_ms": round(w, 2), "kernel_ms": round(kms, 2)}
                for k, (c, w, kms) in s["jobs"].items()
            },
            "top_kernels": [[name, round(ms, 2)] for name, ms in s["top"].most_common(8)],
        }
    return out


def time_head_and_layer(node, args, repeats: int = 5) -> dict:
    """The last stage's norm + LM head + loss, forward and backward, against one decoder layer's,
    on a microbatch-sized input: ms each (events on a GPU)."""
    from noloco_node.model.stage import LlamaStage

    stage = node.parts.stage
    device = next(stage.parameters()).device
    h = stage.config.hidden_size
    x = torch.randn(args.micro, args.seq_len, h, device=device)
    labels = torch.randint(0, stage.config.vocab_size, (args.micro, args.seq_len), device=device)
    layer = next(iter(stage.model.layers.values()))
    position_ids = torch.arange(args.seq_len, device=device)[None]
    position_embeddings = stage.rotary_emb(x, position_ids)
    mask = stage._mask(x) if hasattr(stage, "_mask") else None
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )

    def head_loss():
        xi = x.detach().requires_grad_()
        with autocast:
            loss = LlamaStage.loss(stage.lm_head(stage.model.norm(xi)), labels)
        loss.backward()

    def one_layer():
        xi = x.detach().requires_grad_()
        with autocast:
            out = layer(xi, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    result = {}
    for name, fn in (("head_loss_ms", head_loss), ("layer_ms", one_layer)):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            result[name] = start.elapsed_time(end) / repeats
        else:
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            result[name] = (time.perf_counter() - t) * 1e3 / repeats
    stage.zero_grad(set_to_none=True)
    return result


async def profiled_run(args) -> dict:
    sets = {"pipeline.schedule": args.schedule, "pipeline.overlap_result_copies": str(not args.wait_results).lower()}
    config = config_for(args, Path(args.tmp), **sets)
    corpus, tokenizer, _ = load_run_inputs(config)
    llama, ranges = run_model(config, len(tokenizer))
    swarm = await InProcessSwarm(config, replicas=1).start()
    try:
        threads = await thread_ids(swarm)
        for node in swarm.nodes:
            label_jobs(node)
        await swarm.train(args.warmup, timeout_s=1800)
        if args.device == "cuda":
            torch.cuda.synchronize()
        # Unprofiled timing first: the profiler's own overhead stays out of tokens/s.
        start = time.perf_counter()
        await swarm.train(args.steps, timeout_s=1800)
        if args.device == "cuda":
            torch.cuda.synchronize()
        tokens = args.steps * args.batch * args.seq_len
        tok_s = tokens / (time.perf_counter() - start)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities, experimental_config=all_threads_config()) as prof:
            await swarm.train(args.profile_steps, timeout_s=1800)
            if args.device == "cuda":
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            if args.trace:  # the device side and the job labels only: host ops would make it large
                kept = [e for e in trace.get("traceEvents", []) if e.get("ph") == "M" or e.get("cat") in TRACE_KEEPS]
                with gzip.open(args.trace, "wt", compresslevel=3) as f:
                    json.dump({"traceEvents": kept}, f)
        summary = analyse(trace, threads)
        peak = args.peak_tflops * 1e12
        summary["tok_s"] = tok_s
        summary["mfu"] = tok_s * flops_per_token(llama, args.seq_len) / peak
        summary["profiled_steps"] = args.profile_steps
        summary["step_losses"] = swarm.stage(0)[0].driver.log.step_losses
        summary["head_vs_layer"] = time_head_and_layer(swarm.stage(1)[0], args)
        return summary
    finally:
        await swarm.stop()


def table(summary: dict, label: str) -> str:
    g = summary.get("gpu", {})
    lines = [
        f"[{label}] {summary.get('tok_s', 0):.0f} tok/s MFU {summary.get('mfu', 0):.3f} | profiled "
        f"{summary.get('profiled_steps')} steps: wall {summary.get('wall_ms', 0):.0f} ms, GPU busy "
        f"{g.get('busy_ms', 0):.0f} ms ({g.get('busy_fraction', 0):.2f}), gaps>0.1ms {g.get('gaps_over_0.1ms', 0)} "
        f"= {g.get('gap_ms_over_0.1ms', 0):.0f} ms, largest {g.get('largest_gaps_ms')}, event loop host "
        f"{summary.get('loop_host_ms', 0):.0f} ms, head+loss "
        f"{summary.get('head_vs_layer', {}).get('head_loss_ms', 0):.2f} ms"
        f" vs layer {summary.get('head_vs_layer', {}).get('layer_ms', 0):.2f} ms"
    ]
    for who, s in summary.get("stages", {}).items():
        copies = " ".join(f"{k} {v['count']}x{v['ms']:.1f}ms/{v['MB']:.0f}MB" for k, v in s["memcpy"].items())
        jobs = " ".join(
            f"{k} {v['count']}x wall {v['wall_ms']:.0f} kern {v['kernel_ms']:.0f}" for k, v in s["jobs"].items()
        )
        lines.append(
            f"  {who:6s} kernels {s['kernel_ms']:8.1f} ms ({s['kernels']}) | {copies or 'no copies'} | sync "
            f"{sum(s['syncs'].values())}x {s['sync_ms']:.1f} ms | {jobs}"
        )
        if s["top_kernels"]:
            lines.append("         top: " + "; ".join(f"{n[:48]} {ms:.1f}" for n, ms in s["top_kernels"][:4]))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--max-in-flight", type=int, default=4)
    p.add_argument("--schedule", default="exact", choices=("exact", "overlap"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps without the profiler (tokens/s, MFU)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--label", default="run")
    p.add_argument(
        "--wait-results",
        action="store_true",
        help="pipeline.overlap_result_copies = false: the compute thread waits for each result (the before)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--compile", action="store_true", help="pipeline.compile: the decoder layers torch.compile'd")
    p.add_argument("--subspace", type=int, default=0, help="model.residual_subspace k")
    p.add_argument("--codec", default="bf16", help="pipeline.activation_codec")
    p.add_argument("--trace", type=Path, help="also write the whole chrome trace here, gzipped")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script's logic")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: torch sees no CUDA device on this machine; nothing measured.")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        summary = asyncio.run(profiled_run(args))
    summary["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    summary["package"] = os.path.dirname(sys.modules["noloco_node"].__file__)
    summary["args"] = {k: str(v) for k, v in vars(args).items() if k != "tmp"}
    print(table(summary, args.label), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
