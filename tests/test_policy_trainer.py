"""The policy update in one process: learning direction, bad input, aborts, options, SFT."""

import json

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.grpo import compute_advantages
from tasks.grpo.advantages import JoinError
from tasks.policy.checkpoint import OPTIMIZER_FILE, load_policy, read_policy_version
from tasks.policy.batch import BadBatchError, plan_micro_batches
from tasks.policy.runtime import UpdateAborted, policy_logprobs
from tasks.policy.sft import sft_train
from tests.test_policy_support import (
    OFFSET,
    grpo_step,
    completion_logprob,
    episode,
    make_policy_dir,
    reward_table,
    run_config,
    sft_stage,
    trajectory_rows,
)

PROMPT = "Q: 1+1="
GROUP = [(PROMPT, "2")] * 4 + [(PROMPT, "3")] * 4


def rollouts(model_dir, episodes, rewards, cfg, step=1, group="g0"):
    """A step's trajectories (with the current policy's logprobs, as vLLM would report) and advantages."""
    model = load_policy(model_dir)
    lps = policy_logprobs(model, [episode(p, c)[0] for p, c in episodes])
    traj = trajectory_rows(episodes, group=group, step=step, logprobs=lps)
    return traj, compute_advantages(traj, reward_table(traj, rewards), cfg.grpo)


@pytest.mark.parametrize("favoured,other", [("2", "3"), ("3", "2")])
def test_grpo_moves_probability_toward_rewarded_completion(tmp_path, favoured, other):
    cfg = run_config(lr=1e-3)
    cur = make_policy_dir(tmp_path / "v0")
    m0 = load_policy(cur)
    before = completion_logprob(m0, PROMPT, favoured), completion_logprob(m0, PROMPT, other)
    for step in range(1, 4):
        rewards = [1.0 if c == favoured else 0.0 for _, c in GROUP]
        traj, adv = rollouts(cur, GROUP, rewards, cfg, step=step)
        metrics = grpo_step(cur, traj, adv, cfg, tmp_path / f"v{step}")
        assert metrics["policy_version"] == step and metrics["optimizer_resumed"] == (step > 1)
        assert metrics["is_oob_ratio"] == 0.0  # logprobs came from this very policy
        cur = tmp_path / f"v{step}"
    m = load_policy(cur)
    after = completion_logprob(m, PROMPT, favoured), completion_logprob(m, PROMPT, other)
    assert after[0] > before[0] + 0.5, (before, after)
    assert after[1] < before[1] - 0.5, (before, after)


def test_update_uses_the_rollouts_sampling_temperature(tmp_path):
    """Rollouts sampled at T=0.5 carry logprobs of softmax(logits / 0.5) (vLLM's processed_logprobs);
    the update must compute the same policy, or every importance ratio is off and seq-mask-tis
    drops the sequences."""
    cfg = run_config()
    cfg.agent.training.temperature = 0.5
    src = make_policy_dir(tmp_path / "v0")
    model = load_policy(src)
    ids = [episode(p, c)[0] for p, c in GROUP]
    rewards = [1, 0, 1, 0, 1, 0, 1, 1]
    tempered = trajectory_rows(GROUP, logprobs=policy_logprobs(model, ids, temperature=0.5))
    m = grpo_step(src, tempered, compute_advantages(tempered, reward_table(tempered, rewards), cfg.grpo),
                    cfg, tmp_path / "v1")
    assert m["is_oob_ratio"] == 0.0 and m["sampling_importance_ratio"] == pytest.approx(1.0, abs=1e-5)
    raw = trajectory_rows(GROUP, logprobs=policy_logprobs(model, ids))
    m = grpo_step(src, raw, compute_advantages(raw, reward_table(raw, rewards), cfg.grpo), cfg, tmp_path / "v1b")
    assert m["is_oob_ratio"] > 0.5


def test_metrics_and_router_frozen(tmp_path):
    cfg = run_config()
    src = make_policy_dir(tmp_path / "v0")
    traj, adv = rollouts(src, GROUP, [1, 0, 1, 0, 1, 0, 1, 1], cfg)
    m = grpo_step(src, traj, adv, cfg, tmp_path / "v1")
    for k in ("loss", "clip_fraction_low", "clip_fraction_high", "kl_penalty", "is_oob_ratio", "grad_norm",
              "tokens", "valid_tokens", "seconds", "tokens_per_second", "approx_entropy", "sampling_importance_ratio"):
        assert k in m, k
    assert m["tokens"] == sum(len(episode(p, c)[0]) - 1 for p, c in GROUP)
    assert m["valid_tokens"] == sum(sum(episode(p, c)[1]) for p, c in GROUP)
    assert m["probs_ratio"] == pytest.approx(1.0) and m["num_valid_samples"] == 8
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "v1" / "model.safetensors"))
    gates = [k for k in a if ".mlp.gate." in k]
    assert gates and all(torch.equal(a[k], b[k]) for k in gates)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])


