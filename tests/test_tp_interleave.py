"""Interleaved micro-batches (``GPT.interleaved``, ``--interleave``): the same losses and
gradients as one micro-batch after another and as the single-process model, at tp 2 and 4; the
same collectives; each row-parallel all-reduce left in flight while the other micro-batch
computes, and seen to finish there; bad combinations refused."""
import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.models import GPT, GPTConfig
from fastpar.models.parallel_config import ParallelConfig
from fastpar.tensor_parallel import overlap
from fastpar.testing import run_ranks
from test_model import _params, _shard
from wire import WireRecorder

CONFIGS = {
    "llama-gqa": GPTConfig(vocab_size=96, n_layers=2, d_model=64, n_heads=8, n_kv_heads=4,
                           max_seq_len=32),
    # biases: the row linears' are added by the caller after the wait (skip_bias_add)
    "gpt2": GPTConfig(vocab_size=96, n_layers=2, d_model=64, n_heads=4, max_seq_len=32,
                      norm="layernorm", activation="gelu", rotary=False, bias=True,
                      tie_embeddings=True),
}


def _batches(cfg, n=3, b=2, s=32):
    g = torch.Generator().manual_seed(7)
    return ([torch.randint(0, cfg.vocab_size, (b, s), generator=g) for _ in range(n)],
            [torch.randint(0, cfg.vocab_size, (b, s), generator=g) for _ in range(n)])


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _equal(rank, world_size, name, recompute):
    cfg = CONFIGS[name]
    xs, ys = _batches(cfg)
    full = GPT(cfg)
    ref = [full(x, y) for x, y in zip(xs, ys)]
    sum(ref).backward()
    model = GPT(cfg, tp_group=dist.group.WORLD, recompute=recompute)
    seq = [model(x, y) for x, y in zip(xs, ys)]
    sum(seq).backward()
    one_by_one = _grads(model)
    model.zero_grad(set_to_none=True)
    with WireRecorder() as wire_seq:
        [model(x, y) for x, y in zip(xs, ys)]
    with WireRecorder() as wire_il:
        il = model.interleaved(xs, ys)
    assert sorted(wire_il.records) == sorted(wire_seq.records)     # nothing added or lost
    sum(il).backward()
    for a, b, r in zip(il, seq, ref):
        assert torch.equal(a, b), (a, b)                   # the same ops on the same inputs
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    for n, p, full_p, _ in _params(model, full, world_size, rank):
        torch.testing.assert_close(p.grad, one_by_one[n], atol=1e-6, rtol=1e-5, msg=n)
        want = _shard(model.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1],
                      full_p.grad, world_size, rank)    # this rank's shard of the full gradient
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4, msg=n)
    return True


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_interleaved_equals_one_after_another_and_the_full_model(tp, name, recompute):
    assert all(run_ranks(_equal, tp, name, recompute, timeout=120))


class _Probe:
    """Wraps ``collectives.all_reduce`` as the row linears call it when deferred (and the column
    linears' backward): records, per work, forward or backward, whether it had finished right
    after issue and at the moment it is waited, and how many all-reduces were issued in between
    (another micro-batch's blocks computed)."""

    def __init__(self):
        self.issued, self.real = [], overlap.collectives.all_reduce

    def __call__(self, tensor, *args, **kwargs):
        work = self.real(tensor, *args, **kwargs)
        if not kwargs.get("async_op"):          # the module's other callers (the loss's)
            return work
        rec = {"forward": overlap._deferred is not None,    # a row's, or a column's backward
               "at_issue": work.is_completed(), "at_wait": None, "waits": 0}
        self.issued.append(rec)
        issued = self.issued

        class Work:
            def wait(self):
                if not rec["waits"]:
                    rec["at_wait"] = work.is_completed()
                    rec["issued_since"] = len(issued) - issued.index(rec) - 1
                rec["waits"] += 1
                return work.wait()
        return Work()


LEAD_S, MAX_RUNS = 0.1, 12


@contextlib.contextmanager
def probing():
    """A :class:`_Probe` in place of the overlap module's all-reduce while inside."""
    probe = _Probe()
    overlap.collectives.all_reduce = probe
    try:
        yield probe
    finally:
        overlap.collectives.all_reduce = probe.real


def progress(rank, world_size, run_once):
    """``run_once(model, xs, ys)`` (2 micro-batches; returns the probe records in issue order,
    each checked waited once) again and again, each rank in turn starting on time and its
    peers ``LEAD_S`` later, until every rank has led once and, in the forward and in the
    backward, some wait has found its all-reduce finished with another all-reduce issued since
    (the other micro-batch computed in between) and every rank has led a run whose first
    all-reduce was not finished at issue. Returns (runs whose first all-reduce was not
    finished at issue on the leading rank, runs led, the two found-finished flags)."""
    cfg = GPTConfig(vocab_size=96, n_layers=4, d_model=256, n_heads=4, max_seq_len=128)
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=dist.group.WORLD)
    xs, ys = _batches(cfg, n=2, b=4, s=128)
    pending = first = 0
    finished = {"forward": False, "backward": False}
    for run in range(MAX_RUNS):
        lead = run % world_size                   # each rank in turn starts on time
        dist.barrier()
        if rank != lead:
            time.sleep(LEAD_S)
        records = run_once(model, xs, ys)
        assert all(r["waits"] == 1 for r in records), records
        if rank == lead:    # its first all-reduce was issued before any peer had started
            first += 1
            pending += not records[0]["at_issue"]
        for key in finished:
            finished[key] |= any(r["at_wait"] and not r["at_issue"] and r["issued_since"]
                                 for r in records if r["forward"] == (key == "forward"))
        everyone = [None] * world_size
        dist.all_gather_object(everyone, all(finished.values()) and pending > 0)
        if run >= world_size - 1 and all(everyone):
            break
    return pending, first, finished


