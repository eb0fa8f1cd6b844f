"""The overlapped linears under a zero-bubble split backward: B computes only the input gradient,
W only the weight gradient, each equal to a plain backward's, and no half is computed twice."""
import pytest
import torch
import torch.distributed as dist

from fastpar import extension
from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from fastpar.split_backward import backward_phase
from fastpar.testing import run_ranks


def _close(a, b, what):
    assert a is not None and b is not None, what
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), f"{what}: {(a - b).abs().max()}"


def _collectives(fn, event="comm_start") -> int:
    """How many collectives (or, with event="gemm_begin", GEMMs) the extension ran in fn."""
    extension.events.enable()
    fn()
    n = sum(1 for name, _, _ in extension.events.take() if name == event)
    extension.events.enable(False)
    return n


def _split(rank, tp):
    g = dist.new_group(list(range(tp)))
    for kind in ("column", "row"):
        for sp in (False, True):
            torch.manual_seed(0)
            cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
            layer = cls(16, 16, bias=False, tp_group=g, sequence_parallel=sp)
            torch.manual_seed(10 + rank)
            rows = 8 // tp if (sp and kind == "column") else 8
            width = 16 // tp if kind == "row" else 16
            x = torch.randn(rows, 2, width, requires_grad=True)
            y = layer(x)
            dy = torch.randn_like(y)
            # The plain backward: both gradients at once.
            plain = []
            run = lambda: plain.extend(  # noqa: E731
                torch.autograd.grad(y, [x, layer.weight], dy, retain_graph=True))
            n_plain = _collectives(run)
            gemms_plain = _collectives(run, "gemm_begin")
            gx, gw = plain[:2]
            what = f"{kind} sp={sp}"
            # B: only the input gradient; the weight's GEMM is not run.
            b_only = []

            def input_phase():
                with backward_phase("input", [layer.weight]):
                    b_only.extend(torch.autograd.grad(y, [x], dy, retain_graph=True))
            gemms = _collectives(input_phase, "gemm_begin")
            _close(b_only[0], gx, f"{what} B input grad")
            if kind == "column":                   # the extension's weight-grad GEMM is skipped
                assert gemms < gemms_plain, f"{what}: {gemms} vs {gemms_plain} GEMMs in B"
            assert layer.weight.grad is None, f"{what}: B touched the weight gradient"
            # W: only the weight gradient; no input-gradient collective (column without SP has
            # none left at all; with SP it still gathers the input the weight GEMM needs).
            n = _collectives(lambda: _weight_phase(layer, y, dy))
            _close(layer.weight.grad, gw, f"{what} W weight grad")
            assert x.grad is None, f"{what}: W computed the input gradient"
            if kind == "column":                   # the dgrad all-reduce / reduce-scatter
                assert n < n_plain and (sp or n == 0), f"{what}: {n} vs {n_plain} collectives"
    with pytest.raises(ValueError, match="phase='both' must be 'input' or 'weight'"):
        with backward_phase("both", []):
            pass
    return True


def _weight_phase(layer, y, dy):
    with backward_phase("weight", [layer.weight]):
        torch.autograd.backward(y, dy, inputs=[layer.weight])


@pytest.mark.parametrize("tp", [2, 4])
def test_split_backward_computes_each_half_once(tp):
    assert run_ranks(_split, tp, timeout=90) == [True] * tp


def _reachable(node) -> set:
    """Every autograd node a backward from ``node`` walks (its ancestors in the graph)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        todo += [f for f, _ in n.next_functions]
    return seen


def test_split_backward_cuts_the_stage_graph_at_its_layers():
    """A W call walks only its own layer's graph (its cost does not grow with the layers below
    it), and B over the cut segments gives a plain backward's gradients."""
    from fastpar.models import GPT, get_config
    from fastpar.pipeline.backward import Capture, backward_input, backward_weight, deferrable
    torch.manual_seed(0)
    model = GPT(get_config("tiny", n_layers=5), layers=range(1, 5), pre_process=False,
                post_process=False)
    x = torch.randn(16, 2, model.config.d_model, requires_grad=True)
    dy = torch.randn(16, 2, model.config.d_model)
    model(x).backward(dy)
    plain = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    leaves, eager, cuts = deferrable(model)
    assert len(cuts) == 4 and not eager
    with Capture(leaves, cuts) as cap:
        y = model(x)
    assert len(cap.inputs) == 4 and [k for _, _, k, _ in cap.outputs] == sorted(
        k for _, _, k, _ in cap.outputs)
    sizes = {}
    for m, out, k, _ in cap.outputs:
        if out is None:             # (y, bias) for a fused bias add: its gradients come in B
            assert type(m).__name__ == "RowParallelLinear"
            continue
        walked = _reachable(out.grad_fn)
        assert not any(getattr(n, "variable", None) is x for n in walked), \
            f"{type(m).__name__} of layer {k}: its W call would walk down to the stage input"
        sizes.setdefault(type(m).__name__, set()).add(len(walked))
    # The same module in every layer walks the same graph, however deep the layer.
    assert all(len(s) <= 2 for s in sizes.values()), sizes
    dx, pending = backward_input(y, dy, x, cap, eager)
    late = {id(p) for _, _, ps in pending for p in ps}
    assert len(pending) == sum(out is not None for _, out, _, _ in cap.outputs) > 0
    assert all((p.grad is None) == (id(p) in late) for p in model.parameters())
    backward_weight(pending)
    for a, b in zip([p.grad for p in model.parameters()] + [dx], plain):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()
