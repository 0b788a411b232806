"""One pipeline stage of a Llama model. Knows torch and transformers only: no peers, no network."""
