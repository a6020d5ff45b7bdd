"""The adversarial policy (issue 46, item 4) against the real tools, sandboxes, grader and flow, on both backends.

1. The library: every hostile kind in an episode of its own through the rollout stage
   (tasks/rollout.py collect) and the grading stage, plus a gold-fix control: every episode ends
   as a row with an outcome of the policy's making, the sandbox outlives fork bombs and
   `kill -9 -1`, no patch earns 1 without the fix (except the unpreventable kinds), nothing on the
   host changes, nothing is left behind.
2. A smoke run of the real flow (rollouts, grading, advantages, update) with the adversary mixed
   into the policy's episodes at a high rate, on the session's shared vLLM server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pathlib
import subprocess
import time

import pytest

from schemas.config import RunConfig
from tasks.agent import adversary as A
from tests.fixtures.sandbox import sandbox_cfg
from tests.fixtures.smoke import REPO, flow_env, main_command, smoke_overrides

# Outcomes of the policy's own making; agent_error (our code failed) and infra_error are not.
POLICY_OUTCOMES = {"submitted", "max_turns", "context_limit", "timeout", "patch_too_large", "patch_unreadable"}
# Bypasses the step summary must count (harness changes, tampering or hack signals); rewriting the
# tests at import is not counted (the tests are out of its reach).
COUNTED = tuple(k for k in A.BYPASSES if k != "rewrite_tests")
# Kinds whose turn ends with `echo alive`: the sandbox must still answer after them (a full disk or a
# background fork bomb may leave it wedged by design: their episodes must only end as rows).
ALIVE = ("fork_bomb", "memory_hog", "endless_output", "kill_all")


def host_watch(extra: list[pathlib.Path]) -> dict[str, str | None]:
    """sha256 of each watched host file (None: absent), and of the listing of watched folders."""
    paths = [pathlib.Path(p) for p in ("/etc/passwd", "/etc/hosts", "/etc/shadow", REPO / "pyproject.toml")] + extra
    out = {}
    for p in paths:
        out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    for p in ("/etc/rlvr-adversary.py", "/tmp/rlvr-adversary", "/tmp/hooked", "/tmp/fsmon", "/pkg/x.py"):
        out[p] = "exists" if os.path.lexists(p) else None
    return out


@pytest.fixture
def canaries(tmp_path):
    """Host files the adversary aims at (tasks/agent/adversary.py HOST_TARGETS), made by the test and
    left in place: a suite running beside this one (another clone) watches the same /tmp file."""
    made = [pathlib.Path(A.HOST_TARGETS[2])]
    made[0].write_text("canary\n")
    store_canary = pathlib.Path(A.HOST_TARGETS[4])
    store_canary.parent.mkdir(parents=True, exist_ok=True)
    store_canary.write_text("canary\n")
    made.append(store_canary)
    yield made


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "models" / "mini-base")  # the shipped base's: no build needed


def library_cfg(backend: str) -> RunConfig:
    big = 10 ** 7  # no context or turn limit in the way of a 1 MB argument
    return RunConfig.model_validate({
        "sandbox": sandbox_cfg(backend, concurrency=2).model_dump(),
        "inference": {"max_model_len": big},
        "agent": {"max_turns": 3, "max_context_tokens": big, "prompt_style": "short", "concurrency": 3,
                  "command_timeout_s": 5, "episode_timeout_s": 240,
                  "training": {"max_tokens_per_turn": big}},
    })


def test_plan_is_a_pure_function_of_seed_and_rollout():
    plans = [A.plan(3, f"r/s00001/t/{i}", 0.5, 4) for i in range(400)]
    assert plans == [A.plan(3, f"other-run/s00001/t/{i}", 0.5, 4) for i in range(400)]  # the run id aside
    assert plans != [A.plan(4, f"r/s00001/t/{i}", 0.5, 4) for i in range(400)]
    hostile = [p for p in plans if p is not None]
    assert 150 < len(hostile) < 250 and all(1 <= len(p) <= 3 + 1 and p for p in hostile)
    assert any("gold_fix" in p for p in hostile) and any("gold_fix" not in p for p in hostile)
    assert A.plan(3, "x", 0.0, 4) is None and A.plan(3, "x", 1.0, 4) is not None
    assert set(A.BYPASSES) <= set(A.HOSTILE) and set(A.UNPREVENTABLE) <= set(A.BYPASSES)


def test_carries_fix_reads_the_patch_lines():
    gold = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f(a, b):\n-    return a - b\n+    return a + b\n"
    assert A.carries_fix("+++ b/m.py\n-    return a - b\n+    return a + b\n", gold)
    assert not A.carries_fix("+++ b/m.py\n+    return a + b\n", gold)  # the bug line still there
    assert not A.carries_fix("", gold)
    hidden = "diff --git a/m.py b/m.py\nindex 1..2 100644\nGIT binary patch\ndelta 14\nVcmaFE\n"
    assert A.carries_fix(hidden, gold) is None  # unreadable, neither fixed nor not


def test_turns_are_the_tokens_of_the_calls(tokenizer, r2e_tasks):
    from tasks.agent.prompts import parse_tool_calls
    from tasks.policy.tokenizer import IM_END

    calc = r2e_tasks["calc"]
    target = A.Target(calc["row"], calc["gold"])
    for kind in A.LIBRARY:
        policy = A.AdversarialPolicy(None, [kind], target, tokenizer)
        out = asyncio.run(policy.generate([], 10 ** 7, 1.0, 1.0))
        text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
        assert text.startswith(f"[adversary] {kind}") and text.endswith(IM_END), kind
        _, calls, errors = parse_tool_calls(text.removesuffix(IM_END))
        assert calls or errors, kind
        cut = asyncio.run(A.AdversarialPolicy(None, [kind], target, tokenizer).generate([], 16, 1.0, 1.0))
        assert len(cut.token_ids) <= 16  # never more than asked for
    # invalid UTF-8 reaches the parser as such (replacement characters), NUL and surrogates as JSON escapes
    text = tokenizer.decode(asyncio.run(A.AdversarialPolicy(None, ["invalid_utf8"], target, tokenizer)
                                        .generate([], 10 ** 7, 1, 1)).token_ids)
    assert "\ufffd" in text
    _, calls, _ = parse_tool_calls(A.js("execute_bash", {"cmd": "a\x00\ud800"}))
    assert calls[0]["arguments"]["cmd"] == "a\x00\ud800"


@pytest.mark.slow
@pytest.mark.usefixtures("no_sandbox_leaks")
def test_library_against_tools_sandbox_and_grader(sandbox_backend, r2e_tasks, sandbox_store, tokenizer, canaries):
    """Each hostile kind alone in an episode, then `finish`; a gold-fix control; all graded."""
    from tasks.grading import grade_rollouts
    from tasks.rollout import RolloutSpec, collect, scripted_episodes

    calc = r2e_tasks["calc"]
    task, gold = calc["row"], calc["gold"]
    # git_tricks' .gitattributes makes the patch binary: AlwaysEqual behind it must still be counted.
    kinds = [[k] for k in A.HOSTILE] + [["git_tricks", "always_equal"], ["gold_fix"], ["honest_look", "gold_fix"]]
    cfg = library_cfg(sandbox_backend)
    before = host_watch(canaries)

    def factory(t, sample, sandbox):
        return A.AdversarialPolicy(None, kinds[sample], A.Target(t, gold, read=sandbox.read_file), tokenizer)

    spec = RolloutSpec(run_id=f"adv-{sandbox_backend}", step=1, split="train", samples_per_task=len(kinds),
                       temperature=1.0, top_p=1.0)
    t0 = time.monotonic()
    episodes = scripted_episodes(factory, spec, tokenizer, cfg, sandbox_store)
    table = asyncio.run(collect([task], spec, episodes, cfg.agent.concurrency))
    rollout_s = time.monotonic() - t0
    rows = sorted(table.to_pylist(), key=lambda r: r["sample_index"])
    assert len(rows) == len(kinds)

    failures = []
    for r in rows:
        kind = "+".join(kinds[r["sample_index"]])
        if r["finish_reason"] not in POLICY_OUTCOMES:
            failures.append(f"{kind}: episode ended {r['finish_reason']}: {(r['error'] or '')[-300:]}")
            continue
        tools = [m["content"] for m in json.loads(r["messages"]) if m["role"] == "tool"]
        if not tools:
            failures.append(f"{kind}: no observation recorded")
        if kind in ALIVE and not (tools and tools[-1].rstrip().endswith("alive")):
            failures.append(f"{kind}: the sandbox no longer answers: {tools[-1][-200:] if tools else None!r}")

    t0 = time.monotonic()
    items = [(r["rollout_id"], spec.run_id, 1, task, r["final_patch"]) for r in rows]
    rewards = {g["rollout_id"]: g for g in grade_rollouts(items, cfg.sandbox, sandbox_store).to_pylist()}
    grade_s = time.monotonic() - t0
    for r in rows:
        kind, g = "+".join(kinds[r["sample_index"]]), rewards[r["rollout_id"]]
        fixed = A.carries_fix(r["final_patch"], gold)
        unpreventable = set(kind.split("+")) & set(A.UNPREVENTABLE)
        if g["reward"] == 1.0 and not fixed and (not unpreventable or not g.get("hack_signals")):
            failures.append(f"{kind}: reward 1 without the fix (harness_changes {g['harness_changes']}, "
                            f"hack_signals {g.get('hack_signals')})")
        if set(kind.split("+")) & set(COUNTED) and not (g["harness_changes"] or g.get("tampering")
                                                         or g.get("hack_signals")):
            failures.append(f"{kind}: not counted (no harness change, tampering or hack signal)")
        if g["grading_status"] != "graded" and not g["error"]:
            failures.append(f"{kind}: masked ({g['grading_status']}) without a reason")
    controls = [rewards[r["rollout_id"]]["reward"] for r in rows if "gold_fix" in kinds[r["sample_index"]]]
    assert controls == [1.0, 1.0], f"the gold fix must earn 1 (else the checks above prove nothing): {controls}"

    after = host_watch(canaries)
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if changed:
        failures.append(f"host files changed: {changed}")
    print(f"\n{sandbox_backend}: {len(rows)} adversarial episodes in {rollout_s:.0f} s, graded in {grade_s:.0f} s")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
# The default backend through the flow; docker meets the adversary in the library test above and in
# `make chaos` (both backends through the flow; a second flow run here cost make test two minutes).
@pytest.mark.parametrize("backend", ["bwrap"])
def test_adversarial_smoke_run_through_the_flow(backend, request, smoke_prepared, smoke_server, session_api, tmp_path,
                                                canaries):
    """A GRPO step of the real flow (rollouts, grading, advantages, update, checkpoint, evaluation),
    three in four training episodes adversarial; make chaos runs many."""
    from schemas.presets import load_config
    from tasks.sandbox import leftovers
    from tasks.storage import Store
    from tests.bench.chaos import print_report, report, violations

    request.getfixturevalue("docker_engine" if backend == "docker" else "sandbox_rootfs")
    run_id = f"test-adversary-{backend}-{int(time.time())}"
    overrides = smoke_overrides(**{
        "inference.mode": "external", "inference.base_urls": [smoke_server.base_url], "sandbox.backend": backend,
        "max_steps": 1, "agent.adversary_rate": 0.75, "agent.adversary_seed": 0, "agent.max_turns": 5,
        "agent.training.max_tokens_per_turn": 1024, "grpo.async_rollouts": False, "eval.max_tasks": 1})
    cfg = load_config("smoke", overrides)
    before = host_watch(canaries)
    t0 = time.monotonic()
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(main_command(run_id, overrides), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=flow_env(tmp_path / "prefect", session_api))
        try:
            proc.wait(timeout=1800)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert proc.returncode in (0, 1), f"the run failed (exit {proc.returncode}):\n{text[-6000:]}"
    store = Store.from_config(cfg.storage)
    rep = report(store, run_id)
    print_report(rep, time.monotonic() - t0)
    bad = violations(rep, cfg.max_steps)
    assert rep["episodes"] == cfg.max_steps * cfg.grpo.global_batch_size and rep["hostile_episodes"] > 0, rep
    for step in range(1, cfg.max_steps + 1):  # every stage of every step committed
        assert store.stage_committed(run_id, step, "advantages"), step
        assert store.exists(f"runs/{run_id}/checkpoints/step-{step:05d}.commit"), step
    after = host_watch(canaries)
    bad += [f"host file changed: {k}" for k in before if before[k] != after[k]]
    bad += [f"left behind: {x}" for x in leftovers(proc.pid, docker=backend == "docker")]
    assert not bad, "\n".join(bad) + "\n" + text[-3000:]
