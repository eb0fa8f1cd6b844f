"""The flight recorder (every collective fastpar issues, per rank) and the comparison of the
ranks' records after a stall (one line naming the first rank and collective that differ).

The comparison is a pure function, tested on records written by hand; the recorder runs on 2
gloo ranks, through the same facade the library calls."""
import json

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fastpar.mesh.flight import read_dumps, write_dump
from fastpar.mesh.flight_report import first_divergence
from fastpar.testing import run_ranks

DP, TP, WORLD = "5", "1", "0"


def _dump(rank, groups, entries, world_size=2, **about):
    """A dump as the stall thread writes it: ``entries`` are (group, #n, op, numel, dtype,
    step) in the order this rank issued them."""
    return {"rank": rank, "world_size": world_size, "groups": groups, **about,
            "entries": [{"group": g, "seq": n, "op": op, "numel": k, "dtype": dt, "time": 0.0,
                         "step": step} for g, n, op, k, dt, step in entries]}


def test_a_rank_that_stopped_is_named_with_the_collective_the_others_wait_in():
    groups = {DP: {"name": "dp", "ranks": [0, 1]}, WORLD: {"name": "world", "ranks": [0, 1]}}
    common = [(DP, 56, "all_reduce", 4096, "fp32", 2), (DP, 57, "all_reduce", 1, "fp32", 2),
              (WORLD, 2, "all_reduce", 1, "fp32", 2)]
    dumps = {0: _dump(0, groups, common + [(DP, 58, "all_reduce", 4096, "fp32", 3),
                                           (DP, 59, "all_reduce", 2048, "fp32", 3)]),
             1: _dump(1, groups, common)}
    assert first_divergence(dumps) == (
        "hang at step 3: rank 1 stopped after dp all_reduce #57 (1 x fp32); ranks [0] wait in "
        "dp all_reduce #58 (4096 x fp32) over ranks [0, 1]")


def test_a_different_collective_under_the_same_number_is_named():
    groups = {TP: {"name": "tp", "ranks": [0, 1]}}
    before = [(TP, 11, "all_reduce", 512, "bf16", 7)]
    dumps = {0: _dump(0, groups, before + [(TP, 12, "all_reduce", 512, "bf16", 7)]),
             1: _dump(1, groups, before + [(TP, 12, "all_gather_into_tensor", 256, "bf16", 7)])}
    assert first_divergence(dumps) == (
        "hang at step 7: rank 1 issued tp all_gather_into_tensor #12 (256 x bf16) where ranks "
        "[0] issued tp all_reduce #12 (512 x bf16) over ranks [0, 1]")


def test_a_skipped_collective_names_both_sides_and_the_majority_is_the_reference():
    # Rank 1 skipped dp #9 (the loss all-reduce) and went on to the world all-reduce: a
    # deadlock, each rank held where the other is not. With 3 ranks the two that agree are
    # the reference; with 2, the side of rank 0.
    def run(world):
        ranks = list(range(world))
        groups = {DP: {"name": "dp", "ranks": ranks}, WORLD: {"name": "world", "ranks": ranks}}
        common = [(WORLD, 2, "all_reduce", 1, "fp32", 2), (DP, 8, "all_reduce", 900, "fp32", 3)]
        good = common + [(DP, 9, "all_reduce", 1, "fp32", 3)]
        bad = common + [(WORLD, 3, "all_reduce", 1, "fp32", 3)]
        return first_divergence({r: _dump(r, groups, bad if r == 1 else good, world)
                                 for r in ranks})

    assert run(2) == (
        "hang at step 3: rank 1 issued world all_reduce #3 (1 x fp32) where ranks [0] issued "
        "dp all_reduce #9 (1 x fp32) over ranks [0, 1] (rank 1's last dp collective: "
        "all_reduce #8)")
    assert run(3).startswith(
        "hang at step 3: rank 1 issued world all_reduce #3 (1 x fp32) where ranks [0, 2] "
        "issued dp all_reduce #9 (1 x fp32) over ranks [0, 1, 2]")


def test_groups_of_different_ranks_lead_to_the_rank_that_stopped():
    # 4 ranks, tp groups {0,1} {2,3}, dp groups {0,2} {1,3}. Rank 3 stopped after dp(1,3) #10;
    # rank 1 waits in dp #11 for it, so rank 0 waits in tp(0,1) #21 for rank 1, and rank 2 in
    # tp(2,3) #21 for rank 3. Each is held alone: the walk from rank 0 leads to rank 3.
    groups = {"t01": {"name": "tp", "ranks": [0, 1]}, "t23": {"name": "tp", "ranks": [2, 3]},
              "d02": {"name": "dp", "ranks": [0, 2]}, "d13": {"name": "dp", "ranks": [1, 3]}}

    def rec(tp, dp, last_tp, last_dp):
        out = [(tp, 20, "all_reduce", 64, "fp32", 4), (dp, 10, "all_reduce", 99, "fp32", 4)]
        return out + [(dp, 11, "all_reduce", 99, "fp32", 5)] * last_dp + \
            [(tp, 21, "all_reduce", 64, "fp32", 5)] * last_tp

    dumps = {0: _dump(0, groups, rec("t01", "d02", 1, 1), 4),
             1: _dump(1, groups, rec("t01", "d13", 0, 1), 4),
             2: _dump(2, groups, rec("t23", "d02", 1, 1), 4),
             3: _dump(3, groups, rec("t23", "d13", 0, 0), 4)}
    assert first_divergence(dumps) == (
        "hang at step 5: rank 3 stopped after dp all_reduce #10 (99 x fp32); ranks [1] wait in "
        "dp all_reduce #11 (99 x fp32) over ranks [1, 3]")


