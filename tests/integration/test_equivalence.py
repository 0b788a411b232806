"""The pipeline's oracle: deterministic mode (one replica per stage, microbatches in order, exact
fp32 activations) over gRPC between separate processes equals training the whole
LlamaForCausalLM in one process: same per-microbatch losses and same weights after 5 steps.
P = 2 here, over real streams; P = 2 and 3 also run in process in the fast tier
(tests/unit/node/test_swarm_in_process.py)."""

import pytest
import torch
from safetensors.torch import load_file

from tests.oracle import train_whole_model
from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
STEPS = 5


def test_pipeline_over_grpc_equals_whole_model(tmp_path, make_swarm, num_stages=2):
    overrides = tiny_overrides(
        tmp_path,
        **{"pipeline.num_stages": num_stages, "pipeline.deterministic": "true", "pipeline.activation_codec": "none"},
    )
    config, corpus, tokenizer = prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    servers = [swarm.start_node(s, 0, "--save-weights") for s in range(1, num_stages)]
    swarm.wait_ready(servers)
    driver = swarm.start_node(0, 0, "--steps", str(STEPS), "--save-weights")
    swarm.wait_exit([driver], timeout_s=150)
    assert driver.proc.returncode == 0, driver.log_file.read_text()[-3000:]
    swarm.stop()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the nodes ran with one thread each
    try:
        ref_losses, ref_weights = train_whole_model(config, corpus, tokenizer, STEPS)
    finally:
        torch.set_num_threads(threads)

    stats = swarm.node_stats()
    [stage0] = [s for s in stats.values() if s["stage"] == 0]
    assert stage0["microbatches"] == {"issued": 10, "completed": 10, "reissued": 0, "dropped": 0}
    torch.testing.assert_close(torch.tensor(stage0["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)

    seen = set()
    for path in sorted((swarm.out_dir / "nodes").glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            ref = ref_weights[name]
            rel = float((tensor.double() - ref.double()).norm() / ref.double().norm())
            assert rel <= 1e-5, f"{path.name}:{name} differs by {rel:.2e} (relative)"
            seen.add(name)
    assert seen == set(ref_weights), "the stages together must hold exactly the whole model"
    assert all(s["inner_steps"] == STEPS for s in stats.values())
