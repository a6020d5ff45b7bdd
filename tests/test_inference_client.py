"""Client and server-manager logic without a real server: request shape, error
mapping, endpoint choice, the weight-reload call sequence, the command line."""

import asyncio
import json
import os

import httpx
import pytest

from schemas.config import InferenceConfig
from tasks.inference import (
    ContextLengthError,
    InferenceError,
    InferenceUnavailable,
    PolicyClient,
    RequestRejectedError,
    ServerUnavailableError,
    WeightSyncError,
    build_command,
    free_port,
)
from tasks.inference.server import build_env


class FakeVLLM:
    """Answers like vLLM's HTTP API; records every request."""

    def __init__(self, max_model_len=100, fail=None):
        self.calls, self.max_model_len, self.fail = [], max_model_len, fail or {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((request.url.host, path, request.url.params.get("mode"),
                           json.loads(request.content) if request.content else None))
        if path in self.fail:
            status, body = self.fail[path]
            return httpx.Response(status, text=body)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "policy", "max_model_len": self.max_model_len}]})
        if path == "/v1/completions":
            body = json.loads(request.content)
            n = body["max_tokens"]
            return httpx.Response(200, json={"prompt_token_ids": body["prompt"], "choices": [{
                "token_ids": list(range(n)), "logprobs": {"token_logprobs": [-1.0] * n},
                "finish_reason": "length", "stop_reason": None}]})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={})


def client(fake, urls=("http://a:1",), **kw):
    return PolicyClient(list(urls), stop_token_ids=[2], transport=httpx.MockTransport(fake), **kw)


def test_generate_request_and_result():
    fake = FakeVLLM(max_model_len=100)
    g = asyncio.run(client(fake).generate([5, 6, 7], 10, 0.7, 0.9, seed=3))
    body = fake.calls[-1][3]
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 10
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["seed"] == 3
    assert body["stop_token_ids"] == [2] and body["include_stop_str_in_output"] is True
    assert body["return_token_ids"] is True and body["skip_special_tokens"] is False and body["logprobs"] == 0
    assert g.prompt_token_ids == [5, 6, 7] and g.token_ids == list(range(10)) and len(g.logprobs) == 10
    assert g.policy_version == 0 and g.base_url == "http://a:1"


def test_max_tokens_clipped_to_context_and_context_error():
    fake = FakeVLLM(max_model_len=20)
    c = client(fake)
    assert len(asyncio.run(c.generate(list(range(15)), 50)).token_ids) == 5
    with pytest.raises(ContextLengthError):
        asyncio.run(c.generate(list(range(20)), 5))


@pytest.mark.parametrize("fail,exc", [
    ((500, "EngineDeadError"), ServerUnavailableError),
    ((400, "This model's maximum context length is 20 tokens"), ContextLengthError),
    ((400, "bad request"), RequestRejectedError),
])
def test_http_errors_map_to_types(fail, exc):
    with pytest.raises(exc):
        asyncio.run(client(FakeVLLM(fail={"/v1/completions": fail})).generate([1], 3))


def test_server_down_is_unavailable():
    c = PolicyClient([f"http://127.0.0.1:{free_port()}"])  # nothing listens there
    with pytest.raises(InferenceUnavailable) as e:
        asyncio.run(c.generate([1, 2], 4))
    assert e.value.base_url.startswith("http://127.0.0.1:")

    def reset(request):
        raise httpx.ReadError("connection reset by peer", request=request)

    with pytest.raises(ServerUnavailableError):
        asyncio.run(PolicyClient(["http://a:1"], transport=httpx.MockTransport(reset)).generate([1], 1))


def test_logprob_count_must_match():
    def bad(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "policy", "max_model_len": 50}]})
        return httpx.Response(200, json={"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]},
                                                      "finish_reason": "length"}]})

    with pytest.raises(InferenceError, match="1 logprobs for 2"):
        asyncio.run(PolicyClient(["http://a:1"], transport=httpx.MockTransport(bad)).generate([1], 2))


def test_least_loaded_spreads_requests():
    fake = FakeVLLM()
    c = client(fake, urls=["http://a:1", "http://b:1", "http://c:1"])

    async def many():
        return await asyncio.gather(*(c.generate([1], 2) for _ in range(9)))

    used = [g.base_url for g in asyncio.run(many())]
    assert {u: used.count(u) for u in set(used)} == {"http://a:1": 3, "http://b:1": 3, "http://c:1": 3}


def test_reload_sequence_and_version():
    fake = FakeVLLM()
    c = client(fake, urls=["http://a:1", "http://b:1"])
    asyncio.run(c.reload_weights("/ckpt/v3", 3))
    assert c.version == 3
    for host in "ab":
        seq = [(p, m, b) for h, p, m, b in fake.calls if h == host]
        assert [p for p, _, _ in seq] == ["/pause", "/collective_rpc", "/reset_prefix_cache",
                                          "/update_weight_version", "/resume"]
        assert seq[0][1] == "wait"
        assert seq[1][2] == {"method": "rlvr_reload_weights", "kwargs": {"weights_path": "/ckpt/v3"}}
        assert seq[3][2] == {"new_version": "3"}
    assert asyncio.run(c.generate([1], 1)).policy_version == 3


