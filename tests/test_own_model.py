"""docs/own_model.md runs as written: a plain torch model converted by from_linear, cut by
build_stages over estimate_layer_costs and run by the pipeline at tp=2 x pp=2 trains exactly as
the same model on one process (losses, and the weights to_linear gathers back)."""
import re
from pathlib import Path

import torch

from fastpar.testing import run_ranks

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own_model.md"


def _code() -> str:
    return re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S).group(1)


def _run_page(rank, world_size, code):
    scope = {"__name__": "own_model"}
    exec(compile(code, str(PAGE), "exec"), scope)
    up = scope.get("up")
    weights = None if up is None else (up.weight.detach(), up.bias.detach())
    return scope["losses"], weights, scope["mesh"].pp_rank


def _reference(code):
    """The page's model, loss and data on one process, without fastpar."""
    model_part = code.split("mesh = fastpar.init")[0]
    scope = {"__name__": "own_model_reference"}
    exec(compile(model_part, str(PAGE), "exec"), scope)
    torch.manual_seed(0)
    model = scope["Net"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data, losses = torch.Generator().manual_seed(1), []
    for _ in range(4):
        tokens = (torch.randint(0, 64, (8, 1), generator=data) + torch.arange(16)) % 64
        loss = scope["loss_fn"](model(tokens), (tokens + 1) % 64)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.blocks["0"].up


def test_the_page_trains_as_one_process():
    code = _code()
    out = run_ranks(_run_page, 4, code, init_pg=False, timeout=120)
    ref_losses, ref_up = _reference(code)
    for losses, weights, pp_rank in out:
        if pp_rank == 1:                        # the last stage holds the loss
            assert weights is None
            assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), (losses,
                                                                                ref_losses)
        else:                                   # the first trains block 0
            assert losses == [None] * 4
            torch.testing.assert_close(weights[0], ref_up.weight.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(weights[1], ref_up.bias.detach(), atol=1e-5, rtol=0)
    assert ref_losses[-1] < ref_losses[0]       # it trains
