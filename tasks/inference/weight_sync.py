"""GPU weight sync: broadcast the trainer's weights to vLLM over NCCL.

This is vLLM's weight-transfer API (docs: training/weight_transfer, backend
"nccl"): the server runs with `--weight-transfer-config '{"backend": "nccl"}'`
(server.build_command adds it when InferenceConfig.weight_sync == "nccl"); the
trainer's rank 0 joins an NCCL group with the inference workers once, then
each sync is start_weight_update -> update_weights (concurrent with the NCCL
broadcast) -> finish_weight_update, driven over HTTP by vLLM's own trainer-side
engine. The trainer process therefore needs the `vllm` package (GPU build)
importable; this module imports it lazily so CPU environments never need it.

Untested here (no GPU on the development machines): tests marked `gpu`.
On CPU use PolicyClient.reload_weights (checkpoint directory).
"""

from __future__ import annotations

import urllib.request


class NcclWeightSync:
    """Push a torch module's weights to one vLLM server over NCCL.

    world_size = 1 (this trainer rank) + the server's GPU workers
    (tensor_parallel_size * data_parallel_size). All trainer ranks construct it
    (FSDP gathers are collectives); rank 0 is the sender."""

    def __init__(self, base_url: str, model, *, master_address: str, master_port: int,
                 world_size: int, rank: int = 0):
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.base_url = base_url.rstrip("/")
        self.engine = WeightTransferTrainerFactory.trainer_init(
            NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                world_size=world_size, rank=rank),
            client=HTTPVLLMWeightSyncClient(self.base_url),
            source=ModuleSource(model),
        )
        self.is_sender = rank == 0

    def push(self, version: int) -> None:
        """Send the current weights and record `version` on the server. The
        caller pauses rollouts around it if in-flight requests must not mix versions."""
        self.engine.send_weights()
        if self.is_sender:
            req = urllib.request.Request(
                f"{self.base_url}/update_weight_version", method="POST",
                data=f'{{"new_version": "{int(version)}"}}'.encode(),
                headers={"Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=60).close()

    def close(self) -> None:
        self.engine.shutdown()
