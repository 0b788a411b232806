"""What `noloco-node demo` prints when its swarm is done: its summary.json in a few lines of words
(the file keeps every number)."""

from __future__ import annotations


def report_lines(summary: dict, program: str = "noloco-node") -> list[str]:
    """E.g.
    swarm demo, method noloco: 2 replicas x 2 stages, 40 inner steps in 48 s, 1,391 tok/s
    train loss 7.903 -> 5.871
    microbatches: 160 issued, 160 completed, 0 re-issued, 0 dropped
    outer rounds: 16, 14 paired and 2 solo (1 exchange failed); replica spread 1.204e-03
    the trained model (a Hugging Face model directory): runs/demo/model
      try: ...
    """
    wall = f" in {summary['wall_s']:.0f} s" if summary.get("wall_s") else ""
    rate = summary.get("tokens_per_s")
    lines = [
        f"{summary['mode']} demo, method {summary['method']}: {_count(summary['replicas'], 'replica')} x "
        f"{_count(summary['stages'], 'stage')}, {summary['inner_steps']} inner steps{wall}"
        + (f", {rate:,.0f} tok/s" if rate else ""),
        f"train loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}",
    ]
    if mb := summary.get("microbatches"):
        lines.append(
            f"microbatches: {mb.get('issued', 0):,} issued, {mb.get('completed', 0):,} completed, "
            f"{mb.get('reissued', 0):,} re-issued, {mb.get('dropped', 0):,} dropped"
        )
    outer = summary.get("outer")
    if outer is not None and summary["method"] != "none":  # no outer step to speak of
        spread = summary.get("replica_spread_last")
        lines.append(
            _outer_words(outer, summary["method"])
            + "; replica spread "
            + (f"{spread:.3e}" if spread is not None else "n/a (fewer than 2 replicas saved their weights)")
        )
    if summary.get("model"):
        model, config_file = summary["model"], summary["config_file"]
        lines += [
            f"the trained model (a Hugging Face model directory): {model}",
            f'  try: {program} generate {model} --prompt "And God said"',
            f"       {program} eval --config {config_file} {model}",
        ]
    return lines


def _outer_words(outer: dict, method: str) -> str:
    rounds, paired, solo = outer.get("rounds", 0), outer.get("paired", 0), outer.get("solo", 0)
    if method != "noloco":  # diloco and dp average the whole group; pairs and solos are NoLoCo's
        words = f"outer rounds: {rounds}"
        if outer.get("partial_rounds"):
            words += f", {outer['partial_rounds']} delivered part of the mean only"
        return words
    words = f"outer rounds: {rounds}, {paired} paired and {solo} solo"
    events = []  # events, not rounds: a round can fail an exchange and pair with the next replica
    if outer.get("rejected"):
        events.append(_count(outer["rejected"], "partner snapshot") + " refused")
    if outer.get("timed_out"):
        events.append(_count(outer["timed_out"], "exchange") + " failed")
    return words + (f" ({', '.join(events)})" if events else "")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
