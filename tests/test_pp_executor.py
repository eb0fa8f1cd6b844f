"""The executor on gloo ranks: every schedule against the unpipelined model, pp = 2 and 4; TP
inside the stages and DP across pipelines; bad batches; a dead peer."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastpar
from fastpar.models import GPT, GPTConfig
from fastpar.pipeline import (PipelineExecutor, PipelineTimeoutError, build_schedule,
                              build_stages, partition)
from fastpar.testing import run_ranks
from pp_model import ToyModel, batch, loss_fn, shard_tp

TOL = dict(atol=1e-5, rtol=1e-4)
CONFIGS = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2),
           ("dualpipe-v", 2)]
TOY_ACTIVATION = ((2, 5, 16), torch.float32)        # ToyModel: (micro-batch, seq, hidden)


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a, b, **TOL), f"{what}: max error {(a - b).abs().max().item()}"


def _one_schedule(mesh, name, v, m, activation=None):
    """Three SGD steps pipelined and unpipelined; loss, every gradient, peak, hook, parameters.
    ``activation``: the declared (shape, dtype) between stages (no shape handshake)."""
    pp, rank = mesh.pp_size, mesh.pp_rank
    sched = build_schedule(name, pp, m, v)
    if sched.placement != "loop":               # a V: declared, its handoffs need no message
        activation = activation or TOY_ACTIVATION
    torch.manual_seed(0)
    model = ToyModel(layers=2 * pp)
    ref = copy.deepcopy(model)
    stages = build_stages(model, rank, pp, v, placement=sched.placement)
    last = sched.place(sched.num_stages - 1)[0]  # the rank holding the loss
    ready = {}

    def grads_ready(chunk, stage):              # what the data-parallel code would reduce
        ready[chunk] = {n: p.grad.clone() for n, p in stage.named_parameters()}

    pipe = PipelineExecutor(stages, sched, mesh.pp_group, loss_fn=loss_fn,
                            grads_ready=grads_ready, activation=activation)
    params = [p for st in stages for p in st.parameters()]
    opt, ref_opt = torch.optim.SGD(params, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        tokens, targets = batch(step, size=2 * m)
        evaluated = pipe.evaluate(tokens, targets)      # forward only: no gradient, no graph
        assert all(p.grad is None for p in params), f"{name}: evaluate left gradients"
        loss = pipe.step(tokens, targets)
        ref_loss = loss_fn(ref(tokens), targets)
        if rank == last:
            _close(evaluated, ref_loss.detach(), f"{name} step {step} evaluated loss")
            assert not evaluated.requires_grad
        else:
            assert evaluated is None
        ref_loss.backward()
        if rank == last:
            _close(loss, ref_loss.detach(), f"{name} step {step} loss")
        else:
            assert loss is None
        for st in stages:
            for n, p in st.named_parameters():
                _close(p.grad, ref.get_parameter(n).grad, f"{name} step {step} grad {n}")
                _close(ready[sched.place(st.stage_index)[1]][n], p.grad,
                       f"{name} hook grad {n}")
        assert sorted(ready) == list(range(v))
        assert pipe.peak_activations == sched.peak_activations[rank]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        ready.clear()
    for st in stages:
        for n, p in st.named_parameters():
            _close(p.detach(), ref.get_parameter(n).detach(), f"{name} parameter {n} after 3 steps")
    return pipe.peak_activations


def _bad_batches(mesh, m):
    """Errors found in one rank's batch reach every rank (the first step carries them)."""
    pp, rank = mesh.pp_size, mesh.pp_rank
    pipe = PipelineExecutor(build_stages(ToyModel(layers=pp), rank, pp),
                            build_schedule("1f1b", pp, m), mesh.pp_group, loss_fn=loss_fn)
    tokens, targets = batch(0, size=2 * m)
    carried = []
    for x, y in ((tokens[:m + 1], targets), (tokens, targets[:m + 1]), (None, targets)):
        with pytest.raises(ValueError) as e:
            pipe.step(x, y)
        carried.append(str(e.value))
    assert pipe.step(tokens, targets) is None or rank == pp - 1     # and it recovers
    local = []
    cases = [lambda: PipelineExecutor(build_stages(ToyModel(layers=pp), rank, pp),
                                      build_schedule("1f1b", pp + 1, m), mesh.pp_group,
                                      loss_fn=loss_fn),
             lambda: PipelineExecutor(build_stages(ToyModel(layers=2 * pp), rank, pp, 2),
                                      build_schedule("1f1b", pp, m), mesh.pp_group,
                                      loss_fn=loss_fn),
             lambda: PipelineExecutor(build_stages(ToyModel(layers=pp), (rank + 1) % pp, pp),
                                      build_schedule("1f1b", pp, m), mesh.pp_group,
                                      loss_fn=loss_fn),
             lambda: PipelineExecutor(build_stages(ToyModel(layers=pp), rank, pp),
                                      build_schedule("1f1b", pp, m), mesh.pp_group,
                                      loss_fn=loss_fn, recv_ahead=-1)]
    for case in cases:
        with pytest.raises(ValueError) as e:
            case()
        local.append(str(e.value))
    assert f"pp_size={pp + 1}, the pipeline group has {pp} ranks" in local[0]
    assert "2 stage module(s)" in local[1] and "virtual_stages=1" in local[1]
    assert f"must be stage {rank} of {pp}" in local[2]
    assert "recv_ahead=-1 must be an int >= 0" in local[3]
    return carried


