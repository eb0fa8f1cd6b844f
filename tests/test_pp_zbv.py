"""The V-shape schedule ZB-V (Qi et al. 2024, sec. 6): rank r holds stages r and 2 pp - 1 - r,
the backward split into B (input gradients) and W (weights). Its compute order equals torch's
``ScheduleZBVZeroBubble`` action for action; it validates (the last rank's turn is a local
handoff, no message); the simulator's bubble is half ZB-H1's on the same model; the trainer's
loss curve at pp 2 and 4, with dp, ZeRO, tp and tied embeddings, is the single process's."""
from types import SimpleNamespace

import pytest

from fastpar.pipeline import Action, ScheduleError, build_schedule, make_schedule, simulate
from test_pp_tied import on_the_curve, single_process


def _torch_order(pp, m, rank):
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    from torch.distributed.pipelining.schedules import _ComputationType as T
    kinds = {T.FORWARD: "F", T.BACKWARD_INPUT: "B", T.BACKWARD_WEIGHT: "W"}
    ops = ScheduleZBVZeroBubble._calculate_single_rank_operations(
        SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m), rank)
    return [Action(kinds[a.computation_type], a.microbatch_index,
                   0 if a.stage_index == rank else 1) for a in ops if a is not None]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_the_order_is_torchs_and_it_validates(pp):
    for m in (1, 2, 3, 5, 2 * pp - 1, 2 * pp, 3 * pp + 1):
        s = build_schedule("zb-v", pp, m, 2)
        assert s.placement == "v" and s.split_backward
        for r in range(pp):
            assert s.compute(r) == _torch_order(pp, m, r), (pp, m, r)
            assert {s.stage_index(r, 0), s.stage_index(r, 1)} == {r, 2 * pp - 1 - r}
            assert s.peak_activations[r] <= 2 * pp     # half-size stages: 1F1B's memory
        # The turn of the V is on the last rank: its chunk 0 hands chunk 1 its output and
        # gets its input gradient back with no message.
        last = s.actions[pp - 1]
        assert not [a for a in last if a.kind in ("SEND_F", "RECV_B") and a.chunk == 0]
        assert not [a for a in last if a.kind in ("RECV_F", "SEND_B") and a.chunk == 1]


def test_bad_v_schedules_are_refused():
    with pytest.raises(ValueError, match="virtual_stages=1; a V-shape schedule holds"):
        build_schedule("zb-v", 2, 4, 1)
    # The last rank's chunk 1 running before its chunk 0 produced the input.
    order = [[Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 0)],
             [Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 1), Action("B", 0, 0)]]
    with pytest.raises(ScheduleError, match="deadlocks|runs before"):
        make_schedule("bad-v", order, 2, 1, 2, "v")


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_the_simulated_bubble_is_half_zb_h1s(pp):
    """At f = b = w per V stage: every rank works 6m units and only the first forward's way
    down the ranks (pp - 1 units) is idle, step 6m + pp - 1; ZB-H1 on the same model (stages
    of twice the layers) idles 2 (pp - 1)."""
    for m in (2 * pp - 1, 2 * pp, 4 * pp):
        v = simulate(build_schedule("zb-v", pp, m, 2))
        assert v.step_time == pytest.approx(6 * m + pp - 1)
        assert v.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1))
        h1 = simulate(build_schedule("zb-h1", pp, m), f=2.0, b=2.0, w=2.0)
        assert h1.step_time == pytest.approx(6 * m + 2 * (pp - 1))


RUN = dict(model="tiny", seq_len=32, global_batch_size=8, micro_batch_size=1, steps=5,
           warmup_steps=2, log_every=100, sample_tokens=0)
EIGHT = dict(n_layers=8)


@pytest.fixture(scope="module", params=[("llama", EIGHT), ("gpt2", dict(
    EIGHT, tie_embeddings=True, norm="layernorm", activation="gelu", rotary=False, bias=True))],
    ids=lambda p: p[0])
def reference(request, tmp_path_factory):
    preset = request.param[1]
    return preset, single_process(tmp_path_factory, preset, RUN)[1]


@pytest.mark.parametrize("name, world, layout", [
    ("zb-v pp2", 2, dict(pp=2)),
    ("zb-v pp4", 4, dict(pp=4)),
    ("zb-v pp2 dp2 zero1", 4, dict(pp=2, dp=2, zero=1)),
    ("zb-v pp2 tp2", 4, dict(pp=2, tp=2)),
    ("dualpipe-v pp2", 2, dict(pp=2)),
    ("dualpipe-v pp4", 4, dict(pp=4)),
    ("dualpipe-v pp2 dp2 zero1", 4, dict(pp=2, dp=2, zero=1)),
    ("dualpipe-v pp2 tp2", 4, dict(pp=2, tp=2)),
])
def test_v_schedules_train_on_the_single_process_curve(name, world, layout, reference,
                                                       tmp_path):
    preset, want = reference
    on_the_curve(name, world, dict(layout, schedule=name.split()[0]), preset, RUN, want,
                 tmp_path)


def dry_run_is_the_model(layout: dict):
    """(config, report) of a dry run at 1,024 H100 ranks (4,096 tokens, one sequence per
    micro-batch, ZeRO-1, sp) of ``layout``, each role's parameters and memory checked to equal
    the memory model's."""
    from fastpar.train import TrainConfig
    from fastpar.train.dry_run import dry_run
    cfg = TrainConfig(**dict(dict(seq_len=4096, micro_batch_size=1, zero=1,
                                  sequence_parallel=True, out="unused"), **layout))
    rep = dry_run(cfg, 1024, "h100-80gb")
    for r in rep.roles:
        assert r.params == pytest.approx(r.model_params, rel=1e-6), r
        assert r.total == pytest.approx(r.model_total, rel=1e-3), r
    return cfg, rep


def test_the_dry_run_the_memory_model_and_the_planner_know_the_v():
    """70b on 1,024 ranks, tp8 x pp8 x dp16: each pp rank builds stages r and 15 - r, which
    the memory model counts (equal per role); the planner's step for ZB-V is below ZB-H1's and
    1F1B's on the same layout, and its search offers ZB-V."""
    from fastpar.plan import BUILTIN, Cluster, Workload, planner
    steps = {}
    for sched in ("1f1b", "zb-h1", "zb-v"):
        cfg, rep = dry_run_is_the_model(dict(model="70b", tp=8, pp=8, global_batch_size=256,
                                             schedule=sched))
        steps[sched] = rep.step_time_s
    assert cfg.virtual_stages == 2
    assert steps["zb-v"] < steps["zb-h1"] < steps["1f1b"], steps
    # Rank 0 holds the first stage's layers and the last stage's.
    assert rep.roles[0].layers[0] == 0 and rep.roles[0].layers[-1] == 79
    work = Workload(cfg.model_config, 4096, 256)
    found = {(c.schedule, c.virtual_stages) for c in planner.candidates(
        work, Cluster(64, 8, BUILTIN["h100-80gb"]), {"tp": 8, "pp": 8})}
    assert ("zb-v", 2) in found
