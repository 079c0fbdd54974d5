"""Tokenizers: the built-in character-level one, and HF tokenizer directories.

`load_tokenizer(path_or_name)` returns a `Tokenizer`, a thin wrapper that gives
every backend the same small surface: ``encode`` (never adds special tokens; text
that spells one, ``<eos>`` or a chat marker, is read as that token, as HF tokenizers
do, so pre-rendered chat markers in SFT data work: a dataset whose text holds such
strings literally gets control ids there),
``decode``, ``bos_id``/``eos_id``/``pad_id``, ``vocab_size``, ``apply_chat_template``
and ``encode_prompt`` (what the rollout engine feeds the model for a prompt).

The built-in tokenizer (name ``"tiny"``) is character-level over printable ASCII
plus newline, with ``<pad> <bos> <eos> <unk>``: 100 ids, deliberately not a
multiple of 128 so vocab padding paths get exercised. It lives in HF format under
``assets/tiny_tokenizer/`` (loadable by ``transformers.AutoTokenizer``) and is
regenerated deterministically by ``python -m megatron_tlt.data.tokenizer``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_tlt.errors import TLTError

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tiny_tokenizer"
TINY_SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>",
                       "unk_token": "<unk>"}
TINY_CHARS = ["\n"] + [chr(c) for c in range(32, 127)]

# Names under which end/begin/pad tokens appear in bare tokenizer.json files.
_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>")
_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>")


def _dump_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def build_tiny_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Write the built-in character tokenizer (HF format) into `out_dir`.

    Deterministic: the same files every time (the shipped copy is checked against
    a fresh build in tests). Returns the directory.
    """
    from tokenizers import AddedToken, Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = [TINY_SPECIAL_TOKENS[k] for k in ("pad_token", "bos_token", "eos_token", "unk_token")]
    vocab = {tok: i for i, tok in enumerate(specials + TINY_CHARS)}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _dump_json({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                "clean_up_tokenization_spaces": False, "add_bos_token": False,
                "add_eos_token": False, **TINY_SPECIAL_TOKENS}, out / "tokenizer_config.json")
    _dump_json(dict(TINY_SPECIAL_TOKENS), out / "special_tokens_map.json")
    return out


class Tokenizer:
    """One interface over a `tokenizers.Tokenizer` or a transformers tokenizer.

    `encode` never adds special tokens; `encode_prompt` adds what the model expects
    before a prompt (the chat template's own tokens, or ``<bos>`` when plain).
    """

    def __init__(self, backend: Any, *, kind: str, name_or_path: str, eos_id: int,
                 bos_id: int | None, pad_id: int, vocab_size: int,
                 chat_template: bool = False):
        self._backend = backend
        self._kind = kind  # "tokenizers" | "transformers"
        self.name_or_path = name_or_path
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.use_chat_template = chat_template

    @property
    def has_chat_template(self) -> bool:
        return self._kind == "transformers" and getattr(self._backend, "chat_template", None) is not None

    def encode(self, text: str) -> list[int]:
        if self._kind == "tokenizers":
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._backend.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if self._kind == "tokenizers":
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=False)

    def apply_chat_template(self, prompt: str, use_chat_template: bool | None = None) -> str:
        """The prompt as the model sees it: wrapped in the tokenizer's chat template
        (one user turn plus the generation prompt) when templating is requested
        (`use_chat_template`, defaulting to the flag given at load) and the tokenizer
        has a template; otherwise the prompt unchanged."""
        want = self.use_chat_template if use_chat_template is None else use_chat_template
        if not (want and self.has_chat_template):
            return prompt
        return self._backend.apply_chat_template([{"role": "user", "content": prompt}],
                                                 tokenize=False, add_generation_prompt=True)

    def encode_prompt(self, prompt: str, use_chat_template: bool | None = None) -> list[int]:
        """Token ids fed to the model for `prompt`: the templated text, or
        ``[bos] + encode(prompt)`` when plain (no bos for tokenizers without one)."""
        text = self.apply_chat_template(prompt, use_chat_template)
        if text is not prompt:  # templated: the template spells out its own special tokens
            return self.encode(text)
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(prompt)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})")


