"""The Prefect UI as a person uses it: run artifacts, and a browser (headless Chromium) that starts a
`smoke` training run from the train deployment's form and waits for its result and artifacts."""

from __future__ import annotations

import os
import pathlib
import re
import time
import types

import pytest

from tests.fixtures.smoke_run import REPO, SMOKE_STORE_ROOT

SCREENSHOT_DIR = REPO / ".rlvr" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
FORM_OVERRIDES = ["max_steps=1", "eval.max_tasks=2"]
# Runs started from the session's UI (infra/ui.sh's worker -> flows/deployments.py) go to the test store, never
# the user's .rlvr/store; set at import, before the session-scoped prefect_ui fixture copies the environment.
os.environ["RLVR_UI_STORE"] = SMOKE_STORE_ROOT


def _ctx(run_id: str):
    from schemas.presets import load_config
    from tasks.storage import Store

    return types.SimpleNamespace(store=Store(SMOKE_STORE_ROOT), run_id=run_id, cfg=load_config("smoke"))


def test_artifacts_are_noops_outside_a_flow_run():
    from flows.artifacts import publish_run, publish_step

    broken = types.SimpleNamespace(store=None, run_id="x", cfg=None)  # would raise if touched
    assert publish_step(broken, 1, {"rollouts": 1.0}) is None
    assert publish_run(broken, {}) is None


def test_ui_runs_use_the_ui_store_unless_an_override_names_one(monkeypatch):
    from flows.deployments import _config

    monkeypatch.setenv("RLVR_UI_STORE", SMOKE_STORE_ROOT)
    cfg, ov = _config("smoke", ["max_steps=1"])
    assert cfg.storage.root == SMOKE_STORE_ROOT and ov == {"max_steps": 1, "storage": {"root": SMOKE_STORE_ROOT}}
    cfg, _ = _config("smoke", ["storage.root=file:///tmp/elsewhere"])
    assert cfg.storage.root == "file:///tmp/elsewhere"
    monkeypatch.delenv("RLVR_UI_STORE")
    assert _config("smoke", [])[0].storage.root == "file://.rlvr/store"  # `make ui` for a person: the preset's


def test_run_artifacts_in_a_flow_run(prefect_api, smoke_run):
    from prefect import flow

    from flows.artifacts import artifact_key, publish_run, publish_step
    from flows.train import summarize_run

    ctx = _ctx(smoke_run)

    @flow(name="artifacts-check")
    def publish():
        for step in (1, 2):
            publish_step(ctx, step, ctx.store.get_json(f"runs/{smoke_run}/step-{step:05d}/timings.json"))
            publish_step(ctx, step, {})  # a second call in the same flow run is a no-op
        publish_run(ctx, summarize_run(ctx, {}))
        publish_run(ctx, {"broken": True})  # idempotent, and would not raise anyway

    publish()
    progress = prefect_api.api("POST", "/artifacts/filter",
                               json={"artifacts": {"key": {"any_": [artifact_key(smoke_run, "progress")]}},
                                     "sort": "CREATED_DESC"})
    import json

    rows = json.loads(progress[0]["data"]) if isinstance(progress[0]["data"], str) else progress[0]["data"]
    assert [r["step"] for r in rows] == [1, 2] and progress[0]["type"] == "table"
    steps = prefect_api.api("POST", "/artifacts/filter",
                            json={"artifacts": {"key": {"any_": [artifact_key(smoke_run, "steps")]}}})
    assert steps[0]["type"] == "progress" and steps[0]["data"] == 100.0  # smoke: 2 of max_steps 2
    assert {"mean_reward", "finish_reasons", "pass@4", "s_rollouts", "s_update"} <= set(rows[0])
    summary = prefect_api.api("POST", "/artifacts/filter",
                              json={"artifacts": {"key": {"any_": [artifact_key(smoke_run, "summary")]}}})
    md = summary[0]["data"]
    assert "data:image/png;base64," in md and "mlperf.log" in md and "| 2 |" in md


def test_a_run_finds_the_ui_that_serves_its_history_and_only_that(tmp_path):
    import http.server
    import json
    import threading

    from flows.process import ui_api_url

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api = f"http://127.0.0.1:{server.server_address[1]}/api"
    home, ui = tmp_path / "prefect", tmp_path / "ui"
    ui.mkdir()
    assert ui_api_url(str(home), str(ui)) is None  # no UI was ever started
    (ui / "server.json").write_text(json.dumps({"api_url": api, "prefect_home": str(home)}))
    assert ui_api_url(str(home), str(ui)) == api
    assert ui_api_url(str(tmp_path / "other-home"), str(ui)) is None  # a UI of another history
    server.shutdown()
    server.server_close()
    assert ui_api_url(str(home), str(ui)) is None  # a stale file: its server is gone


