"""DualPipeV (DeepSeek-V3's DualPipe cut in half into a V): ZB-V's placement, with each steady
state F run together with another micro-batch's B on the rank's other chunk. Its order equals
torch's ``ScheduleDualPipeV`` action for action; the simulator's step meets the closed form
of the DualPipe paper's cost model; the overlapped F and B take turns at their expert-parallel
transfer waits, each computing while the other's travel (the mechanism, recorded); with MoE under ep the trainer's loss curve
is the single process's."""
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fastpar.mesh import fill
from fastpar.pipeline import Action, build_schedule, simulate
from fastpar.pipeline import actions as actions_module


def _torch_order(pp, m, rank):
    """torch's order in fastpar's terms: a full backward is B then W, an OVERLAP_F_B the F
    (overlap) then the B and W of its backward."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    from torch.distributed.pipelining.schedules import _ComputationType as T
    ops = ScheduleDualPipeV._calculate_single_rank_operations(
        SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m), rank)
    out = []

    def one(a, overlap=False):
        chunk, mb, t = 0 if a.stage_index == rank else 1, a.microbatch_index, a.computation_type
        out.extend({T.FORWARD: [Action("F", mb, chunk, overlap)],
                    T.BACKWARD_INPUT: [Action("B", mb, chunk)],
                    T.BACKWARD_WEIGHT: [Action("W", mb, chunk)],
                    T.FULL_BACKWARD: [Action("B", mb, chunk), Action("W", mb, chunk)]}[t])
    for a in ops:
        if a is not None and a.computation_type == T.OVERLAP_F_B:
            one(a.sub_actions[0], True)
            one(a.sub_actions[1])
        elif a is not None:
            one(a)
    return out


@pytest.mark.fast
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_the_order_is_torchs_and_it_validates(pp):
    for m in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp + 3):
        s = build_schedule("dualpipe-v", pp, m, 2)
        assert s.placement == "v" and s.split_backward
        for r in range(pp):
            assert s.compute(r) == _torch_order(pp, m, r), (pp, m, r)
            # DualPipeV's activation memory: PP + 1 of the paper's (two-stage) units.
            assert s.peak_activations[r] == 2 * pp + 1
        pairs = sum(a.overlap for r in range(pp) for a in s.actions[r])
        assert pairs == sum(2 * (m - 2 * pp + r + 1) + (pp - r - 1) for r in range(pp)) - 1
    with pytest.raises(ValueError, match="num_microbatches=3 must be at least 2 \\* pp_size"):
        build_schedule("dualpipe-v", 2, 3, 2)


@pytest.mark.fast
@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (2.5, 2.5, 2.5), (1, 2, 1), (2, 3, 1), (2, 1, 1)])
def test_the_simulated_step_is_the_papers_closed_form(f, b, w):
    """DualPipe's bubble (DeepSeek-V3, table 2) is (PP/2 - 1)(F&B + B - 3W) over PP ranks
    holding two stages each; cut in half over pp ranks it is (pp - 1)(F&B + B - 3W). With F&B
    = F + B + W (the pair's compute, without the communication it hides) and F = B = W, the
    simulated step is every rank's 2m(F + B + W) plus exactly that. The expression is the
    paper's approximation for other ratios (at W > B it turns negative); there the simulator
    times the order itself, and its bubble is below 1F1B's (pp - 1)(F + B + W) on stages of
    twice the layers."""
    for pp in (2, 3, 4, 8):
        for m in (2 * pp, 2 * pp + 1, 4 * pp):
            sim = simulate(build_schedule("dualpipe-v", pp, m, 2), f=f, b=b, w=w)
            fb = f + b + w
            bubble = sim.step_time - 2 * m * fb
            if f == b == w:
                assert bubble == pytest.approx((pp - 1) * (fb + b - 3 * w))
            one = simulate(build_schedule("1f1b", pp, m), f=2 * f, b=2 * b, w=2 * w)
            assert one.step_time - 2 * m * fb == pytest.approx(2 * (pp - 1) * fb)
            assert 0 < bubble < 2 * (pp - 1) * fb


@pytest.mark.fast
def test_the_simulator_hides_a_pairs_fillable_waits():
    """An overlapped F's fillable waits run under its B's compute: each pair's F takes its
    compute plus what B could not cover; none hidden when nothing is fillable, and none under
    ZB-V (no pairs)."""
    s = build_schedule("dualpipe-v", 2, 8, 2)
    cost = dict(f=1.0, b=1.0, w=1.0, waits=(0.5, 0.0, 0.0))
    plain, filled = simulate(s, **cost, fillable=(0.0, 0.0)), simulate(s, **cost)
    pairs = [e for e in filled.events if e.action.overlap]
    assert pairs and all(e.end - e.start == pytest.approx(1.5)
                         for e in plain.events if e.action.kind == "F")
    assert all(1.0 - 1e-9 <= e.end - e.start <= 1.5 + 1e-9 for e in pairs)
    assert sum(e.end - e.start == pytest.approx(1.0) for e in pairs) >= len(pairs) // 2
    assert filled.step_time < plain.step_time
    zbv = build_schedule("zb-v", 2, 8, 2)
    assert simulate(zbv, **cost).step_time == \
        simulate(zbv, **cost, fillable=(0.0, 0.0)).step_time
    # The other way: a pair's B waits under its F's compute.
    back = dict(f=1.0, b=1.0, w=1.0, waits=(0.0, 0.5, 0.0))
    plain, filled = simulate(s, **back, fillable=(0.0, 0.0)), simulate(s, **back)
    shorter = [e for e in filled.events if e.action.kind == "B" and e.end - e.start < 1.5 - 1e-9]
    assert len(shorter) >= len(pairs) // 2 and filled.step_time < plain.step_time
    assert simulate(s, **back, fillable=(1.0, 0.0)).step_time == plain.step_time
    with pytest.raises(ValueError, match="fillable=0.5 must be"):
        simulate(s, **back, fillable=0.5)


@pytest.mark.fast
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_a_pairs_forward_sends_before_its_backward_and_every_channel_keeps_its_order(pp):
    """Each overlapped pair whose F feeds another rank posts that send right after the F (the
    next stage starts while this rank runs the pair's B), and the executor's issue order
    keeps every channel's messages in the schedule's order (NCCL matches them in order)."""
    for m in (2 * pp, 2 * pp + 1, 4 * pp):
        s = build_schedule("dualpipe-v", pp, m, 2)
        for r in range(pp):
            acts, early = s.actions[r], s.early_sends(r)
            remote = [i for i, a in enumerate(acts) if a.overlap and
                      s.neighbour(r, a.chunk, "SEND_F") not in (None,) and
                      s.neighbour(r, a.chunk, "SEND_F")[0] != r]
            assert sorted(early) == remote and remote, (pp, m, r)
            for i, k in early.items():
                assert acts[k].kind == "SEND_F" and \
                    (acts[k].microbatch, acts[k].chunk) == (acts[i].microbatch, acts[i].chunk)
            issued = s.issued(r)
            assert sorted(map(repr, issued)) == sorted(map(repr, acts))
            for i in early:                 # F, its send, then the pair's B
                j = issued.index(acts[i])
                assert issued[j + 1] == acts[early[i]] and issued[j + 2] == acts[i + 1]

            def channels(order):
                out = {}
                for a in order:
                    if not a.is_compute:
                        out.setdefault((a.kind[:4], s.peer(r, a)), []).append(s.message(r, a))
                return out
            assert channels(issued) == channels(acts)
            # Receives two batches ahead (gloo): each batch index moves up by at most 2, each
            # receive is posted once, every channel keeps its order.
            def posted(plan):       # message -> (its batch, compute steps before it)
                out, batches, computed = {}, 0, 0
                for kind, x, _ in plan:
                    if kind == "post":
                        out.update({k: (batches, computed) for k in x})
                        batches += 1
                    else:
                        computed += 1
                return out
            where, moved = posted(s.issue_plan(r)), posted(s.issue_plan(r, recv_ahead=2))
            computed = sorted({c for _, c in where.values()})   # before each original batch
            assert moved.keys() == where.keys()
            for k, (q, c) in where.items():
                floor = computed[max(0, computed.index(c) - 2)]
                assert floor <= moved[k][1] <= c and (moved[k][1] == c or
                                                      acts[k].kind.startswith("RECV"))
            assert any(moved[k][1] < c for k, (_, c) in where.items())
            assert channels(s.issued(r, recv_ahead=2)) == channels(acts)
        # Under NCCL (a send waits for its receive, in order on one stream) the early sends
        # are used only where the order still finishes in the strictest model: at pp=2 it
        # does; deeper it deadlocks (a send before the B whose gradient the peer needs before
        # it posts that send's receive), and the executor posts them with the pair's batch.
        issued = SimpleNamespace(name=s.name, pp_size=pp, peer=s.peer, message=s.message,
                                 actions=[s.issued(r) for r in range(pp)])
        actions_module._check_channels(issued)
        if pp == 2:
            actions_module._check_deadlock(issued)
            assert s.early_sends_block_safely()
        else:
            with pytest.raises(actions_module.ScheduleError, match="deadlocks"):
                actions_module._check_deadlock(issued)
            assert not s.early_sends_block_safely()
    # Without pairs nothing moves.
    for name in ("zb-v", "1f1b"):
        s = build_schedule(name, 2, 8, 2 if name == "zb-v" else 1)
        assert s.early_sends(0) == {} and s.issued(0) == list(s.actions[0])


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes ``seconds`` of the host (a stage's heavy backward)."""

    seconds = 0.06

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        import time
        time.sleep(_SlowBackward.seconds)
        return g


class _SlowStage(nn.Module):
    def __init__(self, d, stage, num_stages):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.stage_index, self.num_stages = stage, num_stages

    def forward(self, x):
        return _SlowBackward.apply(torch.tanh(self.lin(x)))


def _early_run(rank, world_size):
    """One DualPipeV step at pp2 (m = 6) with each stage's backward 60 ms of the host, with the
    pairs' sends posted after their F and, as the control, after the whole pair: the
    timelines (absolute clock) and the gradients."""
    from fastpar.pipeline import PipelineExecutor
    out = {}
    for early in (True, False):
        sched = build_schedule("dualpipe-v", 2, 6, 2)
        torch.manual_seed(0)
        stages = [_SlowStage(8, sched.stage_index(rank, c), 4) for c in range(2)]
        pipe = PipelineExecutor(stages, sched, dist.group.WORLD, record=True,
                                activation=((2, 8), torch.float32),
                                loss_fn=lambda y, t: (y - t).square().mean())
        if not early:
            pipe._plans[(sched.name, True)] = sched.issue_plan(rank, early=False,
                                                               recv_ahead=pipe.recv_ahead)
        g = torch.Generator().manual_seed(1)
        pipe.step(torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g))
        out[early] = ([(e.action, e.start + pipe.step_start, e.end + pipe.step_start)
                       for e in pipe.events],
                      [p.grad.clone() for st in stages for p in st.parameters()])
    return out


@pytest.mark.timeout(90)
def test_a_pairs_forward_output_reaches_the_next_stage_while_its_backward_runs():
    """The mechanism: where a pair's F feeds the other rank, that rank's F on the message
    starts (its input arrived: events start when their input is in) while the sender is still
    in the pair's B, tens of ms before it ends; posted after the pair (the control) it never
    does. Same gradients either way."""
    from fastpar.testing import run_ranks
    res = run_ranks(_early_run, 2, timeout=80)
    s = build_schedule("dualpipe-v", 2, 6, 2)
    for early in (True, False):
        ahead = 0
        for r in (0, 1):
            events, peer_events = res[r][early][0], res[1 - r][early][0]
            for i, k in s.early_sends(r).items():
                f, b = s.actions[r][i], s.actions[r][i + 1]
                b_end = next(e for a, _, e in events if a == b)
                target = s.message(r, s.actions[r][k])[2]
                consumer = next(t for a, t, _ in peer_events if a.kind == "F" and
                                a.microbatch == f.microbatch and
                                s.stage_index(1 - r, a.chunk) == target)
                ahead += consumer < b_end - _SlowBackward.seconds / 2
        assert (ahead >= 1) if early else ahead == 0, (early, ahead)
    for r in (0, 1):
        for a, b in zip(res[r][True][1], res[r][False][1]):
            assert torch.equal(a, b)


def _posts_run(rank, world_size):
    """One DualPipeV step at pp2 (m = 6, each backward 60 ms of the host) with receives posted
    2 batches ahead (gloo's default) and where the schedule has them: when each message's send
    and receive were posted (absolute clock)."""
    from fastpar.pipeline import PipelineExecutor, p2p
    out, plain = {}, p2p.post
    for ahead in (2, 0):
        posted = out[ahead] = {}
        sched = build_schedule("dualpipe-v", 2, 6, 2)

        def watched(ops, stream=None):
            now = time.perf_counter()
            for op in ops:
                posted[("send" if op.op is dist.isend else "recv", op.tag)] = now
            return plain(ops, stream)
        p2p.post = watched
        try:
            torch.manual_seed(0)
            stages = [_SlowStage(8, sched.stage_index(rank, c), 4) for c in range(2)]
            pipe = PipelineExecutor(stages, sched, dist.group.WORLD, recv_ahead=ahead,
                                    activation=((2, 8), torch.float32),
                                    loss_fn=lambda y, t: (y - t).square().mean())
            g = torch.Generator().manual_seed(1)
            dist.barrier()
            pipe.step(torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g))
        finally:
            p2p.post = plain
    return out


