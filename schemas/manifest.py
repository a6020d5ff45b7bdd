"""The run manifest: what a run is (its frozen config) and what happened to it (attempts, status).

Stored as `runs/{run_id}/manifest.json`. The list of committed tables is not
duplicated here: the store's commit markers are the single source of truth
(`Store.commits(f"runs/{run_id}")`).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# killed: the attempt's process is gone without having recorded an end (SIGKILL, OOM, power).
RunStatus = Literal["running", "succeeded", "failed", "stopped", "target_not_reached", "killed"]


class Attempt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    started_at: float
    ended_at: float | None = None
    # First step this attempt had to work on; > 0 means it resumed a killed run.
    resumed_at_step: int = 0
    status: RunStatus = "running"
    # How it ended, in words: "stopped: SIGTERM", "failed: RuntimeError: ...", "ended without a word".
    reason: str | None = None
    # Its owner process: a `running` attempt whose owner is gone was killed (Store.read_manifest).
    host: str | None = None
    pid: int | None = None
    pid_start: int | None = None  # the process's start time in clock ticks since boot (/proc/PID/stat)


class RunManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: str
    preset: str
    config: dict
    config_sha256: str
    code_version: str = "unknown"
    # What the run started from (pinned for reproducibility reruns): tasks table, model, demonstrations,
    # base checkpoint keys in the store.
    prepared: dict = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)
    status: RunStatus = "running"
    attempts: list[Attempt] = Field(default_factory=list)

    @staticmethod
    def config_digest(config: dict) -> str:
        return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()

    @property
    def resumed(self) -> bool:
        return len(self.attempts) > 1