def _train_runs(ui, run_id: str) -> list[dict]:
    runs = ui.api("POST", "/flow_runs/filter", json={"flows": {"name": {"any_": ["train"]}}})
    return [r for r in runs if r["parameters"].get("run_id") == run_id]


@pytest.mark.slow
def test_make_ui_shows_the_runs_made_before_it_and_reports_those_made_while_it_is_up(prefect_ui, smoke_train_run):
    """One Prefect history. The smoke run, made from the command line before the UI started, is listed with
    its stages and logs; a command-line run started while the UI is up reports to the UI's server live
    (temporary servers are forbidden to it: were the UI not found, it would fail)."""
    import subprocess

    from tests.fixtures.smoke import main_command

    run_id = smoke_train_run["run_id"]
    (before,) = _train_runs(prefect_ui, run_id)
    assert before["state"]["type"] == "COMPLETED", before["state"]
    stages = prefect_ui.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [before["id"]]}}})
    assert {"dataset", "grpo_iteration"} <= _stage_names(stages), [t["name"] for t in stages]
    logs = prefect_ui.api("POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [before["id"]]}}})
    assert any(e["message"].startswith("prepare: tasks table") for e in logs), logs  # its progress lines

    env = {k: v for k, v in prefect_ui.env.items() if k != "PREFECT_API_URL"}
    env.update(RLVR_UI_DIR=str(prefect_ui.dir), PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="false")
    proc = subprocess.Popen(main_command(run_id, smoke_train_run["overrides"]), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # a rerun of a finished run
    seen_running = False
    while proc.poll() is None:
        new = [r for r in _train_runs(prefect_ui, run_id) if r["id"] != before["id"]]
        seen_running |= bool(new) and new[0]["state"]["type"] == "RUNNING"
        time.sleep(0.3)
    out = proc.stdout.read()
    assert proc.returncode in (0, 1), out[-4000:]  # the smoke run ends at max_steps (1) or passes (0)
    assert f"reporting to the Prefect UI's server: {prefect_ui.url}" in out, out[-4000:]
    (during,) = [r for r in _train_runs(prefect_ui, run_id) if r["id"] != before["id"]]
    assert during["state"]["type"] == "COMPLETED" and seen_running, (during["state"], seen_running)
    stages = prefect_ui.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [during["id"]]}}})
    assert "dataset" in _stage_names(stages), [t["name"] for t in stages]