def test_missing_records_older_entries_and_point_to_point_batches():
    groups = {DP: {"name": "dp", "ranks": [0, 1, 2]}}
    # Rank 2 left no dump; rank 1's record of dp starts at #40 (older entries dropped from its
    # ring): #3 of rank 0 counts as matched. Pipeline batches are not compared.
    r0 = [(DP, 3, "broadcast", 10, "fp32", 0), (DP, 40, "all_reduce", 8, "fp32", 9),
          (DP, 41, "all_reduce", 8, "fp32", 9)]
    r1 = [(DP, 40, "all_reduce", 8, "fp32", 9), (DP, 41, "all_reduce", 8, "fp32", 9)]
    d0, d1 = _dump(0, groups, r0, 3), _dump(1, groups, r1, 3)
    d1["entries"].append({"group": DP, "seq": 7, "op": "batch_isend_irecv", "numel": 3,
                          "dtype": "fp32", "time": 0.0, "step": 9, "peers": [["send", 0]]})
    assert first_divergence({0: d0, 1: d1}) == (
        "rank(s) [2] left no record; every collective in the records was issued alike by every "
        "rank of its group (the last ones: ranks [0, 1]: dp all_reduce #41 (8 x fp32) over "
        "ranks [0, 1, 2]): the ranks stopped inside them or outside collectives")
    d1["entries"].pop(1)                # rank 1 stopped after #40: named, rank 2 noted
    assert first_divergence({0: d0, 1: d1}) == (
        "hang at step 9: rank 1 stopped after dp all_reduce #40 (8 x fp32); ranks [0] wait in "
        "dp all_reduce #41 (8 x fp32) over ranks [0, 1, 2]; rank(s) [2] left no record")


def test_dumps_are_read_for_one_run_and_its_last_attempt(tmp_path):
    groups = {DP: {"name": "dp", "ranks": [0, 1]}}
    write_dump(tmp_path / "rank0.json", _dump(0, groups, [], run_id="a", attempt=1))
    write_dump(tmp_path / "rank1.json", _dump(1, groups, [], run_id="a", attempt=0))
    (tmp_path / "rank2.json").write_text("{not json")
    assert list(read_dumps(tmp_path, "a")) == [0]          # attempt 1 only
    assert read_dumps(tmp_path, "b") == {}
    assert json.loads((tmp_path / "rank0.json").read_text())["attempt"] == 1
    assert not list(tmp_path.glob(".*tmp"))                  # written through a temporary


def _record(rank, world_size):
    from fastpar import extension
    from fastpar.mesh import collectives
    from fastpar.mesh.flight import recorder

    pair = dist.new_group([0, 1])
    recorder.name_groups({"dp": pair})
    x = torch.full((6,), float(rank + 1))
    collectives.all_reduce(x)                                       # world #1
    collectives.all_reduce(x, group=pair)                           # dp #1
    out = torch.empty(12, dtype=torch.bfloat16)
    collectives.all_gather_into_tensor(out, x.bfloat16(), group=pair)    # dp #2
    peer = 1 - rank
    got = torch.empty(6)
    for w in collectives.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, pair),
                                            dist.P2POp(dist.irecv, got, peer, pair)]):
        w.wait()
    recorder.skips = 1                                              # every rank skips it
    skipped = collectives.all_reduce(x, group=pair, async_op=True)
    extension.matmul_allreduce(torch.ones(4, 3), torch.ones(5, 3), pair)    # dp #3
    return recorder.snapshot(), skipped.wait(), x.tolist(), got.tolist()


def test_recorder_numbers_each_groups_collectives_and_keeps_batches_apart():
    snap, skipped_done, x, got = run_ranks(_record, 2)[1]
    # (1 + 2) summed over the world, then over the pair: 6; the skipped all-reduce changed
    # nothing (it would have made 12), and was not recorded.
    assert skipped_done is True and x == [6.0] * 6 and got == [6.0] * 6
    names = {g["name"]: (k, g["ranks"]) for k, g in snap["groups"].items()}
    assert names["world"][1] == [0, 1] and names["dp"][1] == [0, 1]
    rows = [(snap["groups"][e["group"]]["name"], e["seq"], e["op"], e["numel"], e["dtype"],
             e.get("peers")) for e in snap["entries"]]
    assert rows == [("world", 1, "all_reduce", 6, "fp32", None),
                    ("dp", 1, "all_reduce", 6, "fp32", None),
                    ("dp", 2, "all_gather_into_tensor", 6, "bf16", None),
                    ("dp", 1, "batch_isend_irecv", 12, "fp32", [["send", 0], ["recv", 0]]),
                    ("dp", 3, "matmul_allreduce", 12, "fp32", None)]


class _AnyOp(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _record_meta(rank, world_size):
    from fastpar.mesh.flight import recorder

    # A meta tensor has no values: reading one (.item(), .tolist(), a copy) raises. Recording
    # must not dispatch any op at all, so it never waits for a device either.
    huge = torch.empty(2 ** 40, dtype=torch.bfloat16, device="meta")
    with _AnyOp() as seen:
        recorder.collective("all_reduce", None, huge)
        recorder.record_op("matmul_allreduce", None, huge)
    with pytest.raises(Exception):
        huge.item()
    return seen.ops, recorder.snapshot()["entries"][-1]["numel"]


def test_recording_reads_no_tensor_value():
    ops, numel = run_ranks(_record_meta, 1)[0]
    assert ops == [] and numel == 2 ** 40