@pytest.mark.timeout(90)
def test_receives_posted_ahead_are_posted_before_their_messages_are_sent():
    """gloo holds a message whose receive is not posted yet until the receiver posts it and
    asks for it. With a pair's send leaving right after its F, receives posted where the
    schedule has them come after their message's send (the peer's F ran a pair earlier than
    the schedule's batch); posted two batches ahead, every receive is waiting before its
    message leaves. (Late: posted after the send by over a third of a backward; a receive
    posted at the step's start may race its sender's first forward by a few ms.)"""
    from fastpar.testing import run_ranks
    res = run_ranks(_posts_run, 2, timeout=80)
    late = {}
    for ahead in (2, 0):
        late[ahead] = 0
        for r in (0, 1):
            sends = {t: v for (k, t), v in res[r][ahead].items() if k == "send"}
            recvs = {t: v for (k, t), v in res[1 - r][ahead].items() if k == "recv"}
            assert sends.keys() == recvs.keys() and len(sends) == 12
            late[ahead] += sum(recvs[t] > sends[t] + _SlowBackward.seconds / 3 for t in sends)
    assert late[2] == 0 and late[0] >= 2, late


@pytest.mark.fast
def test_the_simulator_sends_a_pairs_forward_before_its_backward():
    """The simulator times the executor's issue order: the message of a pair's F arrives
    ``comm`` after the F (and its post) ends, in both the plain and the core-sharing model."""
    s = build_schedule("dualpipe-v", 2, 8, 2)
    for kw in (dict(), dict(shared=(1, 2))):
        sim = simulate(s, f=2.0, b=1.0, w=1.0, comm=0.25, post=0.125, **kw)
        ev = {(e.rank, e.action): e for e in sim.events}
        checked = 0
        for r in range(2):
            for i, k in s.early_sends(r).items():
                f, b = s.actions[r][i], s.actions[r][i + 1]
                target = s.message(r, s.actions[r][k])[2]
                peer, chunk = s.place(target)
                consumer = ev[(peer, Action("F", f.microbatch, chunk, True))] \
                    if (peer, Action("F", f.microbatch, chunk, True)) in ev else \
                    ev[(peer, Action("F", f.microbatch, chunk))]
                assert consumer.start >= ev[(r, f)].end + 0.25 - 1e-9
                checked += consumer.start < ev[(r, b)].end - 1e-9
        assert checked >= 2, kw
        # With the pair's batch (NCCL where the early order could deadlock): never before B.
        late = simulate(s, f=2.0, b=1.0, w=1.0, comm=0.25, post=0.125, early=False, **kw)
        ev = {(e.rank, e.action): e for e in late.events}
        for r in range(2):
            for i, k in s.early_sends(r).items():
                target = s.message(r, s.actions[r][k])[2]
                peer, chunk = s.place(target)
                consumer = next(e for (p, a), e in ev.items() if p == peer and a.kind == "F"
                                and a.microbatch == s.actions[r][i].microbatch
                                and a.chunk == chunk)
                assert consumer.start >= ev[(r, s.actions[r][i + 1])].end + 0.25 - 1e-9
        assert late.step_time >= sim.step_time


