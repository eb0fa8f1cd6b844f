"""``fastpar train --dry-run``: the real launch path of up to thousands of ranks in one process,
each pipeline rank's model built on a fake process group and the meta device, its memory equal to
the memory model's."""
import pytest

from fastpar.cli import main
from fastpar.train import TrainConfig
from fastpar.train.dry_run import dry_run, format_report


def _cfg(**kw):
    base = dict(model="70b", tp=8, pp=8, seq_len=4096, global_batch_size=256,
                micro_batch_size=1, zero=1, sequence_parallel=True, out="unused")
    return TrainConfig(**{**base, **kw})


def _check_against_the_model(rep, world, pp, n_layers):
    assert len(rep.roles) == pp and sum(r.ranks for r in rep.roles) == world
    # Every layer built once, on the stage the planner's split gives it.
    assert sorted(i for r in rep.roles for i in r.layers) == list(range(n_layers))
    for r in rep.roles:
        assert r.params == pytest.approx(r.model_params, rel=1e-3), r
        assert r.total == pytest.approx(r.model_total, rel=1e-3), r
        assert r.weights > 0 and r.gradients > 0 and r.optimizer > 0 and r.activations > 0


def test_1024_ranks_tp8_pp8_dp16_match_the_memory_model():
    """70b on 1,024 ranks: 8 roles of 128 ranks, each built as its first rank builds it; the
    counted parameters, the DataParallel buffers and the ZeRO-1 shards, with the schedule's
    peak activations, are the memory model's per pipeline rank."""
    rep = dry_run(_cfg(dp=16), 1024, "h100-80gb")
    _check_against_the_model(rep, 1024, 8, 80)
    assert rep.layout == "tp8 x cp1 x pp8 x dp16" and rep.fits
    assert rep.step_time_s and rep.step_time_s > 0
    # 1F1B: the first stage holds the most micro-batches in flight (pp of them), the last one.
    acts = [r.activations for r in rep.roles]
    assert acts == sorted(acts, reverse=True) and acts[0] > 5 * acts[-1]
    # The embedding and the head (vocab / tp rows each) sit on the first and the last stage.
    assert rep.roles[0].params > rep.roles[1].params < rep.roles[-1].params
    text = format_report(rep)
    assert text.count("\n| ") == 8 + 1 and "fits: the fullest rank (pp 0)" in text


def test_1024_ranks_with_context_parallelism():
    rep = dry_run(_cfg(cp=2, pp=4, dp=16, seq_len=8192, zero=0), 1024, "h100-80gb")
    _check_against_the_model(rep, 1024, 4, 80)
    assert rep.layout == "tp8 x cp2 x pp4 x dp16"
    # Without ZeRO-1 every rank keeps the whole optimizer state of its parameters.
    assert all(r.optimizer > 2 * r.gradients for r in rep.roles)


def test_interleaved_micro_batches_at_1024_ranks_hold_two_micro_batches():
    """tp8 x dp128 with two micro-batches per step interleaved: the model's activations are
    two micro-batches' (the logits' gradient once), the rest unchanged."""
    kw = dict(model="7b", pp=1, dp=128, sequence_parallel=False, global_batch_size=256)
    one, two = (dry_run(_cfg(**kw, interleave=k), 1024, "h100-80gb") for k in (1, 2))
    _check_against_the_model(two, 1024, 1, 32)
    (a,), (b,) = one.roles, two.roles
    assert b.params == a.params and b.weights == a.weights and b.optimizer == a.optimizer
    assert 1.9 * a.activations < b.activations < 2 * a.activations
    assert two.step_time_s < one.step_time_s


def test_zero1_divides_the_optimizer_state_by_dp_and_adds_its_buffers():
    one, sharded = (dry_run(_cfg(model="7b", pp=2, dp=4, zero=z), 64) for z in (0, 1))
    for a, b in zip(one.roles, sharded.roles):
        assert b.optimizer == pytest.approx(a.optimizer / 4, rel=1e-3)
        # bf16 parameters, fp32 main gradients: the reduce-scatter's 1/4 shard beside each fp32
        # bucket; the parameters are views of the bf16 bucket the shards are gathered into
        assert b.gradients == pytest.approx(a.gradients * 1.25, rel=1e-9)
        assert b.weights == pytest.approx(a.weights, rel=1e-9)


