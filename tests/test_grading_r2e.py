"""R2E-Gym reward semantics, quirk by quirk (tasks/grading/r2e.py), and the patch filter.
Pure functions: no sandbox needed."""

import json

import pytest

from tasks.grading import clean_test_output, harness_reason, parse_log_pytest, patch_paths, r2e_reward

SUMMARY = "=========================== short test summary info ============================\n"


TAIL = "========================= 1 failed, 2 passed in 0.05s =========================="


def log(*lines: str, tail: str = TAIL) -> str:
    head = ("============================= test session starts ==============================\n"
            "collected 3 items\n\nr2e_tests/test_1.py .F.\n\n")
    return head + SUMMARY + "\n".join(lines) + "\n" + tail + "\n"


# -- parse_log_pytest -------------------------------------------------------------------------
def test_key_is_node_id_after_the_file_joined_by_dots():
    out = parse_log_pytest(log("PASSED r2e_tests/test_1.py::TestUrlDispatcher::test_add_invalid_path",
                               "FAILED r2e_tests/test_1.py::test_b - assert 1 == 2",
                               "ERROR r2e_tests/test_1.py::test_c - RuntimeError: boom"))
    assert out == {"TestUrlDispatcher.test_add_invalid_path": "PASSED", "test_b": "FAILED", "test_c": "ERROR"}


def test_no_summary_means_nothing_parsed():
    assert parse_log_pytest("PASSED r2e_tests/test_1.py::test_a\n") == {}
    assert parse_log_pytest(None) == {}
    assert parse_log_pytest("") == {}


def test_quirk_passed_is_a_substring_test_checked_first():
    # A FAILED line whose message mentions PASSED counts as PASSED, key uncut by the parser...
    out = parse_log_pytest(log("FAILED r2e_tests/test_1.py::test_x - AssertionError: expected PASSED"))
    assert out == {"test_x - AssertionError: expected PASSED": "PASSED"}
    # ...and the reward cuts it at " - " again, so it matches an expected PASSED.
    assert r2e_reward(out, {"test_x": "PASSED"}) == 1.0
    # A test whose *name* contains ERROR or PASSED is classified by that too.
    assert parse_log_pytest(log("FAILED r2e_tests/test_1.py::test_ERROR_path - x")) == {"test_ERROR_path": "FAILED"}
    assert parse_log_pytest(log("ERROR r2e_tests/test_1.py::test_PASSED_flag - x")) == {
        "test_PASSED_flag - x": "PASSED"}


def test_quirk_failed_and_error_keys_cut_at_first_dash_separator_passed_keys_not():
    out = parse_log_pytest(log("PASSED r2e_tests/test_1.py::test_p[a - b]",
                               "FAILED r2e_tests/test_1.py::test_f[a - b] - msg - more"))
    assert out == {"test_p[a - b]": "PASSED", "test_f[a": "FAILED"}


def test_quirk_only_text_between_first_and_second_marker_is_read():
    text = log("PASSED r2e_tests/test_1.py::test_a",
               "some output mentioning short test summary info again",
               "PASSED r2e_tests/test_1.py::test_b")
    assert parse_log_pytest(text) == {"test_a": "PASSED"}


def test_quirk_line_without_node_id_gets_empty_key():
    out = parse_log_pytest(log("ERROR r2e_tests/test_1.py - ModuleNotFoundError: No module named 'x'",
                               "!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!"))
    assert out == {"": "ERROR"}


def test_quirk_colons_inside_parametrize_ids_become_dots():
    out = parse_log_pytest(log("PASSED r2e_tests/test_1.py::TestA::test_url[http::x]"))
    assert out == {"TestA.test_url[http.x]": "PASSED"}


def test_other_statuses_and_lowercase_summary_are_ignored_later_lines_win():
    out = parse_log_pytest(log("SKIPPED [1] r2e_tests/test_1.py:10: no network",
                               "XFAIL r2e_tests/test_1.py::test_x - reason",
                               "XPASS r2e_tests/test_1.py::test_y",
                               "FAILED r2e_tests/test_1.py::test_z - first",
                               "PASSED r2e_tests/other.py::test_z"))
    assert out == {"test_z": "PASSED"}


