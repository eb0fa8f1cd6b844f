"""Every TP mapping, forward and backward, against hand-computed expectations (gloo, tp 2 and 4)."""
import pytest
import torch
import torch.distributed as dist

from fastpar.tensor_parallel import mappings as M
from fastpar.testing import run_ranks


def _check(y, expected, what):
    assert torch.equal(y, expected), f"{what}: got {y.tolist()}, expected {expected.tolist()}"


def _mappings(rank, tp):
    g = dist.new_group(list(range(tp)))
    S, H = 2 * tp, 3 * tp
    # Rank r's input is (r + 1) * base; the upstream gradient is (r + 10) * base.
    base = torch.arange(S * H, dtype=torch.float32).view(S, H)
    total = sum(r + 1 for r in range(tp))
    grad_total = sum(r + 10 for r in range(tp))

    def run(fn, x, grad, *extra):
        x = x.clone().requires_grad_()
        y = fn(x, g, *extra)
        y.backward(grad)
        return y.detach(), x.grad

    mine = (rank + 1) * base
    # copy_to_tp: identity / all-reduce
    y, gx = run(M.copy_to_tp, mine, (rank + 10) * base)
    _check(y, mine, "copy fwd"); _check(gx, grad_total * base, "copy bwd")
    # reduce_from_tp: all-reduce / identity
    y, gx = run(M.reduce_from_tp, mine, (rank + 10) * base)
    _check(y, total * base, "reduce fwd"); _check(gx, (rank + 10) * base, "reduce bwd")
    # scatter_to_tp: my slice of the last dim / all-gather of the slices' grads
    cols = H // tp
    gs = torch.full((S, cols), float(rank))
    y, gx = run(M.scatter_to_tp, base, gs)
    _check(y, base[:, rank * cols:(rank + 1) * cols], "scatter_tp fwd")
    _check(gx, torch.arange(tp, dtype=torch.float32).repeat_interleave(cols).expand(S, H),
           "scatter_tp bwd")
    # gather_from_tp: all-gather of the last dim / my slice
    shard = torch.full((S, 2), float(rank))
    y, gx = run(M.gather_from_tp, shard, base[:, :2 * tp])
    _check(y, torch.arange(tp, dtype=torch.float32).repeat_interleave(2).expand(S, 2 * tp),
           "gather_tp fwd")
    _check(gx, base[:, 2 * rank:2 * rank + 2], "gather_tp bwd")
    # scatter_to_sp: my block of dim 0 / all-gather along dim 0
    rows = S // tp
    y, gx = run(M.scatter_to_sp, base, torch.full((rows, H), float(rank)))
    _check(y, base[rank * rows:(rank + 1) * rows], "scatter_sp fwd")
    _check(gx, torch.arange(tp, dtype=torch.float32).repeat_interleave(rows)[:, None].expand(S, H),
           "scatter_sp bwd")
    # gather_from_sp: all-gather along dim 0 / reduce-scatter (or split if replicated)
    blk = torch.full((rows, H), float(rank))
    y, gx = run(M.gather_from_sp, blk, (rank + 10) * base)
    _check(y, torch.arange(tp, dtype=torch.float32).repeat_interleave(rows)[:, None].expand(S, H),
           "gather_sp fwd")
    _check(gx, grad_total * base[rank * rows:(rank + 1) * rows], "gather_sp bwd")
    y, gx = run(M.gather_from_sp, blk, base, False)
    _check(gx, base[rank * rows:(rank + 1) * rows], "gather_sp bwd (replicated grad)")
    # reduce_scatter_to_sp: sum then my block / all-gather along dim 0
    y, gx = run(M.reduce_scatter_to_sp, mine, torch.full((rows, H), float(rank)))
    _check(y, total * base[rank * rows:(rank + 1) * rows], "reduce_scatter fwd")
    _check(gx, torch.arange(tp, dtype=torch.float32).repeat_interleave(rows)[:, None].expand(S, H),
           "reduce_scatter bwd")
    # 3-D, sequence-first: the SP split is along dim 0
    x3 = torch.arange(2 * tp * 2 * 3, dtype=torch.float32).view(2 * tp, 2, 3)
    _check(M.scatter_to_sp(x3, g), x3[2 * rank:2 * rank + 2], "scatter_sp 3-D")
    _check(M.gather_from_sp(x3[2 * rank:2 * rank + 2], g), x3, "gather_sp 3-D")
    # Sizes that do not divide: ValueError naming the size and tp, on every rank.
    errors = []
    for fn, x in ((M.scatter_to_tp, torch.ones(4, tp + 1)), (M.scatter_to_sp, torch.ones(tp + 1, 4)),
                  (M.reduce_scatter_to_sp, torch.ones(tp + 1, 4))):
        try:
            fn(x, g)
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 3, errors
    assert f"= {tp + 1} is not divisible by the tensor-parallel size tp={tp}" in errors[0]
    # No group, or a group of one: identity.
    assert M.reduce_from_tp(mine, None) is mine and M.gather_from_sp(mine, None) is mine
    return errors


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_forward_and_backward(tp):
    out = run_ranks(_mappings, tp, timeout=60)
    assert all(o == out[0] for o in out)