def _stage_names(task_runs: list[dict]) -> set[str]:
    return {t["name"].rsplit("-", 1)[0] for t in task_runs}  # Prefect names a task run <task>-<key>


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_browser_runs_smoke_from_the_train_form(prefect_ui):
    """Deployments -> train -> Run -> Custom run -> preset smoke, a run id -> Submit; then the flow run's
    page until Completed (run by the work pool's worker), and its Artifacts tab with the run summary (pass@k
    picture) and progress table."""
    from playwright.sync_api import expect, sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is needed: apt-get install -y chromium")
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    run_id = f"ui-smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            page.goto(prefect_ui.url + "/deployments")
            page.get_by_role("link", name="train", exact=True).first.click()
            page.wait_for_url("**/deployments/deployment/**")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run").first.click()
            page.wait_for_url("**/run**")
            _fill_form(page, run_id)
            page.screenshot(path=str(SCREENSHOT_DIR / "train-form.png"), full_page=True)
            dep = prefect_ui.deployment("train", "train")
            runs = _submit(page, prefect_ui, dep["id"], run_id)
            assert runs[0]["parameters"]["preset"] == "smoke"
            assert runs[0]["parameters"]["overrides"] == FORM_OVERRIDES, runs[0]["parameters"]
            run_page = f"{prefect_ui.url}/runs/flow-run/{runs[0]['id']}"
            page.goto(run_page)
            expect(page.get_by_text(runs[0]["name"]).first).to_be_visible()
            page.screenshot(path=str(SCREENSHOT_DIR / "train-run-started.png"))
            # The run page animates and polls: on 2 cores it would take CPU from the run it watches.
            page.goto("about:blank")

            def finished():
                state = prefect_ui.api("GET", f"/flow_runs/{runs[0]['id']}")["state"]
                return state if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

            state = prefect_ui.wait_for_run(finished, 1500, f"flow run for {run_id} finished", poll=10)
            assert state["type"] == "COMPLETED", state
            # Run by the worker on the `rlvr` pool, in a process of its own (not by whoever deployed).
            prefect_ui.assert_ran_on_worker(prefect_ui.api("GET", f"/flow_runs/{runs[0]['id']}"))
            page.goto(run_page)
            expect(page.get_by_text("Completed").first).to_be_visible()
            page.locator(".p-tab").filter(has_text="Artifacts").click()
            expect(page.get_by_text(f"{run_id}-summary").first).to_be_visible()
            expect(page.get_by_text(f"{run_id}-progress").first).to_be_visible()
            page.screenshot(path=str(SCREENSHOT_DIR / "train-run-artifacts.png"), full_page=True)
            page.get_by_text(f"{run_id}-summary").first.click()
            img = page.locator("img[src^='data:image/png']").first
            expect(img).to_be_visible()
            assert page.evaluate("(i) => i.naturalWidth", img.element_handle()) > 100, "the pass@k PNG renders"
            page.screenshot(path=str(SCREENSHOT_DIR / "train-run-summary.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(SCREENSHOT_DIR / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    from tasks.storage import Store

    m = Store(SMOKE_STORE_ROOT).read_manifest(run_id)  # a form run uses the UI's store (RLVR_UI_STORE)
    assert m is not None and m.preset == "smoke" and m.status in ("succeeded", "target_not_reached")
    assert m.config["max_steps"] == 1 and m.config["eval"]["max_tasks"] == 2  # the form's overrides reached it
    user = REPO / ".rlvr" / "store" / "runs" / run_id
    assert not user.exists(), f"the UI run wrote into the user's store: {user}"


def _fill_form(page, run_id: str) -> None:
    from playwright.sync_api import expect

    page.get_by_text("preset (Optional)").wait_for()
    field = page.locator(".schema-form-property").filter(has=page.get_by_text("preset (Optional)"))
    select = field.locator("button.p-select-button__control")
    # Prefect's select opens from the keyboard (a synthetic mouse click on its button does not open it
    # in headless Chromium); the option itself is clicked.
    select.focus()
    page.keyboard.press("ArrowDown")
    page.locator(".p-select-option").filter(has_text=re.compile(r"^\s*smoke\s*$")).first.click()  # not smoke-hybrid
    expect(select).to_have_text("smoke")
    field = page.locator(".schema-form-property").filter(has=page.get_by_text("run_id (Optional)"))
    field.locator("textarea, input").first.fill(run_id)
    # One step, two validation tasks: what the test reads is form -> worker -> run -> artifacts, not training.
    field = page.locator(".schema-form-property").filter(has=page.get_by_text("overrides (Optional)"))
    for i, line in enumerate(FORM_OVERRIDES):
        field.get_by_role("button", name="Add item").click()
        field.locator("textarea, input").nth(i).fill(line)


def _submit(page, prefect_ui, deployment_id: str, run_id: str, tries: int = 3) -> list[dict]:
    """Submit, as a person would: Prefect's SQLite server can answer a write with a 500 ("database is locked")
    while the machine is loaded; the form then stays open under an error toast, and the person submits again."""
    def listed():
        return [r for r in prefect_ui.flow_runs(deployment_id) if r["parameters"].get("run_id") == run_id]

    toasts = []
    for _ in range(tries):
        if page.get_by_text("Something went wrong").count():  # it covers the Submit button; once per page load
            toasts.append(time.strftime("%H:%M:%S"))
            page.reload()
            _fill_form(page, run_id)
        page.get_by_role("button", name="Submit").click()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (runs := listed()):
            if page.get_by_text("Something went wrong").count():
                time.sleep(3)  # the request that failed may be this one or an earlier poll
                runs = listed()
                break
            time.sleep(2)
        if runs:
            assert len(runs) == 1, f"{len(runs)} flow runs for one run id: {runs}"
            return runs
        if time.monotonic() >= deadline:
            break  # neither a run nor an error in 60 s: submitting again would not say more
    log = (prefect_ui.dir / "server.log").read_text(errors="replace")[-3000:]
    raise AssertionError(f"the form created no flow run for {run_id} (error toasts at {toasts}); "
                         f"the server's log ends:\n{log}")
