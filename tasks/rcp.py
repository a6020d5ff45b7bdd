"""MLPerf scoring over several runs, and the RCP (reference convergence point) check, with mlperf_logging's own code.

`mlperf_score` combines runs' times to train as the results summarizer does; `mini_rcp` makes an RCP
entry from our own runs' logs in the checker's JSON format; `rcp_check` runs the official RCP checker
on a set of logs against an RCP file (ours or the benchmark's official one).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import tempfile
import warnings

from tasks.mlperf import BENCHMARK

USAGE = "training"
RULESET = "6.1.0"
# The keys of the reference entries' "Hyperparams" (rcp_checker/training_6.1.0/rcps_qwen35_397b_grpo.json);
# tasks.mlperf.hyperparameters logs all five. The checker matches RCPs on BS alone, never on these.
RCP_HYPERPARAMS = ("opt_base_learning_rate", "opt_gradient_clip_norm", "num_prompts_per_step",
                   "num_generations_per_prompt", "gradient_accumulation_steps")


def mlperf_score(minutes: list[float | None], benchmark: str = BENCHMARK) -> dict:
    """The benchmark's score from its runs' minutes to train; None (or inf/nan) marks a run that does
    not count (did not converge: no run_stop, or a log that fails the compliance checker).

    The rule is mlperf_logging/result_summarizer/result_summarizer.py, `_compute_strong_score_standalone`
    with `_compute_olympic_average`: sort the counted runs, drop the fastest and the slowest (4 of each
    for unet3d) and average the rest; a failed run counts as one of the dropped slowest, and more failed
    runs than that gives no score. The runs required come from benchmark_meta.get_result_file_counts;
    with fewer, result_summarizer/compute_score/__main__.py says "Olympic scoring skipped" and reports a
    plain mean (`mean` here, over the counted runs: compute_score divides by every result file), and
    this gives no score. `valid`: a submission has exactly that many result files
    (package_checker/package_checker.py, strong scaling); more are scored by the summarizer all the same.
    """
    from mlperf_logging.benchmark_meta import get_result_file_counts
    from mlperf_logging.result_summarizer.result_summarizer import _compute_olympic_average

    required = get_result_file_counts(USAGE)[benchmark]
    max_dropped = 4 if benchmark == "unet3d" else 1
    ok = [i for i, m in enumerate(minutes) if m is not None and math.isfinite(m)]
    failed = [i for i in range(len(minutes)) if i not in ok]
    order = sorted(ok, key=lambda i: minutes[i])
    out = {"benchmark": benchmark, "required": required, "runs": len(minutes), "counted": len(ok),
           "mean": sum(minutes[i] for i in ok) / len(ok) if ok else None, "score": None, "valid": False,
           "used": [], "dropped": [{"index": i, "minutes": minutes[i], "why": "did not converge or failed compliance"}
                                    for i in failed]}
    if len(failed) > max_dropped:
        out["rule"] = (f"no score: {len(failed)} runs do not count (not converged or failing compliance), "
                       f"at most {max_dropped} may (summarizer: CRITICAL ERROR)")
        return out
    if len(minutes) < required:
        out["rule"] = (f"no score: {len(minutes)} runs, {required} required (compute_score: Olympic scoring "
                       "skipped, plain mean)")
        return out
    keep = order[max_dropped:len(order) - (max_dropped - len(failed))]
    out["dropped"] = ([{"index": i, "minutes": minutes[i], "why": "fastest"} for i in order[:max_dropped]]
                      + [{"index": i, "minutes": minutes[i], "why": "slowest"} for i in order[max_dropped + len(keep):]]
                      + out["dropped"])
    out["used"] = keep
    # The summarizer's own function (it sorts its argument in place: give it a copy).
    out["score"] = _compute_olympic_average([minutes[i] for i in ok], len(failed), max_dropped)
    out["valid"] = out["score"] is not None and len(minutes) == required
    out["rule"] = (f"olympic mean: {len(minutes)} runs, the fastest {max_dropped} and slowest {max_dropped} dropped "
                   f"(a run that did not converge counts as a slowest), mean of the other {len(keep)}"
                   + (f"; a submission has exactly {required}" if len(minutes) > required else ""))
    return out


def _as_file(log: str, tmp: str, name: str) -> str:
    """A log given as a path stays a path; a log's text is written to a file (the checker reads files)."""
    if ":::MLLOG" not in log:
        return log
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(log)
    return path