class _Block(nn.Module):
    def __init__(self, d, ep_group):
        super().__init__()
        from fastpar.models.moe import MoE
        self.lin = nn.Linear(d, d)
        self.moe = MoE(d, 4, 2, 2 * d, ep_group=ep_group, ep_chunks=2)

    def forward(self, x):
        h = x + torch.tanh(self.lin(x))
        return h + self.moe(h)[0]


class _Stage(nn.Module):
    def __init__(self, d, ep_group, stage, num_stages):
        super().__init__()
        self.layers = nn.ModuleList([_Block(d, ep_group) for _ in range(2)])
        self.stage_index, self.num_stages = stage, num_stages

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _recorded(rank, world_size):
    """pp2 x ep2 (ranks 0, 1 a pipeline; 0 and 2 share experts), two MoE layers per stage: one
    step of DualPipeV and one of ZB-V (the same order but for the pairs), each recording every
    all-to-all issued and waited for, every backward step filled in and the MoE backward's
    compute; and the gradients of both."""
    from fastpar.mesh import fill
    from fastpar.pipeline import PipelineExecutor
    from test_moe_ep import recording
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp_rank, row = rank % 2, rank // 2
    D, m, B, S = 32, 4, 2, 8
    out = {}
    for name in ("dualpipe-v", "zb-v"):
        sched = build_schedule(name, 2, m, 2)
        stages = []
        for c in range(2):
            s = sched.stage_index(pp_rank, c)
            torch.manual_seed(100 + s)          # the same weights on both ep rows
            stages.append(_Stage(D, ep_groups[pp_rank], s, 4))
        events, real_fill = _Threads(), fill.fill

        def filled():
            events.append(("fill", None))
            ran = real_fill()
            events.append(("filled", ran))
            return ran
        fill.fill = filled
        try:
            with recording(events, ("_expert_forward", "_expert_dx")):
                torch.manual_seed(7 + row)          # each ep row its own batch
                x = torch.randn(m * B, S, D)
                t = torch.randn(m * B, S, D)
                pipe = PipelineExecutor(stages, sched, pp_groups[row],
                                        activation=((B, S, D), torch.float32),
                                        loss_fn=lambda y, t: (y - t).square().mean())
                pipe.step(x, t)
        finally:
            fill.fill = real_fill
        grads = [p.grad.clone() for st in stages for p in st.parameters()]
        out[name] = (events, grads)
    return out


