"""What every peer of a run must agree on, computed the same way by `join` and `doctor`: the
corpus and tokenizer the config names, and the manifest hash over the config and tokenizer."""

from __future__ import annotations

import hashlib

from noloco_node.config import NodeConfig


def tokenizer_fingerprint(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def load_run_inputs(config: NodeConfig):
    """(corpus, tokenizer, manifest hash) for `config`; raises ValueError naming data.* fields.
    The hash covers the model files model.config / model.init_from name (their contents) and the
    rule that draws phi_0 from the seed (model/init.py), so peers that would start apart never mix."""
    from noloco_node.data.corpus import resolve_corpus
    from noloco_node.data.tokenizer import load_tokenizer

    data = config.data
    corpus = resolve_corpus(data.path, cache_dir=data.cache_path, text_field=data.text_field)
    tokenizer = load_tokenizer(data.tokenizer, corpus, vocab_size=data.vocab_size, cache_dir=data.cache_path)
    from noloco_node.model import init, subspace
    from noloco_node.model.build import files_fingerprint

    # How U and the fixed embedding are drawn enters only a subspace run's hash (a dense run's stays as it was).
    schemes = [f"init:{init.INIT_SCHEME}"] + (
        [f"subspace:{subspace.SUBSPACE_SCHEME}"] if config.model.residual_subspace else []
    )
    return (
        corpus,
        tokenizer,
        config.manifest_hash(
            f"tokenizer:{tokenizer_fingerprint(tokenizer)}", files_fingerprint(config.model), *schemes
        ),
    )
