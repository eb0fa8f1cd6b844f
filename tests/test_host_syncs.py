"""A training step that does not log never makes the host wait for the device.

On a GPU, ``.item()``, ``float(t)``, ``.tolist()`` or a tensor built from a list block the host
until the device has caught up, so the next step's launches start late. On a CPU they cost
nothing, so the trainer's own loop (:func:`fastpar.train.trainer.train`) runs under
:func:`fastpar.testing.count_host_syncs`, and every call is charged to the step whose iteration
made it: steps that do not log make none; a step that logs reads every step since the last
read with one.
"""
import tempfile

import pytest

from fastpar.testing import count_host_syncs, run_ranks

BASE = dict(model="tiny", seq_len=16, global_batch_size=4, micro_batch_size=1, steps=6,
            warmup_steps=2, log_every=4, no_save=True, sample_tokens=0)
READS = {1, 4, 6}         # the first step, the log step (log_every=4) and the last


def _syncs_per_step(rank, world, kwargs):
    from fastpar.train import TrainConfig
    from fastpar.train import trainer

    starts, inner = {}, trainer.train_step

    def train_step(run, step):
        starts[step] = len(seen)                  # what the steps before made ends here
        return inner(run, step)

    trainer.train_step = train_step
    with count_host_syncs() as seen:
        rows = trainer.train(TrainConfig(**kwargs, out=tempfile.mkdtemp()))
    ends = [starts[s] for s in sorted(starts)[1:]] + [len(seen)]
    per_step = {s: seen[starts[s]:end] for s, end in zip(sorted(starts), ends)}
    return per_step, [r["step"] for r in rows]


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=3),
                                    dict(pp=2)], ids=["dp2", "dp2-zero1", "dp2-zero3", "pp2"])
def test_steps_that_do_not_log_make_no_host_sync(layout):
    for rank, (per_step, steps) in enumerate(run_ranks(_syncs_per_step, 2, dict(BASE, **layout),
                                                       init_pg=False, timeout=90)):
        assert steps == list(range(1, 7))
        for step, syncs in per_step.items():
            if step in READS:       # one read of every step since the last (at most 2 allowed)
                assert 1 <= len(syncs) <= 2, (rank, step, syncs)
            else:
                assert syncs == [], (rank, step, syncs)
