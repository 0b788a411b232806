"""Microbatch routing and inner training across pipeline stages."""
