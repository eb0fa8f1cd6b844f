"""Expert parallelism at ep=2: the MoE dispatch in two chunks (one chunk's all-to-all in flight
while the other's experts compute) against the same dispatch blocking, and against no dispatch.

    python bench/bench_moe.py [--seq-len 512] [--batch 2] [--rounds 6] [--iters 2]
    ../shared/tools/shaped-link 1gbit python bench/bench_moe.py --label 1gbit
    python bench/repeat.py --runs 3 -- ../shared/tools/shaped-link 1gbit \\
        python bench/bench_moe.py --label 1gbit                      # a table for RESULTS

Two gloo ranks, each with its own batch. The model: 4 blocks, d 256, 8 heads, every MLP a
mixture of 8 SwiGLU experts of 512, top 2, dropless (``--moe-ffn``, ``--experts``; ``--shared
N`` adds N shared experts, which compute while the dispatch travels). Each step is
one rank's forward and backward (every all-to-all of both directions, the count exchange and
its host read inside the window); no optimizer step and no data-parallel reduction in any
variant: at ep=1 each would handle twice the experts' parameters, and what is compared is the
dispatch alone. Measured with
bench/common.py's ``compare`` (order rotated every round, each variant's ``--iters`` steps one
timed window after a barrier, the slowest rank's time), against ``blocking``:
  on              ep=2 as the trainer runs it (``--ep-chunks 2``): two chunks, each chunk's
                  experts computing while the other's all-to-all travels, both directions,
                  and the rows a rank keeps computed under the first dispatch and the last
                  return (backward: under the incoming gradients)
  chunks4         the same in four chunks (``--ep-chunks 4``)
  blocking        ep=2 with one chunk (``--ep-chunks 1``): each all-to-all waited before the
                  experts compute (same numbers): the peer
  blocking-again  a second ``blocking``: the A/A control
  no-dispatch     every rank holds all 8 experts and computes its own tokens' rows through
                  the same expert-parallel code path (one chunk) over a group of itself: every
                  all-to-all a local copy (the same expert rows per rank on average): the floor
  no-dispatch-2   the same in two chunks: what chunking alone costs (smaller GEMMs, more ops)
With ``--titan`` (no shared experts): the installed torchtitan's own MoE at ep=2
(bench/titan_moe.py: its router, ``GroupedExperts`` on ``torch._grouped_mm`` in bf16, its
all-to-all dispatcher, its EP plan; the same weights), ``titan`` and ``titan-again`` (its A/A
control), in the same rounds; ``on / titan`` is fastpar's default against it. Its experts run in
bf16 whatever the model's dtype (hard-coded), fastpar's CPU path in the model's fp32, or under
``--autocast`` every fastpar variant's matmuls in bf16 (CPU autocast; torchtitan's model stays
as it is).
``exposed`` = step - floor, the floor the faster of no-dispatch and no-dispatch-2 in the run
(the same compute with no transfer, in one piece or as the chunked path runs it); ``hidden`` =
1 - exposed(variant) / exposed(blocking).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.models import GPT, GPTConfig  # noqa: E402
from fastpar.models.moe import moe_layers  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402

VARIANTS = ("on", "chunks4", "blocking", "blocking-again", "no-dispatch", "no-dispatch-2")


def config(a) -> GPTConfig:
    return GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=8,
                     max_seq_len=a["seq_len"], n_experts=a["experts"], moe_top_k=2,
                     moe_ffn=a["moe_ffn"], moe_aux_loss=0.01, moe_shared_experts=a["shared"])


class _Variant:
    def __init__(self, cfg, mesh, kind: str, alone):
        torch.manual_seed(0)
        ep = None if kind.startswith("no-dispatch") else mesh.dp_group
        self.model = GPT(cfg, ep_group=ep, ep_chunks={"on": 2, "chunks4": 4,
                                                      "no-dispatch-2": 2}.get(kind, 1))
        if ep is None:                  # the same path, its all-to-alls over this rank alone
            for m in moe_layers([self.model]):
                m.ep_group = alone

    def step(self, x, y, autocast=False) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = self.model(x, y)
        loss.backward()
        self.model.zero_grad(set_to_none=True)


def _rank(rank, world_size, a):
    torch.set_num_threads(1)                 # 2 ranks on 2 cores
    mesh = fastpar.init(dp=2)
    cfg = config(a)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (a["batch"], a["seq_len"] + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    variants = {k: _Variant(cfg, mesh, k, alone) for k in VARIANTS}
    steps = {k: (lambda v=variants[k]: v.step(x, y, a["autocast"])) for k in VARIANTS}
    controls, peers = ["blocking-again"], {}
    if a["titan"]:                           # torchtitan's own MoE, the same weights
        import titan_moe
        for k in ("titan", "titan-again"):
            torch.manual_seed(0)
            steps[k] = (lambda s=titan_moe.build_step(GPT(cfg), 2): s(x, y))
        controls, peers = controls + ["titan-again"], {"titan-again": "titan"}
    for k in steps:                          # warm-up: allocator
        steps[k]()
    result = common.compare(steps, "blocking", mesh.device, a["rounds"], a["iters"],
                            control=controls, peers=peers, barrier=dist.barrier)
    rows = a["batch"] * a["seq_len"] * 2     # assignments per rank per layer (top 2)
    return dict(result=result, hop=rows * cfg.d_model * 4 // 2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-ffn", type=int, default=512)
    ap.add_argument("--shared", type=int, default=0, help="shared experts (DeepSeek, Qwen-MoE): "
                    "they compute while the dispatch travels")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--titan", action="store_true", help="also torchtitan's MoE at ep=2")
    ap.add_argument("--autocast", action="store_true", help="fastpar's variants under bf16 "
                    "autocast (its experts in bf16, as torchtitan's always are)")
    ap.add_argument("--label", default="loopback")
    args = ap.parse_args(argv)
    a = dict(seq_len=args.seq_len, batch=args.batch, experts=args.experts,
             moe_ffn=args.moe_ffn, shared=args.shared, rounds=args.rounds, iters=args.iters,
             titan=args.titan, autocast=args.autocast)
    out = run_ranks(_rank, 2, a, init_pg=False, timeout=1800)[0]
    result = out["result"]
    med = result["median"]
    # The floor: the faster of the two ways to run the same compute with no transfer.
    floor = min(med["no-dispatch"], med["no-dispatch-2"])
    rows = [dict(variant=k, median_ms=1e3 * med[k], vs_blocking=med[k] / med["blocking"],
                 paired=result["paired"][k], exposed_ms=1e3 * (med[k] - floor))
            for k in med]
    if args.titan:      # fastpar's default and blocking against torchtitan, round by round
        sec = result["seconds"]
        for k in ("on", "blocking"):
            rows.append(dict(variant=f"{k} / titan", vs_titan=med[k] / med["titan"],
                             paired=common.median([p / q for p, q in zip(sec[k],
                                                                          sec["titan"])])))
    exposed_blocking = med["blocking"] - floor
    for k in ("on", "chunks4"):
        rows.append(dict(variant=f"hidden ({k})", hidden=1 - (med[k] - floor) /
                         exposed_blocking if exposed_blocking > 0 else None))
    print(f"{args.label}: MoE GPT (4 blocks, d 256, {args.experts} experts of {args.moe_ffn}, "
          f"top 2, {args.shared} shared), ep=2, {args.batch} x {args.seq_len} tokens per rank per step; about "
          f"{out['hop'] / 1e6:.2f} MB per rank per all-to-all per layer (balanced routing)")
    common.report(f"moe_{args.label}", rows,
                  ["variant", "median_ms", "vs_blocking", "paired", "exposed_ms", "hidden",
                   "vs_titan"],
                  [{"key": args.label, **result}])


if __name__ == "__main__":
    main()