def test_failed_reload_still_resumes_and_keeps_version():
    fake = FakeVLLM(fail={"/collective_rpc": (500, "no such method")})
    c = client(fake, version=4)
    with pytest.raises(WeightSyncError, match="collective_rpc|reload_weights"):
        asyncio.run(c.reload_weights("/ckpt/v5", 5))
    assert [p for _, p, _, _ in fake.calls][-1] == "/resume"
    assert c.version == 4


def test_generate_waits_for_reload():
    order = []

    class Slow(FakeVLLM):
        def __call__(self, request):
            order.append(request.url.path)
            return super().__call__(request)

    fake = Slow()
    c = client(fake)

    async def both():
        reload = asyncio.create_task(c.reload_weights("/ckpt/v1", 1))
        await asyncio.sleep(0)  # reload has started (gate closed)
        g = await c.generate([1], 1)
        await reload
        return g

    g = asyncio.run(both())
    assert g.policy_version == 1
    assert order.index("/v1/completions") > order.index("/resume")


class TwoServers(FakeVLLM):
    """FakeVLLM for several hosts; hosts in `dead` refuse connections, as a killed server does;
    /weight_info answers `weight_version` (a list: one value per call, the last one repeated)."""

    def __init__(self, dead=(), weight_versions=None, **kw):
        super().__init__(**kw)
        self.dead, self.weight_versions = set(dead), list(weight_versions or [])

    def __call__(self, request):
        if request.url.host in self.dead:
            self.calls.append((request.url.host, request.url.path, None, None))
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/weight_info":
            self.calls.append((request.url.host, "/weight_info", None, None))
            v = self.weight_versions.pop(0) if len(self.weight_versions) > 1 else self.weight_versions[0]
            return httpx.Response(200, json={"weight_version": v})
        return super().__call__(request)


def test_dead_server_fails_over_to_the_others():
    fake = TwoServers(dead={"a"})
    c = client(fake, urls=["http://a:1", "http://b:1"])

    async def many():
        return await asyncio.gather(*(c.generate([1, 2], 3) for _ in range(6)))

    outs = asyncio.run(many())
    # Every request completed, on the live server; the dead one was tried, then left alone (cooldown).
    assert {g.base_url for g in outs} == {"http://b:1"} and all(len(g.token_ids) == 3 for g in outs)
    assert 1 <= sum(1 for h, p, _, _ in fake.calls if h == "a") <= 6
    before = sum(1 for h, _, _, _ in fake.calls if h == "a")
    asyncio.run(c.generate([1], 1))
    assert sum(1 for h, _, _, _ in fake.calls if h == "a") == before


def test_every_server_down_is_unavailable():
    with pytest.raises(InferenceUnavailable):
        asyncio.run(client(TwoServers(dead={"a", "b"}), urls=["http://a:1", "http://b:1"]).generate([1], 1))


def test_reload_leaves_out_a_dead_server_until_a_reload_reaches_it():
    fake = TwoServers(dead={"b"})
    c = client(fake, urls=["http://a:1", "http://b:1"])
    asyncio.run(c.reload_weights("/ckpt/v2", 2))
    assert c.version == 2 and c.live_urls == ["http://a:1"]
    c.failover_cooldown_s = 0.0
    fake.dead.clear()  # b is back, with old weights: still not used
    assert {asyncio.run(c.generate([1], 1)).base_url for _ in range(4)} == {"http://a:1"}
    asyncio.run(c.reload_weights("/ckpt/v3", 3))
    assert c.live_urls == ["http://a:1", "http://b:1"]


def test_reload_error_on_a_live_server_still_fails():
    # A server that answers but cannot reload is a bug, not a lost server: the step must fail.
    fake = TwoServers(fail={"/collective_rpc": (500, "no such method")})
    with pytest.raises(WeightSyncError):
        asyncio.run(client(fake, urls=["http://a:1", "http://b:1"]).reload_weights("/ckpt/v5", 5))
    with pytest.raises(WeightSyncError):
        asyncio.run(client(TwoServers(dead={"a", "b"}), urls=["http://a:1", "http://b:1"]).reload_weights("/c", 1))


def test_version_from_server_and_redraw_across_a_reload():
    fake = TwoServers(weight_versions=["4"])
    c = client(fake, version=0, version_from_server=True)
    assert asyncio.run(c.generate([1], 2)).policy_version == 4
    # The version changed during the request: the sample is drawn again, stamped with the new one.
    fake.weight_versions = ["4", "5", "5", "5"]
    n = sum(1 for _, p, _, _ in fake.calls if p == "/v1/completions")
    assert asyncio.run(c.generate([1], 2)).policy_version == 5
    assert sum(1 for _, p, _, _ in fake.calls if p == "/v1/completions") == n + 2
    fake.weight_versions = [None]  # never reloaded: the client's own version
    assert asyncio.run(c.generate([1], 2)).policy_version == 0


