"""Training data: sources, the layout-independent global batch, bad input."""
import numpy as np
import pytest

from fastpar.train.data import BatchSampler, ByteTokenizer, load_tokens, write_token_file


def test_sources(tmp_path):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    stdlib = load_tokens(max_bytes=100_000)
    assert len(stdlib) == 100_000 and stdlib.dtype == np.uint8
    (tmp_path / "a.txt").write_text("abc" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("xyz" * 50)
    assert len(load_tokens(str(tmp_path))) == 300
    assert len(load_tokens(str(tmp_path / "a.txt"))) == 150
    write_token_file(tmp_path / "t.bin", np.arange(1000) * 7)
    t = load_tokens(str(tmp_path / "t.bin"))
    assert t.dtype == np.uint16 and list(t[:3]) == [0, 7, 14]


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
