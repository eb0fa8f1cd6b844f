"""Token files validated field by field, a .bin never read as text, and describe_data's
fingerprint: every damage is one single-line ValueError naming the file and the field, from
check_data (before launch), load_tokens (in each rank) and the command line alike."""
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from fastpar.data.sources import (check_data, data_vocab, describe_data, load_tokens, read_header,
                                write_token_file)
from fastpar.data.prepare import prepare_data
from fastpar.data.token_file import HEADER_BYTES, MAGIC
from fastpar.data.tokenizer import tokenizer_for_data

N_TOKENS, STARTS = 300, (0, 40, 100)          # the good file: 3 documents, vocabulary 1000


def _set(fmt: str, at: int, *values):
    """A damage: pack ``values`` as ``fmt`` (little-endian) at byte ``at``."""
    def damage(raw: bytearray) -> bytearray:
        struct.pack_into("<" + fmt, raw, at, *values)
        return raw
    return damage


def _offsets(*values):
    return _set(f"{len(values)}Q", HEADER_BYTES, *values)


# name: (damage of the file's bytes, what the message says of the field)
DAMAGES = {
    "magic-one-byte": (_set("8s", 0, b"FPT0KENS"), "header field magic=b'FPT0KENS'"),
    "magic-prefix": (_set("8s", 0, b"FPTOKxxx"), "header field magic=b'FPTOKxxx'"),
    "version": (_set("I", 8, 2), "header field version=2 must be 1"),
    "token-bytes": (_set("I", 12, 3), "header field token_bytes=3 must be 2 or 4"),
    "vocab-zero": (_set("Q", 16, 0), "header field vocab_size=0 must be >= 1"),
    "vocab-over-uint16": (_set("Q", 16, 2**16 + 1), "header field vocab_size=65537 must be <="),
    "n-tokens-too-large": (_set("Q", 24, N_TOKENS + 1), "n_tokens=301 in n_docs=3"),
    "n-tokens-too-small": (_set("Q", 24, N_TOKENS - 1), "n_tokens=299 in n_docs=3"),
    "n-docs-zero": (_set("Q", 32, 0), "header field n_docs=0 must be >= 1"),
    "n-docs-over-tokens": (_set("Q", 32, N_TOKENS + 1), "header field n_docs=301 must be <="),
    "n-docs-vs-size": (_set("Q", 32, 4), "n_tokens=300 in n_docs=4"),
    "padding": (_set("B", 50, 7), "header padding (bytes 40-63) must be zero: byte 50 is 0x07"),
    "first-offset": (_offsets(5, 40, 100), "document offsets: offset 0 (= 5) must be 0"),
    "decreasing-offsets": (_offsets(0, 100, 40),
                           "document offsets: offset 2 (= 40) is smaller than offset 1 (= 100)"),
    "empty-document": (_offsets(0, 40, 40), "document offsets: offset 2 (= 40) equals"),
    "offset-past-end": (_offsets(0, 40, N_TOKENS),
                        f"document offsets: offset 2 (= {N_TOKENS}) must be < n_tokens=300"),
    "truncated-tokens": (lambda raw: raw[:-2], "but the file size is 686 bytes"),
    "truncated-header": (lambda raw: raw[:30], "is truncated: file size=30 bytes"),
}


def _good(path):
    write_token_file(path, np.arange(N_TOKENS) * 3, vocab_size=1000, doc_starts=STARTS)
    return path


def _damage(path, damage) -> None:
    path.write_bytes(bytes(damage(bytearray(path.read_bytes()))))


def _one_error(call, *needles) -> str:
    """``call`` raises one ValueError (not AttributeError or anything else) whose single-line
    message holds every needle."""
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


@pytest.mark.parametrize("where", ["file", "folder"])
@pytest.mark.parametrize("name", list(DAMAGES))
def test_each_damaged_field_is_one_error_naming_file_and_field(tmp_path, name, where):
    damage, field = DAMAGES[name]
    folder = tmp_path / "data"
    folder.mkdir()
    target = _good(folder / ("train.bin" if where == "folder" else "tokens.bin"))
    if where == "folder":
        _good(folder / "val.bin")
    path = str(folder if where == "folder" else target)
    assert len(load_tokens(path)) == N_TOKENS                 # good until damaged
    check_data(path, 8, 1000, "m")
    _damage(target, damage)
    where_ = f"token file '{target}'"
    for call in (lambda: check_data(path, 8, 1000, "m"), lambda: load_tokens(path),
                 lambda: read_header(target), lambda: data_vocab(path),
                 lambda: describe_data(path)):
        _one_error(call, where_, field)