def test_zero2_peaks_whole_gradients_apart_from_activations_with_one_micro_batch():
    """ZeRO-2 frees whole gradients between a step's reduction and the next backward: with one
    micro-batch per step (and no pipeline) the peak holds whichever of whole gradients and
    activations is larger, not both; with accumulation it is ZeRO-1's, to the byte."""
    kw = dict(model="7b", tp=8, pp=1, dp=8, seq_len=4096, global_batch_size=8)
    one, two = (dry_run(_cfg(**kw, zero=z), 64) for z in (1, 2))
    for a, b in zip(one.roles, two.roles):
        assert b.total == pytest.approx(b.model_total, rel=1e-3)
        whole = a.params * 4 / 1e9                     # fp32 main gradients
        assert b.gradients == pytest.approx(a.gradients - min(whole, a.activations), rel=1e-4)
        assert b.total < a.total and (b.weights, b.optimizer) == (a.weights, a.optimizer)
    kw["global_batch_size"] = 16                      # two micro-batches: accumulated whole
    one, two = (dry_run(_cfg(**kw, zero=z), 64) for z in (1, 2))
    assert [r.total for r in one.roles] == [r.total for r in two.roles]


def test_zero3_at_1024_ranks_holds_shards_and_the_units_in_flight():
    """ZeRO-3 on 1,024 ranks (70b, tp8 x pp8 x dp16): the dry run's unit buckets give the memory
    model's per pipeline rank; a rank holds two blocks' weights whole (the one computing and
    the prefetched one) and the embedding or head, not its stage's ten blocks; its optimizer
    state and gradient shards are ZeRO-1's; with one micro-batch per step and no pipeline only
    three blocks' whole gradients exist at once."""
    one, three = (dry_run(_cfg(dp=16, zero=z), 1024, "h100-80gb") for z in (1, 3))
    _check_against_the_model(three, 1024, 8, 80)
    block = 8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672 + 2 * 8192   # 70b's block
    for a, b in zip(one.roles, three.roles):
        assert b.optimizer == pytest.approx(a.optimizer, rel=1e-3)
        root = b.params - len(b.layers) * block / 8
        assert b.weights == pytest.approx((2 * block / 8 + root) * 2 / 1e9, rel=1e-3)
        assert b.weights < a.weights / 3 and b.total < a.total
    kw = dict(model="7b", tp=8, pp=1, dp=128, seq_len=4096, global_batch_size=128)
    one, three = (dry_run(_cfg(**kw, zero=z), 1024) for z in (1, 3))
    _check_against_the_model(three, 1024, 1, 32)
    assert three.roles[0].gradients < one.roles[0].gradients / 5


def test_hsdp_shards_over_its_groups_at_1024_ranks():
    """HSDP (7b, tp2 x dp512, ZeRO-3 over groups of 4 dp ranks, a node of 8 GPUs): each rank
    keeps 1/4 of its optimizer state, not 1/512, as the memory model says; the planner prices
    its all-reduce across nodes on 1/4 of the bytes."""
    kw = dict(model="7b", tp=2, pp=1, dp=512, seq_len=4096, global_batch_size=512, zero=3)
    full, hsdp = (dry_run(_cfg(**kw, dp_shard=s), 1024) for s in (0, 4))
    _check_against_the_model(hsdp, 1024, 1, 32)
    assert hsdp.roles[0].optimizer == pytest.approx(full.roles[0].optimizer * 128, rel=1e-3)
    assert hsdp.roles[0].weights == pytest.approx(full.roles[0].weights, rel=1e-3)
    assert hsdp.step_time_s and full.step_time_s
    # Under CP a shard group is its dp ranks' cp ranks too: 2 dp x 2 cp of 512 x 2.
    kw.update(cp=2, dp=256, seq_len=8192, global_batch_size=256)
    full, hsdp = (dry_run(_cfg(**kw, dp_shard=s), 1024) for s in (0, 2))
    _check_against_the_model(hsdp, 1024, 1, 32)
    assert hsdp.roles[0].optimizer == pytest.approx(full.roles[0].optimizer * 128, rel=1e-3)


def test_bad_input_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="1000"):
        dry_run(_cfg(), 1000)                  # not divisible by tp x pp = 64
    with pytest.raises(ValueError, match="unknown hardware"):
        dry_run(_cfg(dp=16), 1024, "a-gpu-we-do-not-know")


