"""How many tokens the last stage's loss takes at a time (model/losses.py); no torch, so that the
memory estimate (model/memory.py) can size the chunk without it."""

CHUNK_ELEMENTS = 1 << 25
"""Logits per chunk (tokens x vocabulary): 128 MiB in fp32; a 4096 vocabulary takes 8192 tokens
at once (a whole microbatch, usually), a 128k one 261."""


def chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)
