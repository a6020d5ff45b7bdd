"""The agent loop and its tools, in real sandboxes.

Deterministic tests drive the loop with scripted models (plain objects returning fixed
tool calls); the integration tests at the end use the session's real vLLM server.
"""

import asyncio
import json
import random

import pytest

from schemas.config import RunConfig
from schemas.tables import TRAJECTORIES
from tasks.agent.loop import EpisodeConfig, run_episode
from tasks.agent.prompts import parse_tool_calls
from tasks.agent.scripted import ScriptedSolver, parse_unified_diff, unique_edit
from tasks.inference.client import Completion
from tasks.agent.tools import ToolBox, ToolError, tool_schemas
from tests.fixtures.sandbox import sandbox_cfg
from tasks.policy import tokenizer as T


@pytest.fixture(scope="module")
def tokenizer(tiny_policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_policy_dir)


@pytest.fixture
def calc_sandbox(sandbox_rootfs, r2e_tasks, sandbox_store):
    from tasks.sandbox import open_sandbox

    with open_sandbox(r2e_tasks["calc"]["row"], sandbox_cfg("bwrap"), sandbox_store, "agent") as sb:
        yield sb


# --- parsing ------------------------------------------------------------------------------------


def xml_call(name, **args):
    """A tool call in the layout our template renders (Qwen3.5's)."""
    return T.tool_call_text(name, args)


def test_parse_tool_calls_qwen35_layout():
    text = ("thinking\n" + xml_call("file_editor", command="str_replace", path="/testbed/a.py",
                                    old_str='    return "x"\n', new_str="    return 'y'")
            + xml_call("file_editor", command="view", path="/testbed/a.py", view_range=[3, 9])
            + "<tool_call>\n<function=file_editor>\n<parameter=view_range>\n[3,\n</parameter>\n</function>\n</tool_call>"
            + "<tool_call>\n<parameter=cmd>\nls\n</parameter>\n</tool_call>")
    content, calls, errors = parse_tool_calls(text)
    assert content == "thinking"
    # string values come back exactly as written: quotes, a trailing newline, no escaping
    assert calls == [{"name": "file_editor", "arguments": {"command": "str_replace", "path": "/testbed/a.py",
                                                           "old_str": '    return "x"\n', "new_str": "    return 'y'"}},
                     {"name": "file_editor", "arguments": {"command": "view", "path": "/testbed/a.py",
                                                           "view_range": [3, 9]}}]
    assert len(errors) == 2
    assert "parameter view_range of file_editor is not a JSON array" in errors[0]
    assert "expected <function=NAME>" in errors[1]


def test_parse_tool_calls_json_layout_well_formed_and_malformed():
    text = ('thinking\n<tool_call>\n{"name": "search", "arguments": {"search_term": "add"}}\n</tool_call>'
            '<tool_call>\n{"name": "file_editor", "arguments": {oops}\n</tool_call>'
            '<tool_call>\n{"arguments": {}}\n</tool_call>')
    content, calls, errors = parse_tool_calls(text)
    assert content == "thinking"
    assert calls == [{"name": "search", "arguments": {"search_term": "add"}}]
    assert len(errors) == 2 and "invalid JSON" in errors[0] and "needs a \"name\"" in errors[1]
    _, calls, errors = parse_tool_calls('<tool_call>\n{"name": "finish", "arguments": "{\\"command\\": \\"submit\\"}"}')
    assert calls == [] and errors == ["Malformed tool call: <tool_call> is never closed by </tool_call>."]


def test_tool_schemas_keep_r2e_names_and_parameters():
    for style in ("full", "short"):
        names = {t["function"]["name"]: t["function"]["parameters"] for t in tool_schemas(style)}
        assert set(names) == {"file_editor", "execute_bash", "search", "finish"}
        assert names["file_editor"]["properties"]["command"]["enum"] == \
            ["view", "create", "str_replace", "insert", "undo_edit"]
        assert names["execute_bash"]["required"] == ["cmd"]
        assert set(names["search"]["properties"]) == {"search_term", "path"}


