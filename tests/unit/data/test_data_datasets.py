"""Prompt datasets: JSONL and Parquet loading, field mapping, and each bad-input error."""

import json
import re

import pytest

from megatron_tlt.data.datasets import load_prompt_dataset
from megatron_tlt.errors import ConfigError, TLTError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

RECORDS = [
    {"uid": "q1", "question": "What is 1/2 + 0?", "meta": {"gold": "1/2"}, "extra": 1},
    {"uid": "q2", "question": "Compute 6*7.", "meta": {"gold": 42}, "extra": 2},
    {"uid": "q3", "question": "Name a prime.", "meta": {"gold": "2"}, "extra": 3},
]


def write_jsonl(path, records, blank_lines=False):
    lines = []
    for r in records:
        lines.append(json.dumps(r))
        if blank_lines:
            lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_jsonl_and_parquet_give_the_same_samples(tmp_path):
    # Parquet columns need one type: numbers as strings there, ints in the JSONL.
    pq_records = [dict(r, meta={"gold": str(r["meta"]["gold"])}) for r in RECORDS]
    kw = dict(prompt_field="question", answer_field="meta.gold", id_field="uid", task="math")
    a = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", RECORDS, blank_lines=True), **kw)
    b = load_prompt_dataset(write_parquet(tmp_path / "d.parquet", pq_records), **kw)
    key = lambda s: (s.prompt_id, s.prompt, s.answer, s.task, s.solution)  # noqa: E731
    assert [key(s) for s in a] == [key(s) for s in b]
    assert [s.prompt_id for s in a] == ["q1", "q2", "q3"]
    assert [s.answer for s in a] == ["1/2", "42", "2"]
    assert a[0].task == "math" and a[0].solution is None


def test_default_fields_and_positional_ids(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}],
                       blank_lines=True)
    ds = load_prompt_dataset(path)
    assert [s.prompt_id for s in ds] == ["p-1", "p-3"]  # blank lines are counted
    assert [s.prompt for s in ds] == ["a", "b"]
    ds = load_prompt_dataset(write_parquet(tmp_path / "p.parquet", [{"prompt": "a", "answer": "1"}]))
    assert ds[0].prompt_id == "p-0"


def test_prompt_only_dataset(tmp_path):
    ds = load_prompt_dataset(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}]), answer_field=None)
    assert ds[0].answer == ""


def test_literal_dotted_key_wins(tmp_path):
    rec = {"prompt": "p", "a.b": "literal", "a": {"b": "nested"}}
    ds = load_prompt_dataset(write_jsonl(tmp_path / "p.jsonl", [rec]), answer_field="a.b")
    assert ds[0].answer == "literal"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(TLTError, match=re.escape(f"{path}: no such file")):
        load_prompt_dataset(path)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\n")
    with pytest.raises(TLTError, match=r"unsupported file type '\.csv'; expected one of \.jsonl, \.parquet"):
        load_prompt_dataset(path)


def test_malformed_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(TLTError, match=re.escape(f"{path}: line 2: malformed JSON")):
        load_prompt_dataset(path)


def test_invalid_utf8_names_the_line(tmp_path):
    # It raised a bare UnicodeDecodeError naming neither file nor line.
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(TLTError, match=re.escape(f"{path}: line 2: not valid UTF-8 (byte 16 of the line)")):
        load_prompt_dataset(path)


def test_utf8_byte_order_mark_is_allowed(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\n')
    assert [s.prompt for s in load_prompt_dataset(path)] == ["a"]


def test_non_object_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('["a", "b"]\n')
    with pytest.raises(TLTError, match=re.escape(f"{path}: line 1: expected a JSON object, got list")):
        load_prompt_dataset(path)


def test_missing_field_names_line_field_and_fields_present(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"problem": "b", "solution": "2"}])
    with pytest.raises(TLTError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == (f"{path}: line 2: missing prompt field 'prompt' "
                              "(fields present: problem, solution)")
    with pytest.raises(TLTError, match=r"row 1: missing answer field 'meta\.gold' \(fields present: "):
        load_prompt_dataset(write_parquet(tmp_path / "d.parquet", [{"prompt": "a", "meta": {"gold": "1"}},
                                                                   {"prompt": "b", "meta": None}]),
                            answer_field="meta.gold")


def test_wrong_type_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ["a"], "answer": "1"}])
    with pytest.raises(TLTError, match=re.escape(f"{path}: line 1: field 'prompt' (prompt) must be a string, got list")):
        load_prompt_dataset(path)


def test_empty_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n\n")
    with pytest.raises(TLTError, match=re.escape(f"{path}: empty dataset")):
        load_prompt_dataset(path)
    empty_pq = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty_pq)
    with pytest.raises(TLTError, match=re.escape(f"{empty_pq}: empty dataset")):
        load_prompt_dataset(empty_pq)


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(TLTError, match=re.escape(f"{path}: cannot read Parquet file")):
        load_prompt_dataset(path)


def test_duplicate_ids(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": 7, "prompt": "a", "answer": "1"},
                                              {"id": 7, "prompt": "b", "answer": "2"}])
    with pytest.raises(TLTError, match=re.escape(f"{path}: line 2: duplicate prompt id '7' (first at line 1)")):
        load_prompt_dataset(path, id_field="id")


def test_prompt_too_long(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "abc", "answer": "1"}, {"prompt": "x" * 20, "answer": "2"}])
    # tiny tokenizer: <bos> + one token per character
    assert len(load_prompt_dataset(path, max_prompt_tokens=21, tokenizer="tiny")) == 2
    with pytest.raises(TLTError, match=re.escape(f"{path}: line 2: prompt has 21 tokens, more than max_prompt_tokens=20")):
        load_prompt_dataset(path, max_prompt_tokens=20, tokenizer="tiny")
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        load_prompt_dataset(path, max_prompt_tokens=20)


def test_unknown_task_fails_at_load(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"unknown reward 'maths'; known rewards: .*\bmath\b"):
        load_prompt_dataset(path, task="maths")
