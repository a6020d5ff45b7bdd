"""Reading a run back for people: tables as DataFrames, curves, solve rates, one trajectory as a conversation.

Used by `notebooks/inspect_run.ipynb` (so the notebook stays a few short cells)
and by `flows/artifacts.py` (the same numbers in the Prefect UI). Read-only:
everything comes from the run's committed tables in the object store.

    run = open_run("smoke-dev1")                                  # file://.rlvr/store
    run = open_run("X", "s3://bucket/prefix", "http://127.0.0.1:9000")
    run.stage("rewards")                                          # every step's rewards, one DataFrame
"""

from __future__ import annotations

import base64
import io
import json
import pathlib
import re
from dataclasses import dataclass, field

import pandas as pd

from schemas.config import RunConfig
from tasks.evaluation import base_eval_id
from tasks.grading.grader import reward_hacking
from tasks.storage import Store

# Per-token columns: large and useless in a DataFrame; a notebook reads them from the table when needed.
TOKEN_COLUMNS = ("token_ids", "loss_mask", "generation_logprobs")
_STEP = re.compile(r"/step-(\d+)/")


@dataclass
class Run:
    store: Store
    run_id: str
    manifest: object = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def config(self) -> dict:
        return self.manifest.config if self.manifest else {}

    def steps(self, stage: str) -> list[int]:
        """Steps at which `stage` is committed."""
        return sorted(int(m.group(1)) for c in self.store.commits(f"runs/{self.run_id}")
                      if c.stage == stage and (m := _STEP.search("/" + c.key)))

    def stage(self, stage: str) -> pd.DataFrame:
        """One stage's table over all steps (token columns dropped); empty if never committed."""
        if stage not in self._cache:
            frames = []
            for s in self.steps(stage):
                t = self.store.read_stage(self.run_id, s, stage)
                t = t.drop_columns([c for c in TOKEN_COLUMNS if c in t.column_names])
                frames.append(t.to_pandas())
            self._cache[stage] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        return self._cache[stage]

    def base_run_id(self) -> str | None:
        """The run id under which the warm-started base checkpoint was evaluated (`base-<model>-<digest>`)."""
        m = self.store.read_manifest(self.run_id)
        if m is None or not m.prepared.get("base_model") or not m.prepared.get("tasks"):
            return None
        return base_eval_id(RunConfig.model_validate(m.config), m.prepared)

    def base_checkpoint(self) -> str | None:
        """Name of the checkpoint the run started from: pinned in its manifest, else as its first update recorded."""
        m = self.store.read_manifest(self.run_id)
        if m is not None and m.prepared.get("base_model"):
            return pathlib.PurePosixPath(m.prepared["base_model"]).name
        key = f"runs/{self.run_id}/checkpoints/step-00001/rlvr_version.json"
        if not self.store.exists(key):
            return None
        parent = self.store.get_json(key).get("parent") or ""
        return pathlib.PurePosixPath(parent).name or None

    def tasks(self) -> pd.DataFrame:
        """The tasks table rows of this run's instances (repo_name, bug_family, split, ...)."""
        if "tasks" not in self._cache:
            ids = set(self.stage("trajectories").get("instance_id", [])) | set(
                self.stage("eval_samples").get("instance_id", []))
            self._cache["tasks"] = find_tasks(self.store, ids)
        return self._cache["tasks"]


def open_run(run_id: str, root: str = "file://.rlvr/store", endpoint_url: str | None = None) -> Run:
    store = Store(root, endpoint_url)
    run = Run(store=store, run_id=run_id, manifest=store.read_manifest(run_id))
    if run.manifest is None and not store.commits(f"runs/{run_id}"):
        raise FileNotFoundError(f"no run {run_id!r} in {store.root}")
    return run


def find_tasks(store: Store, instance_ids: set[str]) -> pd.DataFrame:
    """The tasks table (under datasets/) that holds the most of these instances, as a DataFrame."""
    cols = ["instance_id", "split", "repo_name", "bug_family", "problem_statement"]
    best, best_hits = pd.DataFrame(columns=cols), 0
    for c in store.commits("datasets"):
        if c.stage != "tasks":
            continue
        t = store.read_table(c.key, stage="tasks")
        df = t.select([x for x in cols if x in t.column_names]).to_pandas()
        hits = int(df["instance_id"].isin(instance_ids).sum())
        if hits > best_hits:
            best, best_hits = df, hits
    return best


