"""Deployments and the local stack's files: typed forms, fast failure on bad input, compose and Kubernetes
templates that their tools accept. The deployments on the work pool and its worker are checked against the
session's server (`make ui`'s infra/ui.sh)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.fixtures.smoke_run import REPO


def _schema(flow) -> dict:
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(flow).model_dump()


def test_forms_are_typed():
    from flows.deployments import evaluate_entry, prepare_entry, train_entry
    from flows.reproducibility import reproducibility
    from schemas.presets import PRESETS

    for f in (train_entry, evaluate_entry, prepare_entry):
        props = _schema(f)["properties"]
        assert props["preset"]["enum"] == list(PRESETS), f.name  # a drop-down, not a text box
        assert props["overrides"]["type"] == "array" and props["overrides"]["items"]["type"] == "string"
        assert props["preset"].get("description"), "the form explains each field"
    repro = _schema(reproducibility)
    assert repro["required"] == ["baseline_run_id"]
    assert set(repro["definitions"]["Tolerances"]["properties"]) == {"z", "min_abs", "time_ratio",
                                                                     "trajectory_agreement", "seeded_agreement"}


def test_bad_input_fails_before_anything_starts():
    from flows.deployments import train_entry
    from schemas.presets import ConfigError

    with pytest.raises(ConfigError, match="prompts_per_step"):
        train_entry.fn(preset="smoke", overrides=["grpo.prompts_per_step=0"])


def test_make_ui_deploys_to_the_work_pool(prefect_ui):
    assert prefect_ui.url in prefect_ui.start_output and "make ui-stop" in prefect_ui.start_output
    pool = prefect_ui.api("GET", f"/work_pools/{prefect_ui.pool}")
    assert pool["type"] == "process", pool
    for name in ("train", "evaluate", "prepare"):
        dep = prefect_ui.deployment(name, name)
        assert dep["entrypoint"] == f"flows/deployments.py:{name}_entry"
        assert dep["work_pool_name"] == prefect_ui.pool
        # The code is this checkout: the worker runs the entrypoint here, nothing is built or pulled.
        assert dep["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        assert dep["parameter_openapi_schema"]["properties"]["preset"]["enum"][0] == "smoke"
        # READY once the worker has polled the pool's queue (every few seconds).
        prefect_ui.wait_for_run(lambda: prefect_ui.deployment(name, name)["status"] == "READY", 60,
                                f"deployment {name} ready", poll=1)
    workers = prefect_ui.api("POST", f"/work_pools/{prefect_ui.pool}/workers/filter", json={})
    assert [w["status"] for w in workers] == ["ONLINE"], workers


def test_a_deployment_run_executes_on_the_worker(prefect_ui):
    """A run created as the UI's Run button does (the API), with a bad override: the worker picks it up
    and runs it in its own process, where the configuration check fails it within seconds."""
    dep = prefect_ui.deployment("evaluate", "evaluate")
    run = prefect_ui.api("POST", f"/deployments/{dep['id']}/create_flow_run",
                         json={"parameters": {"preset": "smoke", "overrides": ["grpo.prompts_per_step=0"]}})

    def finished():
        r = prefect_ui.api("GET", f"/flow_runs/{run['id']}")
        return r if r["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    run = prefect_ui.wait_for_run(finished, 180, "the evaluate run on the worker", poll=1)
    assert run["state"]["type"] == "FAILED" and "prompts_per_step" in run["state"]["message"], run["state"]
    prefect_ui.assert_ran_on_worker(run)


def _compose() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_compose_file_is_valid():
    cmd = _compose()
    if cmd is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")
    out = subprocess.run(cmd + ["-f", "infra/compose.yaml", "--profile", "s3", "config"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for service in ("prefect-server", "deploy", "worker", "s3"):
        assert re.search(rf"^\s+{service}:", out.stdout, re.M), service


def test_kubernetes_base_job_template_resolves():
    from prefect.utilities.templating import apply_values, find_placeholders

    tpl = json.loads((REPO / "infra/k8s/base-job-template.json").read_text())
    variables = tpl["variables"]["properties"]
    used = {p.name for p in find_placeholders(tpl["job_configuration"])}
    assert used <= set(variables), f"placeholders without a variable: {used - set(variables)}"
    defaults = {k: v["default"] for k, v in variables.items() if "default" in v}
    job = apply_values(tpl["job_configuration"], defaults)
    manifest = job["job_manifest"]
    assert manifest["kind"] == "Job"
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == variables["image"]["default"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == variables["gpus"]["default"]


def test_kubernetes_manifests_parse():
    import yaml

    for path in sorted((REPO / "infra/k8s").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert docs and all("kind" in d and "apiVersion" in d for d in docs), path


def test_kuberay_ray_cluster_template_renders():
    """infra/k8s/ray-cluster.yaml: a KubeRay RayCluster of our pinned Ray, on the flow-run image, whose
    sandbox nodes advertise the resource that cluster.sandbox_resources asks for."""
    import typing

    import yaml

    from schemas.config import SandboxConfig

    (doc,) = [d for d in yaml.safe_load_all((REPO / "infra/k8s/ray-cluster.yaml").read_text()) if d]
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    pinned = [line.split("==")[1].strip() for line in (REPO / "requirements.lock").read_text().splitlines()
              if line.startswith("ray[default]==")]
    assert pinned == [doc["spec"]["rayVersion"]], "rayVersion must be the Ray pinned in requirements.lock"
    image = json.loads((REPO / "infra/k8s/base-job-template.json").read_text())[
        "variables"]["properties"]["image"]["default"]
    head, groups = doc["spec"]["headGroupSpec"], doc["spec"]["workerGroupSpecs"]
    backends = typing.get_args(SandboxConfig.model_fields["backend"].annotation)
    for group in [head, *groups]:
        # KubeRay passes rayStartParams to `ray start` as strings; a number there is rejected.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group["rayStartParams"]
        pod = group["template"]["spec"]
        assert {c["image"] for c in pod["containers"] + pod.get("initContainers", [])} == {image}
        for c in pod["containers"]:
            assert c["resources"]["limits"] == c["resources"]["requests"]
    assert {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]} >= {6379, 10001}
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        custom = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert custom and all(k in {f"sandbox_{b}" for b in backends} for k in custom), custom
        assert float(group["rayStartParams"]["num-cpus"]) >= 1
