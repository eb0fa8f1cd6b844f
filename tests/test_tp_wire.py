"""Tensor-parallel traffic per Transformer layer equals Megatron-Core's.

Megatron's volumes per layer, forward + backward, with activations of S*B*H elements:
- with sequence parallelism: 6 all-gathers (forward: the inputs of the attention's and the MLP's
  column linears; backward: those inputs again for the weight gradients, and the two row
  linears' output gradients) and 4 reduce-scatters (forward: the two row outputs; backward: the
  two column input gradients), each of S*B*H elements; 4 all-gathers when the column linears
  keep their gathered inputs (``regather_input=False``, the layers' default, as autograd keeps
  them for torch's own SP) instead of gathering them again (``True``, Megatron's choice, which
  GPT makes under selective recompute);
- without: 4 all-reduces of S*B*H (forward: the two row outputs; backward: the two column input
  gradients).
That holds because q, k, v are one column linear and up, gate another (with overlap=False,
the plain path, autograd keeps the gathered inputs: 4 all-gathers). Under sequence
parallelism the replicated norm weights see a sequence shard, so their gradients are partial
sums: nothing is sent for them in backward, and the step's one all-reduce of all of them
(reduce_replicated_grads) moves H elements per norm weight (and bias), far below an activation;
it is counted apart. Checked at tp 2 and 4, overlap on and off, SwiGLU + RMSNorm, fp32 and under bf16
autocast (where every activation collective moves bf16: 2 bytes an element).
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from fastpar.models import GPTConfig
from fastpar.models.layers import ParallelTransformerLayer, rotary_tables
from fastpar.tensor_parallel import reduce_replicated_grads
from fastpar.testing import run_ranks
from wire import WireRecorder

S, B = 16, 2
CFG = dict(vocab_size=64, n_layers=1, d_model=64, n_heads=8, n_kv_heads=4, max_seq_len=S)


def _layer_traffic(rank, tp):
    group = dist.new_group(list(range(tp)))
    cfg = GPTConfig(**CFG)
    H = cfg.d_model
    out = {}
    for sp, overlap, bf16, regather in itertools.product((True, False), (True, False),
                                                        (False, True), (False, True)):
        if regather and not (sp and overlap):       # only the overlapped SP path gathers again
            continue
        torch.manual_seed(0)
        layer = ParallelTransformerLayer(cfg, tp_group=group, sequence_parallel=sp,
                                         overlap=overlap, regather_input=regather)
        x = torch.randn(S // tp if sp else S, B, H, requires_grad=True)
        rope = rotary_tables(cfg)
        with WireRecorder() as wire, torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            y = layer(x, rope)
            y.float().square().sum().backward()
            in_backward = wire.summary().get("all_reduce")
            reduce_replicated_grads(layer, group)
        elem = 2 if bf16 else 4
        act = S * B * H * elem                      # one S*B*H activation, in bytes
        big = wire.summary(min_bytes=act)
        small = wire.summary()
        what = f"tp={tp} sp={sp} overlap={overlap} bf16={bf16} regather={regather}"
        if sp:
            # Kept gathered inputs (and the plain path's autograd, which keeps them too): 2
            # fewer all-gathers, for tp times the activation memory of those two inputs.
            gathers = 6 if regather else 4
            assert big == {"all_gather": (gathers, gathers * act),
                           "reduce_scatter": (4, 4 * act)}, (what, big)
            # The two RMSNorm weights' gradients, H fp32 elements each, in one all-reduce
            # after backward (none inside it).
            assert in_backward is None, (what, in_backward)
            assert small.get("all_reduce") == (1, 2 * H * 4), (what, small)
        else:
            assert big == {"all_reduce": (4, 4 * act)}, (what, big)
            assert small == big, (what, small)
        out[what] = big
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_traffic_per_layer_is_megatrons(tp):
    assert len(run_ranks(_layer_traffic, tp, timeout=120)[0]) == 10


def _pipeline_bytes(rank, world, pp, bf16):
    """Bytes each pipeline rank sends per micro-batch, through the trainer's own stages."""
    import fastpar
    from fastpar.pipeline import PipelineExecutor, build_schedule
    from fastpar.train import TrainConfig
    from fastpar.train.step import loss_fn
    from fastpar.train.trainer import build_model
    cfg = TrainConfig(model="tiny", pp=pp, seq_len=16, global_batch_size=4, micro_batch_size=1,
                      precision="amp" if bf16 else "fp32", out="unused")
    mesh = fastpar.init(pp=pp)
    chunks = build_model(cfg, mesh)
    stages = chunks
    M = cfg.num_microbatches(cfg.global_batch_size, 1)
    pipe = PipelineExecutor(stages, build_schedule("1f1b", pp, M), mesh.pp_group,
                            loss_fn=loss_fn(mesh.tp_group))
    x = torch.randint(0, 256, (4, 16))
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        pipe.step(x, x)                         # the first step: shapes are exchanged
        with WireRecorder() as wire:
            pipe.step(x, x)
    sends = [n for kind, n in wire.records if kind == "send"]
    return len(sends), sum(sends), M


@pytest.mark.parametrize("bf16", [False, True])
def test_pipeline_sends_one_activation_per_microbatch_in_the_compute_dtype(bf16):
    from fastpar.models import get_config
    d = get_config("tiny").d_model
    elem = 2 if bf16 else 4                    # bf16 under autocast: the residual stream's dtype
    for rank, (count, total, M) in enumerate(run_ranks(_pipeline_bytes, 2, 2, bf16,
                                                       init_pg=False, timeout=120)):
        # Rank 0 sends each micro-batch's activation forward, rank 1 its gradient back.
        assert count == M and total == M * 16 * 1 * d * elem, (rank, count, total)
