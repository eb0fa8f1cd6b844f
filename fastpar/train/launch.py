"""``fastpar train`` on one machine without torchrun: torch's elastic launcher starts the ranks
and restarts failed workers up to ``max_restarts`` times; a restarted run resumes from the last
checkpoint. Under torchrun (RANK is set) the command just runs this rank."""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import replace

from .config import TrainConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(cfg: TrainConfig) -> None:
    from .trainer import train

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        cfg = replace(cfg, resume=True)          # a restarted worker continues, not restarts
    train(cfg)


def launch(cfg: TrainConfig, nproc: int, max_restarts: int = 0) -> None:
    """Run ``cfg`` on ``nproc`` local ranks (checks the layout first, in this process)."""
    from .data import check_data
    from .trainer import check_resume

    cfg.check_layout(nproc)
    check_data(cfg.data)
    check_resume(cfg)
    if "RANK" in os.environ or nproc == 1:
        _worker(cfg)
        return
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"fastpar-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.5, start_method="spawn")
    elastic_launch(config, _worker)(cfg)
