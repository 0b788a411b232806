"""An exported model directory can be read by whoever may read the directory: safetensors wrote
its weights 0600 while config.json followed the umask (a newcomer's export)."""

import os

from transformers import LlamaConfig, LlamaForCausalLM

from noloco_node.node.export import write_model_dir


class Tokenizer:
    bos_token_id = eos_token_id = None

    def save_pretrained(self, out) -> None:
        (out / "tokenizer.json").write_text("{}")


def test_the_weights_get_the_mode_config_json_got(tmp_path):
    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=16)
    weights = dict(LlamaForCausalLM(config).state_dict())
    old = os.umask(0o022)
    try:
        out = write_model_dir(tmp_path / "model", config, weights, Tokenizer())
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["config.json"] == 0o644 and modes["model.safetensors"] == 0o644, modes
