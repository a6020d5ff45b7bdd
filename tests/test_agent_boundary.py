"""Every action has an outcome (issue 46, item 1), on both backends: what a policy's tool call
causes comes back as an ERROR observation and the sandbox goes on working; an error of our own
code ends only its episode (agent_error); an episode is bounded from outside its loop; a patch
over the diff cap and a file over the read cap are outcomes of their own, never cut."""

import asyncio
import json

import pytest

from tasks.agent.tools import ToolBox, ToolError
from tests.fixtures.sandbox import sandbox_cfg
from tests.test_sandbox import open_box

pytestmark = pytest.mark.usefixtures("no_sandbox_leaks")

INIT = "/testbed/calc/__init__.py"


@pytest.fixture
def calc(r2e_tasks):
    return r2e_tasks["calc"]["row"]


def observe(box: ToolBox, name: str, args: dict) -> str:
    """What the loop makes of a call: its observation, or its ToolError as an ERROR observation."""
    try:
        return box.call(name, args)
    except ToolError as e:
        return f"ERROR: {e}"


def assert_still_works(box: ToolBox) -> None:
    assert "def add" in box.call("file_editor", {"command": "view", "path": INIT})
    assert box.call("execute_bash", {"cmd": "echo alive"}).endswith("alive\n")


# --- actions that used to raise through ToolBox.call -------------------------------------------------

FAILING_ACTIONS = {
    "create_in_readonly_pkg": ("file_editor", {"command": "create", "path": "/pkg/x.py", "file_text": "x = 1\n"},
                               "/pkg/x.py"),
    "create_in_etc": ("file_editor", {"command": "create", "path": "/etc/x.py", "file_text": "x = 1\n"}, "/etc/x.py"),
    "nul_in_path": ("file_editor", {"command": "view", "path": "/testbed/a\0b.py"}, "path"),
    "nul_in_create_path": ("file_editor", {"command": "create", "path": "/testbed/a\0b.py", "file_text": "x"}, "path"),
    "nul_in_bash": ("execute_bash", {"cmd": "echo a\0b"}, "cmd"),
    "nul_in_search_term": ("search", {"search_term": "add\0x"}, "search_term"),
    "nul_in_search_path": ("search", {"search_term": "add", "path": "/testbed\0"}, "path"),
}


@pytest.mark.parametrize("action", sorted(FAILING_ACTIONS))
def test_failing_action_is_an_error_observation(sandbox_backend, calc, sandbox_store, action):
    name, args, names = FAILING_ACTIONS[action]
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        box = ToolBox(sb, command_timeout_s=10)
        obs = observe(box, name, args)
        assert obs.startswith("ERROR: ") and names in obs, obs
        assert_still_works(box)


def test_view_of_unreadable_file_is_an_error_observation(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        box = ToolBox(sb, command_timeout_s=10)
        assert box.call("execute_bash", {"cmd": f"chmod 000 {INIT}"}).startswith("Exit code: 0")
        for args in ({"command": "view", "path": INIT},
                     {"command": "str_replace", "path": INIT, "old_str": "a - b", "new_str": "a + b"}):
            obs = observe(box, "file_editor", args)
            assert obs.startswith("ERROR: ") and INIT in obs and "Permission denied" in obs, obs
        box.call("execute_bash", {"cmd": f"chmod 644 {INIT}"})
        assert_still_works(box)


def test_odd_arguments_and_output_are_observations(sandbox_backend, calc, sandbox_store):
    """Arguments no tool expects and output that is not text: each call has an outcome (a string,
    or an ERROR), whatever the backend makes of it, and the sandbox goes on working."""
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        box = ToolBox(sb, command_timeout_s=2)
        for name, args in (("file_editor", {"command": "create", "path": "/testbed/\ud800.py", "file_text": "x"}),
                           ("file_editor", {"command": "view", "path": "/testbed/\ud800.py"}),
                           ("file_editor", {"command": "create", "path": "/testbed/b.py", "file_text": "\ud800"}),
                           ("search", {"search_term": "\ud800"}),
                           ("execute_bash", {"cmd": "echo \ud800"}),
                           ("file_editor", {"command": "str_replace", "path": "/testbed", "old_str": "a"}),
                           ("file_editor", {"command": "view", "path": "/root"})):
            assert isinstance(observe(box, name, args), str)
        out = box.call("execute_bash", {"cmd": r"printf 'a\377\376b\n'"})
        assert out.startswith("Exit code: 0") and "a\ufffd\ufffdb" in out  # undecodable bytes replaced
        out = box.call("execute_bash", {"cmd": "sleep 30"})
        assert "timed out after 2 seconds" in out
        assert_still_works(box)


# --- the episode's outcomes, through run_one (tasks/rollout.py) ------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_policy_dir)


class Scripted:
    """A policy that plays fixed turns: a completion's text, or a callable run in its place."""

    version = 3

    def __init__(self, tokenizer, turns):
        self.tok, self.turns = tokenizer, list(turns)

    async def generate(self, prompt_ids, max_tokens, temperature, top_p, *, seed=None):
        from tasks.inference.client import Completion

        turn = self.turns.pop(0) if self.turns else "<|im_end|>"
        if callable(turn):
            return await turn()
        ids = self.tok.encode(turn, add_special_tokens=False)[:max_tokens]
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                          prompt_token_ids=prompt_ids, policy_version=self.version)