def test_quirk_file_path_is_dropped_so_same_name_in_two_files_collides():
    out = parse_log_pytest(log("PASSED r2e_tests/test_1.py::test_a", "FAILED r2e_tests/test_2.py::test_a - x"))
    assert out == {"test_a": "FAILED"}


# -- clean_test_output ------------------------------------------------------------------------
def test_output_loses_colour_codes_and_carriage_returns():
    raw = "\x1b[1;31mFAILED\x1b[0m r2e_tests/test_1.py::test_a - x\r\n"
    assert clean_test_output(raw, False, 300) == "FAILED r2e_tests/test_1.py::test_a - x\n"


def test_timed_out_run_becomes_a_fixed_message_that_parses_to_nothing():
    text = clean_test_output(log("PASSED r2e_tests/test_1.py::test_a"), True, 300)
    assert text == "The command took too long to execute (>300s)"
    assert parse_log_pytest(text) == {}


# -- r2e_reward -------------------------------------------------------------------------------
def test_reward_needs_same_key_count_and_every_status_equal():
    exp = {"test_a": "PASSED", "test_b": "FAILED"}
    assert r2e_reward({"test_a": "PASSED", "test_b": "FAILED"}, exp) == 1.0
    assert r2e_reward({"test_a": "PASSED", "test_b": "PASSED"}, exp) == 0.0  # a status differs
    assert r2e_reward({"test_a": "PASSED"}, exp) == 0.0  # one missing
    assert r2e_reward({"test_a": "PASSED", "test_b": "FAILED", "test_c": "PASSED"}, exp) == 0.0  # one extra
    assert r2e_reward({"test_a": "PASSED", "test_b": "FAILED"}, json.dumps(exp)) == 1.0  # JSON text accepted


def test_exit_code_plays_no_part_expected_failures_must_fail():
    # The gold state may fail some tests; the rollout must reproduce exactly that.
    assert r2e_reward({"test_a": "PASSED", "test_b": "FAILED"}, {"test_a": "PASSED", "test_b": "FAILED"}) == 1.0
    assert r2e_reward({"test_a": "PASSED", "test_b": "PASSED"}, {"test_a": "PASSED", "test_b": "FAILED"}) == 0.0


def test_deviation_unknown_key_with_same_count_is_zero_not_keyerror():
    assert r2e_reward({"test_a": "PASSED", "test_x": "PASSED"}, {"test_a": "PASSED", "test_b": "PASSED"}) == 0.0


def test_quirk_empty_against_empty_is_one():
    assert r2e_reward({}, {}) == 1.0
    assert r2e_reward({}, "{}") == 1.0


def test_quirk_colour_codes_stripped_from_keys_only_in_digit_form():
    assert r2e_reward({"\x1b[31mtest_a\x1b[0m": "PASSED"}, {"test_a": "PASSED"}) == 1.0
    assert r2e_reward({"\x1b[1;31mtest_a": "PASSED"}, {"test_a": "PASSED"}) == 0.0


def test_quirk_keys_cut_at_dash_separator_on_both_sides_last_sorted_wins():
    # Expected keys with messages (as upstream PASSED keys can have) are cut too.
    assert r2e_reward({"test_a": "PASSED"}, {"test_a - AssertionError: PASSED": "PASSED"}) == 1.0
    # Two keys collapsing to one: the one sorting last decides, and the count shrinks.
    parsed = {"test_a - 1": "FAILED", "test_a - 2": "PASSED"}
    assert r2e_reward(parsed, {"test_a": "PASSED"}) == 1.0
    assert r2e_reward(parsed, {"test_a": "FAILED"}) == 0.0


def test_end_to_end_real_pytest_summary():
    text = """============================= test session starts ==============================
platform linux -- Python 3.11.2, pytest-7.2.1, pluggy-1.0.0+repack
rootdir: /testbed
collected 4 items

r2e_tests/test_1.py .F..                                                 [100%]

=================================== FAILURES ===================================
_______________________________ TestAdd.test_add _______________________________
E       assert -1 == 5
r2e_tests/test_1.py:8: AssertionError
==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED r2e_tests/test_1.py::TestAdd::test_add_negative
PASSED r2e_tests/test_1.py::test_mean
PASSED r2e_tests/test_1.py::test_mean_empty
FAILED r2e_tests/test_1.py::TestAdd::test_add - assert -1 == 5
========================= 1 failed, 3 passed in 0.04s ==========================
"""
    parsed = parse_log_pytest(clean_test_output(text, False, 300))
    assert parsed == {"TestAdd.test_add_negative": "PASSED", "test_mean": "PASSED", "test_mean_empty": "PASSED",
                      "TestAdd.test_add": "FAILED"}
    gold = {"TestAdd.test_add": "PASSED", "TestAdd.test_add_negative": "PASSED", "test_mean": "PASSED",
            "test_mean_empty": "PASSED"}
    assert r2e_reward(parsed, gold) == 0.0