# --- tools in a real sandbox ----------------------------------------------------------------------


def test_file_editor_in_sandbox(calc_sandbox):
    box = ToolBox(calc_sandbox, command_timeout_s=10)
    view = box.call("file_editor", {"command": "view", "path": "/testbed/calc/__init__.py"})
    assert "def add" in view and "     1\t" in view
    line = next(ln for ln in calc_sandbox.read_file("/testbed/calc/__init__.py").splitlines() if "return a - b" in ln)
    out = box.call("file_editor", {"command": "str_replace", "path": "/testbed/calc/__init__.py",
                                   "old_str": line, "new_str": line.replace("a - b", "a + b")})
    assert "has been edited" in out and "a + b" in calc_sandbox.read_file("/testbed/calc/__init__.py")
    with pytest.raises(ToolError, match="did not appear verbatim"):
        box.call("file_editor", {"command": "str_replace", "path": "/testbed/calc/__init__.py",
                                 "old_str": "no such text", "new_str": "x"})
    box.call("file_editor", {"command": "undo_edit", "path": "/testbed/calc/__init__.py"})
    assert "a - b" in calc_sandbox.read_file("/testbed/calc/__init__.py")
    box.call("file_editor", {"command": "create", "path": "/testbed/notes.txt", "file_text": "x\nx\n"})
    with pytest.raises(ToolError, match="Multiple occurrences"):
        box.call("file_editor", {"command": "str_replace", "path": "/testbed/notes.txt", "old_str": "x", "new_str": "y"})
    box.call("file_editor", {"command": "insert", "path": "/testbed/notes.txt", "insert_line": 1, "new_str": "mid"})
    assert calc_sandbox.read_file("/testbed/notes.txt") == "x\nmid\nx\n"
    with pytest.raises(ToolError, match="already exists"):
        box.call("file_editor", {"command": "create", "path": "/testbed/notes.txt", "file_text": ""})
    with pytest.raises(ToolError, match="not an absolute path"):
        box.call("file_editor", {"command": "view", "path": "calc/__init__.py"})
    with pytest.raises(ToolError, match="Unknown tool"):
        box.call("browser", {})
    with pytest.raises(ToolError, match="Unexpected parameters"):
        box.call("execute_bash", {"command": "ls"})


def test_bash_and_search_in_sandbox(calc_sandbox):
    box = ToolBox(calc_sandbox, command_timeout_s=3, observation_cap_chars=2000)
    assert "Exit code: 0" in box.call("execute_bash", {"cmd": "python -c 'print(6*7)'"}) and \
        "42" in box.call("execute_bash", {"cmd": "python -c 'print(6*7)'"})
    assert "timed out" in box.call("execute_bash", {"cmd": "sleep 30"})
    assert len(box.call("execute_bash", {"cmd": "yes | head -c 100000"})) < 2200  # capped
    found = box.call("search", {"search_term": "def add"})
    assert "calc/__init__.py" in found and "Found 1 matches" in found
    assert "No matches" in box.call("search", {"search_term": "zebra_unicorn"})
    # the hidden tests are nowhere in an agent's sandbox
    assert "No such file" in box.call("execute_bash", {"cmd": "ls /testbed/r2e_tests /root/r2e_tests"})


# --- the loop with scripted models ------------------------------------------------------------------


class Replay:
    """A scripted model: returns fixed completions, one per turn."""

    version = 7

    def __init__(self, tokenizer, texts):
        self.tok, self.texts, self.prompts = tokenizer, list(texts), []

    async def generate(self, prompt_ids, max_tokens, temperature, top_p, *, seed=None):
        self.prompts.append(list(prompt_ids))
        text = self.texts.pop(0) if self.texts else "I give up<|im_end|>"
        ids = self.tok.encode(text, add_special_tokens=False)[:max_tokens]
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", prompt_token_ids=prompt_ids,
                          policy_version=self.version)