def test_check_data_validates_every_split_file_of_a_prepared_folder(tmp_path):
    """The trainer also reads val.bin (its sample), so a damaged one stops the launch even when
    only the train split is asked for."""
    _good(tmp_path / "train.bin")
    _good(tmp_path / "val.bin")
    _damage(tmp_path / "val.bin", DAMAGES["offset-past-end"][0])
    _one_error(lambda: check_data(str(tmp_path), 8, 1000, "m", split="train"),
               str(tmp_path / "val.bin"), "document offsets")


def _prepared(tmp_path):
    (tmp_path / "txt").mkdir()
    for i in range(4):
        (tmp_path / "txt" / f"doc{i}.txt").write_text(f"document {i} " * 200)
    return prepare_data([str(tmp_path / "txt")], "bytes", tmp_path / "data").out


def _break_magic(path):
    raw = path.read_bytes()
    assert raw.startswith(MAGIC)
    path.write_bytes(b"garbage!" + raw[8:])


def test_prepared_folder_with_both_magics_damaged_is_refused_not_read_as_text(tmp_path):
    data = _prepared(tmp_path)
    _break_magic(data / "train.bin")
    _break_magic(data / "val.bin")
    train = f"token file '{data / 'train.bin'}': header field magic=b'garbage!' must be"
    for call in (lambda: check_data(str(data), 8, 256, "m"), lambda: load_tokens(str(data)),
                 lambda: data_vocab(str(data)), lambda: tokenizer_for_data(str(data)),
                 lambda: describe_data(str(data))):
        _one_error(call, train)
    val = f"token file '{data / 'val.bin'}': header field magic"
    _one_error(lambda: check_data(str(data), 8, 256, "m", split="val"), val)
    _one_error(lambda: load_tokens(str(data), split="val"), val)


def test_command_line_refuses_a_damaged_folder_before_creating_anything(tmp_path):
    data = _prepared(tmp_path)
    _break_magic(data / "train.bin")
    _break_magic(data / "val.bin")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "fastpar", "train", "--data", str(data),
                           "--out", str(tmp_path / "run"), "--steps", "2"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("fastpar train: error: token file ")
    assert str(data / "train.bin") in lines[0] and "header field magic" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_text_folder_holding_a_bin_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 100)
    (tmp_path / "sub").mkdir()
    (np.arange(100, dtype=np.uint16)).tofile(tmp_path / "sub" / "b.bin")
    needle = (f"data folder '{tmp_path}' holds 'sub/b.bin': a .bin is a token file, never read "
              f"as text; pass it on its own (--data {tmp_path / 'sub' / 'b.bin'}) or remove it")
    for call in (lambda: check_data(str(tmp_path), 8), lambda: load_tokens(str(tmp_path)),
                 lambda: load_tokens(str(tmp_path), split="val"),
                 lambda: describe_data(str(tmp_path))):
        _one_error(call, needle)
    (tmp_path / "sub" / "b.bin").unlink()                  # text only: read as before
    assert len(load_tokens(str(tmp_path))) == 950


@pytest.mark.parametrize("name,head", [("train.bin", b"\x01\x00\x02\x00\x03\x00\x04\x00"),
                                       ("val.bin", b"\x01\x00\x02\x00\x03\x00\x04\x00"),
                                       ("x.bin", b"FPTOKabc"), ("y.bin", b"XXTOKENS")])
def test_a_single_bin_that_looks_like_a_token_file_is_not_read_as_legacy(tmp_path, name, head):
    """A legacy headerless uint16 file is read only under another name and with no (damaged)
    magic; a split's name or a near-magic start is a token file, and this one is damaged."""
    path = tmp_path / name
    path.write_bytes(head + bytes(200))
    for call in (lambda: check_data(str(path), 8), lambda: load_tokens(str(path)),
                 lambda: data_vocab(str(path))):
        _one_error(call, f"token file '{path}': header field magic=")
    legacy = tmp_path / "legacy.bin"
    legacy.write_bytes(b"FPXXXXXS" + bytes(200))           # 3+ bytes off the magic: legacy ids
    assert len(load_tokens(str(legacy))) == 104 - 5 and data_vocab(str(legacy)) is None


def test_the_writer_refuses_an_empty_document_and_writes_no_file(tmp_path):
    with pytest.raises(ValueError, match="document 1 is empty; every document must hold"):
        write_token_file(tmp_path / "t.bin", [1, 2, 3], doc_starts=(0, 3))
    assert list(tmp_path.iterdir()) == []
    h = write_token_file(tmp_path / "none.bin", [])           # no tokens: no documents
    assert (h.n_tokens, h.n_docs) == (0, 0) and read_header(tmp_path / "none.bin") == h
    with pytest.raises(ValueError, match="none.bin' is empty"):
        load_tokens(str(tmp_path / "none.bin"))


