"""Forward inside backward (``overlap_forward_backward``, the trainer's default under tp > 1
without SP): the same losses and gradients, bit for bit, as one micro-batch after another, and
the single-process model's, at tp 2 and 4, with dropout, recompute and bf16 autocast; the same
collectives; each backward all-reduce in flight while the next micro-batch's forward computes,
and each forward one while the backward computes; about one micro-batch's activations; where
the trainer turns it on."""
import gc

import pytest
import torch
import torch.distributed as dist

from fastpar.extension import CPUMemory
from fastpar.models import GPT, GPTConfig
from fastpar.models.gpt import overlap_forward_backward
from fastpar.models.parallel_config import ParallelConfig
from fastpar.tensor_parallel import overlap
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig
from fastpar.train.flags import flags_of
from test_model import _params, _shard
from test_tp_interleave import CONFIGS, _batches, _grads, probing, progress
from wire import WireRecorder


def _one_after_another(model, xs, ys):
    total = 0
    for x, y in zip(xs, ys):
        loss = model(x, y) / len(xs)
        loss.backward()
        total = total + loss.detach()
    return total


def _equal(rank, world_size, name, recompute, dropout, bf16):
    cfg = CONFIGS[name].replace(dropout=0.1 if dropout else 0.0)
    xs, ys = _batches(cfg)
    ctx = (lambda: torch.autocast("cpu", torch.bfloat16)) if bf16 else \
        (lambda: torch.autocast("cpu", enabled=False))
    full = GPT(cfg)
    torch.manual_seed(5)
    with ctx():
        ref = _one_after_another(full, xs, ys)
    model = GPT(cfg, tp_group=dist.group.WORLD, recompute=recompute)
    torch.manual_seed(5)                         # the dropout masks: drawn in the same order
    with ctx(), WireRecorder() as wire_seq:
        seq = _one_after_another(model, xs, ys)
    one_by_one = _grads(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with ctx(), WireRecorder() as wire_fb:
        fb = overlap_forward_backward(model, xs, ys, len(xs))
    # the same collectives and sizes: nothing added or lost (the backward's input-gradient
    # all-reduces go through collectives.all_reduce here, through the extension's op there)
    assert sorted(wire_fb.records) == sorted(wire_seq.records), (wire_fb.records,
                                                                 wire_seq.records)
    assert torch.equal(fb, seq), (fb, seq)       # the same ops on the same inputs
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, one_by_one[n]), n
    if not dropout:                  # (the single process draws other masks: no shards)
        tol = dict(atol=2e-2, rtol=2e-2) if bf16 else dict(atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fb, ref, **tol)
        for n, p, full_p, _ in _params(model, full, world_size, rank):
            want = _shard(model.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1],
                          full_p.grad, world_size, rank)
            torch.testing.assert_close(p.grad, want, **tol, msg=n)
    return True


