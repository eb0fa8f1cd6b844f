"""The benches' one method (bench/common.py compare) and bench/repeat.py's table, on fake steps
timed by a fake clock: exact times, no ranks, nothing measured."""
import json
import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import common  # noqa: E402
import repeat  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def clock(monkeypatch):
    """A clock that only moves when a fake step says it took time."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    return now


def _steps(clock, costs, log):
    def make(name, cost):
        def step():
            log.append(name)
            clock[0] += cost
        return step
    return {name: make(name, cost) for name, cost in costs.items()}


def test_compare_times_each_window_with_its_finish_and_rotates(clock):
    log = []
    costs = {"peer": 0.010, "peer-again": 0.011, "ours": 0.008}
    variants = _steps(clock, costs, log)
    barriers = []

    def finish():
        log.append("finish")
        clock[0] += 0.006                        # a deferred wait: must count, per window

    out = common.compare(variants, "peer", CPU, rounds=3, iters=2, control="peer-again",
                         finish={"ours": finish}, barrier=lambda: barriers.append(1))
    assert len(barriers) == 3 * 3                # one before every window
    steps = [name for name in log if name != "finish"]
    windows = steps[::2]                         # 2 steps per window, back to back
    assert steps[1::2] == windows
    assert windows == ["peer", "peer-again", "ours", "peer-again", "ours", "peer",
                       "ours", "peer", "peer-again"]   # the order rotated every round
    assert log.count("finish") == 3
    # Each round one window of 2 steps per variant; ours waits for its finish inside it.
    assert out["seconds"]["peer"] == pytest.approx([0.010] * 3)
    assert out["seconds"]["ours"] == pytest.approx([0.008 + 0.006 / 2] * 3)
    assert out["ratio"]["ours"] == pytest.approx(0.011 / 0.010)
    assert out["ratio"]["ours"] == out["median"]["ours"] / out["median"]["peer"]
    assert out["aa"] == {"peer-again": pytest.approx(1.1)}
    assert out["aa_rounds"]["peer-again"] == pytest.approx([1.1] * 3)
    assert out["round_ratio"]["ours"] == pytest.approx([1.1] * 3)
    assert out["paired"]["ours"] == pytest.approx(1.1)
    json.dumps(out)                              # JSON-ready


def test_compare_round_order_rotates():
    assert [common.rotated(list("abc"), r)[0] for r in range(4)] == ["a", "b", "c", "a"]


def test_compare_per_variant_peers(clock):
    costs = {"a": 0.01, "a-again": 0.01, "b": 0.02, "b-sp": 0.04, "ours-sp": 0.03}
    out = common.compare(_steps(clock, costs, []), "a", CPU, 2, 1, control="a-again",
                         peers={"ours-sp": "b-sp"})
    assert out["peer_of"]["ours-sp"] == "b-sp" and out["peer_of"]["b"] == "a"
    assert out["ratio"]["ours-sp"] == pytest.approx(0.75)
    assert out["ratio"]["b"] == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(control=[]), "no A/A control"),
    (dict(control="missing"), "A/A control 'missing'"),
    (dict(control="peer"), "other than its peer"),
    (dict(control="again", peer="nobody"), "peer 'nobody'"),
    (dict(control="again", peers={"ours": "nobody"}), "unknown variants"),
    (dict(control="again", finish={"nobody": lambda: None}), "unknown variants"),
])
def test_compare_requires_a_control_and_known_names(clock, kwargs, match):
    kwargs = {"peer": "peer", **kwargs}
    variants = _steps(clock, {"peer": 0.01, "again": 0.01, "ours": 0.01}, [])
    with pytest.raises(ValueError, match=match):
        common.compare(variants, kwargs.pop("peer"), CPU, 1, 1, **kwargs)


def test_report_keeps_command_machine_run_id_and_comparisons(clock, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv(common.RUN_ID_ENV, "r1")
    monkeypatch.setattr(sys, "argv", ["bench/bench_x.py", "--label", "a b"])
    cmp = common.compare(_steps(clock, {"p": 0.01, "p2": 0.01}, []), "p", CPU, 1, 1,
                         control="p2")
    path = common.report("x", [{"v": 1.0}], ["v"], [{"key": "k", **cmp}])
    doc = json.loads(path.read_text())
    assert doc["command"] == "python bench/bench_x.py --label 'a b'"
    assert doc["run_id"] == "r1" and doc["machine"]["cores"]
    assert doc["comparisons"][0]["key"] == "k" and doc["comparisons"][0]["aa"] == {"p2": 1.0}


def _doc(ratio_ours, aa, ms_peer=100.0):
    return {"command": "python bench/bench_x.py", "time": "2026-12-01 10:00",
            "machine": {"host": "h", "cpu": "x86_64", "cores": 2, "gpu": None, "torch": "2"},
            "comparisons": [{
                "key": "pp2", "peer": "peer", "controls": ["again"], "rounds": 3, "iters": 2,
                "peer_of": {"peer": "peer", "again": "peer", "ours": "peer"},
                "median": {"peer": ms_peer / 1e3, "again": aa * ms_peer / 1e3,
                           "ours": ratio_ours * ms_peer / 1e3},
                "ratio": {"peer": 1.0, "again": aa, "ours": ratio_ours},
                "aa": {"again": aa}, "aa_rounds": {"again": [aa - 0.01, aa + 0.02]}}]}


def test_repeat_table_lists_every_run_the_medians_and_the_controls_spread():
    docs = [_doc(0.9, 1.0), _doc(1.1, 0.97, 120.0), _doc(0.95, 1.04)]
    text = repeat.table(docs, "python bench/repeat.py --runs 3 -- python bench/bench_x.py")
    assert text.startswith("`python bench/repeat.py --runs 3 -- python bench/bench_x.py`")
    assert "h, x86_64, 2 cores, no GPU, torch 2" in text
    assert "pp2: 3 runs, each 3 rounds of 2 steps" in text
    assert "fewer than the 3" in repeat.table(docs[:2], "x")
    assert "| ours | peer | 0.900, 1.100, 0.950 | 0.950 | n/a | n/a | 90.0, 132.0, 95.0 | " \
           "95.0 |" in text
    assert "| again (A/A) | peer | 1.000, 0.970, 1.040 | 1.000 | 1.005, 0.975, 1.045 | " \
           "1.005 |" in text
    assert "A/A control again / peer: 0.970-1.040 over the runs (spread 0.070), paired " \
           "0.975-1.045 over the runs, 0.960-1.060 over single rounds." in text


def test_repeat_table_pairs_each_round_with_its_peers_round():
    docs = [_doc(1.0, 1.0) for _ in range(3)]
    for d, slow in zip(docs, (1.0, 1.5, 0.8)):       # the machine's speed drifts between runs
        cmp = d["comparisons"][0]
        cmp["seconds"] = {"peer": [0.1 * slow, 0.2 * slow, 0.1 * slow],
                          "again": [0.1 * slow, 0.2 * slow, 0.1 * slow],
                          "ours": [0.095 * slow, 0.19 * slow, 0.095 * slow]}
        del cmp["aa_rounds"]
        cmp["aa_rounds"] = {"again": [1.0, 1.0, 1.0]}
    text = repeat.table(docs, "x")
    assert "| ours | peer | 1.000, 1.000, 1.000 | 1.000 | 0.950, 0.950, 0.950 | 0.950 |" in text
