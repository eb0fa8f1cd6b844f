"""``fastpar prepare-data``: text -> token files and back, the header, the split, bad input."""
import json

import numpy as np
import pytest

from fastpar.cli import main
from fastpar.data.sources import (check_data, data_vocab, load_tokens, read_header, read_token_file,
                                write_token_file)
from fastpar.data.prepare import prepare_data
from fastpar.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_for_data

WORDS = ["the", "quick", "brown", "fox", "héllo", "wörld", "naïve", "日本語", "🎉", "\t", "  ",
         "\n", "\r\n", "x<|endoftext|>y", "3.14", "don't", "—"]


def _docs(n: int, words: int = 300) -> list[str]:
    rng = np.random.default_rng(n)
    return [" ".join(rng.choice(WORDS, size=words + 37 * i)) + "\n" for i in range(n)]


def _write(folder, docs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_bytes(text.encode("utf-8"))
    return [str(folder)]


def _split_docs(data, split):
    tokens, starts = read_token_file(data / f"{split}.bin")
    bounds = [*map(int, starts), len(tokens)]
    return tokens, [np.asarray(tokens[a:b]) for a, b in zip(bounds, bounds[1:])], starts


def test_bytes_round_trip_header_and_split(tmp_path):
    docs = _docs(6)
    assert main(["prepare-data", *_write(tmp_path / "txt", docs), "--tokenizer", "bytes",
                 "--out", str(tmp_path / "data")]) == 0
    data = tmp_path / "data"
    assert sorted(p.name for p in data.iterdir()) == ["train.bin", "val.bin"]
    train, val = read_header(data / "train.bin"), read_header(data / "val.bin")
    assert (train.vocab_size, train.dtype, val.dtype) == (256, np.uint16, np.uint16)
    assert train.n_docs + val.n_docs == 6 and val.n_docs >= 1 and train.n_docs >= 1
    got = _split_docs(data, "train")[1] + _split_docs(data, "val")[1]
    assert [ByteTokenizer().decode(d) for d in got] == docs     # in order, no separator
    assert train.n_tokens == sum(len(d.encode()) for d in docs[:train.n_docs])
    assert len(load_tokens(str(data))) == train.n_tokens
    assert len(load_tokens(str(data), split="val")) == val.n_tokens
    assert data_vocab(str(data)) == 256 and isinstance(tokenizer_for_data(str(data)),
                                                      ByteTokenizer)


def test_gpt2_bpe_round_trip_and_eos_between_documents(tmp_path):
    docs = _docs(5)
    data = tmp_path / "data"
    done = prepare_data(_write(tmp_path / "txt", docs), "gpt2", data, vocab_size=400)
    tok = tokenizer_for_data(str(data))
    assert (data / "tokenizer.json").is_file() and 256 < tok.vocab_size <= 400
    assert done.train.vocab_size == tok.vocab_size == data_vocab(str(data))
    assert tok.eos_id is not None and tok.decode([tok.eos_id]) == "<|endoftext|>"
    text = "".join(docs)
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < tok.vocab_size
    got = []
    for split in ("train", "val"):
        tokens, split_docs, starts = _split_docs(data, split)
        assert int(tokens.max()) < tok.vocab_size and starts[0] == 0
        assert all(tokens[s - 1] == tok.eos_id for s in starts[1:])      # EOS between documents
        got += [d[:-1] if i < len(split_docs) - 1 else d for i, d in enumerate(split_docs)]
    assert [tok.decode(d) for d in got] == docs
    assert all(tok.eos_id not in d for d in got)     # "<|endoftext|>" in a document is text
    again = load_tokenizer(data)                      # the folder, as `generate` would pass it
    assert again.encode(docs[0]) == tok.encode(docs[0])


def test_one_document_is_cut_at_its_last_tokens(tmp_path):
    doc = _docs(1, 2000)[0]
    (tmp_path / "one.txt").write_text(doc)
    data = tmp_path / "data"
    done = prepare_data([str(tmp_path / "one.txt")], "bytes", data, val_fraction=0.1)
    n = len(doc.encode())
    assert (done.train.n_tokens, done.val.n_tokens) == (n - n // 10, n // 10)
    train, val = load_tokens(str(data)), load_tokens(str(data), split="val")
    assert ByteTokenizer().decode(np.concatenate([train, val])) == doc


def test_documents_order_and_seed(tmp_path):
    docs = [f"document {i}\n" * (i + 1) for i in range(8)]
    inputs = _write(tmp_path / "txt", docs)
    plain = prepare_data(inputs, "bytes", tmp_path / "a", val_fraction=0.4)
    assert plain.val.n_docs == 2                      # their 165 of 396 bytes: closest to 40%
    shuffled = prepare_data(inputs, "bytes", tmp_path / "b", val_fraction=0.4, seed=1)
    a = [ByteTokenizer().decode(d) for d in _split_docs(tmp_path / "a", "train")[1]]
    b = [ByteTokenizer().decode(d) for d in _split_docs(tmp_path / "b", "train")[1]]
    assert a == docs[:plain.train.n_docs] and sorted(b) != b and set(b) <= set(docs)
    assert shuffled.train.n_docs + shuffled.val.n_docs == 8


def _big_vocab_tokenizer(folder, n=70_000):
    """A word-level tokenizer.json with ids above 65535, and the model dir's eos_token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(n - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def test_uint32_for_a_vocabulary_beyond_uint16(tmp_path):
    _big_vocab_tokenizer(tmp_path / "model")
    docs = ["w1 w69997 w65536", "w2 w3", "w68000 w5 zzz"]
    data = tmp_path / "data"
    done = prepare_data(_write(tmp_path / "txt", docs), str(tmp_path / "model"), data)
    assert done.train.dtype == np.uint32 and done.train.vocab_size == 70_000
    assert list(load_tokens(str(data))) == [3, 69_999, 65538, 1, 4, 5]   # <eos> between
    assert list(load_tokens(str(data), split="val")) == [68002, 7, 0]        # zzz -> [UNK]
    assert tokenizer_for_data(str(data)).eos_id == 1
    write_token_file(tmp_path / "direct.bin", [0, 65535, 65536, 99_999], doc_starts=(0, 2))
    tokens, starts = read_token_file(tmp_path / "direct.bin")
    h = read_header(tmp_path / "direct.bin")
    assert (h.dtype, h.vocab_size, h.n_docs) == (np.uint32, 100_000, 2) and list(starts) == [0, 2]
    assert list(tokens) == [0, 65535, 65536, 99_999]
    assert write_token_file(tmp_path / "u16.bin", [65535]).dtype == np.uint16


def test_check_data_refuses_a_larger_vocabulary_and_a_damaged_file(tmp_path):
    data = tmp_path / "data"
    done = prepare_data(_write(tmp_path / "txt", _docs(3)), "gpt2", data, vocab_size=300)
    check_data(str(data), 16, done.train.vocab_size, "big")
    v = done.train.vocab_size
    with pytest.raises(ValueError, match=f"data '{data}' was tokenized with a vocabulary of {v}, "
                                         "but model 'tiny' has 256: "):
        check_data(str(data), 16, 256, "tiny")
    with pytest.raises(ValueError, match=r"in its val split, fewer than --seq-len \+ 2"):
        check_data(str(data), 10**6, v, "big", split="val")
    with pytest.raises(ValueError, match="is one file with no held-out val split"):
        load_tokens(str(data / "train.bin"), split="val")
    raw = (data / "train.bin").read_bytes()
    (data / "train.bin").write_bytes(raw[:-2])                 # one token short
    for call in (lambda: check_data(str(data), 16, v, "big"), lambda: load_tokens(str(data))):
        with pytest.raises(ValueError, match="is corrupt or truncated: its header says"):
            call()
    (data / "train.bin").write_bytes(raw[:8] + b"\x07" + raw[9:])  # format version 7
    with pytest.raises(ValueError, match="has format version 7"):
        data_vocab(str(data))


def _bad_cases(tmp_path):
    tmp_path.mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "tiny.txt").write_text("a few bytes")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / ".hidden").write_text("skipped")
    t = str(tmp_path)
    return {
        "missing": ([f"{t}/missing.txt", "--tokenizer", "bytes"], "missing.txt' does not exist"),
        "empty-file": ([f"{t}/empty.txt", "--tokenizer", "bytes"], "empty.txt' is empty"),
        "no-files": ([f"{t}/nothing", "--tokenizer", "bytes"], "no input files with any text in"),
        "tokenizer": ([f"{t}/tiny.txt", "--tokenizer", "gpt3"],
                      "--tokenizer 'gpt3' is neither bytes, gpt2, nor a tokenizer.json"),
        "val-zero": ([f"{t}/tiny.txt", "--tokenizer", "bytes", "--val-fraction", "0"],
                     "--val-fraction=0.0 must be in (0, 1)"),
        "val-one": ([f"{t}/tiny.txt", "--tokenizer", "bytes", "--val-fraction", "1.5"],
                    "--val-fraction=1.5 must be in (0, 1)"),
        "vocab": ([f"{t}/tiny.txt", "--tokenizer", "gpt2", "--vocab-size", "256"],
                  "--vocab-size=256 is too small for a byte-level BPE: it needs at least 257"),
        "vocab-bytes": ([f"{t}/tiny.txt", "--tokenizer", "bytes", "--vocab-size", "500"],
                        "--vocab-size=500 is for --tokenizer gpt2 only"),
        "val-empty": ([f"{t}/tiny.txt", "--tokenizer", "bytes"],
                      "the val split would be empty: 11 tokens in 1 document(s)"),
        "not-utf8": ([f"{t}/latin1.txt", "--tokenizer", "gpt2"],
                     "latin1.txt' is not UTF-8 text (byte 3): use --tokenizer bytes"),
    }


@pytest.mark.parametrize("name", ["missing", "empty-file", "no-files", "tokenizer", "val-zero",
                                  "val-one", "vocab", "vocab-bytes", "val-empty", "not-utf8"])
def test_bad_input_is_one_error_and_nothing_written(tmp_path, capsys, name):
    args, needle = _bad_cases(tmp_path / "in")[name]
    out = tmp_path / "new" / "deeper" / "data"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["prepare-data", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastpar prepare-data: error: ") and len(err.splitlines()) == 1, err
    assert needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before       # no DATA, no temporaries


def _tree(root):
    """Every file under ``root`` with its bytes: what must not change."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_an_earlier_folder_is_never_replaced_unasked(tmp_path, capsys):
    inputs = _write(tmp_path / "txt", _docs(4))
    data = tmp_path / "data"
    prepare_data(inputs, "gpt2", data, vocab_size=300)
    earlier = _tree(data)
    assert "tokenizer.json" in earlier
    # Without --overwrite: one line naming what is there, nothing touched.
    assert main(["prepare-data", *inputs, "--tokenizer", "bytes", "--out", str(data)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "already holds 'tokenizer.json', 'train.bin'" in err
    assert "--overwrite" in err and _tree(data) == earlier
    # A failed --overwrite run leaves the earlier folder as it was, and no temporaries.
    (tmp_path / "tiny.txt").write_text("abc")
    assert main(["prepare-data", str(tmp_path / "tiny.txt"), "--tokenizer", "bytes",
                 "--out", str(data), "--overwrite"]) == 2
    assert _tree(data) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "tiny.txt", "txt"]
    # --overwrite: the new folder in place, the earlier one kept whole beside it and named.
    assert main(["prepare-data", *inputs, "--tokenizer", "bytes", "--out", str(data),
                 "--overwrite"]) == 0
    out = capsys.readouterr().out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("data.replaced-")]
    assert len(aside) == 1 and str(aside[0]) in out
    assert _tree(aside[0]) == earlier
    assert sorted(p.name for p in data.iterdir()) == ["train.bin", "val.bin"]   # no stale json
    inside = prepare_data(inputs, "bytes", tmp_path / "txt" / "data")     # twice: an output
    again = prepare_data(inputs, "bytes", tmp_path / "txt" / "data", overwrite=True)  # inside
    assert (again.train, again.val) == (inside.train, inside.val)     # the inputs is no input


@pytest.mark.parametrize("case", ["user-folder", "file", "under-a-file"])
def test_a_destination_that_cannot_take_the_data_is_one_line(tmp_path, capsys, case):
    inputs = _write(tmp_path / "txt", _docs(3))
    dest = tmp_path / "dest"
    if case == "user-folder":
        dest.mkdir()
        (dest / "notes.txt").write_text("mine")
        needle = "already holds 'notes.txt'"
    elif case == "file":
        dest.write_text("a file")
        needle = "is a file, not a folder"
    else:                   # a path no user can create (root included): its parent is a file
        (tmp_path / "afile").write_text("x")
        dest = tmp_path / "afile" / "deeper" / "data"
        needle = "is not a folder this user can write"
    before = _tree(tmp_path)
    assert main(["prepare-data", *inputs, "--tokenizer", "bytes", "--out", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastpar prepare-data: error: ") and len(err.splitlines()) == 1, err
    assert needle in err and _tree(tmp_path) == before


def test_a_bin_in_an_input_folder_is_refused_not_read_as_text(tmp_path, capsys):
    inputs = _write(tmp_path / "txt", _docs(3))
    prepare_data(inputs, "bytes", tmp_path / "txt" / "sub")        # token files in the input
    assert main(["prepare-data", str(tmp_path / "txt"), "--tokenizer", "bytes",
                 "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "a .bin is a token file, never read as text" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "data").exists()


def test_empty_files_in_a_folder_are_skipped(tmp_path):
    src = tmp_path / "pkg"
    src.mkdir()
    (src / "__init__.py").write_bytes(b"")              # a package's empty __init__.py
    for i in range(3):
        (src / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n" * 20)
    prepared = prepare_data([str(src)], "bytes", tmp_path / "data")
    assert prepared.train.n_docs + prepared.val.n_docs == 3
