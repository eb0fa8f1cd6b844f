"""fastpar.data.packing: piece starts, packed / padded / stream rows, loss masks, the global
trained-target count and the same global batch on every dp size."""
import numpy as np
import pytest
import torch

from fastpar.data.packing import IGNORE, MODES, DocumentSampler, piece_starts
from fastpar.data.sources import BatchSampler

BASE = 1000     # token value = BASE * (document + 1) + index in the document: never 0


def documents(lengths):
    """(tokens, doc_starts) of documents of ``lengths`` whose tokens tell where they are from."""
    tokens = np.concatenate([BASE * (d + 1) + np.arange(n) for d, n in enumerate(lengths)])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return tokens.astype(np.uint32), starts.astype(np.uint64)


def doc_of(t):
    """The document a token (array or tensor of values) belongs to."""
    return t // BASE - 1


def random_lengths(seed, n_docs=40, low=2, high=60):
    return np.random.default_rng(seed).integers(low, high, size=n_docs)


# Documents of 2 .. 59 tokens, windows of 1, 3 and 16 (some documents are cut, some not).
@pytest.mark.parametrize("seq_len", [1, 3, 16])
def test_piece_starts_cut_every_seq_len_and_never_at_a_last_token(seq_len):
    lengths = random_lengths(0)
    _, starts = documents(lengths)
    n = int(lengths.sum())
    pieces = piece_starts(starts, n, seq_len)
    assert np.all(np.diff(pieces) > 0)                          # sorted and unique
    assert np.isin(starts.astype(np.int64), pieces).all()       # every document starts one
    last_tokens = starts.astype(np.int64) + lengths - 1
    assert not np.isin(last_tokens, pieces).any()
    ends = np.append(starts[1:], n).astype(np.int64)
    for s, e in zip(starts.astype(np.int64), ends):             # exactly s, s + S, ... < e - 1
        inside = pieces[(pieces >= s) & (pieces < e)]
        np.testing.assert_array_equal(inside, np.arange(s, e - 1, seq_len))


def test_piece_starts_small_cases():
    # A document of k*S + 1 tokens has no piece at its last token; one of k*S + 2 has.
    np.testing.assert_array_equal(piece_starts(np.array([0]), 10, 3), [0, 3, 6])
    np.testing.assert_array_equal(piece_starts(np.array([0]), 8, 3), [0, 3, 6])
    np.testing.assert_array_equal(piece_starts(np.array([0, 3, 5, 10]), 14, 3), [0, 3, 5, 8, 10])
    np.testing.assert_array_equal(piece_starts(np.array([0, 40]), 41 + 40, 20),
                                  [0, 20, 40, 60])


def test_packed_rows_follow_documents():
    lengths = random_lengths(1, n_docs=60, low=2, high=30)
    tokens, starts = documents(lengths)
    S, B = 24, 16
    sampler = DocumentSampler(tokens, starts, S, B, seed=3)
    pieces = piece_starts(starts, len(tokens), S)
    crossings = restarts = 0
    for step in range(4):
        ws = sampler.windows(step)
        x, y, pos, trained = sampler.batch(step)
        assert x.shape == y.shape == pos.shape == (B, S)
        assert x.dtype == y.dtype == pos.dtype == torch.int64
        assert np.isin(ws, pieces).all()
        for w, xi, yi, pi in zip(ws, x, y, pos):
            stream = torch.from_numpy(tokens[w:w + S + 1].astype(np.int64))
            assert torch.equal(xi, stream[:-1])
            new_doc = doc_of(stream[1:]) != doc_of(stream[:-1])     # (S,) target starts a doc
            assert torch.equal(yi[new_doc], torch.full_like(yi[new_doc], IGNORE))
            assert torch.equal(yi[~new_doc], stream[1:][~new_doc])
            assert torch.equal(yi[~new_doc], xi[~new_doc] + 1)      # the next token of its doc
            # Positions: 0 at the row's start and at each document start, else +1.
            starts_here = torch.cat([torch.tensor([True]), new_doc[:-1]])
            assert torch.equal(pi[starts_here], torch.zeros_like(pi[starts_here]))
            assert torch.equal(pi[1:][~starts_here[1:]], pi[:-1][~starts_here[1:]] + 1)
            crossings += int(new_doc.sum())
            restarts += int(starts_here[1:].sum())
        ok = y != IGNORE
        assert torch.equal(x[:, 1:][ok[:, :-1]], y[:, :-1][ok[:, :-1]])
        assert trained == int(ok.sum())
    assert crossings > 0 and restarts > 0       # the rows did run across documents