def call(name, **args):
    from tasks.policy import tokenizer as T

    return T.tool_call_text(name, args) + "<|im_end|>"


def run_cfg(backend, **agent):
    from schemas.config import RunConfig

    return RunConfig.model_validate({
        "sandbox": sandbox_cfg(backend).model_dump(), "inference": {"max_model_len": 4096},
        "agent": {"max_turns": 4, "max_context_tokens": 4096, "prompt_style": "short", "concurrency": 2,
                  "command_timeout_s": 10, "training": {"max_tokens_per_turn": 512}, **agent}})


def play(task, policy, cfg, tokenizer, store=None):
    """One episode through run_one: its trajectory row."""
    from tasks.rollout import RolloutSpec, run_one

    spec = RolloutSpec(run_id="b", step=1, split="train", samples_per_task=1, temperature=1.0, top_p=1.0)
    # The test's own bound: without run_one's, an episode that never ends fails here instead of hanging.
    return asyncio.run(asyncio.wait_for(run_one(task, 0, spec, policy, tokenizer, cfg, store), 120))


async def bug():
    raise KeyError("a bug of ours")


def test_error_of_our_code_is_an_agent_error_row_and_masked(sandbox_backend, calc, sandbox_store, tokenizer):
    from schemas.tables import TRAJECTORIES
    from tasks.rollout import RolloutSpec, collect, scripted_episodes

    cfg = run_cfg(sandbox_backend)
    view = call("file_editor", command="view", path=INIT)
    spec = RolloutSpec(run_id="b", step=1, split="train", samples_per_task=2, temperature=1.0, top_p=1.0)
    # Sample 0 meets a bug of ours in its second turn; sample 1 finishes: the stage goes on.
    scripts = {0: [view, bug], 1: [view, call("finish", command="submit")]}
    episodes = scripted_episodes(lambda task, sample, sb: Scripted(tokenizer, scripts[sample]), spec, tokenizer, cfg,
                                 sandbox_store)
    table = asyncio.run(collect([calc], spec, episodes, cfg.agent.concurrency))
    TRAJECTORIES.validate(table)
    broken, fine = table.to_pylist()
    assert fine["finish_reason"] == "submitted" and fine["error"] is None
    assert broken["finish_reason"] == "agent_error" and broken["final_patch"] == ""
    assert broken["error"].startswith("agent_error: KeyError: 'a bug of ours'")
    assert "Traceback (most recent call last)" in broken["error"] and "in bug" in broken["error"]
    # what the episode held when it broke: the prompt, the first turn and its observation
    assert broken["num_turns"] == 1 and broken["num_generated_tokens"] > 0
    assert len(broken["token_ids"]) > broken["prompt_length"] and "def add" in broken["messages"]
    assert broken["policy_version"] == Scripted.version

    # masked downstream: no advantage in training, never a 0 in an evaluation
    from schemas.config import GRPOConfig
    from tasks.evaluation import eval_samples_table
    from tasks.grading import GradeResult
    from tasks.grpo.advantages import compute_advantages

    rows = table.to_pylist()
    rewards = [GradeResult(reward=0.0, grading_status="graded").row(r["rollout_id"], "b", 1, r["instance_id"])
               for r in rows]
    adv = {r["rollout_id"]: r for r in compute_advantages(table, _rewards(rewards), GRPOConfig()).to_pylist()}
    assert adv[broken["rollout_id"]]["masked"] and adv[broken["rollout_id"]]["mask_reason"] == "rollout_agent_error"
    assert not adv[fine["rollout_id"]]["masked"]
    samples = {r["rollout_id"]: r for r in eval_samples_table(table, _rewards(rewards)).to_pylist()}
    assert samples[broken["rollout_id"]]["reward"] is None and samples[broken["rollout_id"]]["masked"]
    assert samples[broken["rollout_id"]]["mask_reason"].startswith("agent_error")
    assert samples[fine["rollout_id"]]["reward"] == 0.0


