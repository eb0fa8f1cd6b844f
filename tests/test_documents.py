"""Packed documents in the model: attention stops at each document's start, positions restart,
and a packed batch equals each document run alone (losses and every gradient), with rotary and
learned positions, GQA, and under context parallelism (the ring skipping the block pairs no
document connects) at cp 2 and 4."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastpar.context_parallel import ring_attention, positions as cp_positions
from fastpar.context_parallel.ring_attention import BLOCK_PAIRS
from fastpar.context_parallel.sharding import document_blocks
from fastpar.models import GPT
from fastpar.models.documents import Documents, document_attention
from fastpar.models.gpt import tokens_per_loss
from fastpar.testing import run_ranks
from test_cp_model import CONFIGS      # llama-gqa (rotary, GQA) and gpt2 (learned positions)

def _positions(lengths_per_row) -> torch.Tensor:
    """(B, S) positions of rows packed with documents of the given lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths])
                        for lengths in lengths_per_row])


def _dense_reference(q, k, v, pos):
    """Attention with an explicit (S x S) block-diagonal causal mask: the definition."""
    S = q.shape[2]
    doc = torch.cumsum((pos == 0).long(), dim=1)                        # (B, S) document ids
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal               # (B, S, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                          enable_gqa=q.shape[1] != k.shape[1])


