"""``--profile-steps A:B``: a ``torch.profiler`` trace of steps A to B on every rank.

Each rank writes ``OUT/profile/steps-A-B/rank<R>.json`` (Chrome trace format: open it in
https://ui.perfetto.dev or chrome://tracing). fastpar's own ranges are named ``fastpar: ...``
(:func:`fastpar.mesh.profiling.span`): each step, each micro-batch's forward and backward, each
tensor-parallel collective and fused GEMM + collective, each data-parallel bucket's start and
wait, ZeRO's gathers, and every pipeline action (``F3``, ``B3.1``, a batch of sends and
receives). Under CUDA the kernels' GPU time is recorded too.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def profile_folder(out, window: tuple[int, int]) -> Path:
    """Where the traces of steps A to B go: a folder of their own, so a resumed run that
    profiles other steps adds traces and replaces none (the launcher refuses the same steps)."""
    return Path(out) / "profile" / f"steps-{window[0]}-{window[1]}"


class StepProfiler:
    """Starts the profiler before step A (or the first step run, when resuming past A) and writes
    the trace after step B."""

    def __init__(self, window: tuple[int, int] | None, out: str, rank: int):
        self.window, self.rank, self.prof = window, rank, None
        self.path = profile_folder(out, window) / f"rank{rank}.json" if window else None

    def before(self, step: int, first: bool) -> None:
        if self.window is None or self.prof is not None:
            return
        a, b = self.window
        if step == a or (first and a < step <= b):
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                             if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts, record_shapes=True)
            self.prof.__enter__()

    def after(self, step: int) -> Path | None:
        """After step ``step``: the trace's path once it is written, else None."""
        if self.prof is None or step != self.window[1]:
            return None
        self.prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        self.prof.export_chrome_trace(str(tmp))
        tmp.replace(self.path)
        self.prof = None
        return self.path
