"""Tied embeddings under pipeline parallelism: the last stage holds a copy of the embedding
(drawn as the first stage's), the two copies' gradients summed over the embedding group once
per step. GPT-2's shape and a tied Llama train on the single-process curve at pp 2 and 4 (with
dp and ZeRO), the copies stay equal, the checkpoint holds the weight once and loads into one
process and into another pipeline."""
import pytest
import torch

from fastpar.testing import run_ranks

RUN = dict(model="tiny", seq_len=32, global_batch_size=8, micro_batch_size=2, steps=6,
           warmup_steps=2, log_every=100, sample_tokens=0)
LLAMA = dict(tie_embeddings=True)
GPT2 = dict(tie_embeddings=True, norm="layernorm", activation="gelu", rotary=False, bias=True)


def _train(rank, world_size, kwargs, preset, check_copies=False):
    from fastpar.models import config
    from fastpar.train import TrainConfig, train
    config.PRESETS["tiny"] = config.PRESETS["tiny"].replace(**preset)
    out = train(TrainConfig(**kwargs))
    return [r["loss"] for r in out]


def single_process(tmp_path_factory, preset, run):
    """(the run's folder, its loss curve) in one process."""
    out = str(tmp_path_factory.mktemp("one"))
    return out, run_ranks(_train, 1, dict(run, out=out), preset, init_pg=False, timeout=240)[0]


def on_the_curve(name, world, layout, preset, run, want, tmp_path):
    """Trains ``layout`` on ``world`` ranks; its loss curve is ``want`` within 1e-5."""
    got = run_ranks(_train, world, dict(run, out=str(tmp_path), **layout), preset,
                    init_pg=False, timeout=240)[0]
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= 1e-5 * b, f"{name} step {step}: {a} vs {b}"
    assert want[-1] < want[0]


@pytest.fixture(scope="module", params=[("llama", LLAMA), ("gpt2", GPT2)], ids=lambda p: p[0])
def reference(request, tmp_path_factory):
    preset = request.param[1]
    return (preset, *single_process(tmp_path_factory, preset, RUN))


@pytest.mark.parametrize("name, world, layout", [
    ("pp2", 2, dict(pp=2)),
    ("pp4", 4, dict(pp=4)),
    ("pp2 dp2 zero1", 4, dict(pp=2, dp=2, zero=1)),
    ("pp2 tp2", 4, dict(pp=2, tp=2)),
])
def test_tied_embeddings_train_on_the_single_process_curve(name, world, layout, reference,
                                                          tmp_path):
    preset, _, want = reference
    on_the_curve(name, world, layout, preset, RUN, want, tmp_path)


@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=2, dp=2, zero=1)], ids=["pp2", "zero1"])
def test_the_checkpoint_holds_the_tied_weight_once_and_loads_anywhere(layout, reference,
                                                                     tmp_path):
    """The last stage's copy is not written; the checkpoint loads into one process with the
    single process's weights, and into pp4, whose last stage's copy gets the same weight."""
    import json

    from fastpar.models import GPT
    from fastpar.models import config
    from fastpar.train.checkpoint import latest_checkpoint, load_checkpoint
    preset, ref_out, _ = reference
    world = 2 * layout.get("dp", 1)
    run_ranks(_train, world, dict(RUN, out=str(tmp_path), **layout), preset, init_pg=False,
              timeout=240)
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    names = [k for f in ckpt.glob("index_*_pp1*.json") for k in json.loads(f.read_text())]
    assert names and not [n for n in names if n.startswith("embed.")], names
    cfg = config.PRESETS["tiny"].replace(**preset)
    one, want = GPT(cfg), GPT(cfg)
    load_checkpoint(ckpt, [one], None, None)
    load_checkpoint(latest_checkpoint(f"{ref_out}/checkpoints"), [want], None, None)
    # Adam turns fp32 rounding of near-zero gradients (summed in another order over dp) into
    # up to ~1% of a step (lr 1.5e-3), more on some CPUs (1.3e-5 seen): 5e-5, a thirtieth of
    # a step; a lost or misplaced gradient moves a weight by a step.
    for (n, a), b in zip(want.named_parameters(), one.parameters()):
        torch.testing.assert_close(b, a, atol=5e-5, rtol=0, msg=lambda m, n=n: f"{n}: {m}")
    # Into a pipeline of four: the last stage's copy is the embedding.
    last = GPT(cfg, layers=[3], pre_process=False)
    load_checkpoint(ckpt, [last], None, None)
    assert torch.equal(last.embed.weight, one.embed.weight)


def test_the_memory_model_and_the_dry_run_know_the_copy():
    """GPT-2 (124M) at 1,024 ranks, tp4 x pp4 x dp64: the last stage holds the embedding's
    copy (its vocab / tp rows) besides the first stage's, as built by the dry run, which the
    memory model counts; the planner charges one all-reduce of its gradient per step."""
    from fastpar.plan import BUILTIN, Cluster, ParallelConfig, Workload, planner
    from fastpar.train import TrainConfig
    from fastpar.train.dry_run import dry_run
    cfg = TrainConfig(model="gpt2-124m", tp=4, pp=4, dp=64, seq_len=1024,
                      global_batch_size=512, micro_batch_size=1)
    rep = dry_run(cfg, 1024, "h100-80gb")
    copy = 50304 * 768 / 4
    for r in rep.roles:
        assert r.params == pytest.approx(r.model_params, rel=1e-3), r
        assert r.total == pytest.approx(r.model_total, rel=1e-3), r
    block = rep.roles[1].params / 4                  # a middle stage: four blocks
    # The last stage: one block, the final LayerNorm and the embedding's copy.
    assert rep.roles[-1].params == block + 2 * 768 + copy
    work, cluster = Workload(cfg.model_config, 1024, 512), Cluster(1024, 8, BUILTIN["h100-80gb"])
    tied = planner._tied_time(work, cluster, ParallelConfig(4, 4, 64, 1, 1, "1f1b", "none"),
                              planner.FASTPAR)
    assert tied > 0 and planner._tied_time(
        work, cluster, ParallelConfig(4, 1, 256, 1, 1, "1f1b", "none"), planner.FASTPAR) == 0
