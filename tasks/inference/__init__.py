"""vLLM inference: the managed server (server.py), the token-in/token-out client
and weight reloads (client.py), and the GPU NCCL weight push (weight_sync.py)."""

import contextlib

from tasks.inference.client import (
    Completion,
    ContextLengthError,
    InferenceError,
    PolicyClient,
    RequestRejectedError,
    ServerUnavailableError,
    WeightSyncError,
)
from tasks.inference.server import ServerStartError, VLLMServer, build_command, free_port

# The name the rollout code catches: the server is down or its engine died.
InferenceUnavailable = ServerUnavailableError

__all__ = [
    "Completion", "ContextLengthError", "InferenceError", "InferenceUnavailable", "PolicyClient",
    "RequestRejectedError", "ServerStartError", "ServerUnavailableError", "VLLMServer", "WeightSyncError",
    "build_command", "free_port", "managed_or_external",
]


def managed_or_external(cfg, model_dir, **server_kwargs):
    """Context manager yielding the base URLs to use for `cfg` (an InferenceConfig):
    external mode -> cfg.base_urls as they are; managed -> one VLLMServer for `model_dir`."""
    @contextlib.contextmanager
    def _cm():
        if cfg.mode == "external":
            if not cfg.base_urls:
                raise ValueError("inference.mode=external needs inference.base_urls")
            yield list(cfg.base_urls)
            return
        with VLLMServer(model_dir, cfg, **server_kwargs) as server:
            yield [server.base_url]

    return _cm()
