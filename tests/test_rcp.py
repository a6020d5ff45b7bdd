"""MLPerf scoring over runs and the RCP check (tasks.rcp) against mlperf_logging's own summarizer and checker."""

import json
import time

import numpy as np
import pytest
from mlperf_logging.mllog import constants as C
from mlperf_logging.rcp_checker.rcp_checker import RCP_Checker
from mlperf_logging.result_summarizer.result_summarizer import _compute_strong_score_standalone

from schemas.presets import load_config
from tasks.mlperf import BENCHMARK, RunLog, hyperparameters
from tasks.rcp import mini_rcp, official_rcp_path, rcp_check, mlperf_score


@pytest.fixture(scope="module")
def cfg():
    return load_config("mini")  # global batch size 128 (16 prompts x 8 generations), lr 5e-5


def write_log(path, cfg, passed_samples, minutes=10.0, accuracy=0.75):
    """An open-division log of a run that evaluates every step and reaches `accuracy` at `passed_samples`
    (success when above the 0.69 target), `minutes` from run_start to run_stop."""
    gbs = cfg.grpo.global_batch_size
    log = RunLog(str(path))
    log.header(cfg)
    log.end(C.INIT_STOP)
    t0 = int(time.time() * 1000)
    log.start(C.RUN_START, time_ms=t0)
    for n in range(gbs, passed_samples + 1, gbs):
        log.start(C.BLOCK_START, metadata={"samples_count": n - gbs, "first_epoch_num": n // gbs - 1, "epoch_count": 1})
        log.end(C.BLOCK_STOP, metadata={"samples_count": n, "first_epoch_num": n // gbs - 1})
        log.start(C.EVAL_START, metadata={"samples_count": n})
        log.event(C.EVAL_ACCURACY, accuracy if n == passed_samples else 0.3, metadata={"samples_count": n})
        log.end(C.EVAL_STOP, metadata={"samples_count": n})
    status = "success" if accuracy > 0.69 else "aborted"
    log.end(C.RUN_STOP, metadata={"status": status, "samples_count": passed_samples}, time_ms=t0 + int(minutes * 60_000))
    log.close()
    return str(path)


# ----------------------------------------------------------------------------- score


def test_three_runs_score_the_middle_one():
    s = mlperf_score([12.0, 10.0, 15.0])
    assert s["required"] == 3 and s["score"] == 12.0 and s["valid"]
    assert s["used"] == [0]
    assert {(d["index"], d["why"]) for d in s["dropped"]} == {(1, "fastest"), (2, "slowest")}


def test_five_runs_average_the_middle_three():
    s = mlperf_score([10.0, 14.0, 11.0, 20.0, 12.0])
    assert s["score"] == pytest.approx((11 + 12 + 14) / 3)
    assert not s["valid"]  # the package checker wants exactly 3 result files
    assert sorted(s["used"]) == [1, 2, 4]
    assert {(d["index"], d["why"]) for d in s["dropped"]} == {(0, "fastest"), (3, "slowest")}


def test_a_failed_run_is_the_dropped_slowest_and_two_leave_no_score():
    s = mlperf_score([12.0, None, 10.0])
    assert s["score"] == 12.0 and s["used"] == [0]  # only the fastest dropped besides the failed run
    assert {(d["index"], d["why"]) for d in s["dropped"]} == {(2, "fastest"),
                                                              (1, "did not converge or failed compliance")}
    s = mlperf_score([12.0, None, float("inf")])
    assert s["score"] is None and not s["valid"] and "at most 1" in s["rule"]


def test_fewer_runs_than_required_give_no_score_only_the_plain_mean():
    s = mlperf_score([10.0, 12.0])
    assert s["score"] is None and not s["valid"] and s["required"] == 3 and s["runs"] == 2
    assert s["mean"] == 11.0 and "3 required" in s["rule"]


def test_score_is_the_summarizers_on_real_logs(tmp_path, cfg):
    # The summarizer reads result_*.txt, drops a log that fails the compliance checker (here: no eval
    # above the target), and scores the rest: the same number as mlperf_score with that run as None.
    minutes = [11.0, 9.5, 14.0, 10.25]
    for i, m in enumerate(minutes):
        write_log(tmp_path / f"result_{i}.txt", cfg, 512, minutes=m)
    write_log(tmp_path / "result_4.txt", cfg, 512, minutes=3.0, accuracy=0.5)
    _, _, score, _, _ = _compute_strong_score_standalone(BENCHMARK, "cpu", False, str(tmp_path), "training",
                                                         "6.1.0", return_full_scores=True)
    ours = mlperf_score(minutes + [None])
    assert ours["score"] == pytest.approx(score) == pytest.approx((10.25 + 11.0 + 14.0) / 3)


# ----------------------------------------------------------------------------- RCPs


def test_mini_rcp_round_trips_through_the_checkers_reader(tmp_path, cfg):
    samples = [512, 640, 640, 768, 768, 1024]
    logs = [write_log(tmp_path / f"run{i}.log", cfg, n) for i, n in enumerate(samples)]
    logs.append(write_log(tmp_path / "miss.log", cfg, 1280, accuracy=0.5))  # not converged: not in the RCP
    rcp = mini_rcp([{"log": p, "global_batch_size": 128} for p in logs])
    (name, entry), = rcp.items()
    official = next(iter(json.load(open(official_rcp_path())).values()))
    assert set(entry) == set(official) and set(entry["Hyperparams"]) == set(official["Hyperparams"])
    hp = hyperparameters(cfg)
    assert entry["BS"] == 128 and entry["Epochs to converge"] == samples
    assert entry["Hyperparams"] == {k: hp[k] for k in official["Hyperparams"]}
    path = tmp_path / "rcps.json"
    path.write_text(json.dumps(rcp))
    with open(path) as f:
        checker = RCP_Checker("training", "6.1.0", BENCHMARK, False, rcp_file=f)
    rec = checker.rcp_data[name]
    assert rec["BS"] == 128
    assert rec["RCP Mean"] == pytest.approx(np.mean([640, 640, 768, 768]))  # olympic: lowest and highest dropped
    assert rec["RCP Stdev"] == pytest.approx(np.std(samples))
    assert rec["Min Epochs"] < rec["RCP Mean"]  # a spread lets a submission converge somewhat faster
    with pytest.raises(ValueError):
        mini_rcp([{"log": logs[0], "global_batch_size": 256}])
    # a log's text works as well as its path
    assert mini_rcp([{"log": open(p).read()} for p in logs]) == rcp


def test_rcp_check_passes_our_runs_against_their_own_rcp_and_fails_a_much_slower_one(tmp_path, cfg):
    # 6 runs: a reference RCP has twice the 3 runs submitted (with 4 or 5 the checker's t-test allows any speed-up)
    samples = [512, 640, 640, 768, 768, 1024]
    logs = [write_log(tmp_path / f"run{i}.log", cfg, n) for i, n in enumerate(samples)]
    rcp = mini_rcp([{"log": p} for p in logs])
    ok, text = rcp_check(logs, rcp)
    assert ok is True, text
    assert "RCP found, RCP test PASSED" in text and "Submission mean epochs: 704.0000" in text

    (name, entry), = rcp.items()
    # The checker bounds how fast runs may converge: against an RCP at 4x their samples they fail ...
    slow = {name: {**entry, "Epochs to converge": [4 * n for n in samples]}}
    ok, text = rcp_check(logs, slow)
    assert ok is False and "RCP found, RCP test FAILED" in text
    # ... and runs converging at 4x an RCP's samples pass: converging slower is allowed.
    fast = {name: {**entry, "Epochs to converge": [n // 4 for n in samples]}}
    ok, text = rcp_check(logs, fast)
    assert ok is True, text


def test_rcp_check_against_the_official_file_finds_no_rcp_at_batch_size_128(tmp_path, cfg):
    logs = [write_log(tmp_path / f"run{i}.log", cfg, n) for i, n in enumerate([512, 640, 768])]
    ok, text = rcp_check(logs, None)
    # Below the smallest reference batch size (256) the checker compares with that RCP (4608 samples).
    assert ok is False and "Missing RCP, please submit RCP with BS = 128" in text
    assert "'BS': 256" in text and "Submission mean epochs: 640.0000" in text
    # Converging later than the BS-256 reference passes as "slower convergence on smaller batch size".
    late = [write_log(tmp_path / f"late{i}.log", cfg, 128 * s) for i, s in enumerate([37, 38, 40])]
    ok, text = rcp_check(late, official_rcp_path())
    assert ok is True and "RCP not found but slower convergence on smaller batch size" in text


def test_rcp_check_says_when_the_checker_cannot_run(tmp_path):
    bare = tmp_path / "bare.log"
    bare.write_text("no MLPerf lines\n")
    ok, text = rcp_check([str(bare)] * 3, None)
    assert ok is None and "raised" in text
