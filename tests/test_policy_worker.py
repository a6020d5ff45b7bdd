"""The persistent trainer worker: same result as one-shot updates, errors that leave the
state untouched, 2 ranks under torchrun, and no processes left behind."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from tasks.grpo import compute_advantages
from tasks.grpo.advantages import JoinError
from tasks.policy import checkpoint as ckpt
from tasks.policy.batch import BadBatchError
from tasks.policy.grpo import PolicyTrainer
from tasks.policy.runtime import UpdateAborted, policy_logprobs
from tasks.policy.worker import TrainerWorker, WorkerError, alive, serve
from tests.test_policy_support import episode, grpo_step, make_policy_dir, reward_table, run_config, trajectory_rows

EPISODES = [("Q: 1+1=", "2"), ("Q: 1+1=", "3"), ("Q: 1+1=", "two"), ("Q: 1+1=", "11"),
            ("Q: 2+2=", "4"), ("Q: 2+2=", "5"), ("Q: 2+2=", "four!"), ("Q: 2+2=", "22")]
REWARDS = [1, 0, 1, 0, 1, 0, 0, 1]
# Compared exactly between worker and one-shot (not timings, RSS or what was saved).
METRICS = ("loss", "grad_norm", "probs_ratio", "approx_entropy", "gen_kl_error", "sampling_importance_ratio",
           "is_oob_ratio", "tokens", "valid_tokens", "policy_version", "optimizer_resumed", "num_valid_samples")


def step_files(d, model_dir, cfg, step, poison=False):
    """A step's trajectories/advantages (logprobs of `model_dir`, as vLLM would report) as Parquet files.
    poison: the last rollout's advantage is huge (finite in float32), so the loss overflows to -inf
    (if the rollouts are on-policy: off-policy ones are dropped by seq-mask-tis, weight 0)."""
    lps = policy_logprobs(ckpt.load_policy(model_dir), [episode(p, c)[0] for p, c in EPISODES])
    traj = trajectory_rows(EPISODES, step=step, logprobs=lps)
    adv = compute_advantages(traj, reward_table(traj, REWARDS), cfg.grpo)
    if poison:
        a = adv.column("advantage").to_pylist()
        adv = adv.set_column(adv.schema.get_field_index("advantage"), "advantage", pa.array(a[:-1] + [3e38]))
    t, a = d / f"traj{step}{'p' if poison else ''}.parquet", d / f"adv{step}{'p' if poison else ''}.parquet"
    pq.write_table(traj, t)
    pq.write_table(adv, a)
    return t, a


def _short(d, files):
    """The advantages file without its last row (a batch that does not join)."""
    pq.write_table(pq.read_table(files[1]).slice(0, 7), d / "short.parquet")
    return d / "short.parquet"


def assert_same_checkpoint(a, b, exact=True):
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for w in (wa, wb):  # FSDP2's full state dict also lists the tied lm_head (a copy of the embeddings)
        if "lm_head.weight" in w:
            assert torch.equal(w.pop("lm_head.weight"), w["model.embed_tokens.weight"])
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]) if exact else (wa[k] - wb[k]).abs().max() < 1e-5, k
    sa = torch.load(a / ckpt.OPTIMIZER_FILE, weights_only=True)["state"]
    sb = torch.load(b / ckpt.OPTIMIZER_FILE, weights_only=True)["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for m in ("exp_avg", "exp_avg_sq", "step"):
            assert (torch.equal(sa[k][m], sb[k][m]) if exact else
                    torch.allclose(sa[k][m], sb[k][m], rtol=1e-3, atol=1e-7)), (k, m)


def trainer_state(t: PolicyTrainer):
    return ([p.detach().clone() for p in t.params],
            {id(p): {k: v.clone() for k, v in s.items()} for p, s in t.optimizer.state.items()})


def assert_same_state(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert all(torch.equal(a[1][k][m], b[1][k][m]) for m in a[1][k]), k


def test_aborted_and_rejected_updates_leave_state_untouched(tmp_path):
    cfg = run_config(lr=1e-3)
    v0 = make_policy_dir(tmp_path / "v0")
    t1, a1 = step_files(tmp_path, v0, cfg, 1)
    trainer = PolicyTrainer(v0, cfg)
    # AdamW state now non-empty
    trainer.grpo_update(*trainer.prepare(pq.read_table(t1), pq.read_table(a1)), tmp_path / "v1")
    tp, ap = step_files(tmp_path, tmp_path / "v1", cfg, 2, poison=True)
    before = trainer_state(trainer)
    # Two optimizer steps: the first is taken, the second (with the poisoned rollout) aborts.
    with pytest.raises(UpdateAborted, match="non-finite loss"):
        trainer.grpo_update(*trainer.prepare(pq.read_table(tp), pq.read_table(ap)), tmp_path / "v2", optimizer_steps=2)
    assert_same_state(before, trainer_state(trainer))
    with pytest.raises(UpdateAborted):
        trainer.grpo_update(*trainer.prepare(pq.read_table(tp), pq.read_table(ap)), tmp_path / "v2")
    with pytest.raises(JoinError):
        trainer.grpo_update(*trainer.prepare(pq.read_table(t1), pq.read_table(a1).slice(0, 5)), tmp_path / "v2")
    assert_same_state(before, trainer_state(trainer))
    assert not (tmp_path / "v2").exists() and trainer.version == 1 and trainer.model_dir == tmp_path / "v1"


def test_serve_protocol_in_process(tmp_path):
    cfg = run_config()
    v0 = make_policy_dir(tmp_path / "v0")
    t1, a1 = step_files(tmp_path, v0, cfg, 1)
    pq.write_table(pq.read_table(a1).slice(0, 6), tmp_path / "short.parquet")
    grpo = {"op": "grpo", "trajectories": str(t1), "advantages": str(a1)}
    lines = ["not json", json.dumps({"op": "train"}), json.dumps({"op": "grpo"}),
             json.dumps({**grpo, "advantages": str(tmp_path / "short.parquet"), "out": str(tmp_path / "x")}),
             json.dumps({**grpo, "out": str(tmp_path / "v7"), "policy_version": 7, "save_optimizer": False}),
             json.dumps({"op": "stop"}), json.dumps({"op": "never read"})]
    out = io.StringIO()
    assert serve(PolicyTrainer(v0, cfg), io.StringIO("\n".join(lines) + "\n"), out) == 0
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r.get("error_type") for r in replies] == ["BadRequest"] * 3 + ["JoinError", None, None]
    assert "g0-s1-6" in replies[3]["message"] and not (tmp_path / "x").exists()
    m = replies[4]["metrics"]
    assert replies[4]["ok"] and m["policy_version"] == 7 and not m["optimizer_saved"]
    assert replies[5] == {"ok": True, "op": "stop", "optimizer_saved": True, "eof": False}
    assert ckpt.read_policy_version(tmp_path / "v7") == 7 and (tmp_path / "v7" / ckpt.OPTIMIZER_FILE).exists()


def test_worker_matches_one_shot_and_survives_errors(tmp_path):
    cfg = run_config(lr=1e-3)
    one, w = tmp_path / "one", tmp_path / "worker"
    one.mkdir(), w.mkdir()
    v0 = make_policy_dir(tmp_path / "v0")
    files = {1: step_files(tmp_path, v0, cfg, 1)}
    worker = TrainerWorker(v0, cfg, num_ranks=1, log_path=tmp_path / "worker.log")
    with worker:
        assert worker.ready["policy_version"] == 0 and worker.log_path.exists()
        for step in (1, 2, 3):
            if step > 1:  # the next step's rollouts come from the policy the previous one made
                files[step] = step_files(tmp_path, one / f"v{step - 1}", cfg, step)
            ref = grpo_step(one / f"v{step - 1}" if step > 1 else v0, *map(pq.read_table, files[step]), cfg,
                              one / f"v{step}")
            # Step 1 keeps AdamW only in memory (step 2 must carry it); step 3's is written by stop().
            got = worker.train_step(*files[step], w / f"v{step}", policy_version=step, save_optimizer=step == 2)
            assert {k: got[k] for k in METRICS} == {k: ref[k] for k in METRICS}
            assert got["optimizer_saved"] == (step == 2) and worker.policy_version == step
            if step == 2:
                assert_same_checkpoint(one / "v2", w / "v2")
                # Errors: nothing changes, nothing is written, the next request works.
                poisoned = step_files(tmp_path, one / "v2", cfg, 3, poison=True)
                with pytest.raises(BadBatchError, match=r"JoinError.*g0-s1-7"):
                    worker.train_step(files[1][0], _short(tmp_path, files[1]), w / "bad", policy_version=3)
                with pytest.raises(UpdateAborted, match="non-finite loss"):
                    worker.train_step(*poisoned, w / "bad", policy_version=3, optimizer_steps=2)
                with pytest.raises(BadBatchError, match="FileNotFoundError|No such file"):
                    worker.train_step(tmp_path / "missing.parquet", files[1][1], w / "bad")
                assert not (w / "bad").exists() and worker.policy_version == 2
        pids = worker.pids()
        assert len(pids) == 1 and alive(pids[0])
        assert not (w / "v3" / ckpt.OPTIMIZER_FILE).exists()
    # stop() wrote the AdamW state step 3 skipped; the state matches the one-shot chain exactly.
    assert_same_checkpoint(one / "v3", w / "v3")
    assert ckpt.read_policy_version(w / "v3") == 3
    assert json.loads((w / "v3" / ckpt.VERSION_FILE).read_text())["parent"] == str(w / "v2")
    assert not any(alive(p) for p in pids) and worker.proc.returncode == 0
    assert "[worker] grpo" in worker.log_path.read_text()


def test_startup_failure_and_timeout_are_bounded(tmp_path):
    cfg = run_config()
    with pytest.raises(WorkerError, match=r"(?s)failed to load .*tail of"):
        TrainerWorker(tmp_path / "missing", cfg, start_timeout=300, log_path=tmp_path / "a.log").start()
    w = TrainerWorker(make_policy_dir(tmp_path / "v0"), cfg, start_timeout=0.5, log_path=tmp_path / "b.log")
    with pytest.raises(WorkerError, match="no reply .* within 0.5 s"):
        w.start()
    assert w.proc.returncode is not None and w.pids() == []


@pytest.mark.slow  # a torchrun worker and the 1-rank references: ~1 min on 2 busy cores
def test_two_ranks_match_one_rank_abort_together_and_leave_no_processes(tmp_path):
    """The one two-rank (FSDP2, gloo) launch of the suite: it resumes a checkpoint's AdamW state, matches one
    rank over two updates, aborts on both ranks at once on a non-finite loss naming the micro-batch and
    goes on, and leaves no process after a Ctrl-C."""
    # 64-token micro-batches: one rank packs 2 micro-batches, each of two ranks 1 (different padding).
    cfg = run_config(lr=1e-3, micro_batch_tokens=64)
    v0 = make_policy_dir(tmp_path / "v0")
    t1, a1 = step_files(tmp_path, v0, cfg, 1)
    grpo_step(v0, pq.read_table(t1), pq.read_table(a1), cfg, tmp_path / "v1")  # v1 carries AdamW state
    t2, a2 = step_files(tmp_path, tmp_path / "v1", cfg, 2)
    one2 = grpo_step(tmp_path / "v1", pq.read_table(t2), pq.read_table(a2), cfg, tmp_path / "one2")
    poisoned = step_files(tmp_path, tmp_path / "one2", cfg, 3, poison=True)
    t3, a3 = step_files(tmp_path, tmp_path / "one2", cfg, 3)
    one3 = grpo_step(tmp_path / "one2", pq.read_table(t3), pq.read_table(a3), cfg, tmp_path / "one3")
    worker = TrainerWorker(tmp_path / "v1", cfg, num_ranks=2, log_path=tmp_path / "worker.log")
    with pytest.raises(KeyboardInterrupt):
        with worker:
            pids = worker.pids()
            assert len(pids) == 3  # torchrun and its 2 ranks
            got2 = worker.train_step(t2, a2, tmp_path / "two2", save_optimizer=False)
            # both ranks abort, both go on; the message names the micro-batch's rollouts on every rank
            with pytest.raises(UpdateAborted, match=r"non-finite loss in micro-batch \d of \d .*g0-s3-7"):
                worker.train_step(*poisoned, tmp_path / "bad", optimizer_steps=2)
            got3 = worker.train_step(t3, a3, tmp_path / "two3")
            raise KeyboardInterrupt  # Ctrl-C in the flow: the worker tree is killed, not waited for
    assert not any(alive(p) for p in pids)
    assert got2["optimizer_resumed"] and got2["policy_version"] == 2
    for got, ref in ((got2, one2), (got3, one3)):
        assert got["world_size"] == 2 and got["tokens"] == ref["tokens"] and got["valid_tokens"] == ref["valid_tokens"]
        for k in ("loss", "grad_norm", "approx_entropy", "gen_kl_error", "sampling_importance_ratio"):
            assert got[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), k
    w2, w1 = load_file(str(tmp_path / "two2" / "model.safetensors")), load_file(str(tmp_path / "v1" / "model.safetensors"))
    r2 = load_file(str(tmp_path / "one2" / "model.safetensors"))
    assert all((w2[k] - r2[k]).abs().max() < 1e-5 for k in r2)  # 1% of one step (lr 1e-3)
    assert max((r2[k] - w1[k]).abs().max() for k in r2) > 5e-4  # the weights moved by about lr
    assert_same_checkpoint(tmp_path / "one3", tmp_path / "two3", exact=False)  # weights and AdamW state
    assert not (tmp_path / "bad").exists()