def _episode(sb, model, tokenizer, **kw):
    args = dict(max_turns=6, max_context_tokens=4096, max_tokens_per_turn=512, temperature=1.0, top_p=1.0,
                command_timeout_s=10, prompt_style="short")
    args.update(kw)
    return asyncio.run(run_episode("add() subtracts", sb, model, tokenizer, EpisodeConfig(**args)))


def test_scripted_solver_fixes_the_task_and_grades_1(calc_sandbox, r2e_tasks, tokenizer, sandbox_store):
    from tasks.grading import grade_patch

    task = r2e_tasks["calc"]
    solver = ScriptedSolver(task["row"], task["gold"], calc_sandbox, tokenizer, random.Random(0))
    ep = _episode(calc_sandbox, solver, tokenizer)
    assert ep.finish_reason == "submitted" and ep.tool_errors == 0
    assert ep.policy_versions and set(ep.policy_versions) == {-1}
    assert "+" in ep.final_patch and "calc/__init__.py" in ep.final_patch
    # exact tokens: every generated token is masked in, every other one out; the sequence is the prompt + turns
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
    assert sum(ep.loss_mask[:ep.prompt_length]) == 0
    res = grade_patch(task["row"], ep.final_patch, sandbox_cfg("bwrap"), sandbox_store)
    assert res.reward == 1.0, res


def test_scripted_solver_blind_edit_skips_looking_and_still_fixes(calc_sandbox, r2e_tasks, tokenizer, sandbox_store):
    """blind_rate=1: no search and no view, the edit straight away (the solver knows the file), and
    the patch is right; blind_rate=0 draws nothing more, so older demonstrations are unchanged."""
    from tasks.grading import grade_patch

    task = r2e_tasks["calc"]

    def plan(seed, **kw):
        rng = random.Random(seed)
        turns = ScriptedSolver(task["row"], task["gold"], calc_sandbox, tokenizer, rng, **kw)._plan()
        return turns, rng.random()  # the next draw tells how many draws planning used

    # Planning reads the file, so plan before the episode edits it.
    plans = [plan(s, blind_rate=0.0) for s in range(8)]
    assert all(any(c["arguments"].get("command") == "view" for c in p) for p, _ in plans)
    # A blind draw that comes out "look" shifts the stream by one: blind_rate=0 must not draw it.
    looked = [plan(s, blind_rate=1e-12) for s in range(8)]
    assert all(b[1] != a[1] for a, b in zip(plans, looked))
    mixed = [plan(s, blind_rate=0.5)[0] for s in range(40)]
    blind = [p for p in mixed if p[0]["arguments"].get("command") == "str_replace"]
    assert 0 < len(blind) < len(mixed)
    assert not any(c["name"] == "search" or c["arguments"].get("command") == "view" for p in blind for c in p)
    solver = ScriptedSolver(task["row"], task["gold"], calc_sandbox, tokenizer, random.Random(0), blind_rate=1.0)
    ep = _episode(calc_sandbox, solver, tokenizer)
    calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in ep.messages if m.get("tool_calls")]
    assert [c.get("command") for c in calls] == ["str_replace", "submit"] and ep.tool_errors == 0
    assert grade_patch(task["row"], ep.final_patch, sandbox_cfg("bwrap"), sandbox_store).reward == 1.0


