"""Fine-tuning data: ``prepare-data`` on JSONL prompt/response pairs and conversations writes
loss masks aligned token for token with the token files (the trained tokens decode to exactly the
responses and assistant turns), chat templates render as transformers renders them, each bad
example is one error naming its file and line, ``read_mask`` refuses a mask that does not match
its split, and ``generate --chat`` continues the template's rendering and prints the reply."""
import contextlib
import io
import json

import numpy as np
import pytest

from fastpar.cli import main
from fastpar.data.masks import mask_file, read_mask
from fastpar.data.prepare import prepare_data
from fastpar.data.token_file import read_header, read_token_file, write_token_file
from fastpar.data.tokenizer import (ByteTokenizer, chat_template, copy_tokenizer_config,
                                    load_tokenizer, render_chat)
from fastpar.train.sample import prompt_ids

EOS = "<|endoftext|>"
BYTES = ByteTokenizer()
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama-2 style: bos_token first, each answer closed by eos_token, no generation prompt.
INST = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} "
        "[/INST]{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{% else %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}{% endfor %}")
PAIRS = [("Translate 'chat': ", "le chat"), ("2 + 2 = ", "4"), ("naïve → ", "naive ✓"),
         ("", "no prompt"), ("日本語? ", " はい"), ("x<|endoftext|>y ", "z<|im_end|>"),
         ("multi\nline\n", "answer\n\n")]


def _tokenizer(folder, template: str | None = CHATML, specials=(EOS, "<s>", "</s>",
               "<|im_start|>", "<|im_end|>"), **config):
    """A byte-level tokenizer (256 byte tokens, no merges) with ``specials`` after them, and a
    tokenizer_config.json with ``template`` and ``config`` (eos_token EOS unless given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": EOS, **config}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _jsonl(path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def _split(data, split):
    """(ids, mask) of each document of a split, after checking that the mask file has the
    split's header counts and document offsets."""
    tokens, starts = read_token_file(data / f"{split}.bin")
    mask = read_mask(data / f"{split}.bin")
    values, mask_starts = read_token_file(mask_file(data / f"{split}.bin"))
    assert mask is not None and np.array_equal(mask, values)
    h, hm = read_header(data / f"{split}.bin"), read_header(mask_file(data / f"{split}.bin"))
    assert (hm.vocab_size, hm.n_tokens, hm.n_docs) == (2, h.n_tokens, h.n_docs)
    assert np.array_equal(starts, mask_starts) and set(np.unique(mask)) <= {0, 1}
    bounds = [*map(int, starts), len(tokens)]
    return [(np.asarray(tokens[a:b]), np.asarray(mask[a:b])) for a, b in zip(bounds, bounds[1:])]


