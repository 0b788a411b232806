"""What one GPU loses when two processes share it: the ceiling of gpu_stage.py's "processes P=2" run,
whose two stage processes each hold their own CUDA context on the one device. Kernels of different
contexts do not run at once: the GPU time-slices between them, and a slice switch costs time. That
is a cost of putting two stages on one GPU (a benchmark's shortcut), not of the gRPC path, and
nothing a swarm with one stage per GPU pays.

A plain Hugging Face loop of half the preset's decoder layers (a stage's share; embeddings and head
kept, small at these presets), first alone in one process, then in two processes at once, each
timed over the same wall-clock window after both finished their warm-up. The figure is the two
processes' tokens/s together over the one process's: 1.0 if sharing cost nothing (each would get
half), below that what the time-slicing takes. Random tokens: the data does not change the time.

    python benchmarks/gpu_shared.py --preset medium [--seq-len 1024 --batch 16 --micro 4] [--seconds 15] [--json F]
    python benchmarks/gpu_shared.py --device cpu --preset tiny --seq-len 64 --batch 8 --micro 2  # a dry run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_stage import flops_per_token, plain_step, synchronize  # noqa: E402

from noloco_node.config import load_config  # noqa: E402
from noloco_node.model.stage import llama_config  # noqa: E402


def half_model_config(args):
    """The preset's Llama config with half its decoder layers (pipeline.num_stages = 2's share)."""
    shape = load_config(overrides=[f"model.preset={args.preset}", f"model.seq_len={args.seq_len}"]).model.shape()
    return llama_config(
        vocab_size=args.vocab,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_layers=max(1, shape["num_layers"] // 2),
        num_heads=shape["num_heads"],
        max_seq_len=args.seq_len,
    )


def child(args) -> None:
    """One plain loop: warm up, say ready, wait for go, then train for args.seconds of wall clock."""
    from transformers import LlamaForCausalLM

    llama = half_model_config(args)
    llama._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = LlamaForCausalLM(llama).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(args.device), tokens[:, 1:].to(args.device)
    for _ in range(args.warmup):
        plain_step(model, opt, x, y, args)
    synchronize(args)
    Path(args.ready).touch()
    deadline = time.monotonic() + 600
    while not Path(args.go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("gpu_shared child: no go within 600 s")
        time.sleep(0.01)
    start = last = time.perf_counter()
    steps = 0
    while last - start < args.seconds:
        plain_step(model, opt, x, y, args)
        last, steps = time.perf_counter(), steps + 1
    Path(args.result).write_text(json.dumps({"steps": steps, "seconds": last - start}))


def run_together(count: int, args, out: Path) -> list[dict]:
    """`count` child loops at once, released together; each one's tokens/s."""
    folder = out / f"x{count}"
    folder.mkdir()
    procs = []
    try:
        for i in range(count):
            files = {k: str(folder / f"{k}{i}") for k in ("ready", "result")}
            argv = [sys.executable, __file__, "--child", "--go", str(folder / "go"), *_shared(args)]
            procs.append(subprocess.Popen([*argv, "--ready", files["ready"], "--result", files["result"]]))
        deadline = time.monotonic() + args.timeout
        while not all((folder / f"ready{i}").exists() for i in range(count)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise SystemExit(f"gpu_shared: {count} loop(s) not ready within {args.timeout:.0f} s")
            time.sleep(0.05)
        (folder / "go").touch()
        for p in procs:
            if p.wait(timeout=max(1.0, deadline + args.seconds - time.monotonic())) != 0:
                raise SystemExit(f"gpu_shared: a loop exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads((folder / f"result{i}").read_text()) for i in range(count)]
    tokens = args.batch * args.seq_len
    return [{**r, "tok_s": r["steps"] * tokens / r["seconds"]} for r in results]


def _shared(args) -> list[str]:
    names = ("device", "preset", "seq_len", "batch", "micro", "vocab", "seconds", "warmup")
    return [x for n in names for x in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="medium")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096, help="as the preset's runs (the trained tokenizer's size)")
    p.add_argument("--seconds", type=float, default=15.0, help="the timed wall-clock window of each loop")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240.0, help="for the loops to build and warm up")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--ready", "--go", "--result"):
        p.add_argument(name, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_shared: torch sees no CUDA device on this machine; nothing measured.")
        return 0
    fpt = flops_per_token(half_model_config(args), args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        alone = run_together(1, args, Path(tmp))[0]
        pair = run_together(2, args, Path(tmp))
    together = sum(r["tok_s"] for r in pair)
    mfu = {k: v * fpt / (args.peak_tflops * 1e12) for k, v in (("alone", alone["tok_s"]), ("together", together))}
    each = " + ".join(f"{r['tok_s']:.0f}" for r in pair)
    print(
        f"{args.preset} at half its layers, {args.device}: one process {alone['tok_s']:.0f} tok/s (MFU "
        f"{mfu['alone']:.3f}); two at once {each} = {together:.0f} tok/s "
        f"(MFU {mfu['together']:.3f}): {together / alone['tok_s']:.3f} of one process's throughput"
    )
    if args.json:
        result = {"alone": alone, "together": pair, "ratio": together / alone["tok_s"], "mfu": mfu, "args": vars(args)}
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