def test_the_command_prints_the_table_and_refuses_what_cannot_fit(capsys):
    args = ["train", "--model", "7b", "--tp", "8", "--micro-batch-size", "1",
            "--global-batch-size", "16", "--nproc", "16", "--dry-run"]
    assert main(args + ["--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "dry run: 16 ranks, tp8 x cp1 x pp1 x dp2" in out and "fits:" in out
    # A sequence far beyond the memory: refused in the same second, nothing started.
    assert main(args + ["--seq-len", "400000"]) == 2
    out = capsys.readouterr().out
    assert "does NOT fit" in out


def test_expert_parallelism_at_1024_ranks_divides_the_experts():
    """Mixtral 8x7B's shape on 1,024 ranks (pp4 x dp256), the experts split over ep 8: each
    role's built parameters (its stage's 1/8 of the experts) and memory are the memory
    model's, and against ep 1 the experts' share of the weights shrinks eightfold; under tp2
    the MoE layers stay whole on each TP rank (with SP on its sequence shard); under ZeRO-1
    and ZeRO-3 the experts' state is cut over their replicas."""
    kw = dict(model="8x7b", tp=1, pp=4, seq_len=4096, global_batch_size=1024, zero=0,
              sequence_parallel=False, recompute="full")
    one, eight = (dry_run(_cfg(**kw, ep=e), 1024, "h100-80gb") for e in (1, 8))
    _check_against_the_model(eight, 1024, 4, 32)
    assert eight.layout.endswith("(ep8)") and eight.fits and not one.fits
    experts = 8 * 3 * 4096 * 14336 * 8      # a stage's 8 layers' experts
    for a, b in zip(one.roles, eight.roles):
        assert a.params - b.params == pytest.approx(experts * 7 / 8, rel=1e-6)
    # Under tp2 (no SP) every TP rank holds its MoE layers whole, the attention split.
    tp2 = dry_run(_cfg(**dict(kw, tp=2), ep=8), 1024, "h100-80gb")
    _check_against_the_model(tp2, 1024, 4, 32)
    attention = 8 * (2 * 4096 * 4096 + 2 * 4096 * 1024)     # a stage's q, o, k, v
    assert eight.roles[1].params - tp2.roles[1].params == pytest.approx(attention / 2, rel=1e-3)
    # Under tp2 with SP each TP rank routes its half of the tokens: the same parameters, the
    # MoE layers' activations halved.
    sp = dry_run(_cfg(**dict(kw, tp=2, sequence_parallel=True), ep=8), 1024, "h100-80gb")
    _check_against_the_model(sp, 1024, 4, 32)
    for a, b in zip(tp2.roles, sp.roles):
        assert b.params == a.params and b.activations < 0.75 * a.activations
    # ZeRO-3: each block gathered as this rank holds it (its 1/8 of the experts), the
    # experts' shards cut over their 32 replicas.
    z3 = dry_run(_cfg(**dict(kw, zero=3), ep=8), 1024, "h100-80gb")
    _check_against_the_model(z3, 1024, 4, 32)
    assert all(b.weights < 0.4 * a.weights for a, b in zip(eight.roles, z3.roles))
    # HSDP in groups of 16 dp ranks: the experts' state over their 2 replicas in a group.
    hsdp = dry_run(_cfg(**dict(kw, zero=1, dp_shard=16), ep=8), 1024, "h100-80gb")
    _check_against_the_model(hsdp, 1024, 4, 32)
    # ZeRO-1: the dense state over 256 dp ranks, the experts' over their 32 replicas.
    zero = dry_run(_cfg(**dict(kw, zero=1), ep=8), 1024, "h100-80gb")
    _check_against_the_model(zero, 1024, 4, 32)
    for a, b in zip(eight.roles, zero.roles):
        dense = a.params - experts / 8
        assert b.optimizer * 1e9 == pytest.approx(
            12 * (dense / 256 + experts / 8 / 32), rel=1e-3)
    for a, b in zip(eight.roles, hsdp.roles):
        dense = a.params - experts / 8
        assert b.optimizer * 1e9 == pytest.approx(
            12 * (dense / 16 + experts / 8 / 2), rel=1e-3)


def test_tp_folded_into_expert_parallelism_at_1024_ranks():
    """Mixtral 8x7B's shape at tp2 SP x pp4 x dp128 with TP folded into ep (ep 8: whole TP
    groups of 4 dp ranks): each TP rank holds other experts, one per layer, half of what the
    unfolded ep 4 holds (its TP ranks the same two), and the experts' ZeRO-1 state is cut over
    their 32 replicas; built parameters and memory equal the memory model."""
    kw = dict(model="8x7b", tp=2, pp=4, seq_len=4096, global_batch_size=1024, zero=1,
              sequence_parallel=True, recompute="full")
    plain = dry_run(_cfg(**kw, ep=4), 1024, "h100-80gb")
    folded = dry_run(_cfg(**kw, ep=8, ep_fold_tp=True), 1024, "h100-80gb")
    _check_against_the_model(folded, 1024, 4, 32)
    assert folded.layout.endswith("(ep8)"), folded.layout
    experts = 8 * 3 * 4096 * 14336 * 8      # a stage's 8 layers' experts
    for a, b in zip(plain.roles, folded.roles):
        assert a.params - b.params == pytest.approx(experts / 8, rel=1e-6)
        dense = b.params - experts / 8
        assert b.optimizer * 1e9 == pytest.approx(12 * (dense / 128 + experts / 8 / 32),
                                                  rel=1e-3)
        assert b.total < a.total
    with pytest.raises(ValueError, match="ep=6 is not a multiple of tp=4"):
        dry_run(_cfg(**dict(kw, tp=4), ep=6, ep_fold_tp=True), 1024, "h100-80gb")
    with pytest.raises(ValueError, match="needs tp > 1 and --sequence-parallel"):
        dry_run(_cfg(**dict(kw, sequence_parallel=False), ep=8, ep_fold_tp=True), 1024,
                "h100-80gb")