# -- numbers ----------------------------------------------------------------------------
def eval_curve(run: Run) -> pd.DataFrame:
    """pass@k / pass@1 per evaluation, the base checkpoint's evaluation as step 0."""
    rows = []
    base = run.base_run_id()
    if base and run.store.stage_committed(base, 0, "eval_summary"):
        rows += run.store.read_stage(base, 0, "eval_summary").to_pylist()
    df = run.stage("eval_summary")
    rows += df.to_dict("records") if len(df) else []
    cols = ["step", "pass_at_k", "pass_at_1", "pass_hat_k", "k", "num_tasks", "samples_count", "eval_seconds"]
    return pd.DataFrame(rows, columns=cols).sort_values("step").reset_index(drop=True)


def reward_curve(run: Run) -> pd.DataFrame:
    """Per training step: mean reward over graded rollouts, how many were graded / infra errors."""
    r = run.stage("rewards")
    if not len(r):
        return pd.DataFrame(columns=["step", "mean_reward", "graded", "infra_errors"])
    g = r.groupby("step")
    return pd.DataFrame({"mean_reward": g["reward"].mean(), "graded": g["reward"].count(),
                         "infra_errors": g["grading_status"].apply(lambda s: int((s != "graded").sum()))}
                        ).reset_index()


def step_stats(store: Store, run_id: str, step: int) -> dict:
    """One training step in numbers (what the Prefect UI's progress table shows)."""
    out: dict = {"step": step}
    if store.stage_committed(run_id, step, "rewards"):
        table = store.read_stage(run_id, step, "rewards")
        hacking = reward_hacking(table)
        rw = table.select(["reward", "grading_status"]).to_pylist()
        graded = [r["reward"] for r in rw if r["reward"] is not None]
        out.update(mean_reward=round(sum(graded) / len(graded), 4) if graded else None,
                   solved=int(sum(graded)), graded=len(graded),
                   env_errors=sum(1 for r in rw if r["grading_status"] == "env_error"),
                   infra_errors=sum(1 for r in rw if r["grading_status"] == "infra_error"),
                   harness_patches=len(hacking["harness_changes"]), tampering=len(hacking["tampering"]),
                   hack_signals=len(hacking["hack_signals"]))
    if store.stage_committed(run_id, step, "trajectories"):
        tr = store.read_stage(run_id, step, "trajectories",
                              columns=["finish_reason", "num_turns", "num_generated_tokens"]).to_pandas()
        out["finish_reasons"] = ", ".join(f"{k} {v}" for k, v in tr["finish_reason"].value_counts().items())
        out["mean_turns"] = round(float(tr["num_turns"].mean()), 2)
        out["mean_generated_tokens"] = round(float(tr["num_generated_tokens"].mean()), 1)
    if store.stage_committed(run_id, step, "advantages"):
        adv = store.read_stage(run_id, step, "advantages", columns=["group_id", "group_std", "masked"]).to_pandas()
        out["groups_with_signal"] = int((adv.groupby("group_id")["group_std"].max() > 0).sum())
        out["masked"] = int(adv["masked"].sum())
    if store.stage_committed(run_id, step, "eval_summary"):
        e = store.read_stage(run_id, step, "eval_summary").to_pylist()[0]
        out[f"pass@{e['k']}"] = round(e["pass_at_k"], 4)
        out["pass@1"] = round(e["pass_at_1"], 4)
    return out


def solve_rates(run: Run, by: str = "repo_name", split: str = "validation") -> pd.DataFrame:
    """Share of graded samples with reward 1, per `by` (repo_name / bug_family) and step.
    split="validation" reads eval_samples, "train" the training rewards."""
    df = run.stage("eval_samples" if split == "validation" else "rewards")
    if not len(df):
        return pd.DataFrame()
    tasks = run.tasks()[["instance_id", by]] if by in run.tasks() else None
    if tasks is None:
        return pd.DataFrame()
    df = df[df["reward"].notna()].merge(tasks, on="instance_id", how="left")
    table = df.pivot_table(index=by, columns="step", values="reward", aggfunc="mean")
    table.columns = [f"step {c}" for c in table.columns]
    return table.round(3)


