"""Pipeline schedules as data: invariants, warm-up counts, deadlock detection, the simulator."""
import json
from collections import Counter

import pytest

from fastpar.pipeline import (Action, Schedule, ScheduleError, build_schedule, make_schedule,
                              simulate)

GRID = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 12, 16)]


def _first_b(schedule, rank):
    """Forwards a rank runs before its first backward."""
    compute = schedule.compute(rank)
    return next(i for i, a in enumerate(compute) if a.kind == "B")


def _common_invariants(s, name):
    for rank in range(s.pp_size):
        counts = Counter(a.kind for a in s.compute(rank))
        n = s.num_microbatches * s.virtual_stages
        assert counts["F"] == counts["B"] == n, (name, rank, counts)
        assert counts["W"] == (n if name == "zb-h1" else 0), (name, rank, counts)
        seen = {}
        for i, a in enumerate(s.compute(rank)):          # F < B < W for every (mb, chunk)
            seen.setdefault((a.microbatch, a.chunk), []).append(a.kind)
        assert all(k == (["F", "B", "W"] if name == "zb-h1" else ["F", "B"])
                   for k in seen.values())
    # every send has its receive on the peer, and nothing is received twice
    sends = Counter(s.message(r, a) for r in range(s.pp_size) for a in s.actions[r]
                    if a.kind.startswith("SEND"))
    recvs = Counter(s.message(r, a) for r in range(s.pp_size) for a in s.actions[r]
                    if a.kind.startswith("RECV"))
    assert sends == recvs and all(v == 1 for v in sends.values())
    assert s.split_backward == (name == "zb-h1")


@pytest.mark.parametrize("pp,m", GRID)
def test_invariants_and_warmup(pp, m):
    for name in ("gpipe", "1f1b", "zb-h1"):
        s = build_schedule(name, pp, m)
        _common_invariants(s, name)
        for r in range(pp):
            if name == "gpipe":
                assert _first_b(s, r) == m and s.peak_activations[r] == m
            else:   # min(pp - r - 1, m) warm-up forwards, then the steady state's first F
                assert _first_b(s, r) == min(pp - r, m), (name, r)
            if name == "1f1b":
                assert s.peak_activations[r] == min(pp - r, m)
            if name == "zb-h1":       # 1F1B's peak: deferred W's never push a rank past pp
                assert s.peak_activations[r] <= min(pp, m)
        if name != "gpipe":
            assert max(s.peak_activations) == min(pp, m)
    if pp > 1 and m % pp == 0:
        for v in (1, 2, 3, 4):
            s = build_schedule("interleaved", pp, m, v)
            _common_invariants(s, "interleaved")
            for r in range(pp):      # Megatron: (pp - r - 1) * 2 + (v - 1) * pp warm-up forwards
                warmup = min((pp - r - 1) * 2 + (v - 1) * pp, m * v)
                assert _first_b(s, r) == min(warmup + 1, m * v), (pp, m, v, r)
            if v > 1:   # rank 0: micro-batches 0..pp-1 on chunk 0, then the same on chunk 1
                first = [(a.microbatch, a.chunk) for a in s.compute(0)[:2 * pp]]
                assert first == [(i % pp, i // pp) for i in range(2 * pp)]


def test_stage_layout_and_comm_actions():
    s = build_schedule("interleaved", 2, 2, 2)
    assert s.num_stages == 4 and s.stage_index(1, 1) == 3
    # rank 1 chunk 0 (stage 1) feeds rank 0 chunk 1 (stage 2)
    assert s.peer(1, Action("SEND_F", 0, 0)) == 0
    assert s.message(1, Action("SEND_F", 0, 0)) == s.message(0, Action("RECV_F", 0, 1))
    one = build_schedule("1f1b", 2, 3)
    assert one.actions[0][:4] == (Action("F", 0), Action("SEND_F", 0), Action("F", 1),
                                  Action("SEND_F", 1))
    assert Action("RECV_B", 0) in one.actions[0] and "rank 1:" in one.table()


def test_simulator_bubbles_match_formulas():
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            ideal = (p - 1) / (m + p - 1)
            for name in ("gpipe", "1f1b"):
                sim = simulate(build_schedule(name, p, m))
                assert sim.bubble_fraction == pytest.approx(ideal, abs=1e-9), (name, p, m)
            for v in (2, 4):
                sim = simulate(build_schedule("interleaved", p, m, v))
                assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-3)
            zb = simulate(build_schedule("zb-h1", p, m))
            # ZB-H1 with f = b = w: (p - 1) idle units against 3m of work
            assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9)
            assert zb.bubble_fraction < 0.5 * ideal
    assert max(simulate(build_schedule("1f1b", 4, 8)).peak_activations) == 4
    assert simulate(build_schedule("gpipe", 4, 8)).peak_activations == [8] * 4


