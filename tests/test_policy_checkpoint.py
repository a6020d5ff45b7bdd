"""Checkpoint dirs: round trip, version file, tokenizer files, optimizer state, atomic writes."""

import json

import pytest
import torch

from tasks.policy import checkpoint as ckpt
from tasks.policy.runtime import policy_logprobs
from tests.test_policy_support import episode, grpo_step, make_policy_dir, reward_table, run_config, trajectory_rows
from tasks.grpo import compute_advantages

SEQS = [episode("Q: 1+1=", "2")[0], episode("Q: what is 2+2?", "four")[0]]


def test_round_trip_same_logprobs(tmp_path):
    src = make_policy_dir(tmp_path / "v0")
    model = ckpt.load_policy(src)
    with torch.no_grad():  # make it differ from anything on disk
        model.model.norm.weight.mul_(1.5)
    want = policy_logprobs(model, SEQS)
    out = ckpt.save_policy(model, tmp_path / "v7", policy_version=7, source_dir=src)
    got = policy_logprobs(ckpt.load_policy(out), SEQS)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert ckpt.read_policy_version(out) == 7 and ckpt.read_policy_version(src) == 0
    meta = json.loads((out / ckpt.VERSION_FILE).read_text())
    assert meta["parent"] == str(src) and meta["parent_version"] == 0
    assert (out / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0", "v7"]  # no temporary dirs left


def test_updated_checkpoint_round_trip_and_optimizer_resume(tmp_path):
    cfg = run_config()
    src = make_policy_dir(tmp_path / "v0")
    group = [("Q: 1+1=", "2")] * 4 + [("Q: 1+1=", "3")] * 4
    lps = policy_logprobs(ckpt.load_policy(src), [episode(p, c)[0] for p, c in group])
    traj = trajectory_rows(group, logprobs=lps)
    adv = compute_advantages(traj, reward_table(traj, [1, 1, 0, 0, 1, 0, 0, 0]), cfg.grpo)
    m1 = grpo_step(src, traj, adv, cfg, tmp_path / "v1")
    v1 = ckpt.load_policy(tmp_path / "v1")
    resaved = ckpt.save_policy(v1, tmp_path / "v1b", policy_version=1, source_dir=tmp_path / "v1")
    assert all(torch.equal(a, b) for a, b in zip(policy_logprobs(v1, SEQS),
                                                 policy_logprobs(ckpt.load_policy(resaved), SEQS)))
    assert (tmp_path / "v1" / ckpt.OPTIMIZER_FILE).exists() and not m1["optimizer_resumed"]
    state = torch.load(tmp_path / "v1" / ckpt.OPTIMIZER_FILE, weights_only=True)
    assert "model.layers.0.self_attn.q_proj.weight" in state["state"]
    m2 = grpo_step(tmp_path / "v1", traj, adv, cfg, tmp_path / "v2")
    assert m2["optimizer_resumed"] and m2["policy_version"] == 2
    m3 = grpo_step(tmp_path / "v1", traj, adv, cfg, tmp_path / "v2", keep_optimizer_state=False)
    assert not m3["optimizer_resumed"] and not (tmp_path / "v2" / ckpt.OPTIMIZER_FILE).exists()


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    src = make_policy_dir(tmp_path / "v0")
    model = ckpt.load_policy(src)

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_policy(model, tmp_path / "v1", policy_version=1, source_dir=src, optimizer_state={"state": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0"]
