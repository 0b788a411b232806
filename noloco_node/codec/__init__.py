"""Tensor codecs: how a tensor becomes bytes and back (fp32, bf16, int8, fp8, int4, top-k, slices), with
their error bounds. Pure torch: the wire messages that carry them live in wire/, and both the
transport and the sync layer use these without reaching the network."""
