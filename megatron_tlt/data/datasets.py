"""Prompt datasets from files: JSONL and Parquet.

`load_prompt_dataset` reads records, picks the prompt / answer / id fields (dotted
paths reach into nested objects: ``"meta.answer"``), and returns `Sample`s. All
checks run at load, before any work starts; each failure is one TLTError naming
the file, the record and the field:

    data.jsonl: line 7: malformed JSON: Expecting ',' delimiter (column 12)
    data.jsonl: line 3: missing field 'question' (fields present: id, problem, solution)
    data.parquet: row 4: prompt has 913 tokens, more than max_prompt_tokens=512

Records are numbered as users see them: JSONL by 1-based line number (blank lines
are skipped but counted), Parquet by 0-based row index. Prompt ids are the
`id_field` value, or ``"{file stem}-{line or row}"``; duplicates are an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from megatron_tlt.data.tasks import Sample
from megatron_tlt.errors import ConfigError, TLTError

SUFFIXES = (".jsonl", ".parquet")
_MISSING = object()


def get_field(record: dict[str, Any], path: str) -> Any:
    """`record[path]`, or the nested value at a dotted path (``"a.b.c"``); a key
    that itself contains dots wins over the nested reading. `_MISSING` if absent."""
    if path in record:
        return record[path]
    value: Any = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _iter_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"line {lineno}"
            try:  # a UTF-8 byte-order mark at the start of the file is allowed
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise TLTError(f"{path}: {where}: not valid UTF-8 (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TLTError(f"{path}: {where}: malformed JSON: {exc.msg} "
                               f"(column {exc.colno})") from None
            if not isinstance(record, dict):
                raise TLTError(f"{path}: {where}: expected a JSON object, got "
                               f"{type(record).__name__}")
            yield where, record


def _iter_parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TLTError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise TLTError(f"{path}: cannot read Parquet file: {str(exc).splitlines()[0]}") from None
    for i, record in enumerate(table.to_pylist()):
        yield f"row {i}", record


def _as_text(value: Any, path: Path, where: str, field: str, role: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and role != "prompt":
        return str(value)
    raise TLTError(f"{path}: {where}: field {field!r} ({role}) must be a string, got "
                   f"{type(value).__name__}: {str(value)[:60]!r}")


def load_prompt_dataset(path: str | os.PathLike, prompt_field: str = "prompt",
                        answer_field: str | None = "answer", id_field: str | None = None,
                        task: str | None = None, max_prompt_tokens: int | None = None,
                        tokenizer: Any = None) -> list[Sample]:
    """Load prompts (and reference answers) from a ``.jsonl`` or ``.parquet`` file.

    Args:
        path: the file.
        prompt_field / answer_field / id_field: field names or dotted paths;
            ``answer_field=None`` for prompt-only data (answers ""), ``id_field=None``
            for positional ids. Numeric answers and ids are turned into strings.
        task: reward name every sample is scored with (checked via `get_reward`,
            so a typo fails here); stored as `Sample.task`.
        max_prompt_tokens: reject prompts longer than this, counted as the model
            sees them (`tokenizer.encode_prompt`); needs `tokenizer`.
        tokenizer: a `Tokenizer` or anything `load_tokenizer` accepts.
    """
    path = Path(path).expanduser()
    if task is not None:
        from megatron_tlt.data.rewards import get_reward

        get_reward(task)
    if max_prompt_tokens is not None:
        if not isinstance(max_prompt_tokens, int) or max_prompt_tokens <= 0:
            raise ConfigError(f"max_prompt_tokens ({max_prompt_tokens!r}) must be a positive int")
        if tokenizer is None:
            raise ConfigError(f"max_prompt_tokens ({max_prompt_tokens}) needs a tokenizer to count "
                              f"tokens of {path}")
    if tokenizer is not None:
        from megatron_tlt.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    if not path.is_file():
        raise TLTError(f"{path}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise TLTError(f"{path}: unsupported file type {suffix or '(none)'!r}; "
                       f"expected one of {', '.join(SUFFIXES)}")
    records = _iter_jsonl(path) if suffix == ".jsonl" else _iter_parquet(path)

    samples: list[Sample] = []
    seen: dict[str, str] = {}
    for where, record in records:
        def need(field: str, role: str) -> Any:
            value = get_field(record, field)
            if value is _MISSING:
                present = ", ".join(sorted(map(str, record))) or "none"
                raise TLTError(f"{path}: {where}: missing {role} field {field!r} "
                               f"(fields present: {present})")
            return value

        prompt = _as_text(need(prompt_field, "prompt"), path, where, prompt_field, "prompt")
        answer = ("" if answer_field is None else
                  _as_text(need(answer_field, "answer"), path, where, answer_field, "answer"))
        if id_field is None:
            pid = f"{path.stem}-{where.split()[-1]}"
        else:
            pid = _as_text(need(id_field, "id"), path, where, id_field, "id")
        if pid in seen:
            raise TLTError(f"{path}: {where}: duplicate prompt id {pid!r} (first at {seen[pid]})")
        seen[pid] = where
        if max_prompt_tokens is not None:
            n_tokens = len(tokenizer.encode_prompt(prompt))
            if n_tokens > max_prompt_tokens:
                raise TLTError(f"{path}: {where}: prompt has {n_tokens} tokens, more than "
                               f"max_prompt_tokens={max_prompt_tokens}")
        meta = {"source": str(path), "record": where}
        samples.append(Sample(prompt, None, answer, meta, prompt_id=pid, task=task or ""))
    if not samples:
        raise TLTError(f"{path}: empty dataset (no records)")
    return samples