def test_simulator_costs():
    p, m, f, b, w, c = 4, 8, 1.0, 1.5, 0.5, 0.25
    sim = simulate(build_schedule("gpipe", p, m), f=f, b=b, w=w, comm=c)
    assert sim.step_time == pytest.approx((m + p - 1) * (f + b + w) + 2 * (p - 1) * c)
    assert sim.busy == [pytest.approx(m * (f + b + w))] * p
    # a slow stage sets the pace: 1F1B's step is at least m times its cost
    slow = simulate(build_schedule("1f1b", p, m), f=[1, 1, 3, 1], b=[1, 1, 3, 1], w=0)
    assert slow.step_time >= m * 6
    assert slow.bubble_fraction > simulate(build_schedule("1f1b", p, m), w=0).bubble_fraction
    with pytest.raises(ValueError, match="3 per-stage costs.*4 stages"):
        simulate(build_schedule("1f1b", p, m), f=[1, 1, 1])
    with pytest.raises(ValueError, match="comm"):
        simulate(build_schedule("1f1b", p, m), comm=-1)


def test_gantt_and_chrome_trace(tmp_path):
    sim = simulate(build_schedule("zb-h1", 4, 8), comm=0.1)
    trace = sim.chrome_trace(tmp_path / "zb.json")
    loaded = json.loads((tmp_path / "zb.json").read_text())
    assert loaded == trace
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 4 * 8 * 3 and {e["tid"] for e in slices} == {0, 1, 2, 3}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
    pytest.importorskip("matplotlib")
    png = sim.gantt(tmp_path / "zb.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_broken_schedules_are_caught_when_built():
    F, B = "F", "B"
    a = Action
    # Rank 0 waits for micro-batch 0's gradient before sending its activation: a deadlock.
    broken = [[a(F, 0), a("RECV_B", 0), a(B, 0), a("SEND_F", 0)],
              [a("RECV_F", 0), a(F, 0), a(B, 0), a("SEND_B", 0)]]
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 waits at \[RECV_B0\].*rank 1 "
                                            r"waits at \[RECV_F0\]"):
        Schedule("broken", 2, 1, 1, broken)
    # A compute order that waits on itself: rank 1 wants micro-batch 1 before 0's gradient left.
    with pytest.raises(ScheduleError, match="deadlocks"):
        make_schedule("cycle", [[a(F, 0), a(B, 0), a(F, 1), a(B, 1)],
                                [a(F, 1), a(B, 1), a(F, 0), a(B, 0)]], 2, 2)
    # Sends and receives in different orders between two ranks.
    swapped = [[a(F, 0), a(F, 1), a("SEND_F", 0), a("SEND_F", 1), a("RECV_B", 0), a("RECV_B", 1),
                a(B, 0), a(B, 1)],
               [a("RECV_F", 1), a("RECV_F", 0), a(F, 0), a(F, 1), a(B, 0), a(B, 1),
                a("SEND_B", 0), a("SEND_B", 1)]]
    with pytest.raises(ScheduleError, match="rank 0 -> rank 1: message 0 sent"):
        Schedule("swapped", 2, 2, 1, swapped)
    with pytest.raises(ScheduleError, match=r"expected \['F', 'B'\]"):
        Schedule("order", 1, 1, 1, [[a(B, 0), a(F, 0)]])
    with pytest.raises(ScheduleError, match="before its RECV_F0"):
        Schedule("norecv", 2, 1, 1, [[a(F, 0), a("SEND_F", 0), a("RECV_B", 0), a(B, 0)],
                                     [a(F, 0), a("RECV_F", 0), a(B, 0), a("SEND_B", 0)]])
    with pytest.raises(ScheduleError, match="out of range"):
        Schedule("range", 1, 1, 1, [[a(F, 0), a(B, 0), a(F, 1)]])