def _runs(ids, mask) -> list[np.ndarray]:
    """The maximal runs of trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


def test_prompt_response_mask_is_the_response_and_eos(tmp_path, capsys):
    model = _tokenizer(tmp_path / "model")
    src = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "response": r} for p, r in PAIRS])
    data = tmp_path / "data"
    assert main(["prepare-data", src, "--tokenizer", str(model), "--out", str(data),
                 "--val-fraction", "0.3"]) == 0
    tok = load_tokenizer(data)
    docs = _split(data, "train") + _split(data, "val")
    assert [len(_split(data, s)) for s in ("train", "val")] == [5, 2]    # round(7 x 0.3)
    trained = []
    for (ids, mask), (prompt, response) in zip(docs, PAIRS, strict=True):
        n = len(tok.encode_document(prompt))
        assert tok.decode(ids) == prompt + response + EOS
        assert list(mask) == [0] * n + [1] * (len(ids) - n)      # the response, then EOS
        assert tok.decode(ids[mask == 1]) == response + EOS and ids[-1] == tok.eos_id
        assert list(ids[:n]) == list(tok.encode_document(prompt))  # special text is plain text
        trained.append(int(mask.sum()))
    out = capsys.readouterr().out
    assert f"{sum(trained[:5]):,} trained; val.bin" in out and f"{sum(trained[5:]):,} trained;" \
        in out
    assert sorted(p.name for p in data.iterdir()) == [
        "tokenizer.json", "tokenizer_config.json", "train.bin", "train.mask.bin", "val.bin",
        "val.mask.bin"]
    assert chat_template(data).source == CHATML      # the template travels with the data


def test_bytes_custom_fields_and_seed(tmp_path):
    records = [{"q": f"question {i}? ", "a": f"answer {i}", "id": i} for i in range(10)]
    src = _jsonl(tmp_path / "in" / "qa.jsonl", records[:6] + [""] + records[6:])   # blank line
    done = prepare_data([str(tmp_path / "in")], "bytes", tmp_path / "a", prompt_field="q",
                        response_field="a")
    docs = _split(tmp_path / "a", "train") + _split(tmp_path / "a", "val")
    texts = [(BYTES.decode(ids), BYTES.decode(ids[m == 1])) for ids, m in docs]
    assert texts == [(r["q"] + r["a"], r["a"]) for r in records]        # bytes: no EOS
    assert (done.val.n_docs, done.trained) == (1, (sum(len(r["a"]) for r in records[:9]),
                                                   len(records[9]["a"])))
    prepare_data([src], "bytes", tmp_path / "b", seed=3, prompt_field="q", response_field="a")
    docs = _split(tmp_path / "b", "train") + _split(tmp_path / "b", "val")
    shuffled = [BYTES.decode(ids[m == 1]) for ids, m in docs]
    assert shuffled != [r["a"] for r in records] and sorted(shuffled) == sorted(
        r["a"] for r in records)


def _conversation(i):
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Hi {i}"},
            {"role": "assistant", "content": f"Hello {i}!"},
            {"role": "user", "content": "And <|im_end|> then?"},
            {"role": "assistant", "content": "Then\nnothing."},
            {"role": "user", "content": "Bye"}][:6 - i % 2]     # odd: ends with an answer


def test_multi_turn_conversation_masks_each_assistant_turn(tmp_path):
    model = _tokenizer(tmp_path / "model")
    convs = [_conversation(i) for i in range(4)]
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    prepare_data([src], str(model), tmp_path / "data", val_fraction=0.25)
    tok = load_tokenizer(model)
    docs = _split(tmp_path / "data", "train") + _split(tmp_path / "data", "val")
    for (ids, mask), conv in zip(docs, convs, strict=True):
        assert tok.decode(ids) == render_chat(CHATML, conv)     # no EOS added
        assert [tok.decode(r) for r in _runs(ids, mask)] == [
            m["content"] + "<|im_end|>\n" for m in conv if m["role"] == "assistant"]
        assert tok.decode(ids[mask == 0]).count("<|im_start|>assistant\n") == 2
        assert tok.eos_id not in ids
    # the template's special tokens are tokens, and so is "<|im_end|>" typed in a message
    assert (ids == tok.tokenizer.token_to_id("<|im_end|>")).sum() == 5 + 1


def test_bos_eos_tokens_and_a_template_without_generation_prompt(tmp_path, capsys):
    model = _tokenizer(tmp_path / "model", INST, bos_token={"content": "<s>"}, eos_token="</s>")
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
              {"role": "user", "content": "again"}, {"role": "assistant", "content": "b"}]
             for i in range(3)]
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    prepare_data([src], str(model), tmp_path / "data")
    tok = load_tokenizer(model)
    ids, mask = _split(tmp_path / "data", "train")[0]
    assert tok.decode(ids) == "<s>[INST] q0 [/INST]a0</s>[INST] again [/INST]b</s>"
    assert [tok.decode(r) for r in _runs(ids, mask)] == ["a0</s>", "b</s>"]
    bad = _jsonl(tmp_path / "sys.jsonl", [{"messages": convs[0]}] + [{"messages": [
        {"role": "system", "content": "s"}, *convs[1]]}])
    assert main(["prepare-data", bad, "--tokenizer", str(model), "--out",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"'{bad}' line 2: chat template error: system messages are not supported" in err


def test_render_chat_matches_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    template = (
        "{%- for m in messages %}\n"
        "  {%- if loop.first and m.role == 'system' %}\n"
        "{{ bos_token }}SYSTEM {{ m.content | tojson }}\n"
        "  {%- elif m.role == 'user' %}\n"
        "    {% if m.content == 'skip' %}{% continue %}{% endif %}\n"
        "USER: {{ m.content }}\n"
        "  {%- else %}\n"
        "ASSISTANT: {{ m.content }}{{ eos_token }}\n"
        "  {%- endif %}\n"
        "{% endfor %}\n"
        "{%- if add_generation_prompt %}ASSISTANT:{% endif %}")
    model = _tokenizer(tmp_path / "model", template, bos_token="<s>", eos_token="</s>")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"), bos_token="<s>",
                                 eos_token="</s>", chat_template=template)
    messages = [{"role": "system", "content": "<b>naïve</b> \"q\""},
                {"role": "user", "content": "skip"}, {"role": "user", "content": "hi\n"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    chat = chat_template(model)
    for generation in (False, True):
        want = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=generation)
        assert chat.render(messages, generation) == want
    assert '"<b>naïve</b> \\"q\\""' in want and "skip" not in want


def _bad_cases(t):
    """{name: (inputs, extra args, the words the one error line holds)}."""
    pair = {"prompt": "p", "response": "r"}
    conv = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    src = lambda name, *recs: _jsonl(t / f"{name}.jsonl", [pair, *recs])     # noqa: E731
    t.mkdir(parents=True)
    (t / "notes.txt").write_text("text")
    plain = _tokenizer(t / "plain", template=None)
    last = _tokenizer(t / "last", "{{ messages[-1].content if messages else '' }}")
    return {
        "json": ([src("json", '{"prompt": "p", "response": ')], [],
                 ["json.jsonl' line 2: not valid JSON (Expecting value at column 29)"]),
        "array": ([src("array", [1, 2])], [],
                  ["array.jsonl' line 2: must be a JSON object, not [1, 2]"]),
        "missing": ([src("missing", {"prompt": "p"})], [],
                    ["missing.jsonl' line 2: no 'response' field"]),
        "renamed": ([src("renamed")], ["--prompt-field", "question"],
                    ["renamed.jsonl' line 1: no 'question' field"]),
        "number": ([src("number", {"prompt": 3, "response": "r"})], [],
                   ["number.jsonl' line 2: field 'prompt' must be a string, not 3"]),
        "empty": ([src("empty", {"prompt": "p", "response": ""})], [],
                  ["empty.jsonl' line 2: field 'response' is empty"]),
        "messages": ([src("messages", {"messages": "hi"})], [],
                     ["messages.jsonl' line 2: field 'messages' must be a non-empty list",
                      'not "hi"']),
        "role": ([src("role", {"messages": [{"role": "tool", "content": "x"}, *conv]})], [],
                 ["role.jsonl' line 2: messages[0] has role 'tool'"]),
        "content": ([src("content", {"messages": [{"role": "user", "content": None}]})], [],
                    ["content.jsonl' line 2: messages[0] content must be a string, not null"]),
        "no-answer": ([src("no-answer", {"messages": conv[:1]})], [],
                      ["no-answer.jsonl' line 2: messages holds no assistant message"]),
        "empty-answer": ([src("empty-answer", {"messages": [
            conv[0], {"role": "assistant", "content": ""}]})], [],
            ["empty-answer.jsonl' line 2: messages[1] is an empty assistant message"]),
        "no-template": ([src("no-template", {"messages": conv})], ["--tokenizer", str(plain)],
                        ["no-template.jsonl' line 2: a 'messages' example needs a chat template",
                         f"--tokenizer '{plain}' has none", "tokenizer_config.json has "
                         "chat_template"]),
        "bytes-chat": ([src("bytes-chat", {"messages": conv})], [],
                       ["bytes-chat.jsonl' line 2", "--tokenizer 'bytes' has none"]),
        "mixed": ([src("mixed"), str(t / "notes.txt")], [],
                  ["the inputs mix fine-tuning examples", "mixed.jsonl", "notes.txt"]),
        "field-on-text": ([str(t / "notes.txt")], ["--response-field", "a"],
                          ["--response-field 'a' is for .jsonl inputs only"]),
        "one": ([_jsonl(t / "one.jsonl", [pair])], [],
                ["the inputs hold 1 example(s): fine-tuning data needs at least 2"]),
        "last-only": ([src("last-only", {"messages": conv})], ["--tokenizer", str(last)],
                      ["last-only.jsonl' line 2: the chat template", "renders messages[:2] not "
                       "as a continuation", "the assistant turns cannot be told apart"]),
    }


@pytest.mark.parametrize("name", ["json", "array", "missing", "renamed", "number", "empty",
                                  "messages", "role", "content", "no-answer", "empty-answer",
                                  "no-template", "bytes-chat", "mixed", "field-on-text", "one",
                                  "last-only"])
def test_bad_examples_are_one_error_naming_file_and_line(tmp_path, capsys, name):
    inputs, extra, words = _bad_cases(tmp_path / "in")[name]
    if "--tokenizer" not in extra:
        extra = ["--tokenizer", "bytes", *extra]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["prepare-data", *inputs, *extra, "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastpar prepare-data: error: ") and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before       # nothing written


def test_a_line_that_is_not_utf8_names_its_line(tmp_path):
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl' line 2: not UTF-8 text \(byte 15\)"):
        prepare_data([str(src)], "bytes", tmp_path / "data")


def test_text_data_has_no_mask_and_keeps_the_tokenizer_config(tmp_path):
    model = _tokenizer(tmp_path / "model")
    (tmp_path / "txt").mkdir()
    for i in range(3):
        (tmp_path / "txt" / f"d{i}.txt").write_text(f"document {i} " * 20)
    prepare_data([str(tmp_path / "txt")], str(model), tmp_path / "data")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "tokenizer.json", "tokenizer_config.json", "train.bin", "val.bin"]
    assert read_mask(tmp_path / "data" / "train.bin") is None
    assert mask_file(tmp_path / "data" / "val.bin") == tmp_path / "data" / "val.mask.bin"


def test_chat_template_from_a_jinja_file_or_a_named_list(tmp_path):
    named = _tokenizer(tmp_path / "named", [{"name": "tool_use", "template": "T"},
                                            {"name": "default", "template": CHATML}])
    assert chat_template(named).source == CHATML
    assert chat_template(named / "tokenizer.json").path == str(named / "tokenizer_config.json")
    (named / "chat_template.jinja").write_text(INST)          # the newer layout wins
    assert chat_template(named).source == INST
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("some text " * 30)
    prepare_data([str(tmp_path / "txt")], str(named), tmp_path / "data", val_fraction=0.5)
    assert (tmp_path / "data" / "chat_template.jinja").read_text() == INST
    assert chat_template(tmp_path / "data").source == INST
    none = _tokenizer(tmp_path / "none", None)
    assert chat_template(none) is None and chat_template("bytes") is None
    copy_tokenizer_config(none / "tokenizer.json", tmp_path / "data")    # another tokenizer's:
    assert not (tmp_path / "data" / "chat_template.jinja").exists()      # no stale template
    assert (tmp_path / "data" / "tokenizer_config.json").read_bytes() == \
        (none / "tokenizer_config.json").read_bytes()
    copy_tokenizer_config(None, tmp_path / "data")                       # bytes: none at all
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "tokenizer.json", "train.bin", "val.bin"]


@pytest.mark.parametrize("damage, words", [
    ("vocab", ["header field vocab_size=3 must be 2"]),
    ("tokens", ["does not match", "n_tokens=", "prepare the data again"]),
    ("docs", ["does not match", "n_docs=1 against", "n_docs=3"]),
    ("offsets", ["does not match", "document offset 1 is"]),
    ("value", ["token 4 has value 2; a mask holds 0 or 1"]),
    ("zeros", ["holds no 1: no token of"]),
])
def test_read_mask_refuses_a_mask_that_does_not_fit(tmp_path, damage, words):
    src = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "response": r} for p, r in PAIRS])
    data = tmp_path / "data"
    prepare_data([src], str(_tokenizer(tmp_path / "model")), data, val_fraction=0.5)
    split = data / "train.bin"
    good = np.array(read_mask(split))
    _, starts = read_token_file(split)
    starts = [int(s) for s in starts]
    assert len(starts) == 3
    if damage == "vocab":
        write_token_file(mask_file(split), good, vocab_size=3, doc_starts=starts)
    elif damage == "tokens":
        write_token_file(mask_file(split), good[:-1], vocab_size=2, doc_starts=starts)
    elif damage == "docs":
        write_token_file(mask_file(split), good, vocab_size=2)
    elif damage == "offsets":
        write_token_file(mask_file(split), good, 2, [0, starts[1] + 1, starts[2]])
    elif damage in ("value", "zeros"):
        write_token_file(mask_file(split), np.zeros_like(good) if damage == "zeros" else good,
                         2, starts)
        if damage == "value":          # the writer refuses ids >= vocab: poke the byte in
            raw = bytearray(mask_file(split).read_bytes())
            raw[read_header(split).data_offset + 2 * 4] = 2
            mask_file(split).write_bytes(bytes(raw))
    with pytest.raises(ValueError) as e:
        read_mask(split)
    assert str(e.value).startswith(f"mask file '{mask_file(split)}'")
    for w in words:
        assert w in str(e.value), str(e.value)


def test_prompt_ids_render_the_chat_template(tmp_path):
    model = _tokenizer(tmp_path / "model")
    tok = load_tokenizer(model)
    ids = prompt_ids(tok, model / "tokenizer.json", "What is TP?", chat=True, system="Brief.")
    assert tok.decode(ids) == ("<|im_start|>system\nBrief.<|im_end|>\n<|im_start|>user\n"
                               "What is TP?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>")          # a token, not text
    assert prompt_ids(tok, model, "hi", chat=True) == tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_ids(tok, model, "hi") == tok.encode("hi")
    with pytest.raises(ValueError, match="--system is for --chat only"):
        prompt_ids(tok, model, "hi", system="s")
    plain = _tokenizer(tmp_path / "plain", template=None)
    for spec in (plain, "bytes"):
        with pytest.raises(ValueError, match=f"--chat needs a chat template, and the tokenizer "
                                             f"'{spec}' has none: pass --tokenizer"):
            prompt_ids(load_tokenizer(spec), spec, "hi", chat=True)


def _run_cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_generate_chat_continues_the_rendering_and_prints_the_reply(tmp_path):
    from fastpar.models import GPT, GPTConfig, generate
    from fastpar.train import save_checkpoint

    config = GPTConfig(vocab_size=256, n_layers=1, d_model=32, n_heads=2, max_seq_len=64,
                       init_seed=5)
    model = GPT(config)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 1, [model], None, None,
                    {"data_step": 1, "model_config": config.to_dict()})
    (run / "config.json").write_text(json.dumps({"train": {"data": None}}))   # bytes
    # 256 byte tokens and a template of plain text: ids the byte-vocabulary model can read
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    chat = _tokenizer(tmp_path / "chat", template, specials=())
    tok = load_tokenizer(chat)
    ids = tok.encode("<system>Be brief.\n<user>Hi\n<assistant>")
    reply = tok.decode(generate(model, ids, 6, temperature=0))
    rc, out, err = _run_cli(["generate", str(run), "--tokenizer", str(chat), "--chat",
                             "--system", "Be brief.", "--prompt", "Hi", "--max-new-tokens", "6",
                             "--temperature", "0"])
    assert (rc, err, out) == (0, "", reply + "\n")
    for argv, words in ((["--chat"], "--chat needs a chat template, and the tokenizer 'bytes'"),
                        (["--system", "s"], "--system is for --chat only")):
        rc, out, err = _run_cli(["generate", str(run), "--prompt", "Hi", *argv])
        assert rc == 2 and out == "" and len(err.splitlines()) == 1 and words in err, err