class _Threads(list):
    """Events, each with the name of the thread that appended it (a pair's B runs on a thread
    of its own, ``fastpar-pair``; its F and everything else on the caller's)."""

    def append(self, e):
        super().append((*e, threading.current_thread().name))


def _hidden(events, issuer: str, computes: str) -> int:
    """How many ``computes`` (an expert phase) ran on another thread while a transfer issued
    on a thread named ``issuer`` was in flight (issued, not yet waited for)."""
    flying, hidden = set(), 0
    for kind, n, t in events:
        if kind == "issue" and t == issuer:
            flying.add(n)
        elif kind == "wait":
            flying.discard(n)
        elif kind == computes and t != issuer and flying:
            hidden += 1
    return hidden


@pytest.mark.timeout(150)
def test_the_pairs_forward_and_backward_compute_while_the_others_transfers_travel():
    """Under DualPipeV an overlapped F and its paired B take turns at their MoE layers' waits
    on a dispatch or a return: the B's expert backward computes while the F's all-to-alls are
    in flight (issued, not waited for), and the F's experts compute while the B's are. Under
    ZB-V (the same model, no pairs) neither happens: everything runs on one thread, and no
    fill point lets anything in. Both give the same gradients."""
    from fastpar.testing import run_ranks
    for rank, out in enumerate(run_ranks(_recorded, 4, timeout=120)):
        dual, zbv = out["dualpipe-v"], out["zb-v"]
        assert [e for e in dual[0] if e[:2] == ("filled", True)], rank
        assert _hidden(dual[0], "MainThread", "_expert_dx") >= 2, rank
        assert _hidden(dual[0], "fastpar-pair", "_expert_forward") >= 2, rank
        assert {t for _, _, t in zbv[0]} == {"MainThread"}, rank
        assert not [e for e in zbv[0] if e[:2] == ("filled", True)], rank
        for a, b in zip(dual[1], zbv[1]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (rank, (a - b).abs().max())


def test_a_pair_takes_turns_at_its_fill_points():
    """``fill.pair`` runs the first side to its first fill point, then the second to its
    first, and so on; a side that ends leaves the other to run on without pausing; the sides
    run with the caller's grad mode; an error in a side is raised by ``pair``; outside a pair
    a fill point runs nothing."""
    from fastpar.mesh import fill
    seen = []

    def side(name, points):
        def run():
            for i in range(points):
                seen.append((name, i, torch.is_grad_enabled()))
                seen.append((name, "ran other", fill.fill()))
            seen.append((name, "end", None))
        return run

    with torch.no_grad():
        times = fill.pair(side("F", 3), side("B", 1))
    assert seen == [("F", 0, False), ("B", 0, False), ("F", "ran other", True),
                    ("F", 1, False), ("B", "ran other", True), ("B", "end", None),
                    ("F", "ran other", True), ("F", 2, False), ("F", "ran other", False),
                    ("F", "end", None)]
    assert len(times) == 2 and min(times) >= 0
    assert fill.fill() is False

    def broken():
        raise ValueError("in a side")
    with pytest.raises(ValueError, match="in a side"):
        fill.pair(side("F", 2), broken)


MOE_ONE = dict(micro_batch_size=1, steps=6)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    from fastpar.testing import run_ranks
    from test_moe import MOE_PRESET, MOE_RUN, _train
    out = str(tmp_path_factory.mktemp("moe-one"))
    return run_ranks(_train, 1, dict(MOE_RUN, **MOE_ONE, out=out), MOE_PRESET, init_pg=False,
                     timeout=240)[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(ep=2), dict(ep=2, zero=3)], ids=["ep2", "ep2 zero3"])
