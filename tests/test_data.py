"""Training data: sources, the layout-independent global batch, bad input."""
import numpy as np
import pytest

from fastpar.train import ByteTokenizer as ExportedByteTokenizer
from fastpar.data.sources import (VAL_FRACTION, BatchSampler, check_data, data_vocab, load_tokens,
                                 write_token_file)
from fastpar.data.tokenizer import ByteTokenizer
from fastpar.data.tokenizer import ByteTokenizer as TheByteTokenizer


def test_sources(tmp_path):
    assert ByteTokenizer is ExportedByteTokenizer is TheByteTokenizer
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.encode("é") == [0xc3, 0xa9]
    stdlib = load_tokens(max_bytes=100_000)              # the first 95%: the last 5% is val
    assert len(stdlib) == 95_000 and stdlib.dtype == np.uint8
    (tmp_path / "a.txt").write_text("abc" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("xyz" * 50)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "c.txt").write_text("skipped")
    assert len(load_tokens(str(tmp_path))) == 285 and data_vocab(str(tmp_path)) == 256
    assert len(load_tokens(str(tmp_path / "a.txt"))) == 143
    write_token_file(tmp_path / "t.bin", np.arange(1000) * 7)
    t = load_tokens(str(tmp_path / "t.bin"))             # a token file: all of it is train
    assert t.dtype == np.uint16 and list(t[:3]) == [0, 7, 14] and len(t) == 1000
    assert data_vocab(str(tmp_path / "t.bin")) == 6994
    (np.arange(1000, dtype=np.uint16) * 7).tofile(tmp_path / "legacy.bin")
    legacy = load_tokens(str(tmp_path / "legacy.bin"))
    assert legacy.dtype == np.uint16 and len(legacy) == 950 and legacy[-1] == 949 * 7
    assert data_vocab(str(tmp_path / "legacy.bin")) is None and data_vocab(None) == 256


@pytest.mark.parametrize("source", [None, "folder", "a.txt", "legacy.bin"])
def test_raw_sources_split_into_disjoint_train_and_val(tmp_path, source):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("".join(chr(65 + i % 26) for i in range(999)))
    (tmp_path / "a.txt").write_text("héllo wörld " * 70)
    (np.arange(2001, dtype=np.uint16) * 3).tofile(tmp_path / "legacy.bin")
    path = None if source is None else str(tmp_path / source)
    whole = np.concatenate([load_tokens(path, 200_000, split=s) for s in ("train", "val")])
    n = len(whole)
    train, val = load_tokens(path, 200_000), load_tokens(path, 200_000, split="val")
    assert len(val) == int(n * VAL_FRACTION) > 0 and len(train) == n - len(val)
    if source == "legacy.bin":                            # ids are their positions x 3
        assert list(train[-1:]) == [(n - len(val) - 1) * 3] and val[0] == (n - len(val)) * 3
    check_data(path, 10, 8000, "m", split="val")


def test_raw_split_errors(tmp_path):
    (tmp_path / "short.txt").write_text("nineteen bytes here")
    with pytest.raises(ValueError, match="has 19 tokens, too few to hold out the last 5%"):
        load_tokens(str(tmp_path / "short.txt"), split="val")
    with pytest.raises(ValueError, match="split='test' is not one of train, val"):
        load_tokens(None, split="test")
    (tmp_path / "long.txt").write_text("x" * 100)         # 95 train tokens, 5 val tokens
    check_data(str(tmp_path / "long.txt"), 93)
    with pytest.raises(ValueError, match="has 95 tokens in its train split, fewer than "
                                         r"--seq-len \+ 2 = 96"):
        check_data(str(tmp_path / "long.txt"), 94)
    with pytest.raises(ValueError, match="has 100 tokens, fewer than"):
        check_data(str(tmp_path / "long.txt"), 99)


def test_global_batch_is_the_same_for_every_dp_size():
    tokens = np.arange(5000) % 251
    full_x, full_y = BatchSampler(tokens, 16, 8, seed=3).batch(5)
    for dp in (2, 4):
        parts = [BatchSampler(tokens, 16, 8, seed=3, dp_rank=r, dp_size=dp).batch(5)
                 for r in range(dp)]
        assert (np.concatenate([p[0] for p in parts]) == full_x.numpy()).all()
    assert (full_y[:, :-1] == full_x[:, 1:]).all()
    other_step = BatchSampler(tokens, 16, 8, seed=3).batch(6)[0]
    assert not (other_step == full_x).all()


@pytest.mark.parametrize("make,needle", [
    (lambda p: load_tokens(str(p / "missing.txt")), "does not exist"),
    (lambda p: load_tokens(str(p / "empty.txt")), "is empty"),
    (lambda p: BatchSampler(np.zeros(10), 16, 4), "fewer than seq_len"),
    (lambda p: BatchSampler(np.zeros(100), 16, 5, dp_size=2), "not divisible by dp=2"),
])
def test_bad_data(tmp_path, make, needle):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=needle):
        make(tmp_path)
