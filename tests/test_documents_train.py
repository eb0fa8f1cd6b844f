"""Training on packed documents with a loss mask: the loss is the mean over every trained target
of the global batch (micro-batches, dp, cp and pp agree with one process), every layout's curve
equals the single process's, the metrics count trained tokens, and masked fine-tuning equals
transformers with labels -100 (packed too, with the same block-diagonal mask)."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from fastpar.data.masks import mask_file
from fastpar.data.packing import IGNORE, DocumentSampler
from fastpar.data.token_file import write_token_file
from fastpar.models import GPT
from fastpar.models.documents import Documents
from fastpar.models.hf import config_from_hf, load_hf, save_hf
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig

BASE = dict(model="tiny", seq_len=32, global_batch_size=8, micro_batch_size=2, steps=4,
            warmup_steps=2, log_every=100, eval_every=2, eval_batches=2, no_save=True,
            sample_tokens=0)


def _write_split(path, rng, n_docs):
    """A token file of documents of 3-70 tokens, and a mask training each one's second part
    (a prompt, then its response)."""
    lengths = rng.integers(3, 70, n_docs)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = rng.integers(0, 256, int(lengths.sum()))
    mask = np.concatenate([(np.arange(n) >= rng.integers(1, n)).astype(np.int64)
                           for n in lengths])
    write_token_file(path, tokens, 256, starts)
    write_token_file(mask_file(path), mask, 2, starts)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(0)
    _write_split(folder / "train.bin", rng, 120)
    _write_split(folder / "val.bin", rng, 30)
    return str(folder)


def _train(rank, world_size, kwargs):
    from fastpar.train import train

    return [{k: r[k] for k in ("loss", "val_loss", "grad_norm", "trained_tokens") if k in r}
            for r in train(TrainConfig(**kwargs))]


def _rows(world, out, data, **kwargs):
    cfg = dict(BASE, out=str(out), data=data, **kwargs)
    return run_ranks(_train, world, cfg, init_pg=False, timeout=240)[0]


@pytest.fixture(scope="module")
def reference_rows(sft_data, tmp_path_factory):
    return _rows(1, tmp_path_factory.mktemp("ref"), sft_data)


def test_the_first_loss_is_the_mean_over_the_global_batchs_trained_targets(sft_data, tmp_path,
                                                                            reference_rows):
    """Step 1's loss (before any update) from its definition: one model, the whole global
    batch, cross-entropy summed over the trained targets / their count. The micro-batches hold
    different counts, so a mean of micro-batch means would differ."""
    from fastpar.data.masks import read_mask
    from fastpar.data.token_file import read_token_file

    cfg = TrainConfig(**dict(BASE, data=sft_data, out=str(tmp_path)))
    tokens, starts = read_token_file(f"{sft_data}/train.bin")
    batch = DocumentSampler(tokens, starts, 32, 8, cfg.seed, mask=read_mask(
        f"{sft_data}/train.bin")).batch(1)
    model = GPT(cfg.model_config)
    logits = model(batch.inputs, docs=Documents(batch.positions))[..., :256]
    loss = F.cross_entropy(logits.reshape(-1, 256).float(), batch.targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum") / batch.trained
    counts = (batch.targets != IGNORE).view(4, -1).sum(1)
    assert batch.trained == int(counts.sum()) and len(set(counts.tolist())) > 1
    assert abs(reference_rows[0]["loss"] - loss.item()) <= 1e-5 * loss.item()
    assert [r["trained_tokens"] for r in reference_rows[:1]] == [batch.trained]


LAYOUTS = {
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "tp2-il2": (2, dict(tp=2, interleave=2)),
    "dp2-fb": (2, dict(dp=2, fb_overlap=True)),
    "pp2-1f1b": (2, dict(pp=2, schedule="1f1b")),
    "cp2": (2, dict(cp=2)),
    "cp2-zigzag": (2, dict(cp=2, cp_balance="zigzag")),
    "cp2-dp2-zero3": (4, dict(cp=2, dp=2, zero=3)),
    "pp2-dp2-zbh1": (4, dict(pp=2, dp=2, schedule="zb-h1")),
    "tp2-pp2-full": (4, dict(tp=2, pp=2, recompute="full")),
    "cp4": (4, dict(cp=4)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_masked_curve_equals_single_process(name, sft_data, reference_rows, tmp_path):
    world, kwargs = LAYOUTS[name]
    rows = _rows(world, tmp_path, sft_data, **kwargs)
    assert len(rows) == len(reference_rows)
    for step, (a, b) in enumerate(zip(rows, reference_rows), 1):
        assert a.keys() == b.keys(), (name, step)
        assert a["trained_tokens"] == b["trained_tokens"]
        for key, tol in (("loss", 2e-5), ("val_loss", 2e-5), ("grad_norm", 1e-4)):
            if key in b:
                assert abs(a[key] - b[key]) <= tol * b[key], f"{name} step {step} {key}: " \
                                                             f"{a} vs {b}"


def test_padded_and_stream_batches_train_fewer_or_other_tokens(sft_data, tmp_path,
                                                               reference_rows):
    padded = _rows(1, tmp_path / "pad", sft_data, pad_documents=True, steps=2, eval_every=0)
    stream = _rows(1, tmp_path / "stream", sft_data, pack_documents=False, steps=2,
                   eval_every=0)
    packed = [r["trained_tokens"] for r in reference_rows[:2]]
    # The same windows, each cut after its first document: never more, here fewer in all.
    pad = [r["trained_tokens"] for r in padded]
    assert all(p <= q for p, q in zip(pad, packed)) and sum(pad) < sum(packed), (pad, packed)
    # Stream windows cross documents: their targets there are trained (the mask allowing).
    assert [r["trained_tokens"] for r in stream] != packed


def test_pad_documents_needs_documents(tmp_path):
    from fastpar.train.batches import make_sampler

    cfg = TrainConfig(**dict(BASE, out=str(tmp_path), pad_documents=True))
    with pytest.raises(ValueError, match="--pad-documents needs prepared data of two or more "
                                         "documents; data 'stdlib corpus'"):
        make_sampler(cfg, "train", 0, 1)


# -- masked fine-tuning against transformers ----------------------------------------------------

VOCAB = 300


def _llama(path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=5000.0, rms_norm_eps=1e-6)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model.float().train()


def _grads_by_hf_name(model, path):
    """fastpar's gradients under transformers' names: exported as if they were the weights."""
    from safetensors.torch import load_file

    saved = {n: p.data for n, p in model.named_parameters()}
    for p in model.parameters():
        p.data = p.grad
    save_hf(model, path)
    for n, p in model.named_parameters():
        p.data = saved[n]
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("packed", [False, True])
def test_masked_fine_tuning_equals_transformers_with_labels_minus_100(tmp_path, packed):
    ref = _llama(tmp_path / "hf")
    model = GPT(config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())))
    load_hf(tmp_path / "hf", [model], 1, 0)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 25), generator=g)
    labels = ids.clone()
    labels[0, :9] = labels[1, :4] = -100                   # the prompts
    kw, docs = {}, None
    if packed:                                              # row 0: two examples, 12 + 13
        labels[0, 12:16] = -100                             # the second one's prompt
        pos = torch.cat([torch.arange(12), torch.arange(13)])
        positions = torch.stack([pos, torch.arange(25)])
        doc = torch.cumsum((positions == 0).long(), 1)
        allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(25, 25).bool().tril()
        mask = torch.zeros(2, 1, 25, 25).masked_fill(~allowed[:, None], float("-inf"))
        kw = dict(attention_mask=mask, position_ids=positions)
        labels[0, 12] = -100                                # never predicted across documents
        docs = Documents(positions[:, :-1])
    want = ref(ids, labels=labels, **kw).loss
    want.backward()
    got = model(ids[:, :-1], labels[:, 1:], docs=docs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.backward()
    grads = _grads_by_hf_name(model, tmp_path / "grads")
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)


def test_moe_with_expert_parallelism_on_packed_documents(sft_data, tmp_path):
    """Attention is the only part that sees the documents: an MoE model's curve on packed,
    masked data at dp2 x ep2 equals one process's (the experts' tokens are the trained and
    untrained alike; the router's auxiliary loss is per micro-batch as before)."""
    kw = dict(model="tiny-moe", steps=3, eval_every=3)
    one = _rows(1, tmp_path / "one", sft_data, **kw)
    ep = _rows(2, tmp_path / "ep", sft_data, dp=2, ep=2, **kw)
    assert [r["trained_tokens"] for r in ep] == [r["trained_tokens"] for r in one]
    for a, b in zip(ep, one):
        for key in ("loss", "val_loss"):
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-4 * b[key], (key, a, b)


def test_resume_refuses_another_way_of_filling_sequences(sft_data, tmp_path):
    """How documents fill a sequence is part of the data order: a resume that changes it is
    refused naming both values (unless --adopt-changes)."""
    from fastpar.testing import RankError

    _rows(1, tmp_path, sft_data, steps=2, eval_every=0, no_save=False)
    with pytest.raises(RankError, match=r"--pack-documents True \(the run\) -> False \(now\)"):
        _rows(1, tmp_path, sft_data, steps=3, eval_every=0, no_save=False, resume=True,
              pack_documents=False)