def test_tool_arguments_are_checked_against_the_schema(calc_sandbox):
    box = ToolBox(calc_sandbox, style="short")
    for args, expected in (({"command": "view", "path": "/testbed/calc/__init__.py", "view_range": "1-3"},
                            "view_range of file_editor must be a list of integers"),
                           ({"command": "insert", "path": "/testbed/calc/__init__.py", "insert_line": "2",
                             "new_str": "x"}, "insert_line of file_editor must be a JSON integer"),
                           ({"command": "view", "path": 7}, "path of file_editor must be a JSON string"),
                           ({"command": "view", "path": "/testbed", "colour": "red"}, "Unexpected parameters")):
        with pytest.raises(ToolError, match=expected):
            box.call("file_editor", args)
    with pytest.raises(ToolError, match="Unknown tool 'finish'"):
        box.call("finish", {})  # the loop ends the episode on finish; the tools never run it
    assert "def add" in box.call("file_editor", {"command": "view", "path": "/testbed/calc/__init__.py",
                                                 "view_range": [1, 5]})


def test_malformed_and_unknown_calls_become_counted_error_observations(calc_sandbox, tokenizer):
    model = Replay(tokenizer, [
        xml_call("telnet") + "<|im_end|>",
        '<tool_call>\n{"name": "file_editor", "arguments": {broken\n</tool_call><|im_end|>',
        'no tool call at all<|im_end|>',
        xml_call("finish", command="submit") + "<|im_end|>",
    ])
    ep = _episode(calc_sandbox, model, tokenizer)
    assert ep.finish_reason == "submitted" and ep.num_turns == 4 and ep.tool_errors == 3
    tool_msgs = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert "Unknown tool 'telnet'" in tool_msgs[0] and "invalid JSON" in tool_msgs[1] and "No tool call" in tool_msgs[2]
    assert ep.final_patch == ""
    # token-in/token-out: each request's prompt is exactly the episode so far
    for i, p in enumerate(model.prompts[1:], 1):
        assert p == ep.token_ids[:len(p)] and len(p) > len(model.prompts[i - 1])


def test_max_turns_and_context_limit(calc_sandbox, tokenizer):
    view = xml_call("file_editor", command="view", path="/testbed/calc/__init__.py") + "<|im_end|>"
    ep = _episode(calc_sandbox, Replay(tokenizer, [view] * 10), tokenizer, max_turns=3)
    assert ep.finish_reason == "max_turns" and ep.num_turns == 3
    budget = ep.prompt_length + 400  # room for about one view
    ep = _episode(calc_sandbox, Replay(tokenizer, [view] * 10), tokenizer, max_turns=30, max_context_tokens=budget)
    assert ep.finish_reason == "context_limit" and ep.num_turns >= 1 and len(ep.token_ids) <= budget


def test_unique_edit_grows_context_until_unique():
    patch = ("--- a/m.py\n+++ b/m.py\n@@ -1,4 +1,4 @@\n def f(x):\n-    return x\n+    return x + 1\n"
             " def g(x):\n")
    (h,) = parse_unified_diff(patch)
    text = "def f(x):\n    return x\ndef g(x):\n    return x\n"
    old, new = unique_edit(text, h)
    assert text.count(old) == 1 and old.startswith("def f(x):") and new == old.replace("return x", "return x + 1", 1)


# --- real vLLM server + real sandboxes ---------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_client(vllm_server, tokenizer):
    from tasks.inference import PolicyClient

    return PolicyClient([vllm_server.base_url], stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])


def test_episode_on_real_server_records_exact_tokens(calc_sandbox, policy_client, tokenizer):
    ep = _episode(calc_sandbox, policy_client, tokenizer, max_turns=3, max_tokens_per_turn=48,
                  max_context_tokens=2048)
    assert ep.finish_reason in ("max_turns", "submitted", "context_limit")
    n_gen = sum(ep.loss_mask)
    assert n_gen > 0 and len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
    gen_lps = [lp for lp, m in zip(ep.logprobs, ep.loss_mask) if m]
    assert all(lp <= 0.0 for lp in gen_lps) and any(lp < 0.0 for lp in gen_lps)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
    # the loop checked after every turn that the server's prompt ids equal our sequence (ServerMismatchError)