# tokens 10 11 12 | 20 21 | 30 31 32 33 34 | 40 41 42 43; S = 3: pieces 0, 3, 5, 8, 10, and the
# drawn offsets 0 .. 9 snap to windows 0, 3, 5 and 8 (8 is the second piece of the third doc).
SMALL_TOKENS = np.array([10, 11, 12, 20, 21, 30, 31, 32, 33, 34, 40, 41, 42, 43], np.uint16)
SMALL_STARTS = np.array([0, 3, 5, 10], np.uint64)
X = IGNORE
SMALL_ROWS = {   # window start: (inputs, targets, positions) for packed; (inputs, targets) padded
    "packed": {0: ([10, 11, 12], [11, 12, X], [0, 1, 2]),
               3: ([20, 21, 30], [21, X, 31], [0, 1, 0]),
               5: ([30, 31, 32], [31, 32, 33], [0, 1, 2]),
               8: ([33, 34, 40], [34, X, 41], [0, 1, 0])},
    "padded": {0: ([10, 11, 12], [11, 12, X], None),
               3: ([20, 21, 0], [21, X, X], None),
               5: ([30, 31, 32], [31, 32, 33], None),
               8: ([33, 34, 0], [34, X, X], None)},
}


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_small_case_by_hand(mode):
    sampler = DocumentSampler(SMALL_TOKENS, SMALL_STARTS, 3, 32, seed=0, mode=mode)
    np.testing.assert_array_equal(sampler.pieces, [0, 3, 5, 8, 10])
    ws = sampler.windows(0)
    assert set(ws.tolist()) == {0, 3, 5, 8}
    x, y, pos, trained = sampler.batch(0)
    for i, w in enumerate(ws.tolist()):
        inputs, targets, positions = SMALL_ROWS[mode][w]
        assert x[i].tolist() == inputs, w
        assert y[i].tolist() == targets, w
        if positions is None:
            assert pos is None
        else:
            assert pos[i].tolist() == positions, w
    per_window = {w: sum(t != X for t in row[1]) for w, row in SMALL_ROWS[mode].items()}
    assert trained == sum(per_window[w] for w in ws.tolist())


def test_small_case_with_a_mask_by_hand():
    mask = np.ones(len(SMALL_TOKENS), np.uint8)
    mask[[4, 6]] = 0                                # tokens 21 and 31 are not trained
    sampler = DocumentSampler(SMALL_TOKENS, SMALL_STARTS, 3, 32, seed=0, mask=mask)
    expected = {0: [11, 12, X], 3: [X, X, X], 5: [X, 32, 33], 8: [34, X, 41]}
    ws = sampler.windows(0).tolist()
    _, y, _, trained = sampler.batch(0)
    for i, w in enumerate(ws):
        assert y[i].tolist() == expected[w], w
    assert trained == sum(sum(t != X for t in expected[w]) for w in ws)


def test_padded_rows_hold_their_first_document_only():
    lengths = random_lengths(2, n_docs=50, low=2, high=20)
    tokens, starts = documents(lengths)
    S, B = 16, 32
    sampler = DocumentSampler(tokens, starts, S, B, seed=5, mode="padded")
    x, y, pos, trained = sampler.batch(0)
    assert pos is None
    padded = 0
    for w, xi, yi in zip(sampler.windows(0), x, y):
        stream = torch.from_numpy(tokens[w:w + S + 1].astype(np.int64))
        mine = doc_of(stream) == doc_of(stream[0])                  # (S + 1,) first document
        assert torch.equal(xi, torch.where(mine[:-1], stream[:-1], 0))
        assert torch.equal(yi, torch.where(mine[1:], stream[1:], IGNORE))
        padded += int((~mine[:-1]).sum())
    assert padded > 0
    assert trained == int((y != IGNORE).sum())


@pytest.mark.parametrize("dp", [1, 3])
def test_stream_rows_are_batch_samplers(dp):
    lengths = random_lengths(3, n_docs=20)
    tokens, starts = documents(lengths)
    S, B, seed = 12, 6, 7
    for rank in range(dp):
        ours = DocumentSampler(tokens, starts, S, B, seed, rank, dp, mode="stream")
        theirs = BatchSampler(tokens, S, B, seed, rank, dp)
        for step in (0, 1, 9):
            x, y, pos, trained = ours.batch(step)
            bx, by = theirs.batch(step)
            assert torch.equal(x, bx) and torch.equal(y, by)
            assert pos is None
            assert trained == B * S
            np.testing.assert_array_equal(ours.windows(step), theirs.offsets(step))


def loss_mask(n, seed):
    return (np.random.default_rng(seed).random(n) < 0.7).astype(np.uint8)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("mode", MODES)