def _rewards(rows):
    from schemas.tables import REWARDS

    return REWARDS.from_rows(rows)


def test_lone_surrogate_in_a_call_is_an_observation_of_the_episode(calc, sandbox_rootfs, sandbox_store, tokenizer):
    # A JSON escape makes a str the tokenizer cannot encode; an observation that echoes it must not break the loop.
    raw = ('<tool_call>\n{"name": "file_editor", "arguments": {"command": "view", "path": "/testbed/\\ud800"}}\n'
           '</tool_call><tool_call>\n{"name": "bash\\ud800", "arguments": {}}\n</tool_call>')
    row = play(calc, Scripted(tokenizer, [raw + "<|im_end|>", call("finish", command="submit")]), run_cfg("bwrap"),
               tokenizer, sandbox_store)
    assert row["finish_reason"] == "submitted" and row["tool_errors"] == 2, row["error"]
    view, unknown = [m["content"] for m in json.loads(row["messages"]) if m["role"] == "tool"]
    assert view.startswith("ERROR: file_editor(command='view', path='/testbed/\\ud800') failed"), view
    assert unknown.startswith("ERROR: Unknown tool 'bash?'"), unknown


# --- a wall-clock bound from outside the loop ----------------------------------------------------------


async def never():
    await asyncio.Event().wait()


def test_generate_that_never_returns_is_cut_from_outside(sandbox_backend, calc, sandbox_store, tokenizer,
                                                         monkeypatch):
    import time

    import tasks.rollout

    monkeypatch.setattr(tasks.rollout, "EPISODE_GRACE_S", 1.0)
    t0 = time.monotonic()
    row = play(calc, Scripted(tokenizer, [call("file_editor", command="view", path=INIT), never]),
               run_cfg(sandbox_backend, episode_timeout_s=2), tokenizer, sandbox_store)
    assert time.monotonic() - t0 < 30
    assert row["finish_reason"] == "timeout" and "cut from outside the agent loop after 3 s" in row["error"]
    assert row["num_turns"] == 1 and "def add" in row["messages"]  # the turns before the cut are kept


def test_hung_sandbox_call_is_cut_from_outside_and_the_sandbox_closed(sandbox_backend, calc, sandbox_store,
                                                                      tokenizer, monkeypatch):
    """A command that outlives the episode (its own timeout is longer): the cut closes the sandbox,
    which kills the command and frees the thread it held."""
    import time

    import tasks.rollout

    monkeypatch.setattr(tasks.rollout, "EPISODE_GRACE_S", 1.0)
    t0 = time.monotonic()
    row = play(calc, Scripted(tokenizer, [call("execute_bash", cmd="sleep 600")]),
               run_cfg(sandbox_backend, episode_timeout_s=2, command_timeout_s=300), tokenizer, sandbox_store)
    assert row["finish_reason"] == "timeout" and "cut from outside" in row["error"] and row["final_patch"] == ""
    # asyncio.run returns only once the thread that ran the command has ended: the close ended the command
    assert time.monotonic() - t0 < 30


def test_hang_in_a_fake_sandbox_is_cut_and_closing_unblocks_it(calc, tokenizer, monkeypatch):
    """Unit test of the bound: a sandbox whose every command blocks until it is closed."""
    import threading

    import tasks.rollout
    import tasks.sandbox
    from tasks.sandbox.base import CommandResult, SandboxError

    class Hanging:
        def __init__(self):
            self.closed = threading.Event()
            self.ran = 0

        def run(self, cmd, timeout=None, **kw):
            self.ran += 1
            if not self.closed.wait(60):
                return CommandResult(exit_code=0, output="", timed_out=False, seconds=60)
            raise SandboxError("closed while the command ran")

        def close(self):
            self.closed.set()

    box = Hanging()
    monkeypatch.setattr(tasks.sandbox, "open_sandbox", lambda *a, **k: box)
    monkeypatch.setattr(tasks.rollout, "EPISODE_GRACE_S", 0.5)
    row = play(calc, Scripted(tokenizer, [call("search", search_term="add")]), run_cfg("bwrap", episode_timeout_s=0.5),
               tokenizer)
    assert box.ran == 1 and box.closed.is_set()
    assert row["finish_reason"] == "timeout" and "cut from outside" in row["error"]