def _overlap_off_is_identical(mesh, name, v, m):
    """Waiting for every batch right after posting it gives bit-identical gradients."""
    grads = []
    for overlap in (True, False):
        torch.manual_seed(0)
        stages = build_stages(ToyModel(layers=2 * mesh.pp_size), mesh.pp_rank, mesh.pp_size, v)
        pipe = PipelineExecutor(stages, build_schedule(name, mesh.pp_size, m, v), mesh.pp_group,
                                loss_fn=loss_fn, overlap=overlap)
        pipe.step(*batch(5, size=2 * m))
        grads.append([p.grad for st in stages for p in st.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads)), name


def _gpt_stages(mesh):
    """fastpar's GPT built per stage (layers, pre_process, post_process) runs as it is."""
    for rotary, vocab in ((True, 64), (False, 60)):    # learned positions: a table the forward
        _gpt_stages_of(mesh, GPTConfig(vocab_size=vocab, n_layers=4, d_model=32, n_heads=4,
                                       max_seq_len=16, pad_vocab_to=64, rotary=rotary))


def _unused(logits, targets):
    raise AssertionError("stage_loss=True: the last stage computes the loss, loss_fn is unused")


def _gpt_stages_of(mesh, cfg):
    pp, rank = mesh.pp_size, mesh.pp_rank
    ref = GPT(cfg)
    tokens, targets = batch(4, size=8, seq=16, vocab=cfg.vocab_size)

    def gpt_loss(logits, t):                     # logits (B, S, V) on the last stage
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    gpt_loss(ref(tokens), targets).backward()
    # stage_loss: the last stage computes the model's own loss (padding columns unmasked).
    for name, v, stage_loss in (("zb-h1", 1, False), ("interleaved", 2, False),
                                ("1f1b", 1, True), ("zb-h1", 1, True)):
        parts = partition([0.0] + [1.0] * cfg.n_layers + [0.0], pp, v)
        stages = [GPT(cfg, layers=parts[s], pre_process=s == 0, post_process=s == pp * v - 1)
                  for s in (c * pp + rank for c in range(v))]
        pipe = PipelineExecutor(stages, build_schedule(name, pp, 4, v), mesh.pp_group,
                                loss_fn=_unused if stage_loss else gpt_loss, stage_loss=stage_loss)
        loss = pipe.step(tokens, targets)
        if rank == pp - 1:
            _close(loss, gpt_loss(ref(tokens), targets).detach(), f"GPT {name} loss")
        for st in stages:
            for n, p in st.named_parameters():
                assert p.grad is not None, f"GPT {name} rotary={cfg.rotary}: no grad for {n}"
                _close(p.grad, ref.get_parameter(n).grad, f"GPT {name} grad {n}")