# -- what a patch may not change ---------------------------------------------------------------
def _section(path: str, body: str = "@@ -1 +1 @@\n-a\n+b\n") -> str:
    return f"diff --git a/{path} b/{path}\nindex 1..2 100644\n--- a/{path}\n+++ b/{path}\n{body}"


def test_patch_paths_are_gits_parse_not_the_header_text():
    quoted = ('diff --git "a/.\\166env/bin/python" "b/.\\166env/bin/python"\nnew file mode 100755\n'
              '--- /dev/null\n+++ "b/.\\166env/bin/python"\n@@ -0,0 +1 @@\n+echo PASSED\n')
    rename = "diff --git a/pkg/x.py b/r2e_tests/x.py\nsimilarity index 100%\nrename from pkg/x.py\nrename to r2e_tests/x.py\n"
    plain = "--- a/run_tests.sh\n+++ b/run_tests.sh\n@@ -1 +1 @@\n-a\n+b\n"
    assert patch_paths(_section("pkg/mod.py") + quoted + rename) == ["pkg/mod.py", ".venv/bin/python", "r2e_tests/x.py"]
    assert patch_paths(plain) == ["run_tests.sh"]
    for bad in ("this is not a diff\n", "diff --git a/x b/x\n"):
        with pytest.raises(Exception, match="No valid patches"):
            patch_paths(bad)


@pytest.mark.parametrize("path, added, why", [
    ("pkg/mod.py", False, None), ("tests/r2e_tests_like.py", False, None), ("sub/run_tests.sh", False, None),
    ("r2e_tests/test_1.py", False, "environment"), ("run_tests.sh", False, "environment"),
    (".venv/bin/python", False, "environment"), (".git/config", False, "environment"),
    ("conftest.py", False, "pytest loads"), ("pkg/tests/conftest.py", False, "pytest loads"),
    ("pytest.ini", False, "pytest loads"), ("tox.ini", False, "pytest loads"),
    ("sitecustomize.py", False, "start-up"), ("pkg/usercustomize.py", False, "start-up"),
    ("x.pth", False, "start-up"), ("pkg/__pycache__/m.cpython-311.pyc", False, "bytecode"),
    ("pytest.py", True, "shadows the module pytest"), ("json/", True, "shadows the module json"),
    ("src/random.py", True, "shadows the module random"), ("_pytest/__init__.py", True, "shadows"),
    ("pkg/json.py", True, None), ("json.py", False, None), ("setup.cfg", True, None),
])
def test_harness_paths(path, added, why):
    got = harness_reason(path, added=added)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_pytest_section_compares_content_not_text():
    from tasks.grading.grader import _pytest_section

    a = "[metadata]\nname = x\n[tool:pytest]\naddopts = -q\n"
    b = "[metadata]\nname = y\n\n[tool:pytest]\naddopts   = -q\n"
    assert _pytest_section(a, "ini", ("tool:pytest",)) == _pytest_section(b, "ini", ("tool:pytest",))
    assert _pytest_section(a, "ini", ("tool:pytest",)) != _pytest_section(a.replace("-q", "-p no:x"), "ini",
                                                                        ("tool:pytest",))
    t = '[project]\nname = "x"\n[tool.pytest.ini_options]\naddopts = "-q"\n'
    assert _pytest_section(t, "toml", ("tool", "pytest")) == {"ini_options": {"addopts": "-q"}}
    assert _pytest_section('[project]\nname = "y"\n', "toml", ("tool", "pytest")) is None
    assert str(_pytest_section("[broken", "toml", ("tool", "pytest"))).startswith("unparseable")
