"""Cut a model into pipeline stages: contiguous slices of the blocks in an ``nn.ModuleDict``.

The model is expected to read as a loop (torchtitan's convention): optional modules before the
blocks (``embed``), the blocks in ``model.blocks`` (an ``nn.ModuleDict`` in execution order),
optional modules after them (``norm``, ``head``). The first stage also holds the modules before the
blocks, the last stage the modules after them; the loss is the executor's ``loss_fn``. Stages share
the model's modules (no copy) and keep their attribute names, so a stage's ``named_parameters()``
are the model's names (``blocks.3.fc1.weight``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..mesh.layout import require_positive
from .partition import partition
from .actions import stage_of


class PipelineStage(nn.Module):
    """Stage ``stage_index`` of ``num_stages``: [first modules] -> blocks -> [last modules]."""

    def __init__(self, stage_index: int, num_stages: int, blocks: dict[str, nn.Module],
                 first: dict[str, nn.Module] | None = None,
                 last: dict[str, nn.Module] | None = None, blocks_name: str = "blocks"):
        super().__init__()
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index={stage_index} out of range for num_stages={num_stages}")
        self.stage_index, self.num_stages = stage_index, num_stages
        self._first, self._last = list(first or {}), list(last or {})
        self._blocks_name = blocks_name
        for name, module in (first or {}).items():
            self.add_module(name, module)
        self.add_module(blocks_name, nn.ModuleDict(blocks))
        for name, module in (last or {}).items():
            self.add_module(name, module)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def block_names(self) -> list[str]:
        return list(getattr(self, self._blocks_name).keys())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self._first:
            x = getattr(self, name)(x)
        for block in getattr(self, self._blocks_name).values():
            x = block(x)
        for name in self._last:
            x = getattr(self, name)(x)
        return x

    def extra_repr(self) -> str:
        names = self.block_names
        span = f"{names[0]}..{names[-1]}" if names else "none"
        return f"stage {self.stage_index}/{self.num_stages}, blocks {span}"


def _optional_modules(model: nn.Module, names: Sequence[str], where: str) -> dict[str, nn.Module]:
    out = {}
    for name in names:
        if not hasattr(model, name):
            raise ValueError(f"build_stages: the model has no attribute {name!r} (named in "
                             f"{where}); pass {where}=(...) with the names it uses")
        module = getattr(model, name)
        if module is not None:              # an optional part the model does not have
            out[name] = module
    return out


def check_parts(parts: Sequence[range], num_blocks: int, num_stages: int) -> list[range]:
    """``parts`` must give each of ``num_stages`` stages a non-empty run of consecutive blocks,
    covering ``0..num_blocks-1`` in order."""
    parts = [range(p.start, p.stop) if isinstance(p, range) else range(*p) for p in parts]
    if len(parts) != num_stages:
        raise ValueError(f"build_stages: {len(parts)} block ranges for {num_stages} stages")
    expected = 0
    for s, p in enumerate(parts):
        if p.start != expected or p.stop <= p.start or p.step != 1:
            raise ValueError(f"build_stages: stage {s} gets blocks {p}, expected a non-empty "
                             f"range starting at block {expected} (ranges must tile "
                             f"0..{num_blocks})")
        expected = p.stop
    if expected != num_blocks:
        raise ValueError(f"build_stages: the ranges end at block {expected}, the model has "
                         f"{num_blocks} blocks")
    return parts


def build_stages(model: nn.Module | Callable[..., nn.Module], pp_rank: int, pp_size: int,
                 virtual_stages: int = 1, *, parts: Sequence[range] | None = None,
                 layer_costs: Sequence[float] | None = None, num_blocks: int | None = None,
                 blocks: str = "blocks", first: Sequence[str] = ("embed",),
                 last: Sequence[str] = ("norm", "head"),
                 placement: str = "loop") -> list[nn.Module]:
    """This rank's stages, one per chunk: chunk ``c`` is stage ``c * pp_size + pp_rank``
    (``placement="v"``, two chunks: stages ``pp_rank`` and ``2 pp_size - 1 - pp_rank``;
    :func:`fastpar.pipeline.actions.stage_of`).

    ``model`` is either a whole model whose blocks sit in ``model.<blocks>`` (cut into
    :class:`PipelineStage` views that share its modules), or a model provider, Megatron's
    convention: ``model(layers=range, pre_process=bool, post_process=bool)`` builds only one
    stage's chunk (``fastpar.models.GPT`` is one: ``functools.partial(GPT, config, ...)``), with
    ``num_blocks`` the whole model's; the chunk gets ``stage_index`` and ``num_stages``.

    ``parts`` gives each of the ``pp_size * virtual_stages`` stages its range of block indices;
    without it the blocks are split by :func:`~fastpar.pipeline.partition` over ``layer_costs``
    (``[first modules, block 0, ..., block N-1, last modules]``, e.g. from
    :func:`~fastpar.pipeline.estimate_layer_costs` or ``GPTConfig.piece_flops``), or evenly.
    """
    require_positive({"pp_size": pp_size, "virtual_stages": virtual_stages}, "build_stages: ")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"build_stages: pp_rank={pp_rank} out of range for pp_size={pp_size}")
    provider = not isinstance(model, nn.Module)
    container = None if provider else getattr(model, blocks, None)
    if provider:
        require_positive({"num_blocks": num_blocks}, "build_stages: a model provider needs ")
    elif not isinstance(container, nn.ModuleDict):
        raise ValueError(f"build_stages: model.{blocks} must be an nn.ModuleDict of blocks in "
                         f"execution order, got {type(container).__name__}")
    keys = [str(i) for i in range(num_blocks)] if provider else list(container.keys())
    num_stages = pp_size * virtual_stages
    if parts is None:
        costs = list(layer_costs) if layer_costs is not None else [0.0] + [1.0] * len(keys) + [0.0]
        if len(costs) != len(keys) + 2:
            raise ValueError(f"build_stages: layer_costs has {len(costs)} entries, expected "
                             f"{len(keys) + 2} (first modules, {len(keys)} blocks, last modules)")
        parts = partition(costs, pp_size, virtual_stages)
    parts = check_parts(parts, len(keys), num_stages)
    if placement == "v" and virtual_stages != 2:
        raise ValueError(f"build_stages: placement 'v' holds two chunks per rank, "
                         f"virtual_stages={virtual_stages}")
    where = [stage_of(placement, pp_size, pp_rank, c) for c in range(virtual_stages)]
    if provider:
        return [_provided(model, s, num_stages, parts) for s in where]
    head = _optional_modules(model, first, "first")
    tail = _optional_modules(model, last, "last")
    stages = []
    for s in where:
        stages.append(PipelineStage(s, num_stages, {keys[i]: container[keys[i]] for i in parts[s]},
                                    first=head if s == 0 else None,
                                    last=tail if s == num_stages - 1 else None, blocks_name=blocks))
    return stages


def _provided(make, s: int, num_stages: int, parts: list[range]) -> nn.Module:
    chunk = make(layers=parts[s], pre_process=s == 0, post_process=s == num_stages - 1)
    chunk.stage_index, chunk.num_stages = s, num_stages
    return chunk