def finish_reasons(run: Run, stage: str = "trajectories") -> pd.DataFrame:
    df = run.stage(stage)
    if not len(df):
        return pd.DataFrame()
    return df.pivot_table(index="step", columns="finish_reason", values="rollout_id", aggfunc="count", fill_value=0)


def reward_hacks(run: Run, stage: str = "rewards") -> pd.DataFrame:
    """One row per rollout the grader flagged: harness changes removed, tampering (reward 0), or
    reward-hacking constructs in its patch (tasks/grading/hacks.py). Open one with
    pick_rollout(run, rollout_id)."""
    df = run.stage(stage)
    cols = ["rollout_id", "step", "instance_id", "reward", "signal", "details"]
    rows = []
    for r in df.to_dict("records") if len(df) else []:
        for signal in ("tampering", "harness_changes", "hack_signals"):
            found = r.get(signal)
            if found is not None and len(found):
                rows.append({**{c: r[c] for c in cols[:4]}, "signal": signal, "details": "; ".join(found)})
    return pd.DataFrame(rows, columns=cols)


# -- pictures (matplotlib) ----------------------------------------------------------------
def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg",) and "inline" not in matplotlib.get_backend():
        matplotlib.use("Agg")  # no display on servers and in flow runs
    import matplotlib.pyplot as plt

    return plt


def plot_curves(run: Run, target: float | None = None):
    """Left: mean training reward per step. Right: pass@k and pass@1 per evaluation (step 0 = base)."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    rc = reward_curve(run)
    a.plot(rc["step"], rc["mean_reward"], "o-")
    a.set(title="training reward (mean per step)", xlabel="step", ylabel="reward", ylim=(-0.05, 1.05))
    _integer_steps(a)
    ec = eval_curve(run)
    _pass_axes(b, ec, target if target is not None else run.config.get("eval", {}).get("target"))
    fig.tight_layout()
    return fig


def _pass_axes(ax, ec: pd.DataFrame, target: float | None):
    k = int(ec["k"].iloc[0]) if len(ec) else 4
    ax.plot(ec["step"], ec["pass_at_k"], "o-", label=f"pass@{k}")
    ax.plot(ec["step"], ec["pass_at_1"], "s--", label="pass@1", alpha=0.7)
    if target:
        ax.axhline(target, color="grey", ls=":", label=f"target {target}")
    ax.set(title="validation", xlabel="step (0 = base checkpoint)", ylabel="score", ylim=(-0.05, 1.05))
    ax.legend(loc="best", fontsize=8)
    _integer_steps(ax)


def _integer_steps(ax):
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def pass_at_k_png(run: Run, target: float | None = None) -> bytes:
    """The pass@k curve as PNG bytes (for the Prefect UI)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3))
    _pass_axes(ax, eval_curve(run), target)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def plot_distributions(run: Run, stage: str = "trajectories"):
    """Histograms of turns and generated tokens per rollout, and of finish reasons."""
    plt = _plt()
    df = run.stage(stage)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    if len(df):
        axes[0].hist(df["num_turns"], bins=range(1, int(df["num_turns"].max()) + 2), align="left", rwidth=0.8)
        axes[1].hist(df["num_generated_tokens"], bins=20)
        df["finish_reason"].value_counts().plot.bar(ax=axes[2], rot=20)
    axes[0].set(title=f"turns per rollout ({stage})", xlabel="turns")
    axes[1].set(title="generated tokens per rollout", xlabel="tokens")
    axes[2].set(title="finish reasons")
    fig.tight_layout()
    return fig