def _pipeline(rank, world_size):
    torch.set_num_threads(1)                    # ranks share 2 cores: no intra-op threads
    mesh = fastpar.init(pp=world_size)
    m = {2: 6, 4: 8}[world_size]
    peaks = {name: _one_schedule(mesh, name, v, m) for name, v in CONFIGS}
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        _overlap_off_is_identical(mesh, name, v, m)
    if world_size == 2:
        _gpt_stages(mesh)
    return peaks, _bad_batches(mesh, m)


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_unpipelined(pp):
    out = run_ranks(_pipeline, pp, timeout=150)
    m = {2: 6, 4: 8}[pp]
    for rank, (peaks, _) in enumerate(out):
        assert peaks["1f1b"] == min(pp - rank, m) <= pp        # measured, not predicted
        assert peaks["gpipe"] == m
        assert peaks["zb-h1"] <= pp
    carried = [errors for _, errors in out]
    assert all(c == carried[0] for c in carried)                # the same errors on every rank
    assert f"{m + 1} samples in dim 0, which do not split into num_microbatches={m}" \
        in carried[0][0] and carried[0][0].startswith("pipeline step: inputs")
    assert carried[0][1].startswith("pipeline step: targets")
    assert "the rank holding stage 0 needs inputs" in carried[0][2]


def _declared_activation(rank, world_size):
    """The model declares what passes between stages: the same numbers with no handshake
    message; a wrong declaration and a bad batch raise the same error on every rank."""
    from fastpar.pipeline import p2p
    torch.set_num_threads(1)
    mesh = fastpar.init(pp=world_size, timeout=20)
    sent = []
    for name in ("send_meta", "recv_meta"):         # the handshake's only two calls
        real = getattr(p2p, name)
        setattr(p2p, name, lambda *a, _real=real, **k: sent.append(a) or _real(*a, **k))
    m, act = 4, TOY_ACTIVATION
    for name, v in (("1f1b", 1), ("interleaved", 2), ("zb-v", 2)):
        _one_schedule(mesh, name, v, m, activation=act)
    stages = build_stages(ToyModel(layers=2 * world_size), mesh.pp_rank, world_size, 1)
    errors = []
    # A bad batch: every rank was given it, every rank refuses it. A wrong declaration: the
    # stage that finds it refuses to send (its peer's receive then fails: last, on purpose).
    # The wrong declaration's receive fails by the group's timeout: 5 s, on groups of their own.
    short = fastpar.init(pp=world_size, timeout=5)
    for declared, size in ((act, 2 * m + 1), (((2, 5, 8), torch.float32), 2 * m)):
        pipe = PipelineExecutor(stages, build_schedule("1f1b", world_size, m), short.pp_group,
                                loss_fn=loss_fn, activation=declared)
        try:
            pipe.step(*batch(0, size=size))
        except (ValueError, PipelineTimeoutError) as e:
            errors.append(str(e))
    return len(sent), errors


def test_declared_activation_needs_no_handshake():
    out = run_ranks(_declared_activation, 2, timeout=120)
    assert [n for n, _ in out] == [0, 0]             # not one shape message
    bad, wrong = [errors[0] for _, errors in out], out[0][1][1]
    assert bad[0] == bad[1] and "9 samples in dim 0" in bad[0], bad
    assert "its output is (2, 5, 16) torch.float32, the declared activation (2, 5, 8)" in wrong


