"""Corpora, tokenizer and packed training sequences. Knows datasets/tokenizers, not peers."""
