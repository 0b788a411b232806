"""Optimizer math: pure torch. Must not import grpc, hivemind, asyncio or transformers."""
