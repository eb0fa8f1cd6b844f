"""The per-parameter view of a DistributedOptimizer's state, and its parameter groups.

``StateByParam`` is ``optimizer.state`` looked up by model parameter (what checkpoints save and
load for an unsharded optimizer); ``group_options`` / ``group_index`` sort the model's
parameters into the torch-style ``param_groups`` the user gave.
"""
from __future__ import annotations

from collections.abc import MutableMapping

import torch


class StateByParam:
    """``optimizer.state`` looked up by model parameter instead of by master."""

    def __init__(self, opt):
        self._opt = opt

    def get(self, p, default=None):
        sp = self._opt._by_param.get(id(p))
        return default if sp is None else self._opt.optimizer.state.get(sp, default)

    def __getitem__(self, p):
        return self._wrap(self._opt._by_param[id(p)])

    def _wrap(self, sp):
        """The placed state of master (or shard piece) ``sp``."""
        return _PlacedState(self._opt.optimizer.state[sp], sp, self._opt.optimizer.param_groups)


class _PlacedState(MutableMapping):
    """One master's optimizer state; a ``step`` written into it (by a checkpoint loader) is
    placed as torch's ``load_state_dict`` places it: fp32 on the master's device for fused or
    capturable groups (their step runs there), else left as given (a CPU scalar)."""

    def __init__(self, state: dict, master: torch.Tensor, groups):
        self._state, self._master = state, master
        self._on_device = any((g.get("fused") or g.get("capturable")) and
                              any(q is master for q in g["params"]) for g in groups)

    def __setitem__(self, key, value):
        if key == "step" and self._on_device and torch.is_tensor(value):
            value = value.to(dtype=torch.float32, device=self._master.device)
        self._state[key] = value

    def __getitem__(self, key):
        return self._state[key]

    def __delitem__(self, key):
        del self._state[key]

    def __iter__(self):
        return iter(self._state)

    def __len__(self):
        return len(self._state)


def group_options(param_groups) -> list[dict]:
    opts = [{k: v for k, v in g.items() if k != "params"} for g in (param_groups or [])]
    return opts + [{}]


def group_index(params, param_groups) -> list[int]:
    """For each trainable parameter, the index of its group (the last one: the defaults)."""
    index = {id(p): len(param_groups or []) for p in params}
    for g, group in enumerate(param_groups or []):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param_groups[{g}] must be a dict with a 'params' list")
        for p in group["params"]:
            if id(p) not in index:
                raise ValueError(f"param_groups[{g}] holds a tensor that is not a trainable "
                                 f"parameter of the model")
            index[id(p)] = g
    return [index[id(p)] for p in params]