def test_bad_arguments():
    cases = [
        (lambda: build_schedule("pipedream", 2, 4), "unknown schedule 'pipedream'"),
        (lambda: build_schedule("1f1b", 0, 4), "pp_size=0 must be"),
        (lambda: build_schedule("gpipe", 2, 0), "num_microbatches=0 must be"),
        (lambda: build_schedule("interleaved", 4, 6, 2), "num_microbatches=6 must be a multiple "
                                                          "of pp_size=4.*use 8"),
        (lambda: build_schedule("interleaved", 4, 2, 2), "num_microbatches=2 must be a multiple"),
        (lambda: build_schedule("interleaved", 1, 2, 2), "virtual_stages=2 needs pp_size > 1"),
        (lambda: build_schedule("1f1b", 2, 4, 2), "virtual_stages=2 needs the 'interleaved'"),
        (lambda: build_schedule("zb-h1", 2, 4, 0), "virtual_stages=0 must be"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_forward_schedule_keeps_the_forward_order(name, v):
    from fastpar.pipeline import forward_schedule

    for pp, m in ((2, 4), (4, 8), (3, 6)):
        s = build_schedule(name, pp, m, v)
        f = forward_schedule(s)
        assert not f.split_backward
        for rank in range(pp):
            assert f.compute(rank) == [a for a in s.compute(rank) if a.kind == "F"]
            assert {a.kind for a in f.actions[rank]} <= {"F", "SEND_F", "RECV_F"}
    with pytest.raises(ScheduleError, match="expected"):    # a B on one rank only is no schedule
        Schedule("half", 1, 2, 1, [[Action("F", 0), Action("B", 0), Action("F", 1)]])


def test_in_flight_counts_what_waits_for_w():
    """Under a split backward a micro-batch is alive from F to W, and between its B and its W it
    also holds its weights' output gradients: the memory model reads both counts."""
    zb = build_schedule("zb-h1", 2, 4)
    # rank 1 runs F0 B0 F1 B1 W0 ...: after B1, two alive and both awaiting W
    assert (2, 2) in zb.in_flight[1]
    assert all(alive >= waiting for f in zb.in_flight for alive, waiting in f)
    assert zb.peak_activations == tuple(max(a for a, _ in f) for f in zb.in_flight)
    plain = build_schedule("1f1b", 4, 8)
    assert plain.in_flight == tuple(((p, 0),) for p in plain.peak_activations)


def test_simulator_posts_and_shared_cores():
    """Host time of posting each message; ranks sharing CPU cores (processor sharing)."""
    one = build_schedule("gpipe", 2, 1)
    # rank 0: F (1), post its send (0.05), the message takes 0.1, rank 1: F, B (1 + 1), post
    # its send, 0.1 in flight, rank 0's B (1); rank 0 posted its receive after its send.
    sim = simulate(one, f=1, b=1, w=0, comm=0.1, post=0.05)
    assert sim.step_time == pytest.approx(1 + 0.05 + 0.1 + 2 + 0.05 + 0.1 + 1)
    for name, p, m, v in (("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 8, 1)):
        s = build_schedule(name, p, m, v)
        plain = simulate(s, 1.0, 2.0, 1.0, comm=0.1, post=0.05)
        # as many cores as processes: the same timeline
        roomy = simulate(s, 1.0, 2.0, 1.0, comm=0.1, post=0.05, shared=(1, p))
        assert roomy.step_time == pytest.approx(plain.step_time)
        # half the cores: slower, but never slower than running every rank's work on them
        half = simulate(s, 1.0, 2.0, 1.0, comm=0.1, post=0.05, shared=(1, p / 2))
        work = p * m * v * (1 + 2 + 1 + 2 * 0.05)
        assert plain.step_time < half.step_time <= work / (p / 2) + plain.step_time
        assert half.step_time >= work / (p / 2) - 1e-9
    # One core for a 2-stage GPipe: never idle (rank 0 runs while rank 1 waits), so the step is
    # all the work, and processes per rank count as that many competitors.
    g = build_schedule("gpipe", 2, 4)
    assert simulate(g, 1.0, 2.0, 0.0, shared=(1, 1)).step_time == pytest.approx(2 * 4 * 3)
    assert simulate(g, 1.0, 2.0, 0.0, shared=(2, 2)).step_time == pytest.approx(2 * 4 * 3)
    # Waiting (on a collective) uses no core: two ranks that only wait run side by side.
    zero = [0.0, 0.0]
    both = simulate(g, zero, zero, zero, waits=([1.0, 1.0], [2.0, 2.0], zero), shared=(1, 1))
    assert both.step_time == pytest.approx(simulate(g, 1.0, 2.0, 0.0).step_time)
    with pytest.raises(ValueError, match="post"):
        simulate(g, post=-1)
    with pytest.raises(ValueError, match="shared"):
        simulate(g, shared=(1, 0))