def test_describe_data_formats_and_a_location_independent_fingerprint(tmp_path):
    data = _prepared(tmp_path)
    d = describe_data(str(data))
    train, val = read_header(data / "train.bin"), read_header(data / "val.bin")
    assert d["format"] == "prepared" and d["vocab_size"] == 256
    assert d["splits"]["train"]["tokens"] == train.n_tokens
    assert d["splits"]["val"]["tokens"] == val.n_tokens
    assert d["path"] == str(data.resolve()) and json.loads(json.dumps(d)) == d
    moved = shutil.move(str(data), str(tmp_path / "elsewhere" / "moved"))
    again = describe_data(moved)
    assert again["fingerprint"] == d["fingerprint"] and again["path"] != d["path"]
    raw = bytearray((tmp_path / "elsewhere" / "moved" / "train.bin").read_bytes())
    at = train.data_offset + 2 * 10                           # token 10, still a valid id
    raw[at] ^= 1
    (tmp_path / "elsewhere" / "moved" / "train.bin").write_bytes(bytes(raw))
    changed = describe_data(moved)
    assert changed["fingerprint"] != d["fingerprint"] and changed["splits"] == d["splits"]

    single = describe_data(str(tmp_path / "elsewhere" / "moved" / "val.bin"))
    assert single["format"] == "token-file" and single["splits"] == {
        "train": {"tokens": val.n_tokens, "documents": val.n_docs}}
    (np.arange(1000, dtype=np.uint16)).tofile(tmp_path / "legacy.bin")
    legacy = describe_data(str(tmp_path / "legacy.bin"))
    assert legacy["format"] == "legacy-bin" and legacy["vocab_size"] is None
    assert legacy["splits"] == {"train": {"tokens": 950}, "val": {"tokens": 50}}


def test_describe_data_of_text_sources(tmp_path):
    src = tmp_path / "txt"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha " * 100)
    (src / "sub" / "b.txt").write_text("beta " * 100)
    d = describe_data(str(src))
    assert d["format"] == "text" and d["vocab_size"] == 256
    assert d["splits"] == {"train": {"tokens": 1045}, "val": {"tokens": 55}}
    moved = shutil.move(str(src), str(tmp_path / "moved"))
    assert describe_data(moved)["fingerprint"] == d["fingerprint"]
    (tmp_path / "moved" / "sub" / "b.txt").write_text("betA " * 100)      # one byte differs
    assert describe_data(moved)["fingerprint"] != d["fingerprint"]
    before = describe_data(moved)["fingerprint"]
    os.rename(tmp_path / "moved" / "a.txt", tmp_path / "moved" / "c.txt")  # a name is content
    assert describe_data(moved)["fingerprint"] != before
    one = describe_data(moved + "/c.txt")
    assert one["format"] == "text" and one["splits"]["train"]["tokens"] == 570
    stdlib = describe_data(None)
    assert stdlib["format"] == "stdlib" and stdlib["python"] == ".".join(
        map(str, sys.version_info[:3])) and 0 < stdlib["bytes"] <= 8 * 2**20
    assert stdlib["fingerprint"] == describe_data(None)["fingerprint"]


def _fastest(call, repeat=5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def test_describe_and_check_are_fast_and_read_no_whole_file(tmp_path):
    """A 4 GiB token file (sparse: its tokens are zeros on no disk) is described and checked
    in well under a second: only its header, offsets and the ends of its tokens are read."""
    big = tmp_path / "big.bin"
    n = 2**31                                                     # uint16 tokens: 4 GiB
    with open(big, "wb") as f:
        f.write(struct.pack("<8sIIQQQ", MAGIC, 1, 2, 256, n, 1).ljust(HEADER_BYTES, b"\0"))
        f.write(struct.pack("<Q", 0))
        f.truncate(HEADER_BYTES + 8 + 2 * n)
    assert _fastest(lambda: describe_data(str(big)), 2) < 0.5
    assert _fastest(lambda: check_data(str(big), 128), 2) < 0.5
    assert describe_data(str(big))["splits"] == {"train": {"tokens": n, "documents": 1}}
    src = tmp_path / "txt"
    src.mkdir()
    for i in range(20):
        (src / f"f{i}.txt").write_text("text " * 2000)
    assert _fastest(lambda: describe_data(None)) < 0.05
    assert _fastest(lambda: describe_data(str(src))) < 0.05
