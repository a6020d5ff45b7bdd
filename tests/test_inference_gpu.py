"""GPU path (skipped without CUDA): a vLLM GPU server for the tiny policy, the
same token-in/token-out client, the checkpoint reload and the NCCL weight push.

Needs RLVR_VLLM_PYTHON (or InferenceConfig.vllm_python) pointing at a GPU vLLM
environment, and `vllm` importable in this process for the NCCL push."""

import asyncio

import pytest
import torch

from schemas.config import InferenceConfig
from tasks.inference import PolicyClient, VLLMServer, free_port
from tasks.policy import tokenizer as T
from tasks.policy.model import load_pretrained_policy

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def gpu_server(tiny_policy_dir, vllm_python, tmp_path_factory):
    cfg = InferenceConfig(device="gpu", max_model_len=2048, gpu_memory_utilization=0.3, weight_sync="nccl",
                          vllm_python=str(vllm_python), startup_timeout_s=900)
    with VLLMServer(tiny_policy_dir, cfg, log_dir=tmp_path_factory.mktemp("vllm-gpu")) as server:
        yield server


def test_generate_and_checkpoint_reload(gpu_server, tiny_policy_dir, tiny_policy_alt_dir):
    model, tok = load_pretrained_policy(tiny_policy_dir)
    c = PolicyClient([gpu_server.base_url], stop_token_ids=[T.special_token_ids(tok)[T.IM_END]])
    prompt = T.prompt_ids(tok, [{"role": "user", "content": "hi"}])

    async def scenario():
        a = await c.generate(prompt, 16, 0.0)
        await c.reload_weights(tiny_policy_alt_dir, 1)
        b = await c.generate(prompt, 16, 0.0)
        await c.reload_weights(tiny_policy_dir, 2)
        return a, b, await c.generate(prompt, 16, 0.0)

    a, b, back = asyncio.run(scenario())
    assert a.prompt_token_ids == prompt and len(a.logprobs) == len(a.token_ids)
    assert b.policy_version == 1 and back.policy_version == 2
    assert back.token_ids == a.token_ids and b.logprobs != a.logprobs


def test_nccl_weight_push(gpu_server, tiny_policy_dir, tiny_policy_alt_dir):
    from tasks.inference.weight_sync import NcclWeightSync

    model, tok = load_pretrained_policy(tiny_policy_alt_dir, dtype=torch.bfloat16)
    model = model.cuda()
    sync = NcclWeightSync(gpu_server.base_url, model, master_address="127.0.0.1", master_port=free_port(),
                          world_size=2)
    try:
        sync.push(version=7)
    finally:
        sync.close()
    c = PolicyClient([gpu_server.base_url])
    assert asyncio.run(c.server_version()) == "7"