def test_record_version_tells_every_server():
    fake = FakeVLLM()
    asyncio.run(client(fake, urls=["http://a:1", "http://b:1"]).record_version(3))
    assert sorted((h, p, b["new_version"]) for h, p, _, b in fake.calls) == [
        ("a", "/update_weight_version", "3"), ("b", "/update_weight_version", "3")]


def test_build_command_cpu_and_gpu(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    cpu = build_command(tmp_path, InferenceConfig(max_model_len=4096), 9000)
    joined = " ".join(cpu)
    assert cpu[1].endswith("rlvr_serve.py")  # vLLM's api_server, its engine core forked on CPU
    for flag in ["--dtype float32", "--max-model-len 4096", "--served-model-name policy", "--port 9000",
                 "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser qwen3_coder",
                 "--enforce-eager", "--worker-extension-cls rlvr_vllm_ext.RlvrWorkerExtension",
                 "--generation-config vllm"]:
        assert flag in joined, flag
    assert "--tensor-parallel-size" not in joined
    gpu = " ".join(build_command(tmp_path, InferenceConfig(
        device="gpu", tensor_parallel_size=4, data_parallel_size=2, enable_expert_parallel=True,
        gpu_memory_utilization=0.8, weight_sync="nccl"), 9000))
    for flag in ["--dtype auto", "--tensor-parallel-size 4", "--data-parallel-size 2", "--enable-expert-parallel",
                 "--gpu-memory-utilization 0.8", '--weight-transfer-config {"backend": "nccl"}']:
        assert flag in gpu, flag
    assert "--enforce-eager" not in gpu
    env = build_env(InferenceConfig(cpu_kvcache_gib=3, cpu_threads=2), tmp_path)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["OMP_NUM_THREADS"] == "2" and env["PYTHONPATH"].endswith("vllm_ext")
    # CPU: the model in the engine core's process unless asked otherwise; vLLM needs both settings.
    assert "--distributed-executor-backend uni" in joined and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    mp = InferenceConfig(cpu_executor="mp")
    assert "--distributed-executor-backend" not in " ".join(build_command(tmp_path, mp, 9000))
    assert build_env(mp, tmp_path).get("VLLM_ENABLE_V1_MULTIPROCESSING") == os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert "--distributed-executor-backend" not in gpu
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    extra = InferenceConfig(speculative_config=spec, extra_args=["--max-num-batched-tokens", "4096"],
                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    joined = " ".join(build_command(tmp_path, extra, 9000))
    assert f"--speculative-config {json.dumps(spec)}" in joined and "--max-num-batched-tokens 4096" in joined
    assert build_env(extra, tmp_path)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_qwen3_5_on_cpu_is_bf16(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe_text"}')
    assert "--dtype bfloat16" in " ".join(build_command(tmp_path, InferenceConfig(), 9000))
    # fp32 starts a server that dies on its first request: refused before it starts, with the reason.
    from schemas.presets import PermanentError

    with pytest.raises(PermanentError, match="inference.dtype=float32 cannot serve .*GDN attention asserts bfloat16"):
        build_command(tmp_path, InferenceConfig(dtype="float32"), 9000)
    assert "--dtype float32" in " ".join(build_command(tmp_path, InferenceConfig(dtype="float32", device="gpu"), 9000))
    # vLLM caches a hybrid's prefixes only with chunked prefill (which seeded runs turn off on CPU): else none.
    assert "--enable-prefix-caching" in build_command(tmp_path, InferenceConfig(), 9000)
    assert "--no-enable-prefix-caching" in build_command(tmp_path, InferenceConfig(chunked_prefill=False), 9000)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')  # the default architecture: fp32 serves
    assert "--enable-prefix-caching" in build_command(tmp_path, InferenceConfig(chunked_prefill=False), 9000)
    assert "--dtype float32" in " ".join(build_command(tmp_path, InferenceConfig(dtype="float32"), 9000))


def test_an_idle_connection_is_not_reused_when_the_server_may_be_closing_it():
    """uvicorn (vLLM's server) closes a connection idle for 5 s; a request sent on it at that moment gets no
    answer ("Server disconnected without sending a response", a failed weight reload in CI). This server
    plays the losing side of that race for every request arriving on a connection idle >= 4.5 s."""
    from tasks.inference.client import KEEPALIVE_EXPIRY_S

    server_keepalive_s = 5.0  # VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default
    assert KEEPALIVE_EXPIRY_S < server_keepalive_s - 2.0  # a margin for a loaded machine

    async def handle(reader, writer):
        last = asyncio.get_running_loop().time()
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if asyncio.get_running_loop().time() - last >= server_keepalive_s - 0.5:
                writer.close()  # the server's keep-alive timer fired as the request arrived
                return
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), b"0"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            last = asyncio.get_running_loop().time()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, PolicyClient(url) as client:
            await client._request(url, "POST", "/pause", params={"mode": "wait"})
            await asyncio.sleep(server_keepalive_s - 0.4)
            await client._request(url, "POST", "/pause", params={"mode": "wait"})  # a fresh connection

    asyncio.run(go())