def _tp_and_dp(rank, world_size):
    torch.set_num_threads(1)
    # TP inside each stage: tp=2 x pp=2; shards of the gradients against the unsharded model.
    mesh = fastpar.init(tp=2, pp=2)
    tp, tp_rank = mesh.tp_size, mesh.tp_rank
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
        torch.manual_seed(0)
        ref = ToyModel(layers=4)
        model = shard_tp(copy.deepcopy(ref), mesh.tp_group)
        stages = build_stages(model, mesh.pp_rank, 2, v)
        pipe = PipelineExecutor(stages, build_schedule(name, 2, 4, v), mesh.pp_group,
                                loss_fn=loss_fn)
        tokens, targets = batch(1, size=8)
        loss = pipe.step(tokens, targets)
        ref_loss = loss_fn(ref(tokens), targets)
        ref_loss.backward()
        if mesh.pp_rank == 1:
            _close(loss, ref_loss.detach(), f"tp {name} loss")
        for st in stages:
            for n, p in st.named_parameters():
                g = ref.get_parameter(n).grad
                g = g.chunk(tp, 0)[tp_rank] if ".fc1." in n else (
                    g.chunk(tp, 1)[tp_rank] if n.endswith("fc2.weight") else g)
                _close(p.grad, g, f"tp {name} grad {n}")
    # DP across pipelines: pp=2 x dp=2, each replica half the batch, gradients all-reduced from
    # the grads_ready hook while the pipeline still runs.
    mesh = fastpar.init(pp=2, dp=2)
    order = []
    for name, v in (("interleaved", 2), ("zb-h1", 1)):
        torch.manual_seed(0)
        model = ToyModel(layers=4)
        ref = copy.deepcopy(model)
        stages = build_stages(model, mesh.pp_rank, 2, v)
        works = []

        def reduce_chunk(chunk, stage):
            order.append((name, chunk))
            works.extend(dist.all_reduce(p.grad, group=mesh.dp_group, async_op=True)
                         for p in stage.parameters())

        pipe = PipelineExecutor(stages, build_schedule(name, 2, 4, v), mesh.pp_group,
                                loss_fn=loss_fn, grads_ready=reduce_chunk)
        tokens, targets = batch(2, size=16)
        pipe.step(tokens.chunk(2)[mesh.dp_rank], targets.chunk(2)[mesh.dp_rank])
        for w in works:
            w.wait()
        loss_fn(ref(tokens), targets).backward()
        for st in stages:
            for n, p in st.named_parameters():
                _close(p.grad / mesh.dp_size, ref.get_parameter(n).grad, f"dp {name} grad {n}")
    return order


def test_tp_inside_stages_and_dp_across_pipelines():
    orders = run_ranks(_tp_and_dp, 4, timeout=150)
    # With two chunks per rank, chunk 1's gradients are complete (and reducing) before chunk 0's.
    assert all(o[:2] == [("interleaved", 1), ("interleaved", 0)] for o in orders)


def _dead_peer(rank, world_size, flag):
    torch.set_num_threads(1)
    mesh = fastpar.init(pp=2, timeout=2)
    torch.manual_seed(0)
    pipe = PipelineExecutor(build_stages(ToyModel(layers=2), rank, 2),
                            build_schedule("1f1b", 2, 2), mesh.pp_group, loss_fn=loss_fn)
    tokens, targets = batch(0, size=4)
    pipe.step(tokens, targets)                  # a good step first: shapes known
    start = time.monotonic()
    if rank == 0:                               # rank 1 has "died": it never runs the step
        with pytest.raises(PipelineTimeoutError) as e:
            pipe.step(tokens, targets)
        open(flag, "w").close()
        return str(e.value), time.monotonic() - start
    while not os.path.exists(flag) and time.monotonic() - start < 30:
        time.sleep(0.05)
    return None


def test_dead_peer_fails_with_stage_and_microbatch(tmp_path):
    (message, waited), _ = run_ranks(_dead_peer, 2, str(tmp_path / "done"), timeout=60)
    assert message.startswith("pipeline stage 0 (pp rank 0) receiving the gradient of "
                              "micro-batch 0 out of stage 0 from stage 1 (pp rank 1, global "
                              "rank 1) did not complete"), message
    assert 1.5 < waited < 15


class _Work:
    """A fake c10d Work that records how it is waited for, and can fail like a timed-out one."""

    def __init__(self, error=None):
        self.calls, self.error = [], error

    def wait(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_p2p_wait_never_passes_a_timeout_to_work_wait():
    """Work.wait(timeout) spins the host under NCCL; the group's own timeout bounds the wait."""
    from fastpar.pipeline import p2p

    works = [_Work(), _Work()]
    p2p.wait(works, "receiving x")
    assert all(w.calls == [((), {})] for w in works)
    failed = _Work("Timed out waiting 2000ms for recv operation to complete")
    with pytest.raises(PipelineTimeoutError, match="^receiving x did not complete: Timed out"):
        p2p.wait([failed], "receiving x")
    assert failed.calls == [((), {})]