@pytest.mark.parametrize("case", [
    dict(tp=2, name="llama-gqa", recompute="none", dropout=False, bf16=False),
    dict(tp=2, name="gpt2", recompute="selective", dropout=False, bf16=False),
    dict(tp=4, name="llama-gqa", recompute="selective", dropout=False, bf16=False),
    dict(tp=4, name="gpt2", recompute="none", dropout=False, bf16=False),
    dict(tp=2, name="gpt2", recompute="none", dropout=True, bf16=False),
    dict(tp=2, name="llama-gqa", recompute="none", dropout=False, bf16=True),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_forward_inside_backward_equals_one_after_another(case):
    case = dict(case)
    tp = case.pop("tp")
    assert all(run_ranks(_equal, tp, *case.values(), timeout=180))


def _fb_once(model, xs, ys):
    with probing() as probe:
        overlap_forward_backward(model, xs, ys, 2)
    fwd = [r for r in probe.issued if r["forward"]]
    # both micro-batches' forwards: the embedding's and 4 blocks x 2 row all-reduces left in
    # flight (micro-batch 0's waited at its next step: nothing to overlap before the first
    # backward); micro-batch 0's backward: the head's and 4 x 2 column input-gradient ones,
    # each with a forward step of micro-batch 1 run under it
    assert len(fwd) == 18 and len(probe.issued) - len(fwd) == 9, probe.issued
    return probe.issued


def _progress(rank, world_size):
    return progress(rank, world_size, _fb_once)


@pytest.mark.parametrize("tp", [2, 4])
def test_reductions_travel_under_the_other_micro_batchs_compute(tp):
    """Progress, not order: a backward all-reduce has not finished when its issue returns (the
    issuing rank started 0.1 s before its peers), and is found finished when waited, with the
    next micro-batch's forward step (which issued its own all-reduce) run in between; a forward
    all-reduce likewise, with the backward's compute (and its next all-reduce) in between. A
    backward that waited before running the forward step, or a forward step that waited its
    own all-reduce, fails here."""
    for pending, first, finished in run_ranks(_progress, tp, timeout=180):
        assert pending and 2 * pending >= first, \
            f"an all-reduce had finished when its issue returned ({pending} of {first} pending)"
        assert all(finished.values()), f"none finished under the other's compute: {finished}"


def _peaks(rank, world_size):
    torch.set_num_threads(1)
    CPUMemory.install()
    cfg = GPTConfig(vocab_size=96, n_layers=4, d_model=128, n_heads=4, max_seq_len=256)
    xs, ys = _batches(cfg, n=4, b=2, s=256)
    model = GPT(cfg, tp_group=dist.group.WORLD)
    out = {}
    for mode in ("seq", "fb", "interleave 2"):
        model.zero_grad(set_to_none=True)
        gc.collect()
        base = CPUMemory.allocated()
        CPUMemory.reset_peak()
        if mode == "seq":
            _one_after_another(model, xs, ys)
        elif mode == "fb":
            overlap_forward_backward(model, xs, ys, 4)
        else:
            for i in (0, 2):
                (sum(model.interleaved(xs[i:i + 2], ys[i:i + 2])) / 4).backward()
        out[mode] = CPUMemory.peak() - base
    return out


def test_about_one_micro_batchs_activations():
    """The backward frees its blocks from the top while the next forward fills from the bottom:
    the peak (gradients included) is one micro-batch's plus at most one block's, where holding
    both micro-batches (the forward run whole before the backward, as interleaving does)
    costs a micro-batch more."""
    for peaks in run_ranks(_peaks, 2, timeout=180):
        seq, fb, both = peaks["seq"], peaks["fb"], peaks["interleave 2"]
        layer = (both - seq) / 4                # one micro-batch's four blocks, about
        assert both > 1.5 * seq, peaks          # (the measurement can tell)
        assert seq <= fb <= seq + layer, peaks


def test_where_the_trainer_turns_it_on():
    on = ParallelConfig(tp=2, dp=1, micro_batch_size=1)
    assert on.fb_overlapped(4)
    for change in (dict(tp=1), dict(sequence_parallel=True), dict(pp=2), dict(cp=2),
                   dict(recompute="full"), dict(zero=3), dict(interleave=2),
                   dict(fb_overlap=False)):
        assert not ParallelConfig(**{**on.__dict__, **change}).fb_overlapped(4), change
    assert not on.fb_overlapped(1)              # one micro-batch: nothing to overlap
    assert not TrainConfig(tp=2, compile=True).fb_overlapped(4)
    assert TrainConfig(tp=2).fb_overlapped(4)
    # --no-fb-overlap, and back
    assert flags_of(TrainConfig(fb_overlap=False), ["fb_overlap"], TrainConfig()) == \
        ["--no-fb-overlap"]
    assert flags_of(TrainConfig(), ["fb_overlap"], TrainConfig()) == []


def test_the_cli_flag():
    import argparse

    from fastpar.train.flags import add_flags
    p = argparse.ArgumentParser()
    add_flags(p, TrainConfig, ["fb_overlap", "sequence_parallel"])
    assert p.parse_args([]).fb_overlap is True
    assert p.parse_args(["--no-fb-overlap"]).fb_overlap is False
    assert p.parse_args(["--sequence-parallel"]).sequence_parallel is True


def test_a_hook_on_a_block_is_refused():
    tiny = GPTConfig(vocab_size=96, n_layers=2, d_model=64, n_heads=4, max_seq_len=32)
    model = GPT(tiny)
    model.layers["0"].register_forward_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match="hooks on 0 would not run"):
        overlap_forward_backward(model, *_batches(tiny, n=2))