def test_document_attention_is_causal_inside_each_document():
    torch.manual_seed(0)
    pos = _positions([[5, 9, 2], [16], [1, 15]])
    q = torch.randn(3, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(3, 2, 16, 8, requires_grad=True) for _ in range(2))
    docs = Documents(pos)
    assert docs.starts == [[0, 5, 14], [0], [0, 1]] and docs.bounds == [3, 0, 5, 14, 1, 0, 2, 0, 1]
    got = document_attention(q, k, v, docs)
    want = _dense_reference(q, k, v, pos)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), g)
    for a, b in zip(grads, torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # The first document's output does not depend on the second's keys.
    k2 = k.detach().clone()
    k2[0, :, 5:] += 1.0
    torch.testing.assert_close(document_attention(q, k2, v, docs)[0, :, :5], got[0, :, :5])
    with pytest.raises(ValueError, match=r"documents of shape \(3, 16\), q of batch 2"):
        document_attention(q[:2], k[:2], v[:2], docs)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_packed_row_equals_each_document_alone(name, recompute):
    """Per-document losses and the summed gradients of a packed row equal each document run on
    its own (positions from 0, attending to nothing else)."""
    cfg = CONFIGS[name]
    torch.manual_seed(1)
    lengths = [7, 20, 4, 17]                                   # 48 tokens in one row
    tokens = torch.randint(0, cfg.vocab_size, (1, 48))
    targets = torch.randint(0, cfg.vocab_size, (1, 48))
    packed = GPT(cfg, recompute=recompute).train()
    docs = Documents(_positions([lengths]))
    logits = packed(tokens, docs=docs)
    per_token = F.cross_entropy(logits[0].float(), targets[0], reduction="none")
    with tokens_per_loss(1.0):                                 # the sum: the gradient of each
        packed(tokens, targets, docs=docs).backward()          # document's summed loss
    alone = GPT(cfg, recompute=recompute).train()
    start = 0
    for n in lengths:
        x, t = tokens[:, start:start + n], targets[:, start:start + n]
        z = alone(x)
        torch.testing.assert_close(z, logits[:, start:start + n], atol=2e-5, rtol=1e-4)
        doc_loss = F.cross_entropy(z[0].float(), t[0], reduction="sum")
        torch.testing.assert_close(doc_loss, per_token[start:start + n].sum(), atol=1e-4,
                                   rtol=1e-5)
        doc_loss.backward()
        start += n
    for (n, p), q in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_a_packed_row_is_not_the_plain_causal_row():
    """The documents change the numbers (the test above would pass vacuously otherwise)."""
    cfg = CONFIGS["llama-gqa"]
    tokens = torch.randint(0, cfg.vocab_size, (1, 48))
    model = GPT(cfg)
    z_plain = model(tokens)[..., :cfg.vocab_size]
    z_docs = model(tokens, docs=Documents(_positions([[24, 24]])))[..., :cfg.vocab_size]
    torch.testing.assert_close(z_docs[:, :24], z_plain[:, :24])
    assert (z_docs[:, 24:] - z_plain[:, 24:]).abs().max() > 1e-3


def test_document_blocks_cover_the_dense_mask():
    """Every (query, key) pair of a document is in exactly one sub-block of exactly one ring
    step, and no other pair is, at cp 2 and 4."""
    S = 48
    for cp in (2, 4):
        for starts in ([0], [0, 5, 6, 30], [0, 11, 12, 13, 40], [0, 24]):
            doc = torch.zeros(S, dtype=torch.long)
            for s in starts[1:]:
                doc[s:] += 1
            want = (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
            seen = torch.zeros(S, S, dtype=torch.long)
            for r in range(cp):
                qpos = cp_positions(S, r, cp)
                for src in range(cp):
                    kpos = cp_positions(S, src, cp)
                    for rows, cols, causal in document_blocks(starts, S, src, r, cp):
                        qs, ks = qpos[rows], kpos[cols]
                        block = torch.ones(len(qs), len(ks), dtype=torch.bool)
                        if causal:
                            block = block.tril()
                        seen[qs[:, None], ks[None, :]] += block.long()
            assert (seen <= 1).all() and torch.equal(seen.bool(), want), (cp, starts)


def _ring_with_documents(rank, world_size, lengths, balance="zigzag"):
    torch.manual_seed(0)
    S = 48
    pos = _positions(lengths)
    docs = Documents(pos, cp_balance=balance)
    q = torch.randn(len(lengths), 4, S, 8, requires_grad=True)
    k, v = (torch.randn(len(lengths), 2, S, 8, requires_grad=True)
            for _ in range(2))
    want = _dense_reference(q, k, v, pos)
    g = torch.randn_like(want)
    dq, dk, dv = torch.autograd.grad(want, (q, k, v), g)
    def mine(t):
        return docs.shard(t, rank, world_size, 2)
    ql, kl, vl = (mine(t.detach()).requires_grad_() for t in (q, k, v))
    BLOCK_PAIRS.update(computed=0, skipped=0)
    out = ring_attention(ql, kl, vl, dist.group.WORLD, bounds=docs.bounds,
                         chunks=docs.ring_chunks(world_size) if balance == "work" else None)
    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, mine(want), **tol)
    out.backward(mine(g))
    for got, full in ((ql.grad, dq), (kl.grad, dk), (vl.grad, dv)):
        torch.testing.assert_close(got, mine(full), **tol)
    counts = torch.tensor([BLOCK_PAIRS["computed"], BLOCK_PAIRS["skipped"]])
    dist.all_reduce(counts)
    return counts.tolist()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("balance", ["zigzag", "work"])
def test_ring_attention_with_documents_equals_full_attention_with_them(cp, balance):
    lengths = [[3, 5, 40], [48], [20, 28]]
    counts = run_ranks(_ring_with_documents, cp, lengths, balance, timeout=120)
    computed, skipped = counts[0]
    # forward and backward each count every (sequence, chunk pair) the causal mask allows:
    # 3 sequences x cp(2cp+1)/2... of the 2cp chunks' pairs; documents skip some.
    total = 2 * 3 * sum(len(p) for p in
                        ([(0, 0), (1, 0), (1, 1)],) * cp + ([(0, 0), (1, 0)],) * (cp * (cp - 1)))
    assert computed + skipped == total and skipped > 0
    one = run_ranks(_ring_with_documents, cp, [[48]], timeout=120)[0]
    assert one[1] == 0                          # one document: nothing to skip


def _cp_model_with_documents(rank, world_size, name, balance):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))
    targets = torch.randint(0, cfg.vocab_size, (2, 48))
    docs = Documents(_positions([[10, 30, 8], [25, 23]]), cp_balance=balance)
    full = GPT(cfg)
    z = full(tokens, docs=docs)
    full(tokens, targets, docs=docs).backward()
    model = GPT(cfg, cp_group=dist.group.WORLD)
    local = docs.shard(tokens, rank, world_size)
    z_local = model(local, docs=docs)
    torch.testing.assert_close(z_local, docs.shard(z, rank, world_size), atol=1e-5, rtol=1e-5)
    model(local, docs.shard(targets, rank, world_size), docs=docs).backward()
    for (n, p), q in zip(model.named_parameters(), full.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g / world_size, q.grad, atol=1e-5, rtol=1e-4, msg=n)
    return True


@pytest.mark.parametrize("name, balance", [("llama-gqa", "work"), ("gpt2", "work"),
                                           ("llama-gqa", "zigzag")])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_gpt_with_documents_equals_the_full_model(name, balance, cp):
    assert all(run_ranks(_cp_model_with_documents, cp, name, balance, timeout=120))