def read_run(log: str) -> dict:
    """What the RCP checker reads from one log (path or text): converged, epochs to converge (for this
    benchmark the samples_count of the last eval_accuracy before a successful run_stop), global batch
    size, benchmark; and the keys an RCP entry records (hyperparameters, org, platform, precision)."""
    from mlperf_logging.rcp_checker.rcp_checker import read_submission_file

    with tempfile.TemporaryDirectory() as tmp:
        path = _as_file(log, tmp, "log.txt")
        not_converged, epochs, bs, benchmark = read_submission_file(path, RULESET, False)
        with open(path, encoding="latin-1") as f:
            values = {}
            for line in f:
                if ":::MLLOG " in line:
                    rec = json.loads(line.split(":::MLLOG ", 1)[1])
                    values.setdefault(rec["key"], rec.get("value"))
                    if rec["key"] == "run_stop":
                        values["run_stop_samples"] = rec.get("metadata", {}).get("samples_count")
    return {"converged": not not_converged, "epochs": None if not_converged else epochs, "bs": bs,
            "benchmark": benchmark, "hyperparams": {k: values.get(k) for k in RCP_HYPERPARAMS},
            "org": values.get("submission_org"), "platform": values.get("submission_platform"),
            "precision": values.get("lowest_numerical_precision_in_linear"),
            "run_stop_samples": values.get("run_stop_samples")}


def mini_rcp(runs: list[dict]) -> dict:
    """An RCP file's content ({record name: entry}, the keys of the reference entries) built from our
    runs, each {"log": path or text} (optionally "global_batch_size" to check the log's against).

    Only converged runs give an entry of "Epochs to converge", as in the reference files. Our logs
    write every key the entries use, but no number_of_nodes/accelerators_per_node: Platform is the
    logged submission_platform text. References have 2x the submission's runs (rcp_checker.py) and
    the checker drops the lowest and highest of them: fewer than 3 converged runs leave no mean.
    """
    read = [read_run(r["log"]) for r in runs]
    for r, got in zip(runs, read):
        if r.get("global_batch_size") is not None and r["global_batch_size"] != got["bs"]:
            raise ValueError(f"global batch size {r['global_batch_size']} given, the log has {got['bs']}")
    first = read[0]
    for key in ("bs", "benchmark", "hyperparams"):
        if any(r[key] != first[key] for r in read):
            raise ValueError(f"runs differ in {key}: an RCP entry is one configuration")
    epochs = [r["epochs"] for r in read if r["converged"]]
    if not epochs:
        raise ValueError("no run converged: an RCP lists converged runs only")
    precision = {"bfloat16": "BF16", "fp32": "FP32", "fp16": "FP16"}.get(first["precision"], first["precision"])
    entry = {"Benchmark": first["benchmark"], "Creator": first["org"],
             "When": f"mini RCP from {len(epochs)} of our own runs, not a reference",
             "Platform": first["platform"], "Precision": precision, "BS": first["bs"],
             "Hyperparams": first["hyperparams"], "Epochs to converge": sorted(epochs)}
    return {f"{first['benchmark']}_mini_{first['bs']}": entry}


def official_rcp_path(benchmark: str = BENCHMARK, ruleset: str = RULESET) -> str:
    """The benchmark's reference RCP file in the installed mlperf_logging (what the checker reads by default)."""
    from mlperf_logging.rcp_checker import rcp_checker

    return os.path.join(os.path.dirname(rcp_checker.__file__), f"{USAGE}_{ruleset}", f"rcps_{benchmark}.json")


def rcp_check(log_paths: list[str], rcp_json: dict | str | None = None, ruleset: str = RULESET,
              rcp_pass: str = "pruned_rcps") -> tuple[bool | None, str]:
    """Run the official RCP checker (rcp_checker.check_directory, in this process) on our logs laid out
    as a submission's result_0.txt, result_1.txt, ...; against `rcp_json` (an RCP file's content or
    path; None: the official file). Returns (passed, the checker's output); passed is None when the
    checker could not run (an error, which the text gives)."""
    from mlperf_logging.rcp_checker import rcp_checker

    root = logging.getLogger()
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s - %(message)s"))  # as rcp_checker.main formats
    level = root.level
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = os.path.join(tmp, "results")
        os.makedirs(results)
        for i, p in enumerate(log_paths):
            shutil.copyfile(p, os.path.join(results, f"result_{i}.txt"))
        if isinstance(rcp_json, dict):
            rcp_path = os.path.join(tmp, "rcps.json")
            with open(rcp_path, "w") as f:
                json.dump(rcp_json, f, indent=2)
        else:
            rcp_path = rcp_json
        # The checker logs with the root logger (logging.info): catch that, then put the root back as it was.
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        rcp_file = open(rcp_path) if rcp_path else None
        try:
            # pruned_rcps: what rcp_checker.main and the package checker use (check_directory's default is invalid)
            passed, msg, _ = rcp_checker.check_directory(results, USAGE, ruleset, False, False, rcp_file=rcp_file,
                                                         rcp_pass=rcp_pass)
            root.info("%s, RCP test %s", msg, "PASSED" if passed else "FAILED")
        except Exception as e:  # e.g. no benchmark name in the logs: KeyError None
            passed = None
            root.error("the RCP checker raised %s: %s", type(e).__name__, e)
        finally:
            if rcp_file:
                rcp_file.close()
            root.removeHandler(handler)
            root.setLevel(level)
    text = buf.getvalue() + "".join(f"WARNING - {w.category.__name__}: {w.message}\n" for w in caught)
    return (None if passed is None else bool(passed)), text