# -- one trajectory, readable -----------------------------------------------------------------
def find_rollout(run: Run, rollout_id: str | None = None, solved: bool | None = None) -> dict:
    """A trajectory row joined with its reward row; by id, or the first (solved / unsolved) one."""
    for stage, rstage in (("trajectories", "rewards"), ("eval_trajectories", "eval_rewards")):
        tr, rw = run.stage(stage), run.stage(rstage)
        if not len(tr):
            continue
        df = tr.merge(rw[["rollout_id", "reward", "grading_status", "test_statuses", "patch_applied"]],
                      on="rollout_id", how="left") if len(rw) else tr
        if rollout_id is not None:
            df = df[df["rollout_id"] == rollout_id]
        elif solved is not None and "reward" in df:
            df = df[(df["reward"] == 1.0) == solved]
        if len(df):
            return df.iloc[0].to_dict()
    raise KeyError(f"no rollout {rollout_id!r} in run {run.run_id}" if rollout_id
                   else f"no {'solved' if solved else 'unsolved'} rollout in run {run.run_id}")


def _present(v) -> bool:
    """Not None and not NaN (a left join in pandas turns a missing value into NaN)."""
    return v is not None and v == v and v != ""


def pick_rollout(run: Run, rollout_id: str | None = None) -> dict:
    """The given rollout, else a solved one (the interesting kind), else the first one."""
    if rollout_id:
        return find_rollout(run, rollout_id)
    try:
        return find_rollout(run, solved=True)
    except KeyError:
        return find_rollout(run)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more characters)"


def render_trajectory(row: dict, max_chars: int = 3000) -> str:
    """A rollout as Markdown: each message, tool calls with their arguments, observations, final patch, tests."""
    fence = "~~~~"  # tool output may contain ``` itself
    out = [f"### {row['rollout_id']}",
           f"step {row['step']} · policy v{row['policy_version']} · {row['split']} · {row['num_turns']} turns · "
           f"{row['num_generated_tokens']} generated tokens · finish **{row['finish_reason']}**"
           + (f" · error `{row['error']}`" if _present(row.get("error")) else "")]
    for i, m in enumerate(json.loads(row["messages"])):
        role = m.get("role", "?")
        out.append(f"\n**[{i}] {role}**")
        if m.get("content"):
            out.append(f"{fence}\n{_clip(str(m['content']), max_chars)}\n{fence}")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments", "")
            try:
                args = json.dumps(json.loads(args), indent=1) if isinstance(args, str) else json.dumps(args)
            except ValueError:
                pass
            out.append(f"tool call `{fn.get('name')}`\n{fence}json\n{_clip(args, max_chars)}\n{fence}")
    out.append("\n**final patch**")
    out.append(f"{fence}diff\n{_clip(row['final_patch'], max_chars)}\n{fence}" if row.get("final_patch")
               else "(empty)")
    if _present(row.get("grading_status")):
        out.append(f"\n**tests** ({row['grading_status']}, patch applied: {row.get('patch_applied')}, "
                   f"reward **{row.get('reward')}**)")
        try:
            statuses = json.loads(row.get("test_statuses") or "{}")
        except ValueError:
            statuses = {}
        out += [f"- `{name}`: {status}" for name, status in sorted(statuses.items())] or ["(no test ran)"]
    return "\n".join(out)


# -- the notebook, executed ---------------------------------------------------------------------
NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "inspect_run.ipynb"


def execute_notebook(run_id: str, store: str = "file://.rlvr/store", endpoint_url: str | None = None,
                     rollout_id: str | None = None, out: str | None = None, timeout: int = 600):
    """Run notebooks/inspect_run.ipynb top to bottom for one run (its `parameters` cell is replaced by
    these values) and save the executed copy; raises nbclient's CellExecutionError on any error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = (f"RUN_ID = {run_id!r}\nSTORE = {store!r}\nENDPOINT_URL = {endpoint_url!r}\n"
              f"ROLLOUT_ID = {rollout_id!r}\n")
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            cell.source = params
            break
    root = NOTEBOOK.parents[1]
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    out = pathlib.Path(out or root / ".rlvr" / "notebooks" / f"inspect_run-{run_id}.ipynb")
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Execute notebooks/inspect_run.ipynb for one run; prints where the "
                                             "executed notebook is.")
    ap.add_argument("run_id")
    ap.add_argument("--store", default="file://.rlvr/store")
    ap.add_argument("--endpoint-url")
    ap.add_argument("--rollout-id")
    ap.add_argument("--out")
    a = ap.parse_args()
    print(execute_notebook(a.run_id, a.store, a.endpoint_url, a.rollout_id, a.out))