def test_work_balance_deals_chunks_by_attention_work():
    """One long document and many short ones: under the zigzag the ring's steps wait for the
    rank holding the long document's end; dealing the chunks by block-pair work shortens the
    ring's critical path, and is never worse than the zigzag."""
    pos = _positions([[40, 2, 2, 2, 2], [4] * 12])
    for cp in (2, 4):
        balance = {}
        for mode in ("zigzag", "work"):
            docs = Documents(pos, cp_balance=mode)
            layout = docs.cp_layout(cp)
            assert sorted(c for r in layout for c in r) == list(range(2 * cp))
            assert all(len(r) == 2 for r in layout)
            balance[mode] = docs.ring_balance(cp)
        assert 1 <= balance["work"] < balance["zigzag"], (cp, balance)
    torch.manual_seed(3)
    for _ in range(20):                 # random documents: never worse than the zigzag
        lengths = [[int(n) for n in torch.randint(1, 30, (8,))] for _ in range(2)]
        lengths = [ls[:next(i for i in range(1, 9) if sum(ls[:i]) >= 48)] for ls in lengths]
        lengths = [ls[:-1] + [48 - sum(ls[:-1])] for ls in lengths]
        pos = _positions(lengths)
        for cp in (2, 4):
            assert Documents(pos).ring_balance(cp) <= \
                Documents(pos, cp_balance="zigzag").ring_balance(cp) + 1e-9
    assert Documents(pos, cp_balance="zigzag").cp_layout(2) == [(0, 3), (1, 2)]
    with pytest.raises(ValueError, match="cp_balance='even' is not one of work, zigzag"):
        Documents(pos, cp_balance="even")


def test_pair_work_counts_the_dense_masks_pairs():
    pos = _positions([[5, 9, 20, 14], [48], [1, 47]])
    docs = Documents(pos)
    doc = torch.cumsum((pos == 0).long(), 1)
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(48, 48, dtype=torch.bool).tril()
    for cp in (2, 4):
        n = 2 * cp
        c = 48 // n
        w = docs.pair_work(cp)
        for i in range(n):
            for j in range(n):
                assert w[i][j] == allowed[:, i * c:(i + 1) * c, j * c:(j + 1) * c].sum(), (i, j)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_flash_and_per_sequence_rotary_on_cuda():
    """On CUDA in bf16 the documents go through the variable-length flash kernel (one call,
    cumulative lengths built on the host) and the rotary tables per sequence through the Triton
    kernel: the packed row equals each document alone, within bf16."""
    torch.manual_seed(0)
    pos = _positions([[300, 700, 24], [1024], [1, 1023]])
    q = torch.randn(3, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(3, 2, 1024, 64, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    docs = Documents(pos, "cuda")
    got = document_attention(q, k, v, docs)
    want = torch.cat([torch.cat([F.scaled_dot_product_attention(
        q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], is_causal=True,
        enable_gqa=True) for s, e in docs.spans(b)], 2) for b in range(3)])
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    cfg = CONFIGS["llama-gqa"]
    model = GPT(cfg, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (1, 48), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        packed = model(tokens, docs=Documents(_positions([[20, 28]]), "cuda"))
        alone = torch.cat([model(tokens[:, :20]), model(tokens[:, 20:])], 1)
    torch.testing.assert_close(packed.float(), alone.float(), atol=5e-2, rtol=5e-2)


def test_the_planner_and_the_flop_count_know_packed_documents():
    """Attention inside documents costs their span of keys, not the sequence's: the FLOP count
    (and so the trainer's MFU) and the planner's step shrink with it; memory does not."""
    from fastpar.data.packing import DocumentSampler, attention_span
    from fastpar.models import get_config
    from fastpar.models.parallel_config import ParallelConfig
    from fastpar.plan.hardware import get_hardware
    from fastpar.plan.planner import Cluster, Workload, evaluate

    assert attention_span([0, 10, 20], 30, 64) == 10.0
    assert attention_span([0], 200, 64) == (3 * 64 ** 2 + 8 ** 2) / 200   # pieces of 64
    tokens = np.zeros(1024, np.int64)
    assert DocumentSampler(tokens, [0, 512], 64, 4).attention_span() == 64.0
    assert DocumentSampler(tokens, [0, 512], 64, 4, mode="padded").attention_span() is None
    m = get_config("1b")
    full, packed = (m.layer_flops(4096, 1, span) for span in (None, 512.0))
    assert packed["core"] == full["core"] / 8 and packed["mlp"] == full["mlp"]
    assert m.train_flops(4096, 10, span=512.0) < m.train_flops(4096, 10)
    cluster = Cluster(8, 8, get_hardware("h100-80gb"))
    cfg = ParallelConfig(tp=2, pp=1, dp=2, cp=2, micro_batch_size=1)
    whole, docs = (evaluate(Workload(m, 8192, 16, span), cluster, cfg) for span in (None, 600.0))
    assert docs.step_time_s < whole.step_time_s and docs.tflops_per_gpu < whole.tflops_per_gpu
    assert docs.memory_gb_per_gpu == whole.memory_gb_per_gpu
    with pytest.raises(ValueError, match=r"doc_span=9000 must be in \(0, seq_len=8192\]"):
        Workload(m, 8192, 16, 9000)