# --- sizes: a patch over the diff cap, a file over the read cap ------------------------------------


def test_patch_over_the_cap_is_its_own_outcome_never_cut(sandbox_backend, calc, sandbox_store, tokenizer,
                                                         monkeypatch):
    from tasks.sandbox.base import BaseSandbox, PatchTooLargeError

    monkeypatch.setattr(BaseSandbox, "diff_cap_bytes", 4096)  # the real cap is 64 MB
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        sb.write_file("/testbed/small.txt", "x\n" * 100)
        patch = sb.diff()
        assert len(patch) < 4096 and patch.endswith("+x\n")  # under the cap: whole
        sb.write_file("/testbed/big.txt", "y\n" * 4000)
        with pytest.raises(PatchTooLargeError, match="bytes over the 4096-byte cap") as e:
            sb.diff()
        assert e.value.size > 8000 and e.value.cap == 4096

    row = play(calc, Scripted(tokenizer, [call("execute_bash", cmd="seq 100000 > /testbed/big.txt"),
                                          call("finish", command="submit")]),
               run_cfg(sandbox_backend), tokenizer, sandbox_store)
    assert row["finish_reason"] == "patch_too_large" and row["final_patch"] == ""
    over = int(row["error"].split()[1])
    assert row["error"].startswith(f"patch_too_large: {over} bytes over the 4096-byte cap") and over > 500_000


def test_empty_patch_of_patch_too_large_grades_0_and_is_not_masked(calc, sandbox_rootfs, sandbox_store):
    """The policy's own action: graded as the empty patch (R2E-Gym's 0), a sample like any other."""
    from schemas.config import GRPOConfig
    from schemas.tables import TRAJECTORIES
    from tasks.grading import grade_patch
    from tasks.grpo.advantages import compute_advantages
    from tests.rows import trajectory_row

    res = grade_patch(calc, "", sandbox_cfg("bwrap"), sandbox_store)
    assert res.grading_status == "graded" and res.reward == 0.0
    rows = [dict(trajectory_row(0), finish_reason="patch_too_large", final_patch=""), trajectory_row(1)]
    rewards = [dict(res.row(r["rollout_id"], r["run_id"], r["step"], r["instance_id"]), reward=float(i))
               for i, r in enumerate(rows)]
    adv = compute_advantages(TRAJECTORIES.from_rows(rows), _rewards(rewards), GRPOConfig()).to_pylist()
    assert not any(a["masked"] for a in adv) and adv[0]["advantage"] < 0 < adv[1]["advantage"]


def test_read_file_refuses_by_size_before_reading(sandbox_backend, calc, sandbox_store):
    from tasks.sandbox import FileTooLargeError

    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        sb.read_cap_bytes = 4096
        read = []
        exec_ = sb._exec

        def counting(*a, **k):
            r, data = exec_(*a, **k)
            read.append(r.output_bytes)
            return r, data

        sb._exec = counting
        assert sb.run("truncate -s 1G /testbed/huge.bin").ok  # sparse: no memory or quota used
        with pytest.raises(FileTooLargeError, match="huge.bin is 1073741824 bytes") as e:
            sb.read_file("/testbed/huge.bin")
        assert e.value.size == 1 << 30 and read[-1] < 64  # the size only, not a byte of the file
        # a file whose size stat cannot tell is read to at most cap + 1 bytes
        with pytest.raises(FileTooLargeError):
            sb.read_file("/dev/zero")
        assert read[-1] <= 4096 + 1 + 64
        box = ToolBox(sb, command_timeout_s=10)
        obs = observe(box, "file_editor", {"command": "view", "path": "/testbed/huge.bin"})
        assert obs.startswith("ERROR: ") and "huge.bin is 1073741824 bytes" in obs and "head, sed -n" in obs


# --- what the agent does to its own repository, disk and pids, then diff() ---------------------------

