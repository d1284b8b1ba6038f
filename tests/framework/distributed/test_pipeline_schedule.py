"""Pipeline schedules: the 1F1B golden order, memory (in-flight micro-batches), and properties of
every schedule checked by an independent replay written here (each job once, F before B before W,
messages between stages respected, no deadlock)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.framework.distributed.pipeline_schedule import (
    SCHEDULES,
    Job,
    Schedule,
    ScheduleError,
    make_schedule,
    simulate,
)

GOLDEN = Path(__file__).parent / "golden"


def test_1f1b_of_4_stages_and_8_micro_batches_is_the_textbook_order():
    """golden/1f1b_4x8.txt is written by hand from Narayanan et al. 2021, figure 4 (PipeDream-flush):
    rank r runs 4 - r - 1 forwards, then alternates one forward and one backward, then drains."""
    s = make_schedule("1f1b", 4, 8)
    assert str(s) + "\n" == (GOLDEN / "1f1b_4x8.txt").read_text()
    assert s.peak_in_flight() == 4  # the stage count, not the 8 micro-batches
    assert [s.in_flight(r) for r in range(4)] == [4, 3, 2, 1]
    assert make_schedule("fthenb", 4, 8).peak_in_flight() == 8  # GPipe keeps every micro-batch


def needs(j: Job, stages: int) -> list[Job]:
    """What a job needs, from the definition: a forward the previous stage's forward, a backward
    its own forward and the next stage's backward, a weight gradient its own backward."""
    if j.kind == "F":
        return [Job("F", j.stage - 1, j.micro)] if j.stage else []
    if j.kind == "B":
        return [Job("F", j.stage, j.micro)] + (
            [Job("B", j.stage + 1, j.micro)] if j.stage < stages - 1 else []
        )
    return [Job("B", j.stage, j.micro)]


def replay(s: Schedule) -> list[Job]:
    """Run the per-rank lists with blocking receives (an independent reference): a rank's next job
    starts once every job it needs has run, on any rank. Returns a global order, or fails."""
    pos = [0] * s.pp
    done: list[Job] = []
    seen: set[Job] = set()
    while any(p < len(js) for p, js in zip(pos, s.jobs)):
        moved = False
        for r, js in enumerate(s.jobs):
            while pos[r] < len(js) and all(d in seen for d in needs(js[pos[r]], s.stages)):
                seen.add(js[pos[r]])
                done.append(js[pos[r]])
                pos[r] += 1
                moved = True
        assert moved, f"deadlock at {[js[p] for p, js in zip(pos, s.jobs) if p < len(js)]}"
    return done


def configs():
    return st.tuples(
        st.sampled_from(sorted(SCHEDULES)),
        st.integers(1, 5),  # pp
        st.integers(1, 12),  # micro-batches
        st.integers(1, 3),  # virtual stages
    )


@settings(max_examples=150, deadline=None)
@given(configs())
def test_every_schedule_runs_each_job_once_in_dependency_order(cfg):
    name, pp, m, v = cfg
    if name == "interleaved":
        v, m = max(v, 2), m * pp  # its preconditions (the errors are tested below)
    elif v > 1:
        with pytest.raises(ScheduleError, match="needs the interleaved schedule"):
            make_schedule(name, pp, m, v)
        v = 1
    s = make_schedule(name, pp, m, v)
    kinds = "FBW" if name == "zero_bubble" else "FB"
    jobs = [j for js in s.jobs for j in js]
    want = {Job(k, st_, i) for k in kinds for st_ in range(pp * v) for i in range(m)}
    assert len(jobs) == len(set(jobs)) == len(want) and set(jobs) == want
    for r, js in enumerate(s.jobs):
        assert all(j.stage % pp == r for j in js)
        at = {j: i for i, j in enumerate(js)}
        for j in js:
            if j.kind in "BW":
                assert at[Job("F", j.stage, j.micro)] < at[j]
            if j.kind == "W":
                assert at[Job("B", j.stage, j.micro)] < at[j]
    order = replay(s)
    assert len(order) == len(jobs)
    # the clock agrees: no job starts before what it needs has ended
    tl = simulate(s, hop=0.25)
    for j in jobs:
        for d in needs(j, s.stages):
            hop = 0.25 if d.stage % pp != j.stage % pp else 0.0
            assert tl.times[j][0] >= tl.times[d][1] + hop - 1e-9
    # memory: 1F1B and zero bubble hold at most pp micro-batches, FThenB all of them
    if name in ("1f1b", "zero_bubble"):
        assert s.peak_in_flight() == min(pp, m) or (name == "zero_bubble" and s.peak_in_flight() <= pp)
    if name == "fthenb":
        assert s.peak_in_flight() == m


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_splitting_the_backward_and_interleaving_shrink_the_bubble(pp, m):
    """With B = 2F (B = W = F when split): 1F1B takes 3(m + pp - 1); zero bubble at most two
    job-times over ZB-H1's 3m + pp - 1; interleaving v chunks (each 1/v of the work) shrinks it."""
    one = simulate(make_schedule("1f1b", pp, m))
    assert one.makespan == 3 * (m + pp - 1)
    zb = simulate(make_schedule("zero_bubble", pp, m))
    assert 3 * m + pp - 1 <= zb.makespan <= 3 * m + pp + 1
    assert zb.makespan < one.makespan
    il = simulate(make_schedule("interleaved", pp, m, 2), costs={"F": 0.5, "B": 1.0, "W": 0.0})
    assert il.makespan < one.makespan and il.bubble < one.bubble


def test_schedules_print_and_render_their_clock():
    s = make_schedule("interleaved", 2, 4, 2)
    assert str(s).splitlines()[1].startswith("rank 0: F0.0 F1.0 F0.1 F1.1")
    assert "F3.1" in str(s) and "2 stages per rank" in str(s)
    rows = simulate(make_schedule("1f1b", 2, 2)).render().splitlines()
    assert rows == ["rank 0: FF..B0.B1", "rank 1: .FB0FB1.."]  # B takes two units


@pytest.mark.parametrize(
    "args,match",
    [
        (("gpipe", 2, 4), "unknown pipeline schedule 'gpipe'; use one of fthenb, 1f1b"),
        (("interleaved", 2, 3, 2), r"micro_batches \(3\) must be a multiple of pp \(2\)"),
        (("interleaved", 2, 4, 1), "needs virtual_stages >= 2"),
        (("1f1b", 0, 4), "pp must be a positive integer, got 0"),
        (("zero_bubble", 2, 4, 2), "needs the interleaved schedule"),
    ],
)
def test_bad_schedules_are_one_clear_error(args, match):
    with pytest.raises(ScheduleError, match=match):
        make_schedule(*args)


def test_check_catches_a_broken_list():
    s = make_schedule("1f1b", 2, 2)
    swapped = (s.jobs[0], (s.jobs[1][1], s.jobs[1][0], *s.jobs[1][2:]))
    with pytest.raises(ScheduleError, match="rank 1 runs B0 of stage 1 before F0 of stage 1"):
        Schedule("bad", 2, 2, 1, swapped).check()
    f, b = (lambda s, i: Job("F", s, i)), (lambda s, i: Job("B", s, i))
    deadlock = ((f(0, 0), b(0, 0), f(0, 1), b(0, 1)), (f(1, 1), b(1, 1), f(1, 0), b(1, 0)))
    with pytest.raises(ScheduleError, match="deadlock, the ranks wait at B0 of stage 0, F1 of stage 1"):
        Schedule("bad", 2, 2, 1, deadlock).check()