def test_moe_under_expert_parallelism_trains_on_the_single_process_curve(layout, moe_reference,
                                                                         tmp_path):
    """The trainer at dp2 x pp2 x ep2 with DualPipeV (four micro-batches of one sequence; the
    pairs fill their MoE layers' transfer waits with the other micro-batch's backward), also
    under ZeRO-3: the single process's loss curve, with the auxiliary loss, the loss-free
    bias, a shared expert and a capacity that drops."""
    from fastpar.testing import run_ranks
    from test_moe import MOE_PRESET, MOE_RUN, _train
    got = run_ranks(_train, 4, dict(MOE_RUN, **MOE_ONE, out=str(tmp_path), dp=2, pp=2,
                                    schedule="dualpipe-v", **layout), MOE_PRESET,
                    init_pg=False, timeout=240)[0]
    want = moe_reference
    assert len(got) == len(want) == MOE_ONE["steps"] and want[-1] < want[0]
    for step, (a, b) in enumerate(zip(got, want), 1):     # ep's summation order: see test_moe
        assert abs(a - b) <= 1e-4 * b, f"step {step}: {a} vs {b}"


def test_the_dry_run_the_memory_model_and_the_planner_know_dualpipe_v():
    """8x7b on 1,024 ranks, tp2 (sp) x pp8 x dp64 with its experts over ep8: each pp rank
    builds stages r and 15 - r, which the memory model counts (equal per role). DualPipeV's
    pairs hide the MoE dispatch's waits behind each other's compute, but its steady
    state runs full backwards (no W left to fill the bubble): at 32 micro-batches its step is
    below ZB-V's and ZB-H1's on the same layout, at 16 (the fewest it takes, m = 2 pp) ZB-V's
    is below it; the search picks accordingly."""
    from fastpar.plan import BUILTIN, Cluster, Workload, planner
    from test_pp_zbv import dry_run_is_the_model
    steps = {}
    for sched in ("zb-h1", "zb-v", "dualpipe-v"):
        cfg, rep = dry_run_is_the_model(dict(model="8x7b", tp=2, pp=8, ep=8,
                                             global_batch_size=2048, schedule=sched))
        steps[sched] = rep.step_time_s
    assert cfg.virtual_stages == 2 and rep.roles[0].layers[-1] == 31
    assert steps["dualpipe-v"] < steps["zb-v"] < steps["zb-h1"], steps
    fixed = {"tp": 2, "pp": 8, "ep": 8, "ep_fold_tp": False, "micro_batch_size": 1, "zero": 1,
             "sequence_parallel": True, "recompute": "none"}
    cluster = Cluster(1024, 8, BUILTIN["h100-80gb"])
    for batch, first in ((2048, "dualpipe-v"), (1024, "zb-v")):
        best, _ = planner.search(Workload(cfg.model_config, 4096, batch), cluster, fixed=fixed,
                                 top=3)
        assert best[0].config.schedule == first, (batch, [e.config.schedule for e in best])


