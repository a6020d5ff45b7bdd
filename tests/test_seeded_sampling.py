"""Seeded sampling (agent.seeded_sampling): each request carries a seed from (run seed, rollout, turn),
so a rerun of one configuration samples the same tokens. The collections run on the session's real
vLLM CPU server (the tiny random policy at T=1, as the smoke preset trains) in real sandboxes."""

import asyncio

import pytest

from schemas.config import RunConfig
from tasks.agent.loop import request_seed
from tasks.rollout import RolloutSpec, collect, sampling_key, served_episodes
from tests.fixtures.sandbox import sandbox_cfg


def test_request_seed_is_stable_and_spread():
    # Pinned: a changed derivation would silently stop reruns from matching runs made before it.
    assert request_seed(0, "train/s00001/calc/0", 0) == 764331685792290467
    seeds = {request_seed(r, k, t) for r in (0, 1) for k in ("train/s00001/a/0", "train/s00001/a/1") for t in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2 ** 63 for s in seeds)


def test_sampling_key_leaves_out_the_run_id_and_keeps_the_split():
    train = RolloutSpec(run_id="a", step=2, split="train", samples_per_task=4, temperature=1.0, top_p=1.0)
    rerun = RolloutSpec(run_id="a-rerun", step=2, split="train", samples_per_task=4, temperature=1.0, top_p=1.0)
    val = RolloutSpec(run_id="a", step=2, split="validation", samples_per_task=4, temperature=0.1, top_p=0.95)
    assert sampling_key(train, "t1", 3) == sampling_key(rerun, "t1", 3) == "train/s00002/t1/3"
    assert sampling_key(val, "t1", 3) != sampling_key(train, "t1", 3)


@pytest.fixture(scope="module")
def tokenizer(tiny_policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_policy_dir)


@pytest.fixture(scope="module")
def policy_client(vllm_server, tokenizer):
    from tasks.inference import PolicyClient

    return PolicyClient([vllm_server.base_url], stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])


class Recorder:
    """The client, recording each request's seed."""

    def __init__(self, inner):
        self.inner, self.version, self.seeds = inner, inner.version, []

    async def generate(self, prompt_ids, max_tokens, temperature, top_p, *, seed=None):
        self.seeds.append(seed)
        return await self.inner.generate(prompt_ids, max_tokens, temperature, top_p, seed=seed)


def collect_tokens(policy, tokenizer, tasks, store, run_id: str, seed: int, seeded: bool = True,
                   concurrency: int = 4, samples: int = 2) -> list[dict]:
    cfg = RunConfig.model_validate({
        "seed": seed, "sandbox": sandbox_cfg("bwrap").model_dump(), "inference": {"max_model_len": 2048},
        "agent": {"max_turns": 2, "max_context_tokens": 2048, "prompt_style": "short", "concurrency": concurrency,
                  "seeded_sampling": seeded, "training": {"max_tokens_per_turn": 32}},
    })
    spec = RolloutSpec(run_id=run_id, step=1, split="train", samples_per_task=samples, temperature=1.0, top_p=1.0)
    table = asyncio.run(collect(tasks, spec, served_episodes(policy, spec, tokenizer, cfg, store), concurrency))
    rows = table.to_pylist()
    assert all(r["finish_reason"] not in ("infra_error", "agent_error") for r in rows), rows
    return rows


def tokens(rows):
    return {(r["instance_id"], r["sample_index"]): r["token_ids"] for r in rows}


def test_same_run_seed_samples_the_same_tokens(policy_client, tokenizer, r2e_tasks, sandbox_store, sandbox_rootfs):
    tasks = [r2e_tasks["calc"]["row"], r2e_tasks["strutil"]["row"]]
    rec = Recorder(policy_client)
    a = collect_tokens(rec, tokenizer, tasks, sandbox_store, "seeded-a", seed=0)
    # Every request carried the seed of its rollout and turn (the run id plays no part).
    spec = RolloutSpec(run_id="other", step=1, split="train", samples_per_task=2, temperature=1.0, top_p=1.0)
    expected = sorted(request_seed(0, sampling_key(spec, r["instance_id"], r["sample_index"]), t)
                      for r in a for t in range(r["num_turns"]))
    assert sorted(rec.seeds) == expected
    # Another run id, same run seed, episodes in flight together: the same tokens, episode by episode.
    b = collect_tokens(policy_client, tokenizer, tasks, sandbox_store, "seeded-b", seed=0)
    assert tokens(a) == tokens(b)
    # The samples of one task are not copies of each other.
    assert tokens(a)[(tasks[0]["instance_id"], 0)] != tokens(a)[(tasks[0]["instance_id"], 1)]
    # Another run seed draws other tokens.
    c = collect_tokens(policy_client, tokenizer, tasks, sandbox_store, "seeded-c", seed=1)
    assert any(tokens(a)[k] != tokens(c)[k] for k in tokens(a))


def test_seeded_sampling_off_sends_no_seed(policy_client, tokenizer, r2e_tasks, sandbox_store, sandbox_rootfs):
    rec = Recorder(policy_client)
    rows = collect_tokens(rec, tokenizer, [r2e_tasks["calc"]["row"]], sandbox_store, "unseeded", seed=0,
                          seeded=False, concurrency=1, samples=1)
    assert rec.seeds == [None] * rows[0]["num_turns"] and rec.seeds
