"""Emulated wide-area links for experiments: a delaying, rate-limiting TCP relay (the kernel here
has no netem) and a self-check that measures a profile through it."""
