"""Sandboxes: where an agent's commands and the hidden tests run.

One protocol, two backends chosen by `SandboxConfig.backend`:
- `bwrap` (default; no daemon): bubblewrap over a read-only root filesystem, writable
  /testbed and /tmp only, uid 1000, no capabilities, no network, cgroup memory/pids/CPU
  limits, wall-clock kill. One short-lived process per command.
- `docker`: one container per sandbox (`network_mode=none`, same limits, read-only root),
  each command an exec in it; `docker_reuse=True` keeps reset containers warm between sandboxes.

Disk quota (archive tasks, both backends): what a sandbox can write lives on one tmpfs of
`disk_mb` beyond its copy of the task; past it a write fails with ENOSPC ("No space left on
device"), and the pages count against `memory_mb` too. R2E-Gym image tasks have none.

    with open_sandbox(task_row, cfg, store, mode="agent") as sb:
        r = sb.run("python -c 'print(1)'", timeout=10)   # CommandResult(exit_code, output, timed_out, seconds, ...)
        r = sb.run("git apply -", stdin=patch_text)         # run(cmd, timeout=None, *, workdir="/testbed",
                                                            #     output_cap=None, env=None, stdin=None)
        sb.write_file("/testbed/pkg/mod.py", "...")         # parents created; owned by the sandbox user
        text = sb.read_file("pkg/mod.py")                   # relative paths: relative to /testbed;
                                                            # FileTooLargeError over 256 MB, never cut
        sb.copy_tree_in(host_dir, "/testbed/data")
        patch = sb.diff()                                   # the rollout's final patch (trusted git)

Modes: "agent" = /testbed only; the hidden tests and run_tests.sh are nowhere in the
sandbox. "grading" = also /root/r2e_tests and /root/run_tests.sh (read-only for uid 1000),
where R2E-Gym keeps them; tasks/grading links /testbed/r2e_tests to them after the patch.

Commands run in /testbed as `/bin/sh -c CMD` with `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1` where we
control the tests (archives whose .venv is only the interpreter link: the mini benchmark); archives
that bring their own virtualenv and real R2E-Gym images keep autoload on (their plugins). Output is
stdout and stderr together (bwrap: one pipe, in order; docker: two streams, so their
relative order can differ), capped at `output_cap_bytes` keeping head and tail. `timed_out`
means our deadline killed the command and everything it started (exit_code is then None).
File operations run inside the sandbox as its user (the host never follows the agent's
symlinks). bwrap: background processes end with their command; docker: they live on in
the container until it closes (an exec whose background child keeps stdout open returns
~2 s late: docker's own wait).

Errors that are not the agent's doing raise `SandboxInfraError` (retry it; never score it).
Closing kills every process and removes the container / cgroups / temp dirs, also on
Ctrl-C and exceptions (context manager + atexit); `reap_stale()` (or `python -m
tasks.sandbox reap`) removes what a SIGKILLed process left.

Environment archive (`environment_uri` in the tasks table; an object-store URI of a .tar.gz,
built by `build_environment_archive` (in-memory files) or `environment.build_archive_from_dir` (a
directory: file modes, symlinks and empty directories kept; every .git at any depth (a nested
repository's files stay, its history does not) and its own .venv left out):

    testbed/                 the repo, a fresh git repository whose single commit is the buggy state
                             (message "buggy state", fixed author and date; no other refs, no
                             reflogs, hooks or other objects): the task's name and history stay out
    testbed/.git/info/exclude   lists .venv, __pycache__/, *.pyc, .pytest_cache/ (clean `git status`)
    testbed/.venv/           either only bin/python, a symlink to /usr/bin/python3 (the image's python;
                             the mini benchmark), or a real virtualenv for /testbed/.venv made with
                             the image's python (pyvenv.cfg, system site packages on, the task's own
                             packages in lib/python3.11/site-packages): the task brings its own
                             environment and its tests run with plugin autoload on. Never committed.
    r2e_tests/               the hidden tests (test_*.py, conftest.py, data files ...)
    run_tests.sh             run in /testbed; by default
                             "#!/bin/bash\\n.venv/bin/python -W ignore -m pytest -rA r2e_tests\\n"

Members are regular files, directories and symlinks only, with relative paths; a symlink stays
inside its top directory, except the venv's interpreter links (testbed/.venv/bin/python* ->
/usr/bin/python3*). The repo must not contain r2e_tests/ or run_tests.sh itself (grading removes
them from /testbed). Rows without environment_uri are real R2E-Gym rows: `docker_image`
(namanjain12/...) holds /testbed, /testbed/run_tests.sh and /r2e_tests; only the docker backend
runs those.

Importing a user's own repositories (`python -m tasks.dataset.importer DIR --store ROOT
[--backend bwrap|docker] [--offline] [--num-validation N]`; DIR a local directory or an
object-store prefix, one directory per task):

    <name>/repo/            the repo snapshot in its buggy state (every .git and its own .venv are left out)
    <name>/r2e_tests/       the hidden tests
    <name>/gold.patch       the fix, a unified diff against repo/ (`git diff` output; text files), or
                            parsed_commit_content in task.json (R2E-Gym's ParsedCommit)
    <name>/run_tests.sh     optional (default above)
    <name>/task.json        an R2E-Gym-style row: problem_statement (required), expected_output_json
                            (optional: else the statuses of a first gold-patch run, which verification
                            then checks), repo_name (default <name>), commit_hash (default: the
                            archive's commit), modified_files (default: the gold patch's), and for a
                            task that brings its own environment:
                              "requirements": pip requirements of its tests ("pytest-cov==5.0",
                                 "./myplugin", "-r repo/requirements-test.txt"; paths relative to
                                 <name>/), resolved to wheels here on the host (`pip wheel`: PyPI or
                                 PIP_FIND_LINKS; --offline: no index, local packages built with this
                                 environment's setuptools) and installed by the image's python in a
                                 sandbox (no network there) into the task's virtualenv
                              "pythonpath": repo directories that virtualenv puts on sys.path ("src":
                                 what an editable install of a src layout amounts to)

Each task is built into an archive (environments/import/<sha>.tar.gz), checked as the loader checks
a row, and verified in sandboxes: gold patch 1 twice, empty patch 0 (tasks/dataset/verify.py:
check_tasks; a pass is recorded per row, archive, image and backend, so it is not redone). A task
that fails any step is printed by name with the reason and its test log tail, and left out. The
verified rows go to datasets/import-<id>/rows.jsonl (train on them: `dataset.source=r2e
dataset.path=<that URI>`; `prepare` builds the sandbox image and verifies archive rows the same
way), with a tasks table and import_report.json next to it. Extra Debian packages are not a task
option: Python dependencies go in the virtualenv; a task that needs more needs its own image
(`docker_image`, docker backend).

The base image and rootfs: tasks/sandbox/image.py (`python -m tasks.sandbox.image build`).
"""

