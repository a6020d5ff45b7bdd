"""A long stage's progress line says how much is left only once there is evidence for it."""
from flows.runtime import Progress


def test_time_left_waits_for_a_tenth_of_the_items(capsys):
    progress = Progress("evaluation", 100, unit="tasks", every_s=0.0)
    for _ in range(9):
        progress()
    early = capsys.readouterr().out.strip().splitlines()
    assert len(early) == 9 and all("estimating the time left" in line and "about" not in line for line in early)
    progress()
    line = capsys.readouterr().out.strip()
    assert "evaluation: 10/100 tasks" in line and "left" in line and "estimating" not in line
    for _ in range(90):
        progress()
    assert "left" not in capsys.readouterr().out.strip().splitlines()[-1]  # done: nothing left to estimate


def test_time_left_counts_the_rate_after_the_first_items_finish(capsys):
    # 100 items, 10 in flight, 10 s each: the first ends at 10 s, then one a second. At 10 done (19 s)
    # 90 s are left; the average since the start (1.9 s an item) would say 171 s.
    now = [0.0]
    progress = Progress("evaluation", 100, unit="tasks", every_s=0.0, clock=lambda: now[0])
    for i in range(10):
        now[0] = 10.0 + i
        progress()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "10/100 tasks" in line and "about 1.5 min left" in line, line  # 90 s


def test_a_resumed_stage_counts_what_an_earlier_attempt_finished(capsys):
    # 60 of 100 done before a stop: the resumed attempt's lines count from 60, and its rate is its own
    # (one a second from its first item), not 61 items over this attempt's seconds.
    now = [0.0]
    progress = Progress("step 1 trajectories", 100, unit="episodes", every_s=0.0, clock=lambda: now[0])
    progress.resumed(60)
    for i in range(11):
        now[0] = 5.0 + i
        progress()
    lines = capsys.readouterr().out.strip().splitlines()
    assert "61/100 episodes" in lines[0] and "estimating the time left" in lines[0]
    assert "71/100 episodes" in lines[-1] and "about 29 s left" in lines[-1], lines[-1]
