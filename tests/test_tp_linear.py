"""Column/Row parallel linear layers against the single-device nn.Linear they were sharded from."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, overlap as tp_overlap
from fastpar.tensor_parallel import reduce_replicated_grads
from fastpar.tensor_parallel.overlap import row_chunks
from fastpar.testing import run_ranks

TOL = dict(atol=1e-5, rtol=1e-5)


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, **TOL), f"{what}: max error {err}"


def _inputs(shape, rank, tp, sp):
    """The full input (same on every rank) and what this rank feeds the layer."""
    x = torch.randn(*shape)
    mine = x.chunk(tp, 0)[rank] if sp else x
    return x.requires_grad_(), mine.detach().clone().requires_grad_()


def _column(g, rank, tp, sp, overlap, shape, gather_output, regather=False):
    ref = nn.Linear(shape[-1], 8 * tp)
    layer = ColumnParallelLinear.from_linear(ref, tp_group=g, sequence_parallel=sp,
                                             overlap=overlap, gather_output=gather_output,
                                             regather_input=regather)
    x, mine = _inputs(shape, rank, tp, sp)
    y_ref, y = ref(x), layer(mine)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y.backward(dy if gather_output else dy.chunk(tp, -1)[rank])
    what = f"Column tp={tp} sp={sp} overlap={overlap} shape={shape} gather={gather_output} " \
        f"regather={regather}"
    _close(y, y_ref if gather_output else y_ref.chunk(tp, -1)[rank], what + " out")
    _close(layer.weight.grad, ref.weight.grad.chunk(tp, 0)[rank], what + " dW")
    _close(layer.bias.grad, ref.bias.grad.chunk(tp, 0)[rank], what + " db")
    _close(mine.grad, x.grad.chunk(tp, 0)[rank] if sp else x.grad, what + " dx")
    return y.detach()


def _row(g, rank, tp, sp, overlap, shape, input_is_parallel):
    ref = nn.Linear(shape[-1], 6)
    layer = RowParallelLinear.from_linear(ref, tp_group=g, sequence_parallel=sp, overlap=overlap,
                                          input_is_parallel=input_is_parallel, chunks=3)
    x = torch.randn(*shape, requires_grad=True)
    mine = (x.chunk(tp, -1)[rank] if input_is_parallel else x).detach().clone().requires_grad_()
    y_ref, y = ref(x), layer(mine)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y.backward(dy.chunk(tp, 0)[rank] if sp else dy)
    reduce_replicated_grads(layer, g)        # under SP the bias's gradient was partial
    what = f"Row tp={tp} sp={sp} overlap={overlap} shape={shape} parallel_in={input_is_parallel}"
    _close(y, y_ref.chunk(tp, 0)[rank] if sp else y_ref, what + " out")
    _close(layer.weight.grad, ref.weight.grad.chunk(tp, 1)[rank], what + " dW")
    _close(layer.bias.grad, ref.bias.grad, what + " db")
    _close(mine.grad, x.grad.chunk(tp, -1)[rank] if input_is_parallel else x.grad, what + " dx")
    return y.detach()


def _mlp(g, rank, tp, sp, overlap):
    """Column -> GELU -> Row, end to end, against the unsharded MLP."""
    fc1, fc2 = nn.Linear(16, 12 * tp), nn.Linear(12 * tp, 16)
    col = ColumnParallelLinear.from_linear(fc1, tp_group=g, sequence_parallel=sp, overlap=overlap)
    row = RowParallelLinear.from_linear(fc2, tp_group=g, sequence_parallel=sp, overlap=overlap)
    x, mine = _inputs((4 * tp, 3, 16), rank, tp, sp)
    y_ref = fc2(F.gelu(fc1(x)))
    y = row(F.gelu(col(mine)))
    y_ref.square().mean().backward()
    # Every rank's loss is the mean over the whole batch: under SP sum the shards' parts.
    (y.square().sum() / y_ref.numel()).backward()
    reduce_replicated_grads([col, row], g)
    what = f"MLP tp={tp} sp={sp} overlap={overlap}"
    _close(y, y_ref.chunk(tp, 0)[rank] if sp else y_ref, what + " out")
    _close(col.weight.grad, fc1.weight.grad.chunk(tp, 0)[rank], what + " fc1 dW")
    _close(col.bias.grad, fc1.bias.grad.chunk(tp, 0)[rank], what + " fc1 db")
    _close(row.weight.grad, fc2.weight.grad.chunk(tp, 1)[rank], what + " fc2 dW")
    bias_grad = row.bias.grad.clone()
    _close(bias_grad, fc2.bias.grad, what + " fc2 db")
    _close(mine.grad, x.grad.chunk(tp, 0)[rank] if sp else x.grad, what + " dx")
    return y.detach()


def _layers(rank, tp):
    g = dist.new_group(list(range(tp)))
    # These shapes are far below a chunk's minimum size: lift it, so that the layers run
    # their chunked all-reduces too (the rule itself: test_row_chunks_...).
    tp_overlap.MIN_CHUNK_BYTES = 0
    outs = {}
    for sp in (False, True):
        for overlap in (False, True):
            torch.manual_seed(1)
            for shape in ((4 * tp, 5), (2 * tp, 3, 5)):     # 2-D (T, H) and 3-D (S, B, H)
                for flag in ((False, True) if not sp else (False,)):
                    outs[("col", sp, overlap, shape, flag)] = _column(g, rank, tp, sp, overlap,
                                                                      shape, flag)
                if sp:      # the input gathered again in backward instead of kept
                    outs[("col-regather", sp, overlap, shape, False)] = _column(
                        g, rank, tp, sp, overlap, shape, False, regather=True)
                for flag in ((True, False) if not sp else (True,)):
                    shape_r = shape[:-1] + (4 * tp,)
                    outs[("row", sp, overlap, shape, flag)] = _row(g, rank, tp, sp, overlap,
                                                                   shape_r, flag)
            outs[("mlp", sp, overlap)] = _mlp(g, rank, tp, sp, overlap)
    # Overlap on and off compute the same numbers.
    for key, y in outs.items():
        if key[2]:
            other = outs[key[:2] + (False,) + key[3:]]
            assert torch.allclose(y, other, atol=1e-6, rtol=1e-6), f"overlap on/off differ: {key}"
    return len(outs)


def test_row_chunks_keep_each_all_reduce_above_the_minimum():
    assert tp_overlap.MIN_CHUNK_BYTES == 1 << 20
    assert row_chunks(4, 2048, 512, 4) == 4        # 4 MiB: four chunks of 1 MiB
    assert row_chunks(4, 1024, 512, 4) == 2        # 2 MiB: two
    assert row_chunks(4, 2048, 512, 2) == 2        # bf16: half the bytes
    assert row_chunks(4, 256, 128, 4) == 1         # 128 KiB (the tiny preset): one piece
    assert row_chunks(4, 3, 1 << 20, 4) == 3       # never more chunks than rows
    assert row_chunks(1, 1 << 16, 1 << 12, 4) == 1  # never more than asked


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_unsharded(tp):
    assert run_ranks(_layers, tp, timeout=120) == [32] * tp


def _init_and_conversions(rank, tp):
    g = dist.new_group(list(range(tp)))
    torch.manual_seed(7)
    col = ColumnParallelLinear(6, 4 * tp, tp_group=g)
    torch.manual_seed(7)
    ref = nn.Linear(6, 4 * tp)
    assert torch.equal(col.weight, ref.weight.chunk(tp, 0)[rank])
    assert torch.equal(col.bias, ref.bias.chunk(tp, 0)[rank])
    torch.manual_seed(7)
    row = RowParallelLinear(4 * tp, 6, tp_group=g)
    torch.manual_seed(7)
    ref_r = nn.Linear(4 * tp, 6)
    assert torch.equal(row.weight, ref_r.weight.chunk(tp, 1)[rank])
    assert torch.equal(row.bias, ref_r.bias)
    # Gathering back gives the full layer.
    back = col.to_linear()
    assert torch.equal(back.weight, ref.weight) and torch.equal(back.bias, ref.bias)
    back = row.to_linear()
    assert torch.equal(back.weight, ref_r.weight) and torch.equal(back.bias, ref_r.bias)
    # Frozen weights: no weight gradient, the input gradient is still right.
    ref.weight.requires_grad_(False)
    frozen = ColumnParallelLinear.from_linear(ref, tp_group=g, gather_output=True)
    assert not frozen.weight.requires_grad and frozen.bias.requires_grad
    x = torch.randn(5, 6, requires_grad=True)
    frozen(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    ref(x).sum().backward()
    assert frozen.weight.grad is None and torch.allclose(gx, x.grad, atol=1e-6)
    # The attribute `overlap` can be switched after construction.
    frozen.overlap = False
    x.grad = None
    frozen(x).sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-6)
    return _bad_inputs(g, tp)


def _bad_inputs(g, tp):
    errors = []
    cases = [
        lambda: ColumnParallelLinear(8, 4 * tp + 1, tp_group=g),
        lambda: RowParallelLinear(4 * tp + 1, 8, tp_group=g),
        lambda: ColumnParallelLinear(8, 4 * tp, tp_group=g)(torch.ones(3, 9)),
        lambda: RowParallelLinear(4 * tp, 8, tp_group=g)(torch.ones(3, 4 * tp)),
        lambda: RowParallelLinear(4 * tp, 8, tp_group=g, sequence_parallel=True)(
            torch.ones(tp + 1, 2, 4)),
        lambda: RowParallelLinear(4 * tp, 8, tp_group=g, chunks=0),
    ]
    for case in cases:
        try:
            case()
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == len(cases), errors
    assert f"ColumnParallelLinear: out_features = {4 * tp + 1} is not divisible" in errors[0]
    assert f"tp={tp}" in errors[0]
    assert f"RowParallelLinear: in_features = {4 * tp + 1} is not divisible" in errors[1]
    assert "ColumnParallelLinear: input has width (9,)" in errors[2] and "expects 8" in errors[2]
    assert f"RowParallelLinear: input has width ({4 * tp},)" in errors[3]
    assert f"sequence length (dim 0) {tp + 1} is not divisible by tp={tp}" in errors[4]
    assert "chunks=0" in errors[5]
    return errors


@pytest.mark.parametrize("tp", [2, 4])
def test_init_conversion_frozen_and_bad_input(tp):
    out = run_ranks(_init_and_conversions, tp, timeout=60)
    assert all(o == out[0] for o in out)      # the same error on every rank


def test_no_group_is_exactly_nn_linear():
    for cls in (ColumnParallelLinear, RowParallelLinear):
        torch.manual_seed(3)
        layer = cls(7, 5)
        torch.manual_seed(3)
        ref = nn.Linear(7, 5)
        assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
        x = torch.randn(2, 3, 7)
        assert torch.equal(layer(x), ref(x))


def _fused(rank, tp):
    """A column linear of parts q, k, v (GQA: fewer k/v rows) equals the three nn.Linear, and
    each rank holds its own slice of each part; to_linear gives the three back."""
    from fastpar.tensor_parallel import ColumnParallelLinear
    g = dist.new_group(list(range(tp)))
    torch.manual_seed(0)
    q, k, v = torch.nn.Linear(16, 32), torch.nn.Linear(16, 8 * tp // 2), \
        torch.nn.Linear(16, 8 * tp // 2)
    for sp in (False, True):
        fused = ColumnParallelLinear.fused({"q": q, "k": k, "v": v}, tp_group=g,
                                           sequence_parallel=sp)
        assert fused.parts == (("q", 32), ("k", 4 * tp), ("v", 4 * tp))
        for (name, offset, rows), ref in zip(fused.local_parts(), (q, k, v)):
            assert torch.equal(fused.weight[offset:offset + rows], ref.weight.chunk(tp)[rank])
            assert torch.equal(fused.bias[offset:offset + rows], ref.bias.chunk(tp)[rank])
        x = torch.randn(4 * tp, 2, 16)
        inp = x.chunk(tp)[rank] if sp else x
        outs = fused.split(fused(inp))
        for out, ref in zip(outs, (q, k, v)):
            assert torch.allclose(out, ref(x).chunk(tp, -1)[rank], atol=1e-6)
        back = fused.to_linear()
        assert torch.equal(back.weight, torch.cat([q.weight, k.weight, v.weight]))
        assert torch.equal(back.bias, torch.cat([q.bias, k.bias, v.bias]))
    with pytest.raises(ValueError, match="out_features of part 'k' = 3 is not divisible by"):
        ColumnParallelLinear(16, 35, parts=[("q", 32), ("k", 3)], tp_group=g)
    with pytest.raises(ValueError, match="add up to 40, not out_features=48"):
        ColumnParallelLinear(16, 48, parts=[("q", 32), ("k", 8)], tp_group=g)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_parts_shard_each_part(tp):
    assert run_ranks(_fused, tp, timeout=60) == [True] * tp
