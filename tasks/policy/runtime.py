"""The policy on its ranks: load and shard it, compute its logprobs, sum across ranks, take a
checked optimizer step, save it. Shared by the GRPO update (grpo.py) and the warm start (sft.py).

Runs as 1 process or N under torchrun (gloo on CPU, NCCL on GPU). With N ranks the model is
sharded by NeMo Automodel's FSDP2 parallelizer; every rank reads the whole batch and computes
the same plan, so ranks agree on global counts and on the number of forward passes without
talking to each other.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from schemas.config import RunConfig
from tasks.policy import checkpoint as ckpt
from tasks.policy.batch import MicroBatch, Sample, collate, plan_micro_batches

# NeMo-RL metrics that are extrema (combined by min/max); every other one is a
# global-count-normalised term that adds up over micro-batches and ranks.
MIN_METRICS = ("probs_ratio_min", "probs_ratio_clamped_min")
MAX_METRICS = ("probs_ratio_max", "probs_ratio_clamped_max")


class UpdateAborted(RuntimeError):
    """A non-finite loss or gradient: nothing was saved, the previous checkpoint stands."""


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device
    bf16: bool

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_runtime(precision: str | None = None) -> Runtime:
    """Join the torchrun job if there is one (gloo on CPU, NCCL on GPU)."""
    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        from nemo_automodel.components.distributed.init_utils import initialize_distributed

        initialize_distributed("nccl" if cuda else "gloo", timeout_minutes=10)
    rank = dist.get_rank() if world > 1 else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    precision = precision or ("bf16" if cuda else "fp32")
    return Runtime(rank, world, device, precision == "bf16")


def is_router_param(name: str) -> bool:
    """qwen3_moe's router weights (`...mlp.gate.weight`), not the experts' gate projections."""
    return ".mlp.gate." in name


def load_for_training(model_dir: str | os.PathLike, rt: Runtime, freeze_router: bool = False):
    """Load fp32 master weights; shard with Automodel's FSDP2 parallelizer when world > 1."""
    model = ckpt.load_policy(model_dir)
    if freeze_router:
        for name, p in model.named_parameters():
            if is_router_param(name):
                p.requires_grad_(False)
    model.to(rt.device)
    if rt.world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from nemo_automodel.components.distributed.config import FSDP2Config
        from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

        # Compute in bf16 on GPUs (Automodel's default policy), fp32 on CPU; reduce grads in fp32.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if rt.bf16 else torch.float32,
                                  reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=False)
        mesh = MeshContext.build(FSDP2Config(mp_policy=mp), ParallelismSizes(dp_size=rt.world), world_size=rt.world)
        model = parallelize_model(model, mesh)
    model.train()
    return model, [p for p in model.parameters() if p.requires_grad]


def token_logprobs(model, mb: MicroBatch, rt: Runtime, temperature: float = 1.0) -> torch.Tensor:
    """[b, T] float32 log pi(token t+1 | tokens <= t): logits at t predict token t+1.

    GRPO passes the rollouts' sampling temperature: the policy that sampled them is
    softmax(logits / T), and its logprobs are what vLLM reports (processed_logprobs) and what
    the importance ratios and the policy gradient must use."""
    # One GPU is not sharded, so FSDP2's bf16 policy does not apply: autocast instead.
    autocast = rt.bf16 and rt.world == 1 and rt.device.type == "cuda"
    inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
    if rt.bf16 and rt.world == 1 and rt.device.type == "cpu":
        logits = _bf16_forward(model, inputs)
    else:
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            logits = model(**inputs).logits
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    nll = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="none")
    return -nll.view_as(mb.targets)


def _bf16_forward(model, inputs: dict) -> torch.Tensor:
    """Logits of the whole forward in bf16, on the bf16 rounding of the fp32 master weights: what
    FSDP2's param_dtype=bf16 computes on N ranks, and the weights vLLM serves in bf16 from our fp32
    checkpoints. Gradients flow back through the cast into the fp32 master weights, which AdamW steps."""
    from torch.func import functional_call

    params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    return functional_call(model, params, args=(), kwargs=inputs).logits


def policy_logprobs(model, token_ids: list[list[int]], micro_batch_tokens: int = 16384,
                    device: str | torch.device = "cpu", temperature: float = 1.0,
                    precision: str = "fp32") -> list[torch.Tensor]:
    """Per sequence, the shifted logprobs [L-1] of a plain (unsharded) model, computed as the trainer
    computes them at `precision` (fp32, or bf16 on fp32 master weights). For tests and tools."""
    rt = Runtime(0, 1, torch.device(device), precision == "bf16")
    samples = [Sample(str(i), torch.tensor(t, dtype=torch.long), torch.zeros(len(t) - 1), torch.zeros(len(t) - 1))
               for i, t in enumerate(token_ids)]
    out: list[torch.Tensor | None] = [None] * len(samples)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for (idx,) in plan_micro_batches([len(s.tokens) for s in samples], 1, micro_batch_tokens):
            mb = collate(samples, idx, rt.device)
            lp = token_logprobs(model, mb, rt, temperature).cpu()
            for j, i in enumerate(idx):
                out[i] = lp[j, :len(samples[i].tokens) - 1]
    model.train(was_training)
    return out


