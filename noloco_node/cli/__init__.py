"""Command-line entry points. Modules here import torch, transformers and hivemind only inside
`run`, so `noloco-node --help` answers instantly."""
