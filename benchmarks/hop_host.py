"""Host work of one pipeline hop, phase by phase, at a model preset's activation shape, each as a
multiple of one plain copy of the hop's float32 tensor measured in the same run (this machine is
noisy; the ratio is the figure).

A hop's host work runs on the sending and the receiving node's event loop, beside the compute
thread that launches the stage's kernels: on a GPU node every millisecond of it competes with the
device's feed for the CPU and the GIL (issue 35: processes over gRPC ran at 0.71 of a plain loop
where the same parts in one process ran at 0.90). Phases, in the order a hop crosses them:

  sender    encode          StageClient's encode_tensor of the stage's host result, as a GPU stage
                            hands it (bfloat16; a bf16 payload is then a view of it, no copy)
            chunk           the 1 MiB ForwardMessage chunks (rpc/tensors.chunk_messages)
            serialize       what gRPC does to each message before it writes it
  receiver  parse           gRPC's parse of each message
            collect         PayloadReceiver.add of every chunk into the preallocated buffer
            decode          decode_received: bf16 stays a view of the buffer, the others decode
            check           RunningBounds.check, the servicer's value screen (optim/integrity.py)
            widen           float32 of what arrived narrower: on a GPU this runs on the device
                            after the copy, so it is listed, not counted in the host total
  device    to device       on a GPU only: collect, decode and the worker's copy to the device, from
                            pageable memory (pinned by a host copy first) and from pinned memory
                            (codec/host_memory.py), each until the device has it
  previous  decode+check    the receive path's decode and screen before: every codec decoded to
                            float32 (by today's decoders), screened with abs().max() and a scaled
                            square mean (kept here to compare with)

With --gil, the share of each host phase's time a compute thread of the same process loses to it
through the GIL (benchmarks/gil_probe.py; work that holds the GIL throughout reads about half, as
the two threads take turns), and their sum in milliseconds for the hop's two ends.

    .venv/bin/python benchmarks/hop_host.py [--preset medium] [--microbatch 4] [--seq 1024]
        [--codecs bf16,int8,int4] [--repeats 7] [--threads 1] [--gil] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from codec_throughput import median_seconds
from gil_probe import share_lost_to_gil

from noloco_node.codec.checked import decode_checked, decode_received
from noloco_node.config.sections import MODEL_PRESETS
from noloco_node.optim.integrity import RunningBounds
from noloco_node.pipeline.transfers import Transfers
from noloco_node.runtime.memory import tune_allocator
from noloco_node.rpc.tensors import PayloadReceiver, chunk_messages, encode_tensor, header_to_spec
from noloco_node.wire.v1 import stage_pb2

HOST_PHASES = ("encode", "chunk", "serialize", "parse", "collect", "decode", "check")
DEVICE_KINDS = ("pageable", "pinned")


def previous_screen(tensor: torch.Tensor) -> float:
    """The value screen before this benchmark's change: |x| materialised for its max, then the
    square mean of x / peak (two more temporaries)."""
    peak = float(tensor.abs().max())
    scaled = tensor.to(torch.float32) / peak
    return peak * float(scaled.pow(2).mean().sqrt())


def hop_phases(activations: torch.Tensor, codec: str, repeats: int, gil: bool = False) -> dict:
    """Median seconds of each phase of one hop of `activations` (float32) sent with `codec`; with
    `gil`, also the share of each host phase another thread loses to it (under "gil")."""
    handed = activations.to(torch.bfloat16) if codec != "none" else activations  # what a GPU stage hands on
    header, payload = encode_tensor(handed, codec, dtype="float32", copy=False)
    spec = header_to_spec(header)
    messages = list(chunk_messages(stage_pb2.ForwardMessage, payload))
    wire = [m.SerializeToString() for m in messages]
    parsed = [stage_pb2.ForwardMessage.FromString(w) for w in wire]

    def collect() -> bytearray:
        receiver = PayloadReceiver(spec, max_bytes=len(payload))
        for message in parsed:
            receiver.add(message.chunk)
        return receiver.finish()

    buffer = collect()
    received = decode_received(spec, buffer)
    bounds = RunningBounds(factor=1000.0, max_abs=1e6)
    host = {
        "encode": lambda: encode_tensor(handed, codec, dtype="float32", copy=False),
        "chunk": lambda: list(chunk_messages(stage_pb2.ForwardMessage, payload)),
        "serialize": lambda: [m.SerializeToString() for m in messages],
        "parse": lambda: [stage_pb2.ForwardMessage.FromString(w) for w in wire],
        "collect": collect,
        "decode": lambda: decode_received(spec, buffer),
        "check": lambda: bounds.check(received),
    }
    held = {name: share_lost_to_gil(fn, repeats) for name, fn in host.items()} if gil else {}
    return {
        **{name: median_seconds(fn, repeats) for name, fn in host.items()},
        **(to_device_phases(spec, parsed, len(payload), repeats) if torch.cuda.is_available() else {}),
        "gil": held,
        "widen": median_seconds(lambda: received.to(torch.float32), repeats)
        if received.dtype != torch.float32
        else 0.0,
        "previous decode+check": median_seconds(lambda: previous_screen(decode_checked(spec, buffer)), repeats),
        "payload_bytes": len(payload),
    }


def to_device_phases(spec, parsed: list, payload_bytes: int, repeats: int) -> dict:
    """On a GPU: the receiver's collect and decode into pageable memory then the worker's copy to
    the device (which pins a copy of it first), against the same into pinned memory
    (codec/host_memory.py), whose copy is a DMA from the buffer itself; each until the device has it."""
    transfers = Transfers(torch.device("cuda"), (torch.float32, torch.float32), (None, None))

    def received_on_device(pinned: bool) -> None:
        receiver = PayloadReceiver(spec, max_bytes=payload_bytes, pinned=pinned)
        for message in parsed:
            receiver.add(message.chunk)
        transfers.input_to_device(decode_received(spec, receiver.finish(), pinned=pinned))
        torch.cuda.synchronize()

    return {
        f"to device, {kind}": median_seconds(lambda: received_on_device(kind == "pinned"), repeats)
        for kind in DEVICE_KINDS
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium", choices=sorted(MODEL_PRESETS))
    p.add_argument("--microbatch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--codecs", default="bf16,int8,int4")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    p.add_argument("--gil", action="store_true", help="also measure what each host phase costs another thread")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tune_allocator()  # as a node does (node/lifecycle.py): large temporaries reuse their pages
    hidden = MODEL_PRESETS[args.preset][0]
    activations = torch.randn(args.microbatch, args.seq, hidden, generator=torch.Generator().manual_seed(0))
    target = torch.empty_like(activations)
    copy_s = median_seconds(lambda: target.copy_(activations), args.repeats)
    print(
        f"{args.preset}: a hop of {args.microbatch} x {args.seq} x {hidden} float32 "
        f"({activations.nbytes / 1e6:.1f} MB); one copy of it {copy_s * 1e3:.2f} ms (the unit below); "
        f"{args.threads} torch thread(s), median of {args.repeats}"
    )
    results = {"preset": args.preset, "shape": list(activations.shape), "copy_s": copy_s, "codecs": {}}
    for codec in args.codecs.split(","):
        phases = hop_phases(activations, codec, args.repeats, args.gil)
        host = sum(phases[name] for name in HOST_PHASES)
        receive = sum(phases[name] for name in ("parse", "collect", "decode", "check"))
        previous = receive - phases["decode"] - phases["check"] + phases["previous decode+check"]
        results["codecs"][codec] = {**phases, "host_s": host, "receive_s": receive, "previous_receive_s": previous}
        print(f"\n{codec}: {phases['payload_bytes'] / 1e6:.1f} MB on the wire")
        gil = phases["gil"]
        on_device = [f"to device, {kind}" for kind in DEVICE_KINDS if f"to device, {kind}" in phases]
        for name in (*HOST_PHASES, "widen", "previous decode+check", *on_device):
            held = f"  another thread loses {gil[name]:4.0%}" if name in gil else ""
            print(f"  {name:22s} {phases[name] * 1e3:8.2f} ms  {phases[name] / copy_s:6.2f} copies{held}")
        print(f"  {'host, both ends':22s} {host * 1e3:8.2f} ms  {host / copy_s:6.2f} copies")
        if gil:
            held_s = sum(phases[name] * gil[name] for name in HOST_PHASES)
            results["codecs"][codec]["gil_held_s"] = held_s
            print(f"  {'lost to the GIL':22s} {held_s * 1e3:8.2f} ms  (by another thread, both ends)")
        print(
            f"  {'receiver':22s} {receive * 1e3:8.2f} ms  {receive / copy_s:6.2f} copies "
            f"(previous path {previous * 1e3:.2f} ms, {previous / copy_s:.2f} copies: {previous / receive:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
