"""The tensor-parallel layers under bf16 autocast, the way a GPU training step runs them.

On a GPU the trainer runs bf16 autocast over fp32 weights, so the TP layers see bf16 activations
next to fp32 parameters. CPU autocast (``torch.autocast("cpu", dtype=torch.bfloat16)``) puts them
in the same situation. A small model built from every TP layer (vocab-parallel embedding, column,
row, column logits, vocab-parallel cross-entropy) runs forward and backward in each overlap x
sequence-parallel combination at tp 2 and 4 and must
- give, at every layer, the dtype that torch's own layers give under autocast (bf16 out of the
  linears, fp32 out of the embedding, the fp32 residual sum and the loss; fp32 parameter
  gradients);
- give a loss and parameter gradients within bf16 rounding of the fp32 single-process run:
  max |error| <= TOL * max |reference| per tensor, TOL = 3e-2 (bf16 keeps 8 significant bits,
  a relative rounding of 2^-9 per operation, accumulated over a few GEMMs and reductions), and
  no worse than 4x the error of the same model built from torch's layers under autocast.
"""
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                     VocabParallelEmbedding, reduce_replicated_grads,
                                     vocab_parallel_cross_entropy)
from fastpar.split_backward import backward_phase
from fastpar.testing import run_ranks

V, D, H, S, B = 32, 16, 64, 8, 2
TOL = 3e-2
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _reference(autocast: bool):
    """(loss, dtypes, {name: grad}) of the model from torch's own layers, fp32 or autocast."""
    torch.manual_seed(0)
    emb, fc1, fc2, head = nn.Embedding(V, D), nn.Linear(D, H), nn.Linear(H, D), \
        nn.Linear(D, V, bias=False)
    ids, target = _data()
    with torch.autocast(**BF16, enabled=autocast):
        e = emb(ids)
        h = fc1(e)
        y = fc2(F.gelu(h)) + e
        logits = head(y)
        loss = F.cross_entropy(logits.view(-1, V), target.view(-1))
    loss.backward()
    dtypes = [t.dtype for t in (e, h, y, logits, loss)]
    grads = {"emb": emb.weight.grad, "fc1": fc1.weight.grad, "fc1.b": fc1.bias.grad,
             "fc2": fc2.weight.grad, "fc2.b": fc2.bias.grad, "head": head.weight.grad}
    return loss.detach(), dtypes, grads


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (S, B), generator=g), torch.randint(0, V, (S, B), generator=g)


def _sharded(group, overlap: bool, sp: bool):
    tp, r = group.size(), group.rank()
    torch.manual_seed(0)
    kw = dict(tp_group=group, sequence_parallel=sp)
    emb = VocabParallelEmbedding(V, D, **kw)
    fc1 = ColumnParallelLinear(D, H, overlap=overlap, **kw)
    fc2 = RowParallelLinear(H, D, overlap=overlap, **kw)
    head = ColumnParallelLinear(D, V, bias=False, overlap=overlap, **kw)
    ids, target = _data()
    with torch.autocast(**BF16):
        e = emb(ids)                                       # (S[/tp], B, D)
        h = fc1(e)                                         # (S, B, H/tp)
        y = fc2(F.gelu(h)) + e                             # (S[/tp], B, D)
        logits = head(y)                                   # (S, B, V/tp)
        loss = vocab_parallel_cross_entropy(logits, target, tp_group=group).mean()
    loss.backward()
    reduce_replicated_grads([fc2], group)                  # fc2's bias under SP: partial
    dtypes = [t.dtype for t in (e, h, y, logits, loss)]

    def full(p, dim):                                      # gather a sharded gradient
        parts = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(parts, p.contiguous(), group=group)
        return torch.cat(parts, dim)

    grads = {"emb": full(emb.weight.grad, 0), "fc1": full(fc1.weight.grad, 0),
             "fc1.b": full(fc1.bias.grad, 0), "fc2": full(fc2.weight.grad, 1),
             "fc2.b": fc2.bias.grad, "head": full(head.weight.grad, 0)}
    params = [emb.weight, fc1.weight, fc1.bias, fc2.weight, fc2.bias, head.weight]
    return loss.detach(), dtypes, grads, [p.grad.dtype for p in params]


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _check(rank, tp):
    group = dist.new_group(list(range(tp)))
    ref_loss, ref_dtypes, ref_grads = _reference(autocast=False)
    ac_loss, ac_dtypes, ac_grads = _reference(autocast=True)
    assert ac_dtypes[1] == ac_dtypes[3] == torch.bfloat16, ac_dtypes   # the linears' outputs
    errors = {}
    for overlap, sp in itertools.product((True, False), repeat=2):
        what = f"tp={tp} overlap={overlap} sp={sp}"
        loss, dtypes, grads, grad_dtypes = _sharded(group, overlap, sp)
        assert dtypes == ac_dtypes, f"{what}: dtypes {dtypes}, torch under autocast {ac_dtypes}"
        assert grad_dtypes == [torch.float32] * 6, f"{what}: parameter grads {grad_dtypes}"
        pairs = [("loss", loss, ac_loss, ref_loss)] + \
            [(k, grads[k], ac_grads[k], ref_grads[k]) for k in ref_grads]
        for name, got, torch_ac, ref in pairs:
            err, torch_err = _rel(got, ref), _rel(torch_ac, ref)
            errors[(overlap, sp, name)] = err
            assert err <= TOL and err <= max(4 * torch_err, 1e-3), \
                f"{what} {name}: error {err:.2e} vs fp32 (torch's layers under autocast: " \
                f"{torch_err:.2e})"
    return max(errors.values())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_under_bf16_autocast(tp):
    worst = run_ranks(_check, tp, timeout=120)
    assert all(0 < w <= TOL for w in worst)    # > 0: the bf16 path really ran in bf16


def _split(rank, tp):
    """The zero-bubble split finds a layer's weight under autocast, where the Function sees the
    weight's bf16 copy: B must not run the weight GEMM, W must not run the input GEMM."""
    from fastpar import extension
    group = dist.new_group(list(range(tp)))
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 16, bias=False, tp_group=group)
    x = torch.randn(8, 2, 16, requires_grad=True)
    with torch.autocast(**BF16):
        y = layer(x)
    dy = torch.randn_like(y)

    def gemms(fn):
        extension.events.enable()
        fn()
        n = sum(1 for e, _, _ in extension.events.take() if e == "gemm_begin")
        extension.events.enable(False)
        return n
    plain = gemms(lambda: torch.autograd.grad(y, [x, layer.weight], dy, retain_graph=True))
    with backward_phase("input", [layer.weight]):
        b = gemms(lambda: torch.autograd.grad(y, [x], dy, retain_graph=True))
    with backward_phase("weight", [layer.weight]):
        w = gemms(lambda: torch.autograd.backward(y, dy, inputs=[layer.weight]))
    assert b < plain and w < plain, (plain, b, w)
    assert layer.weight.grad.dtype == torch.float32
    return True


def test_split_backward_under_autocast():
    assert run_ranks(_split, 2, timeout=60) == [True, True]
