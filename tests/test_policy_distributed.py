"""The trainer as a flow launches it: the trainer worker, 1 rank or 2 under torchrun (FSDP2, gloo).
And the GPU path (NCCL, bf16), run only where CUDA is. Two ranks against one over GRPO updates, their
abort on a non-finite loss and their clean exit are one launch: test_policy_worker.py."""

import pyarrow.parquet as pq
import pytest
import torch

from tasks.grpo import compute_advantages
from tasks.policy import checkpoint as ckpt

from tasks.policy.batch import BadBatchError
from tasks.policy.runtime import policy_logprobs
from tasks.policy.worker import TrainerWorker
from tests.test_policy_support import (episode, grpo_step, make_policy_dir, reward_table, run_config,
                                       sft_stage, trajectory_rows)

EPISODES = [("Q: 1+1=", "2"), ("Q: 1+1=", "3"), ("Q: 1+1=", "two"), ("Q: 1+1=", "11"),
            ("Q: 2+2=", "4"), ("Q: 2+2=", "5"), ("Q: 2+2=", "four!"), ("Q: 2+2=", "22")]
REWARDS = [1, 0, 1, 0, 1, 0, 0, 1]


def step_inputs(tmp_path, model_dir, cfg, step):
    lps = policy_logprobs(ckpt.load_policy(model_dir), [episode(p, c)[0] for p, c in EPISODES])
    traj = trajectory_rows(EPISODES, step=step, logprobs=lps)
    adv = compute_advantages(traj, reward_table(traj, REWARDS), cfg.grpo)
    pq.write_table(traj, tmp_path / f"traj{step}.parquet")
    pq.write_table(adv, tmp_path / f"adv{step}.parquet")
    (tmp_path / "run.json").write_text(cfg.model_dump_json())
    return traj, adv


def worker_update(tmp_path, cfg, model_dir, out, step, num_ranks, precision=None) -> dict:
    """One update as a flow takes it: a trainer worker of `num_ranks` processes, then stopped."""
    with TrainerWorker(model_dir, cfg, num_ranks=num_ranks, precision=precision, start_timeout=300) as w:
        return w.train_step(tmp_path / f"traj{step}.parquet", tmp_path / f"adv{step}.parquet", out, timeout=300)


@pytest.mark.slow
def test_sft_two_ranks(tmp_path, capfd):
    cfg = run_config()
    cfg.optimizer.num_ranks = 2
    v0 = make_policy_dir(tmp_path / "base")
    demos = trajectory_rows([("Q: 1+1=", "2"), ("Q: 2+2=", "4"), ("Q: 3+3=", "6"), ("Q: 4+4=", "8")], group="demo")
    pq.write_table(demos, tmp_path / "demos.parquet")
    with TrainerWorker(v0, cfg, mode="sft", start_timeout=300) as w:
        m = w.sft(tmp_path / "demos.parquet", tmp_path / "sft", sft_stage(), max_steps=12, timeout=300)
    assert m["world_size"] == 2 and m["steps"] == 12 and m["loss_last"] < m["loss_first"]
    assert ckpt.read_policy_version(tmp_path / "sft") == 0
    # The warm start's progress reaches the caller's stderr, once (rank 0), the rest stays quiet.
    err = capfd.readouterr().err
    assert err.count("sft step 1/12: loss") == 1 and "[trainer progress]" not in err


@pytest.mark.slow
def test_one_rank_worker_and_bad_input(tmp_path):
    cfg = run_config()
    v0 = make_policy_dir(tmp_path / "v0")
    traj, adv = step_inputs(tmp_path, v0, cfg, 1)
    with TrainerWorker(v0, cfg, start_timeout=300) as w:
        pq.write_table(adv.slice(0, 6), tmp_path / "short.parquet")
        with pytest.raises(BadBatchError, match=r"g0-s1-6, g0-s1-7"):
            w.train_step(tmp_path / "traj1.parquet", tmp_path / "short.parquet", tmp_path / "v2", timeout=300)
        assert not (tmp_path / "v2").exists()
        m = w.train_step(tmp_path / "traj1.parquet", tmp_path / "adv1.parquet", tmp_path / "v1", timeout=300)
    assert m["world_size"] == 1 and m["policy_version"] == 1 and (tmp_path / "v1" / "model.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2])
def test_gpu_bf16_update(tmp_path, ranks):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    cfg = run_config(lr=1e-3)
    v0 = make_policy_dir(tmp_path / "v0")
    traj, adv = step_inputs(tmp_path, v0, cfg, 1)
    cpu = grpo_step(v0, traj, adv, cfg, tmp_path / "cpu", precision="fp32")  # CUDA visible: runs on GPU 0 in fp32
    gpu = worker_update(tmp_path, cfg, v0, tmp_path / "gpu", 1, num_ranks=ranks, precision="bf16")
    assert gpu["world_size"] == ranks
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=5e-2, abs=5e-3)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=5e-2)
    a = ckpt.load_policy(tmp_path / "gpu").state_dict()
    before = ckpt.load_policy(v0).state_dict()
    assert all(v.dtype == torch.float32 for v in a.values())  # fp32 master weights are what we save
    assert max((a[k] - before[k]).abs().max() for k in a) > 5e-4