def test_global_batch_is_the_same_on_every_dp_size(mode, masked):
    lengths = random_lengths(4, n_docs=30, low=2, high=40)
    tokens, starts = documents(lengths)
    mask = loss_mask(len(tokens), 0) if masked else None
    S, B = 10, 8
    whole = DocumentSampler(tokens, starts, S, B, seed=11, mode=mode, mask=mask).batch(2)
    assert whole.trained == int((whole.targets != IGNORE).sum())
    for dp in (2, 4):
        shares = [DocumentSampler(tokens, starts, S, B, 11, r, dp, mode, mask).batch(2)
                  for r in range(dp)]
        assert all(s.inputs.shape == (B // dp, S) for s in shares)
        assert torch.equal(torch.cat([s.inputs for s in shares]), whole.inputs)
        assert torch.equal(torch.cat([s.targets for s in shares]), whole.targets)
        if mode == "packed":
            assert torch.equal(torch.cat([s.positions for s in shares]), whole.positions)
        else:
            assert all(s.positions is None for s in shares)
        assert [s.trained for s in shares] == [whole.trained] * dp


@pytest.mark.parametrize("mode", MODES)
def test_loss_mask_ignores_targets_whose_mask_is_zero(mode):
    lengths = random_lengths(5, n_docs=30, low=2, high=40)
    tokens, starts = documents(lengths)
    mask = loss_mask(len(tokens), 1)
    S, B = 12, 16
    plain = DocumentSampler(tokens, starts, S, B, seed=2, mode=mode)
    masked = DocumentSampler(tokens, starts, S, B, seed=2, mode=mode, mask=mask)
    ws = masked.windows(4)
    np.testing.assert_array_equal(ws, plain.windows(4))
    cut = torch.from_numpy(np.stack([mask[w + 1:w + S + 1] == 0 for w in ws]))   # (B, S)
    assert cut.any() and (~cut).any()
    a, b = plain.batch(4), masked.batch(4)
    assert torch.equal(b.inputs, a.inputs)
    assert torch.equal(b.targets, a.targets.masked_fill(cut, IGNORE))
    assert b.trained == int((b.targets != IGNORE).sum()) < a.trained


def test_pieces_are_picked_in_proportion_to_their_length():
    # One window per document (seq_len > every document): a piece is a document.
    lengths = np.array([200, 5, 80, 5, 150, 20, 5, 300, 40, 5])
    tokens, starts = documents(lengths)
    S = 301
    sampler = DocumentSampler(tokens, starts, S, 500, seed=0)
    ws = np.concatenate([sampler.windows(step) for step in range(40)])      # 20000 windows
    assert (ws + S + 1 <= len(tokens)).all()
    pieces = sampler.pieces
    np.testing.assert_array_equal(pieces, starts)
    counts = np.array([(ws == p).sum() for p in pieces])
    # The offset is drawn from 0 .. n - S - 2 and snaps back to its piece's start.
    drawable = len(tokens) - S - 1
    expected = np.clip(np.append(pieces[1:], len(tokens)), None, drawable) - pieces
    expected = np.clip(expected, 0, None) / drawable * len(ws)
    assert counts.sum() == len(ws)
    assert (counts[expected == 0] == 0).all()
    seen = expected > 0
    np.testing.assert_allclose(counts[seen], expected[seen], rtol=0.15)
    assert counts[0] > 20 * counts[1]               # 200 tokens against 5


def test_every_window_lies_inside_the_tokens():
    lengths = random_lengths(6, n_docs=15, low=2, high=50)
    tokens, starts = documents(lengths)
    for mode in MODES:
        for S in (1, 7, 40):
            sampler = DocumentSampler(tokens, starts, S, 64, seed=1, mode=mode)
            ws = np.concatenate([sampler.windows(step) for step in range(20)])
            assert (ws >= 0).all() and (ws + S + 1 <= len(tokens)).all()
            assert sampler.batch(0).inputs.shape == (64, S)


def test_bad_input_is_one_clear_error():
    tokens, starts = documents([6, 4])
    with pytest.raises(ValueError, match="mode='bogus' is not one of packed, padded, stream"):
        DocumentSampler(tokens, starts, 4, 2, mode="bogus")
    with pytest.raises(ValueError, match="global batch 4 is not divisible by dp=3"):
        DocumentSampler(tokens, starts, 4, 4, dp_size=3)
    with pytest.raises(ValueError, match="10 tokens, fewer than seq_len \\+ 2 = 11"):
        DocumentSampler(tokens, starts, 9, 2)
    with pytest.raises(ValueError, match="loss mask has 9 values for 10 tokens"):
        DocumentSampler(tokens, starts, 4, 2, mask=np.ones(9, np.uint8))


@pytest.mark.parametrize("mode", ["packed", "padded", "stream"])
def test_a_rank_builds_only_its_own_windows(mode, monkeypatch):
    """The global batch's trained count comes from the offsets and the mask's sums: a rank of
    dp 64 builds its one window, not the 64 of the global batch (host time at scale)."""
    rng = np.random.default_rng(5)
    starts = np.concatenate([[0], np.cumsum(rng.integers(2, 40, 300))])[:-1]
    tokens = np.arange(int(starts[-1]) + 50) % 1000
    mask = (rng.random(len(tokens)) < 0.6).astype(np.uint16)
    built = []
    real = DocumentSampler._layout
    monkeypatch.setattr(DocumentSampler, "_layout",
                        lambda self, w: built.append(w) or real(self, w))
    shares = [DocumentSampler(tokens, starts, 16, 64, 0, r, 64, mode, mask).batch(2)
              for r in range(64)]
    assert len(built) == 64                      # one window per rank
    total = sum(int((b.targets != IGNORE).sum()) for b in shares)
    assert {b.trained for b in shares} == {total}