def test_diff_after_the_agent_made_its_repository_unreadable(sandbox_backend, calc, sandbox_store):
    """chmod of a file or the whole repository, and a process left running, do not stop the final patch."""
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        box = ToolBox(sb, command_timeout_s=10)
        box.call("file_editor", {"command": "str_replace", "path": INIT, "old_str": "a - b", "new_str": "a + b"})
        assert box.call("execute_bash", {"cmd": f"chmod 000 {INIT}"}).startswith("Exit code: 0")
        assert "+    return a + b" in sb.diff()
        box.call("execute_bash", {"cmd": "(sleep 600 &) ; chmod -R 000 /testbed"})
        patch = sb.diff()
        assert "+    return a + b" in patch and "-    return a - b" in patch
        assert sb.run("pgrep -u 1000 sleep", workdir="/").exit_code != 0  # the leftover is gone
        assert_still_works(box)


def test_patch_git_cannot_read_is_its_own_outcome_not_masked(sandbox_backend, calc, sandbox_store, tokenizer,
                                                            monkeypatch):
    from tasks.sandbox.base import CommandResult, PatchUnreadableError
    from tasks.grpo.advantages import MASKED_FINISH_REASONS

    failed = CommandResult(exit_code=128, output="fatal: unable to write new index file", timed_out=False,
                           seconds=0.1, truncated=False, output_bytes=37)
    from tasks.sandbox.bwrap import BwrapSandbox
    from tasks.sandbox.dockerbox import DockerSandbox

    for cls in (BwrapSandbox, DockerSandbox):  # git failing on what the agent left: the rest of diff() is real
        monkeypatch.setattr(cls, "_run_diff", lambda self: failed)
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        with pytest.raises(PatchUnreadableError, match="exit 128.*unable to write new index file"):
            sb.diff()
    row = play(calc, Scripted(tokenizer, [call("finish", command="submit")]), run_cfg(sandbox_backend),
               tokenizer, sandbox_store)
    assert row["finish_reason"] == "patch_unreadable" and row["final_patch"] == ""
    assert "unable to write new index file" in row["error"]
    assert "patch_unreadable" not in MASKED_FINISH_REASONS  # the policy broke its own repo: its 0 stands


def test_over_long_argument_is_refused_with_the_limit(sandbox_backend, calc, sandbox_store):
    from tasks.agent.tools import MAX_ARGV_BYTES
    from tasks.sandbox.base import SandboxError, SandboxInfraError

    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        box = ToolBox(sb, command_timeout_s=10)
        for name, args in (("execute_bash", {"cmd": "echo " + "x" * (1 << 20)}),
                           ("search", {"search_term": "y" * 200_000}),
                           ("file_editor", {"command": "view", "path": "/testbed/" + "z" * 150_000})):
            obs = observe(box, name, args)
            assert obs.startswith("ERROR: ") and f"{MAX_ARGV_BYTES}-byte limit" in obs, obs[:300]
            assert "file_editor create" in obs
        # Below the tools, an argv the kernel refuses (E2BIG) is the caller's error, not the engine's.
        with pytest.raises(SandboxError, match="arguments too long") as e:
            sb.run("echo " + "x" * (1 << 20))
        assert not isinstance(e.value, SandboxInfraError)
        assert_still_works(box)


def test_fork_bomb_then_the_next_command_works(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        box = ToolBox(sb, command_timeout_s=5)
        obs = observe(box, "execute_bash", {"cmd": "b() { b | b & }; b"})
        assert "ERROR" in obs or "Exit code" in obs, obs[:300]
        assert box.call("execute_bash", {"cmd": "echo ok"}).endswith("ok\n")
        assert sb.run("echo ok").output == "ok\n"
        if sandbox_backend == "docker":  # its leftovers are killed from the host, needing no pid inside
            assert sb._kill_from_host()
        assert sb.diff() == ""
        assert_still_works(box)


def test_full_disk_and_memory_end_as_the_policys_outcome(sandbox_backend, calc, sandbox_store, tokenizer):
    """Filling the quota (a tmpfs: memory too) leaves git maybe no room to read: never agent_error/infra_error."""
    fill = "dd if=/dev/zero of=/testbed/fill bs=1M count=100000 status=none; dd if=/dev/zero of=/tmp/f bs=1M count=100000"
    row = play(calc, Scripted(tokenizer, [call("execute_bash", cmd=fill), call("finish", command="submit")]),
               run_cfg(sandbox_backend), tokenizer, sandbox_store)
    assert row["finish_reason"] in ("submitted", "patch_unreadable"), row["error"]
    if row["finish_reason"] == "patch_unreadable":
        assert row["final_patch"] == "" and row["error"].startswith("patch_unreadable: git diff failed")