def _interleaved_once(model, xs, ys):
    with probing() as probe:
        losses = model.interleaved(xs, ys)
    with probing() as back:
        sum(losses).backward()
    # 2 micro-batches x 4 blocks x 2 branches; in the backward the same for the column
    # linears' input grads
    assert len(probe.issued) == 16 and len(back.issued) == 16, (probe.issued, back.issued)
    assert all(r["forward"] for r in probe.issued) and not any(r["forward"]
                                                               for r in back.issued)
    return probe.issued + back.issued


def _progress(rank, world_size):
    return progress(rank, world_size, _interleaved_once)


@pytest.mark.parametrize("tp", [2, 4])
def test_reductions_travel_while_the_other_micro_batch_computes(tp):
    """Progress, not order: the row-parallel all-reduce a micro-batch issues has not finished
    when the issue returns (the issuing rank started first, its peers 0.1 s later; in most
    runs each rank leads), and some
    are found finished when their micro-batch comes back to wait for them, with only the other
    micro-batch's block computed in between. In the backward likewise for the column linears'
    input-gradient all-reduces: waited once, only after the other micro-batch's backward has
    issued its own, and some found finished. An interleave that waited at issue, or whose
    all-reduces moved only when waited on, fails here."""
    for pending, first, finished in run_ranks(_progress, tp, timeout=180):
        # (a led run may meet a busy machine that holds the leader between the issue and the
        # check while its peers catch up and the all-reduce completes; runs go on until each
        # rank has led one with it pending: an interleave that waited at issue never does)
        assert pending and 2 * pending >= first, \
            f"an all-reduce had finished when its issue returned ({pending} of {first} pending)"
        assert all(finished.values()), f"none finished while the other micro-batch computed: " \
                                        f"{finished}"


def test_bad_combinations_are_refused():
    tiny = GPTConfig(vocab_size=96, n_layers=2, d_model=64, n_heads=4, max_seq_len=32)
    ok = ParallelConfig(tp=2, micro_batch_size=1, interleave=2)
    ok.check(tiny, 2, 4, 32)
    cases = {
        "tp=1": dict(tp=1),
        "sequence parallelism": dict(sequence_parallel=True),
        "pp=2": dict(pp=2, dp=1),
        "cp=2": dict(cp=2, dp=1),
        "recompute 'full'": dict(recompute="full"),
        "zero 3": dict(zero=3, dp=2),
        "1 micro-batch per step": dict(micro_batch_size=4),
    }
    for why, change in cases.items():
        bad = ParallelConfig(**{**ok.__dict__, **change})
        world = bad.tp * bad.pp * bad.cp * (bad.dp or 1)
        with pytest.raises(ValueError, match=f"interleave=2 needs .*{why}"):
            bad.check(tiny, world, 4 * (bad.dp or 1), 32)
    with pytest.raises(ValueError, match="dropout=0.1"):
        ok.check(tiny.replace(dropout=0.1), 2, 4, 32)
    with pytest.raises(ValueError, match="interleave"):
        ParallelConfig(interleave=0).check_fields()
    model = GPT(tiny)
    model.layers["0"].register_forward_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match="hooks on 0 would not run"):
        model.interleaved(*_batches(tiny, n=2))
    with pytest.raises(ValueError, match="recompute 'none' or 'selective'"):
        GPT(tiny, recompute="full").interleaved(*_batches(tiny, n=2))
    with pytest.raises(ValueError, match="dropout=0.1"):
        GPT(tiny.replace(dropout=0.1)).interleaved(*_batches(tiny, n=2))


def _late_node_in_child(q):
    x = torch.randn(3, requires_grad=True)
    y, _ = overlap.wait_grad_later(x)
    y.sum().backward()
    q.put(x.grad.tolist())


def test_the_late_node_thread_survives_a_fork():
    """A process forked after the helper thread started (which the child does not inherit)
    still gets its WaitGrad nodes made: no hang."""
    import multiprocessing as mp

    x = torch.randn(3, requires_grad=True)
    y, _ = overlap.wait_grad_later(x)           # the parent's helper thread is running
    y.sum().backward()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_late_node_in_child, args=(q,))
    p.start()
    p.join(30)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive and q.get(timeout=5) == [1.0, 1.0, 1.0]