class _Waits(torch.autograd.Function):
    """A layer that would wait on a transfer in its forward and its backward: a fill point in
    each (as the MoE layer's dispatch); ``threads`` records the backward's threads."""

    threads: list = []

    @staticmethod
    def forward(ctx, x):
        fill.fill()
        return x * 2

    @staticmethod
    def backward(ctx, g):
        _Waits.threads.append(threading.current_thread().name)
        fill.fill()
        return g * 2


def _pair_run(device: str, paired: bool):
    """Micro-batch 0's backward and micro-batch 1's forward, as a pair or one after the other,
    under bf16 autocast on a side stream (CUDA): the loss, every gradient, and the threads the
    backward's fill points were reached on."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64, device=device) for _ in range(3)]
    seen = _Waits.threads = []

    def net(x):
        for layer in layers:
            x = _Waits.apply(layer(x)).relu()
        return x.float().square().mean()

    x0, x1 = (torch.randn(32, 64, device=device) for _ in range(2))
    stream = torch.cuda.Stream() if device == "cuda" else None
    out = {}
    with torch.autocast(device, torch.bfloat16), \
            (torch.cuda.stream(stream) if stream else contextlib.nullcontext()):
        y0 = net(x0)

        def f():
            out["y1"] = net(x1)

        def b():
            y0.backward()
        if paired:
            fill.pair(f, b)
        else:
            f()
            b()
        out["y1"].backward()
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    return out["y1"].detach(), [p.grad.clone() for m in layers for p in m.parameters()], seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")])])
def test_a_pair_equals_its_two_sides_run_one_after_the_other(device):
    """A pair (the forward of one micro-batch, the backward of another) under bf16 autocast, on a
    CUDA side stream: the backward side runs on its own thread with the caller's autocast and
    stream, the turns at the fill points (forward and backward; on CUDA the backward's are
    reached on autograd's device thread) neither hang nor change a number: the loss and every
    gradient equal the sides run one after the other (to the last bits a kernel's choice could
    move on a GPU)."""
    y, grads, seen = _pair_run(device, True)
    y_ref, ref, _ = _pair_run(device, False)
    assert set(seen) - {"MainThread"}, seen       # the pair's backward off the caller's thread
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