def test_collect_writes_valid_trajectories_and_marks_infra_errors(policy_client, tokenizer, r2e_tasks, sandbox_store,
                                                                   sandbox_rootfs):
    from tasks.rollout import PartialTable, RolloutSpec, collect, partial_parts, served_episodes

    cfg = RunConfig.model_validate({
        "sandbox": sandbox_cfg("bwrap").model_dump(),
        "inference": {"max_model_len": 2048},
        "agent": {"max_turns": 2, "max_context_tokens": 2048, "prompt_style": "short", "concurrency": 4,
                  "training": {"max_tokens_per_turn": 32}},
    })
    broken = dict(r2e_tasks["strutil"]["row"], instance_id="broken-env",
                  environment_uri=sandbox_store.uri("environments/does-not-exist.tar.gz"))
    tasks = [r2e_tasks["calc"]["row"], broken]
    spec = RolloutSpec(run_id="t", step=1, split="train", samples_per_task=2, temperature=1.0, top_p=1.0)
    partial = PartialTable(sandbox_store, "runs/t/step-00001/trajectories_partial.parquet")
    table = asyncio.run(collect(tasks, spec, served_episodes(policy_client, spec, tokenizer, cfg, sandbox_store),
                                cfg.agent.concurrency, partial=partial))
    TRAJECTORIES.validate(table)
    rows = table.to_pylist()
    assert len(rows) == 4
    by_task = {r["instance_id"]: r for r in rows}
    assert by_task["broken-env"]["finish_reason"] == "infra_error" and "sandbox" in by_task["broken-env"]["error"]
    assert by_task[r2e_tasks["calc"]["row"]["instance_id"]]["finish_reason"] != "infra_error"
    # finished episodes were committed as they finished, in append-only parts
    parts = partial_parts(sandbox_store, "runs/t/step-00001/trajectories_partial.parquet")
    assert parts and sum(sandbox_store.read_table(k).num_rows for k in parts) == 4
    # a rerun of the stage reuses what the partial table holds and runs nothing again
    async def never(task, sample):
        raise AssertionError(f"episode {task['instance_id']}/{sample} ran again")

    again = asyncio.run(collect(tasks, spec, never, cfg.agent.concurrency, partial=partial))
    assert again.equals(table)


def test_a_stop_that_left_a_gap_between_parts_resumes(tmp_path):
    """A stop can commit part 2 (the flush on the way out) while part 1's write, cut by the same stop,
    never committed: the next attempt numbers its parts after the last one, not by their count."""
    from tasks.rollout import PartialTable, RolloutSpec, collect, partial_parts, rollout_id
    from tasks.storage import Store
    from tests.rows import trajectory_row

    store, key = Store(f"file://{tmp_path}"), "runs/t/step-00001/trajectories_partial.parquet"
    spec = RolloutSpec(run_id="t", step=1, split="train", samples_per_task=4, temperature=1.0, top_p=1.0)
    tasks = [{"instance_id": "task-0"}]

    def row(sample: int) -> dict:
        return dict(trajectory_row(sample, run_id="t"), rollout_id=rollout_id("t", 1, "task-0", sample))

    for part, sample in ((0, 0), (2, 1)):  # part 1 is the one the stop cut
        store.write_table(f"runs/t/step-00001/trajectories_partial-{part:05d}.parquet",
                          TRAJECTORIES.from_rows([row(sample)]), stage="trajectories_partial")

    ran = []

    async def episodes(task, sample):
        ran.append(sample)
        return row(sample)

    table = asyncio.run(collect(tasks, spec, episodes, 4, partial=PartialTable(store, key)))
    assert sorted(ran) == [2, 3] and table.num_rows == 4
    assert [k.rsplit("-", 1)[1] for k in partial_parts(store, key)][:2] == ["00000.parquet", "00002.parquet"]
    assert all(int(k.rsplit("-", 1)[1][:5]) > 2 for k in partial_parts(store, key)[2:])