def test_two_optimizer_steps_use_prev_logprobs(tmp_path):
    cfg = run_config(lr=3e-3)
    src = make_policy_dir(tmp_path / "v0")
    traj, adv = rollouts(src, GROUP, [1, 1, 1, 1, 0, 0, 0, 0], cfg)
    m = grpo_step(src, traj, adv, cfg, tmp_path / "v1", optimizer_steps=2)
    assert m["optimizer_steps"] == 2 and len(m["per_step"]) == 2
    first, second = m["per_step"]
    assert first["probs_ratio_min"] == pytest.approx(1.0, abs=1e-5) and first["probs_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    # The second mini-batch is scored by the policy after the first step against pi_prev from before it.
    assert abs(second["probs_ratio_max"] - 1.0) > 1e-3 or abs(second["probs_ratio_min"] - 1.0) > 1e-3


def test_train_global_batch_size_sets_the_optimizer_steps(tmp_path):
    """optimizer.train_global_batch_size = samples per AdamW step: 8 samples at 3 -> steps of 3, 3, 2."""
    cfg = run_config(lr=1e-3)
    src = make_policy_dir(tmp_path / "v0")
    traj, adv = rollouts(src, GROUP, [1, 1, 0, 0, 1, 0, 1, 0], cfg)
    assert grpo_step(src, traj, adv, cfg, tmp_path / "v1")["optimizer_steps"] == 1  # unset: the reference's one
    cfg.optimizer.train_global_batch_size = 3
    m = grpo_step(src, traj, adv, cfg, tmp_path / "v1b")
    assert m["optimizer_steps"] == 3 and [s["num_samples"] for s in m["per_step"]] == [3, 3, 2]


def test_kl_penalty_against_reference(tmp_path):
    cfg = run_config(reference_policy_kl_penalty=0.05)
    src = make_policy_dir(tmp_path / "v0")
    traj, adv = rollouts(src, GROUP, [1, 0, 0, 0, 1, 0, 0, 0], cfg)
    with pytest.raises(ValueError, match="reference"):
        grpo_step(src, traj, adv, cfg, tmp_path / "nope")
    m1 = grpo_step(src, traj, adv, cfg, tmp_path / "v1", reference_dir=src)
    assert m1["kl_penalty"] == pytest.approx(0.0, abs=1e-7)  # the policy is the reference
    traj, adv = rollouts(tmp_path / "v1", GROUP, [1, 0, 0, 0, 1, 0, 0, 0], cfg, step=2)
    m2 = grpo_step(tmp_path / "v1", traj, adv, cfg, tmp_path / "v2", reference_dir=src)
    assert m2["kl_penalty"] > 0


def test_masked_samples_are_left_out(tmp_path):
    cfg = run_config()
    src = make_policy_dir(tmp_path / "v0")
    traj, adv = rollouts(src, GROUP, [1, 0, 1, 0, 1, 0, 1, 1], cfg)
    masked = adv.set_column(adv.schema.get_field_index("masked"), "masked",
                            pa.array([True] * 3 + [False] * 5))
    masked = masked.set_column(masked.schema.get_field_index("mask_reason"), "mask_reason",
                               pa.array(["timeout"] * 3 + [None] * 5))
    m = grpo_step(src, traj, masked, cfg, tmp_path / "v1")
    assert m["num_masked_samples"] == 3 and m["num_valid_samples"] == 5
    everything = masked.set_column(masked.schema.get_field_index("masked"), "masked",
                                   pa.array([True] * 8))
    m = grpo_step(src, traj, everything, cfg, tmp_path / "v2")
    assert m["skipped"] and m["num_masked_samples"] == 8
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "v2" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_policy_version(tmp_path / "v2") == 1


def _rows(traj):
    return traj.to_pylist()


def test_bad_input_names_rollouts_and_writes_nothing(tmp_path):
    cfg = run_config()
    src = make_policy_dir(tmp_path / "v0")
    traj, adv = rollouts(src, GROUP, [1, 0, 1, 0, 1, 0, 1, 1], cfg)
    out = tmp_path / "v1"

    rows = _rows(traj)
    rows[2]["loss_mask"] = rows[2]["loss_mask"][:-1]
    with pytest.raises(BadBatchError, match=r"differ in length.*g0-s1-2"):
        grpo_step(src, rows, adv, cfg, out)

    rows = _rows(traj)
    rows[5]["generation_logprobs"][-1] = float("nan")
    rows[6]["generation_logprobs"][-2] = float("inf")
    with pytest.raises(BadBatchError, match=r"not finite.*g0-s1-5, g0-s1-6"):
        grpo_step(src, rows, adv, cfg, out)

    rows = _rows(traj)
    rows[1]["token_ids"][3] = 10_000
    with pytest.raises(BadBatchError, match=r"outside the vocabulary.*g0-s1-1"):
        grpo_step(src, rows, adv, cfg, out)

    with pytest.raises(JoinError, match=r"g0-s1-7"):
        grpo_step(src, traj, adv.slice(0, 7), cfg, out)
    adv_rows = adv.to_pylist()
    adv_rows[0]["rollout_id"] = "stranger"
    with pytest.raises(JoinError, match=r"stranger"):
        grpo_step(src, traj, adv_rows, cfg, out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["v0"]


def test_nan_loss_aborts_naming_the_micro_batch(tmp_path):
    cfg = run_config(micro_batch_tokens=64)  # one ~40-token sample per micro-batch
    src = make_policy_dir(tmp_path / "v0", tie_word_embeddings=False)
    prompt = "Q: what is one plus one? answer="
    episodes = [(prompt, "22"), (prompt, "33"), (prompt, "4"), (prompt, "5")]
    traj, adv = rollouts(src, episodes, [1, 0, 1, 0], cfg)
    # Poison the input embedding of "5": only the shortest sample, the last micro-batch, sees it.
    weights = load_file(str(src / "model.safetensors"))
    weights["model.embed_tokens.weight"][ord("5") + OFFSET] = float("nan")
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UpdateAborted, match=r"non-finite loss in micro-batch 3 of 4 \(rank 0: g0-s1-3\)"):
        grpo_step(src, traj, adv, cfg, tmp_path / "v1")
    assert not (tmp_path / "v1").exists()


def test_plan_micro_batches_covers_everything_once():
    lengths = [50, 10, 30, 30, 70, 5, 5, 20, 90]
    for world in (1, 2, 3):
        plan = plan_micro_batches(lengths, world, token_budget=100)
        assert all(len(step) == world for step in plan)
        seen = sorted(i for step in plan for mb in step for i in mb)
        assert seen == list(range(len(lengths)))
        for step in plan:
            for mb in step:
                if len(mb) > 1:
                    assert len(mb) * max(lengths[i] for i in mb) <= 100


def test_sft_learns_demonstrations(tmp_path):
    cfg = run_config()
    src = make_policy_dir(tmp_path / "base")
    demos = trajectory_rows([("Q: 1+1=", "2"), ("Q: 2+2=", "4"), ("Q: 3+3=", "6"), ("Q: 4+4=", "8")], group="demo")
    before = completion_logprob(load_policy(src), "Q: 2+2=", "4")
    m = sft_train(src, demos, cfg, sft_stage(), tmp_path / "sft", max_steps=25)
    assert m["steps"] == 25 and m["loss_last"] < m["loss_first"] / 3
    after = completion_logprob(load_policy(tmp_path / "sft"), "Q: 2+2=", "4")
    assert after > before + 3
    assert read_policy_version(tmp_path / "sft") == 0
    assert (tmp_path / "sft" / "tokenizer_config.json").exists()
    assert not (tmp_path / "sft" / OPTIMIZER_FILE).exists()
    assert json.loads((tmp_path / "sft" / "rlvr_version.json").read_text())["mode"] == "sft"


def test_sft_context_loss_weight_also_learns_the_prompt(tmp_path):
    src = make_policy_dir(tmp_path / "base")
    demos = trajectory_rows([("Q: 1+1=", "2"), ("Q: 2+2=", "4"), ("Q: 3+3=", "6"), ("Q: 4+4=", "8")], group="demo")
    prompt_lp = {}
    for w in (0.0, 1.0):
        sft_train(src, demos, run_config(), sft_stage(context_loss_weight=w), tmp_path / f"w{w}", max_steps=25)
        prompt_lp[w] = completion_logprob(load_policy(tmp_path / f"w{w}"), "Q: 3", "+3=")
    # Completion-only SFT leaves the prompt's own text unlearned; weight 1 learns it too.
    assert prompt_lp[1.0] > prompt_lp[0.0] + 3


def test_sft_micro_batches_change_speed_not_the_update(tmp_path):
    src = make_policy_dir(tmp_path / "base")
    demos = trajectory_rows([("Q: 1+1=", "2"), ("Q: 2+2=", "4"), ("Q: 33+33=", "66"), ("Q: 4+4=", "8")],
                            group="demo")
    weights = {}
    for mbt in (None, 64):  # one padded block vs several micro-batches
        m = sft_train(src, demos, run_config(), sft_stage(batch_size=4, micro_batch_tokens=mbt),
                      tmp_path / f"mb{mbt}", max_steps=3)
        weights[mbt] = load_file(tmp_path / f"mb{mbt}" / "model.safetensors")
    assert weights[None].keys() == weights[64].keys()
    initial = load_file(src / "model.safetensors")
    moved = max((weights[None][k] - initial[k]).abs().max() for k in weights[None])
    assert moved > 1e-3
    for k in weights[None]:
        torch.testing.assert_close(weights[64][k], weights[None][k], atol=1e-5, rtol=1e-4)
    assert m["steps"] == 3


def test_sft_cosine_decay_follows_whichever_limit_ends_the_run_first():
    from tasks.policy.sft import sft_lr

    assert sft_lr(1e-3, False, 900, 960, 2000.0, 40.0) == 1e-3
    assert sft_lr(1e-3, True, 0, 960, 0.0, 40.0) == pytest.approx(1e-3)
    assert sft_lr(1e-3, True, 480, 960, 0.0, 40.0) == pytest.approx(5e-4)
    assert sft_lr(1e-3, True, 100, 960, 20 * 60.0, 40.0) == pytest.approx(5e-4)  # half the minutes
    assert sft_lr(1e-3, True, 960, 960, 0.0, 40.0) == pytest.approx(0.0, abs=1e-12)
    assert sft_lr(1e-3, True, 10, None, 50 * 60.0, 40.0) == pytest.approx(0.0, abs=1e-12)  # past the deadline
    # two cycles: back to the full rate halfway, 0 at the end of each half
    assert sft_lr(1e-3, True, 479, 960, 0.0, 40.0, cycles=2) == pytest.approx(0.0, abs=1e-7)
    assert sft_lr(1e-3, True, 480, 960, 0.0, 40.0, cycles=2) == pytest.approx(1e-3)
    assert sft_lr(1e-3, True, 720, 960, 0.0, 40.0, cycles=2) == pytest.approx(5e-4)
    assert sft_lr(1e-3, True, 960, 960, 0.0, 40.0, cycles=2) == pytest.approx(0.0, abs=1e-12)


def test_nan_gradient_aborts_naming_the_micro_batch(tmp_path, monkeypatch):
    from tasks.policy import grpo as trainer

    cfg = run_config(micro_batch_tokens=64)
    src = make_policy_dir(tmp_path / "v0")
    prompt = "Q: what is one plus one? answer="
    traj, adv = rollouts(src, [(prompt, "22"), (prompt, "333"), (prompt, "4")], [1, 0, 1], cfg)
    real, calls = trainer.token_logprobs, []

    def poisoned(model, mb, rt, temperature=1.0):  # finite loss, NaN gradient from the second micro-batch
        lp = real(model, mb, rt, temperature)
        calls.append(mb.indices)
        if len(calls) == 2:
            lp.register_hook(lambda g: g * float("nan"))
        return lp

    monkeypatch.setattr(trainer, "token_logprobs", poisoned)
    with pytest.raises(UpdateAborted, match=r"non-finite gradient in micro-batch 1 of 3 \(rank 0: g0-s1-0\)"):
        grpo_step(src, traj, adv, cfg, tmp_path / "v1")
    assert not (tmp_path / "v1").exists()


def test_bf16_precision_is_a_bf16_forward_on_the_rounded_fp32_master_weights(tmp_path):
    """optimizer.precision=bf16: the logprobs are exactly those of the model cast to bf16 (what vLLM
    serves from our fp32 checkpoints), the gradients reach the fp32 weights, and the update moves
    probability as the fp32 one does, with the checkpoint and AdamW state in fp32."""
    import copy

    from tasks.policy.batch import Sample, collate
    from tasks.policy.runtime import Runtime, token_logprobs

    cfg = run_config(lr=1e-3)
    cur = make_policy_dir(tmp_path / "v0")
    model = load_policy(cur)
    ids = episode(PROMPT, "2")[0]
    sample = Sample("s", torch.tensor(ids), torch.ones(len(ids) - 1), torch.zeros(len(ids) - 1))
    mb = collate([sample], [0], torch.device("cpu"))
    lp = token_logprobs(model, mb, Runtime(0, 1, torch.device("cpu"), True))
    with torch.no_grad():
        cast = copy.deepcopy(model)
        for p in cast.parameters():  # the parameters in bf16; buffers (rotary frequencies) as they were
            p.data = p.data.to(torch.bfloat16)
        ref = torch.log_softmax(cast(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float(), -1)
    ref = ref[0].gather(-1, mb.targets[0, :, None])[:, 0]  # collate shifts: logits at t predict targets[t]
    assert torch.equal(lp[0], ref)  # bitwise: the same bf16 weights, the same bf16 computation
    assert not torch.equal(lp[0], policy_logprobs(model, [ids])[0])  # and not the fp32 one
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g is not None and g.dtype == torch.float32 for g in grads) and any(g.abs().sum() > 0 for g in grads)

    m0 = load_policy(cur)
    before = completion_logprob(m0, PROMPT, "2")
    rewards = [1.0 if c == "2" else 0.0 for _, c in GROUP]
    traj, adv = rollouts(cur, GROUP, rewards, cfg)
    metrics = grpo_step(cur, traj, adv, cfg, tmp_path / "v1", precision="bf16")
    assert metrics["precision"] == "bf16"
    after = load_policy(tmp_path / "v1")
    assert all(p.dtype == torch.float32 for p in after.parameters())
    assert completion_logprob(after, PROMPT, "2") > before + 0.1
    state = torch.load(tmp_path / "v1" / OPTIMIZER_FILE, weights_only=False)["state"]
    assert all(v["exp_avg"].dtype == torch.float32 for v in state.values())


def test_sft_resumes_a_stopped_stage_exactly_where_it_stopped(tmp_path, monkeypatch):
    """A stage killed mid-way and run again ends with the weights, losses and metrics of one run
    straight through: weights, AdamW moments, the shuffle and the lr schedule all carry over."""
    import tasks.policy.sft as sft

    src = make_policy_dir(tmp_path / "base")
    demos = trajectory_rows([("Q: 1+1=", "2"), ("Q: 2+2=", "4"), ("Q: 33+33=", "66"), ("Q: 4+4=", "8"),
                             ("Q: 5+5=", "10")], group="demo")
    stage = sft_stage(batch_size=2, cosine_decay=True, cosine_cycles=2, minutes=None)
    straight = sft_train(src, demos, run_config(), stage, tmp_path / "straight", max_steps=8)

    real_step, calls = sft.sft_step, []

    def dies_at_the_sixth(*args):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt("killed")  # what a SIGINT raises in the worker mid-step
        return real_step(*args)

    monkeypatch.setattr(sft, "sft_step", dies_at_the_sixth)
    with pytest.raises(KeyboardInterrupt):
        sft_train(src, demos, run_config(), stage, tmp_path / "resumed", max_steps=8, resume_every_s=0)
    assert not (tmp_path / "resumed").exists() and (tmp_path / "resumed.resume").is_dir()
    monkeypatch.setattr(sft, "sft_step", real_step)
    lines = []
    resumed = sft_train(src, demos, run_config(), stage, tmp_path / "resumed", max_steps=8, resume_every_s=0,
                        progress=lines.append)
    assert resumed["resumed_at_step"] == 5 and lines[0].startswith("sft resumed at step 5/8")
    assert resumed["losses"] == straight["losses"] and resumed["tokens"] == straight["tokens"]
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "resumed.resume").exists()  # gone once the stage's checkpoint is saved


def test_sft_starts_over_when_the_resume_state_is_another_stages(tmp_path, monkeypatch):
    import tasks.policy.sft as sft

    src = make_policy_dir(tmp_path / "base")
    demos = trajectory_rows([("Q: 1+1=", "2"), ("Q: 2+2=", "4"), ("Q: 3+3=", "6")], group="demo")
    real_step, calls = sft.sft_step, []

    def dies_at_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real_step(*args)

    for lr, steps in ((2e-3, 4), (1e-3, 6)):  # another lr; another limit
        calls.clear()
        monkeypatch.setattr(sft, "sft_step", dies_at_the_third)
        with pytest.raises(KeyboardInterrupt):
            sft_train(src, demos, run_config(), sft_stage(lr=1e-3, minutes=None), tmp_path / "out", max_steps=4,
                      resume_every_s=0)
        monkeypatch.setattr(sft, "sft_step", real_step)
        m = sft_train(src, demos, run_config(), sft_stage(lr=lr, minutes=None), tmp_path / "out", max_steps=steps,
                      resume_every_s=0)
        assert m["resumed_at_step"] == 0 and m["steps"] == steps