def all_reduce(values: list[float], op: str) -> list[float]:
    """Combine a few numbers over ranks: op is "sum", "min" or "max"."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def collective_device() -> torch.device:
    """NCCL only moves CUDA tensors; gloo takes CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _grads_finite(params) -> bool:
    return all(bool(torch.isfinite(_local(p.grad)).all()) for p in params if p.grad is not None)


def _grad_norm_and_clip(params, max_norm: float | None) -> float:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):  # sharded grads: the norm over all shards
        total = total.full_tensor()
    if max_norm is not None and math.isfinite(total.item()):
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
    return total.item()


def forward_logprobs(model, samples, plan, rt, store: str, temperature: float = 1.0):
    """No-grad logprobs of this rank's samples into Sample.<store> (prev or ref policy)."""
    with torch.no_grad():
        for step in plan:
            mb = collate(samples, step[rt.rank], rt.device)
            lp = token_logprobs(model, mb, rt, temperature).cpu()
            for j, i in enumerate(mb.indices):
                setattr(samples[i], store, lp[j, :len(samples[i].tokens) - 1].clone())


class OptimizerStep:
    """One AdamW step accumulated over micro-batches: `backward` each micro-batch's term of the
    global loss (already normalised by the whole batch's counts), then `apply` once. `apply`
    raises UpdateAborted, on every rank, before stepping on a non-finite loss or gradient."""

    def __init__(self, rt: Runtime, params):
        self.rt, self.params = rt, params
        self.sums: dict[str, float] = {}
        self.mins = {k: math.inf for k in MIN_METRICS}
        self.maxs = {k: -math.inf for k in MAX_METRICS}
        self.bad_loss = self.bad_grad = math.inf
        self.tokens = self.passes = 0

    def backward(self, loss: torch.Tensor, metrics: dict, mb: MicroBatch) -> None:
        s, self.passes = self.passes, self.passes + 1
        if not mb.indices:
            loss = loss * 0.0  # dummy pass: keeps FSDP2's collectives in step, adds nothing
        if not math.isfinite(loss.item()):
            self.bad_loss = min(self.bad_loss, s)
        # FSDP2 averages gradients over ranks; our loss terms are already global, so sum instead.
        (loss * self.rt.world).backward()
        if self.bad_grad == math.inf and not _grads_finite(self.params):
            self.bad_grad = s
        self.tokens += mb.real_tokens
        for k, v in metrics.items():
            if k in self.mins:
                self.mins[k] = min(self.mins[k], v)
            elif k in self.maxs:
                self.maxs[k] = max(self.maxs[k], v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v

    def apply(self, optimizer, max_grad_norm: float | None, samples: list[Sample], plan) -> dict:
        """Combine the ranks' counts; abort on anything non-finite; else clip, step, and return the metrics."""
        keys = sorted(self.sums)
        summed = all_reduce([self.sums[k] for k in keys] + [self.tokens], "sum")
        lo = all_reduce([self.mins[k] for k in MIN_METRICS] + [self.bad_loss, self.bad_grad], "min")
        hi = all_reduce([self.maxs[k] for k in MAX_METRICS], "max")
        bad_loss, bad_grad = lo[-2], lo[-1]
        if bad_loss < math.inf or bad_grad < math.inf:
            s = int(min(bad_loss, bad_grad))
            what = "loss" if bad_loss <= bad_grad else "gradient"
            where = "; ".join(f"rank {r}: {', '.join(samples[i].rollout_id for i in idx) or 'dummy pass'}"
                              for r, idx in enumerate(plan[s]))
            optimizer.zero_grad(set_to_none=True)
            raise UpdateAborted(f"non-finite {what} in micro-batch {s} of {len(plan)} ({where}); "
                                "no optimizer step taken, previous checkpoint kept")
        grad_norm = _grad_norm_and_clip(self.params, max_grad_norm)
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise UpdateAborted(f"non-finite gradient norm ({grad_norm}) after {len(plan)} micro-batches; "
                                "no optimizer step taken, previous checkpoint kept")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out = dict(zip(keys, summed[:-1]))
        out.update(zip(MIN_METRICS, lo[:len(MIN_METRICS)]))
        out.update(zip(MAX_METRICS, hi))
        out.update(grad_norm=grad_norm, tokens=int(summed[-1]), micro_batches=len(plan))
        return out


def adamw(params, cfg: RunConfig, lr: float) -> torch.optim.Optimizer:
    o = cfg.optimizer
    return torch.optim.AdamW(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def vocab_size(model_dir) -> int | None:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    return getattr(c, "vocab_size", None) or getattr(getattr(c, "text_config", None), "vocab_size", None)


def save(model, optimizer, rt, out_dir, model_dir, version, info) -> float:
    t = time.perf_counter()
    state = ckpt.full_state_dict(model)
    opt_state = ckpt.full_optimizer_state(model, optimizer) if optimizer is not None else None
    if rt.main:
        ckpt.save_policy(model, out_dir, policy_version=version, source_dir=model_dir, state_dict=state,
                         optimizer_state=opt_state, info=info)
    if rt.world > 1:
        dist.barrier()
    return time.perf_counter() - t
