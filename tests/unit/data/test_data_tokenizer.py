"""Tokenizers: the built-in one (shipped == fresh build, round trip), HF loading, errors."""

import json

import pytest

from megatron_tlt.data.tasks import list_tasks, make_dataset
from megatron_tlt.data.tokenizer import TINY_TOKENIZER_DIR, build_tiny_tokenizer, load_tokenizer, tokenizer_dir
from megatron_tlt.errors import TLTError

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def test_shipped_tiny_tokenizer_equals_fresh_build(tmp_path):
    build_tiny_tokenizer(tmp_path)
    for name in FILES:
        shipped = json.loads((TINY_TOKENIZER_DIR / name).read_text(encoding="utf-8"))
        fresh = json.loads((tmp_path / name).read_text(encoding="utf-8"))
        assert shipped == fresh, f"{name} differs; run python -m megatron_tlt.data.tokenizer"
    # Deterministic to the byte.
    build_tiny_tokenizer(tmp_path / "again")
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_tiny_special_ids_and_vocab():
    tok = load_tokenizer("tiny")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 100 and tok.vocab_size % 128 != 0
    assert tok.encode("") == []
    assert tok.encode_prompt("ab") == [tok.bos_id] + tok.encode("ab")
    assert tok.apply_chat_template("ab") == "ab"  # no chat template: plain
    assert tok.decode([tok.bos_id, *tok.encode("x"), tok.eos_id], skip_special_tokens=True) == "x"


def test_round_trip_on_task_text():
    tok = load_tokenizer("tiny")
    ds = make_dataset(list_tasks(), 300, seed=0)
    for s in ds:
        for text in (s.prompt, s.solution, s.prompt + s.solution):
            ids = tok.encode(text)
            assert len(ids) == len(text)  # one token per character
            assert tok.decode(ids) == text
            assert all(3 < i < tok.vocab_size for i in ids)  # no <unk>, no specials


def test_round_trip_all_printable_ascii():
    tok = load_tokenizer("tiny")
    text = "".join(chr(c) for c in range(32, 127)) + "\n  <eos"
    assert tok.decode(tok.encode(text)) == text
    # Characters outside the alphabet map to <unk> (negative control for round trip).
    assert tok.decode(tok.encode("é")) == "<unk>"


def test_hf_auto_tokenizer_loads_tiny_directory_identically():
    tiny = load_tokenizer("tiny")
    hf = load_tokenizer(TINY_TOKENIZER_DIR)
    text = make_dataset(["sort"], 1, seed=0)[0].prompt + "#### [1, 2]\n"
    assert hf.encode(text) == tiny.encode(text)
    assert hf.decode(hf.encode(text)) == text
    assert (hf.bos_id, hf.eos_id, hf.pad_id, hf.vocab_size) == (1, 2, 0, 100)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_files_beside_a_model_config_load_as_the_tiny_tokenizer(tmp_path, family):
    """An SFT / RL export of a model trained with the tiny tokenizer (its files next to the
    model's config.json) encodes as training did, for every family: with model_type qwen2,
    AutoTokenizer chose Qwen2Tokenizer over the declared PreTrainedTokenizerFast and
    dropped every space and newline."""
    import shutil

    for f in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, "architectures": ["X"]}))
    text = "Compute left to right, mod 100: 13-74+8\nanswer"
    tiny = load_tokenizer("tiny")
    got = load_tokenizer(str(tmp_path))
    assert got.encode(text) == tiny.encode(text) and got.decode(got.encode(text)) == text


def test_bare_tokenizer_json_file():
    tok = load_tokenizer(TINY_TOKENIZER_DIR / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    assert tok.decode(tok.encode("1+2=3")) == "1+2=3"


def test_chat_template_used_only_when_requested(tmp_path):
    build_tiny_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}U: {{ m['content'] }}\n{% endfor %}A:"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = load_tokenizer(tmp_path)
    chat = load_tokenizer(tmp_path, chat_template=True)
    assert plain.has_chat_template and chat.has_chat_template
    assert plain.apply_chat_template("hi") == "hi"
    assert chat.apply_chat_template("hi") == "U: hi\nA:"
    assert chat.encode_prompt("hi") == chat.encode("U: hi\nA:")
    assert plain.encode_prompt("hi") == [1] + plain.encode("hi")


def test_tokenizer_dir_is_where_the_files_are():
    assert tokenizer_dir("tiny") == str(TINY_TOKENIZER_DIR)
    assert tokenizer_dir(TINY_TOKENIZER_DIR) == str(TINY_TOKENIZER_DIR)
    assert tokenizer_dir(TINY_TOKENIZER_DIR / "tokenizer.json") == str(TINY_TOKENIZER_DIR)


def test_missing_path_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TLTError, match=f"tokenizer {missing}: no such file or directory"):
        load_tokenizer(missing)


def test_empty_directory_error(tmp_path):
    with pytest.raises(TLTError, match=f"tokenizer {tmp_path}: directory holds no tokenizer files"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_json_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TLTError, match=f"tokenizer {tmp_path}.*tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(TLTError, match=f"tokenizer {tmp_path}"):
        load_tokenizer(tmp_path)


def test_missing_eos_error(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "t.json"))
    with pytest.raises(TLTError, match="no end-of-sequence token"):
        load_tokenizer(tmp_path / "t.json")