def _from_tokenizer_json(file: Path, name: str, special_map: dict[str, str] | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTok

    try:
        tok = HFTok.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise TLTError(f"tokenizer {file}: cannot load tokenizer.json: {exc}") from None

    def find(key: str, names: Sequence[str]) -> int | None:
        candidates = ([special_map[key]] if special_map and key in special_map else []) + list(names)
        for cand in candidates:
            if isinstance(cand, dict):  # special_tokens_map may hold AddedToken dicts
                cand = cand.get("content")
            idx = tok.token_to_id(cand) if isinstance(cand, str) else None
            if idx is not None:
                return idx
        return None

    eos = find("eos_token", _EOS_NAMES)
    if eos is None:
        raise TLTError(f"tokenizer {file}: no end-of-sequence token (looked for "
                       f"{', '.join(_EOS_NAMES)}); add special_tokens_map.json with eos_token")
    pad = find("pad_token", _PAD_NAMES)
    return Tokenizer(tok, kind="tokenizers", name_or_path=name, eos_id=eos,
                     bos_id=find("bos_token", _BOS_NAMES), pad_id=eos if pad is None else pad,
                     vocab_size=tok.get_vocab_size(with_added_tokens=True))


def _from_hf_dir(path: Path, chat_template: bool) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a hard dependency
        raise TLTError(f"tokenizer {path}: loading an HF tokenizer needs transformers ({exc})") from None
    loader = AutoTokenizer
    if _declared_class(path) == "PreTrainedTokenizerFast":
        # the generic fast tokenizer the directory names: AutoTokenizer picks config.json's
        # model family's class instead (transformers 5: Qwen2Tokenizer for a qwen2 model,
        # which re-tokenizes a tokenizer.json of another kind: the tiny one lost its spaces)
        from transformers import PreTrainedTokenizerFast as loader
    try:
        tok = loader.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        if (path / "tokenizer.json").is_file():  # a bare tokenizers file next to an odd config
            return _from_tokenizer_json(path / "tokenizer.json", str(path), _special_map(path))
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TLTError(f"tokenizer {path}: cannot load as an HF tokenizer directory: {msg}") from None
    eos = tok.eos_token_id
    if eos is None:
        raise TLTError(f"tokenizer {path}: has no eos_token; set eos_token in tokenizer_config.json")
    pad = tok.pad_token_id
    return Tokenizer(tok, kind="transformers", name_or_path=str(path), eos_id=eos,
                     bos_id=tok.bos_token_id, pad_id=eos if pad is None else pad,
                     vocab_size=len(tok), chat_template=chat_template)


def _declared_class(directory: Path) -> str | None:
    """tokenizer_config.json's tokenizer_class, None when absent or unreadable."""
    try:
        data = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    cls = data.get("tokenizer_class") if isinstance(data, dict) else None
    return cls if isinstance(cls, str) else None


def _special_map(directory: Path) -> dict[str, str] | None:
    file = directory / "special_tokens_map.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TLTError(f"tokenizer {file}: malformed JSON: {exc}") from None
    return data if isinstance(data, dict) else None


def tokenizer_dir(path_or_name: str | os.PathLike) -> str:
    """The directory holding the files of what `load_tokenizer(path_or_name)` loads
    ('tiny': the built-in one's): training runs copy them next to every saved model,
    so `eval --ckpt` and conversion find the tokenizer there."""
    if str(path_or_name) == "tiny":
        return str(TINY_TOKENIZER_DIR)
    path = os.path.abspath(os.fspath(path_or_name))
    return path if os.path.isdir(path) else os.path.dirname(path)


def load_tokenizer(path_or_name: str | os.PathLike, *, chat_template: bool = False) -> Tokenizer:
    """Load a tokenizer, offline.

    * ``"tiny"``: the built-in character tokenizer (no transformers import).
    * a directory: an HF tokenizer, via ``AutoTokenizer.from_pretrained(path,
      local_files_only=True)``; falls back to its bare ``tokenizer.json``.
    * a ``.json`` file: a bare `tokenizers` file (eos/bos/pad found by name, or
      from a ``special_tokens_map.json`` beside it).

    `chat_template`: whether `apply_chat_template`/`encode_prompt` use the
    tokenizer's chat template (when it has one). Raises TLTError naming the path
    when it is missing or cannot be loaded.
    """
    if isinstance(path_or_name, Tokenizer):
        return path_or_name
    if str(path_or_name) == "tiny":
        file = TINY_TOKENIZER_DIR / "tokenizer.json"
        if not file.is_file():
            raise TLTError(f"tokenizer tiny: built-in file {file} is missing; "
                           "regenerate it with python -m megatron_tlt.data.tokenizer")
        return _from_tokenizer_json(file, "tiny", dict(TINY_SPECIAL_TOKENS))
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise TLTError(f"tokenizer {path}: no such file or directory "
                       "(give an HF tokenizer directory, a tokenizer.json, or 'tiny')")
    if path.is_file():
        return _from_tokenizer_json(path, str(path), _special_map(path.parent))
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                              "tokenizer.model", "vocab.json")):
        raise TLTError(f"tokenizer {path}: directory holds no tokenizer files "
                       "(expected tokenizer.json or tokenizer_config.json)")
    return _from_hf_dir(path, chat_template)


if __name__ == "__main__":  # python -m megatron_tlt.data.tokenizer [OUT_DIR]
    print(build_tiny_tokenizer(sys.argv[1] if len(sys.argv) > 1 else TINY_TOKENIZER_DIR))