from __future__ import annotations

import os

from tasks.sandbox.base import (DIFF_EXCLUDES, BaseSandbox, CommandResult, FileTooLargeError, SandboxError,
                                SandboxInfraError, close_all, pid_alive)
from tasks.sandbox.environment import EnvironmentError_ as EnvironmentSpecError
from tasks.sandbox.environment import Environment, RUN_TESTS_SH, resolve as resolve_environment
from tasks.sandbox.environment import build_environment_archive

Sandbox = BaseSandbox
MODES = ("agent", "grading")

__all__ = ["open_sandbox", "Sandbox", "CommandResult", "SandboxError", "SandboxInfraError", "FileTooLargeError",
           "EnvironmentSpecError", "Environment", "resolve_environment", "build_environment_archive",
           "RUN_TESTS_SH", "DIFF_EXCLUDES", "close_all", "close_pools", "reap_stale", "leftovers"]


def open_sandbox(task_row: dict, cfg, store=None, mode: str = "agent", env: Environment | None = None) -> BaseSandbox:
    """Start a sandbox for a task row (tasks-table dict). `store` resolves `environment_uri`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    env = env or resolve_environment(task_row, store, base_image=cfg.image)
    if cfg.backend == "bwrap":
        from tasks.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(env, cfg, mode)
    if cfg.backend == "docker":
        from tasks.sandbox.dockerbox import DockerSandbox

        return DockerSandbox(env, cfg, mode)
    raise ValueError(f"unknown sandbox backend {cfg.backend!r}")


def close_pools() -> None:
    from tasks.sandbox import dockerbox

    dockerbox.close_pools()


def reap_stale(docker: bool = True) -> list[str]:
    """Remove containers, cgroups, tmpfs mounts and temp dirs left by sandbox-owning processes that died."""
    from tasks.sandbox import bwrap

    removed = bwrap.reap_stale(pid_alive)
    if docker:
        from tasks.sandbox import dockerbox

        try:
            removed += dockerbox.reap_stale(pid_alive)
        except SandboxInfraError:
            pass
    return removed


def leftovers(pid: int | None = None, docker: bool = True) -> list[str]:
    """What a process (default: this one) still holds: tests assert it is empty after close."""
    from tasks.sandbox import bwrap

    pid = pid or os.getpid()
    out = bwrap.leftovers(pid)
    if docker:
        from tasks.sandbox import dockerbox

        try:
            out += dockerbox.leftovers(pid)
        except SandboxInfraError:
            pass
    return out
