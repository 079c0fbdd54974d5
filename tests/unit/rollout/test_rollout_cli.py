"""`megatron-tlt generate` body: flags, JSONL in/out, per-line errors."""

import argparse
import json
import shutil

import pytest

from megatron_tlt.errors import TLTError
from megatron_tlt.rollout.cli import add_generate_args, main


@pytest.fixture(scope="module")
def model_dir(hf_models, tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("cli_model") / "m"
    shutil.copytree(hf_models["llama"][0], d)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 300)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(d)
    return str(d)


def _args(model_dir, prompts_path, out, *extra):
    parser = add_generate_args(argparse.ArgumentParser())
    return parser.parse_args(["--model", model_dir, "--prompts", str(prompts_path), "--out", str(out),
                              "--max-new-tokens", "6", "--block-size", "4", *extra])


def _write(path, lines):
    """One line per item: str and bytes as they are, anything else as JSON."""
    path.write_bytes(b"\n".join(l if isinstance(l, bytes) else (l if isinstance(l, str) else json.dumps(l)).encode()
                                for l in lines) + b"\n")
    return path


def test_generate_jsonl(model_dir, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [
        {"prompt_id": "a", "prompt": "w5 w17 w42"},
        "",
        {"prompt_token_ids": [3, 4, 5, 6]},
        {"prompt_id": "bad", "prompt_token_ids": [3, 400]},
        {"prompt_id": "none", "prompt": "w9", "n": 0},
        {"prompt_id": "empty", "prompt_token_ids": []},
        {"prompt_id": "a", "prompt": "w8"},  # same prompt_id as line 1
    ])
    out = tmp_path / "out.jsonl"
    rc = main(_args(model_dir, prompts, out, "--n", "2", "--temperature", "0.8", "--top-p", "0.9",
                    "--seed", "3"))
    assert rc == 1  # rejected lines
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(l["prompt_id"], l["sample_index"]) for l in lines] == [
        ("a", 0), ("a", 1), (1, 0), (1, 1), ("bad", 0), ("bad", 1), ("none", None), ("empty", 0),
        ("empty", 1), ("a", 0), ("a", 1)]
    for l in lines[:4]:
        assert l["error"] is None and l["finish_reason"] in ("stop", "length")
        assert len(l["token_ids"]) == len(l["logprobs"]) and 1 <= len(l["token_ids"]) <= 6
        assert isinstance(l["text"], str) and l["spec"] == {} and l["policy_version"] == 0
        if l["finish_reason"] == "stop":
            assert l["token_ids"][-1] == 1  # tokenizer eos
    assert lines[0]["token_ids"] != lines[1]["token_ids"]
    # every rejected request names its line (the engine's own message named its position
    # among the expanded requests instead)
    assert lines[4]["error"].endswith("p.jsonl:4: prompt 'bad' sample 0: prompt token id 400 at index 1 "
                                      "is outside the vocabulary [0, 300)")
    assert lines[4]["finish_reason"] == "error" and "p.jsonl:4: prompt 'bad' sample 1:" in lines[5]["error"]
    assert "p.jsonl:5: prompt 'none': number of samples n must be" in lines[6]["error"]
    assert lines[7]["error"].endswith("p.jsonl:6: prompt 'empty' sample 0: prompt is empty (no prompt tokens)")
    assert lines[9]["error"].endswith("p.jsonl:7: prompt 'a' sample 0: same prompt_id and sample_index as "
                                      "line 1 (both would sample identical tokens)")
    assert all(l["token_ids"] == [] and l["finish_reason"] == "error" for l in lines[4:])
    # Same seed -> identical file.
    out2 = tmp_path / "out2.jsonl"
    main(_args(model_dir, prompts, out2, "--n", "2", "--temperature", "0.8", "--top-p", "0.9",
               "--seed", "3"))
    assert out2.read_text() == out.read_text()


def test_greedy_text_matches_tokens(model_dir, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": "w5 w6"}])
    out = tmp_path / "out.jsonl"
    assert main(_args(model_dir, prompts, out, "--temperature", "0")) == 0
    (line,) = [json.loads(l) for l in out.read_text().splitlines()]
    words = [f"w{t}" for t in line["token_ids"] if t != 1]
    assert line["text"] == " ".join(words)


@pytest.mark.parametrize("content, flags, message", [
    (['{"prompt": "w1"}', '{"prompt": "w2"', '{"prompt": "w3"}'], [], r"p\.jsonl:2: not valid JSON"),
    (['[1, 2]'], [], r"p\.jsonl:1: expected a JSON object"),
    (['{"prompt": "w1", "prompt_token_ids": [1]}'], [], "exactly one of"),
    (['{"text": "w1"}'], [], "exactly one of"),
    (['{"prompt": 5}'], [], "'prompt' must be a string"),
    (['{"prompt": "w1"}'], ["--n", "0"], r"--n must be in \[1, 65536\], got 0"),
    (['{"prompt": "w1"}'], ["--n", "100000000000"], r"--n must be in \[1, 65536\], got 100000000000"),
    # json.loads' ValueError / RecursionError were tracebacks
    (['{"prompt_id": 1' + "0" * 5000 + ', "prompt": "w1"}'], [], r"p\.jsonl:1: not valid JSON input \(ValueError"),
    (['{"prompt_token_ids": ' + "[" * 100000 + "]" * 100000 + "}"], [], r"p\.jsonl:1: not valid JSON input \(RecursionError"),
    # a lone surrogate crashed request_seed, the tokenizer or the output write
    (['{"prompt": "w1"}', '{"prompt_id": "\\ud800", "prompt": "w1"}'], [],
     r"p\.jsonl:2: 'prompt_id' is not valid Unicode text"),
    (['{"prompt": "w1 \\udc00"}'], [], r"p\.jsonl:1: 'prompt' is not valid Unicode text"),
    (['{"prompt": "w1"}'], ["--spec", "eagle"], "--spec eagle needs --drafter DIR"),
    (['{"prompt": "w1"}'], ["--drafter", "/x"], "--drafter needs --spec eagle"),
    (['{"prompt": "w1"}'], ["--spec", "ngram", "--spec-depth", "0"], "--spec flags: spec depth must be"),
    (['{"prompt": "w1"}'], ["--top-p", "1.5"], r"sampling flags: top_p must be in \(0, 1\]"),
    (['{"prompt": "w1"}'], ["--temperature", "1e-40"], r"sampling flags: temperature must be 0 \(greedy\)"),
    (['{"prompt": "w1"}'], ["--device", "gpu"], r"--device 'gpu': expected auto, cpu or cuda\[:i\]"),
    (['{"prompt": "w1"}'], ["--block-size", "0"], "--block-size must be >= 1, got 0"),
    (['{"prompt": "w1"}'], ["--num-blocks", "0"], "--num-blocks must be >= 1, got 0"),
    (['{"prompt": "w1"}'], ["--max-num-seqs", "-2"], "--max-num-seqs must be >= 1, got -2"),
    (['{"prompt": "w1"}', b'{"prompt": "w\xff"}'], [], r"p\.jsonl:2: not valid UTF-8 \(byte 14 of the line\)"),
])
def test_bad_input_is_one_clear_error(model_dir, tmp_path, content, flags, message):
    prompts = _write(tmp_path / "p.jsonl", content)
    out = tmp_path / "out.jsonl"
    with pytest.raises(TLTError, match=message):
        main(_args(model_dir, prompts, out, *flags))
    assert not out.exists()


def test_out_that_is_a_directory(model_dir, tmp_path):
    """--out naming a directory was an IsADirectoryError at the final rename, after the
    whole generation, leaving OUT.tmp behind."""
    prompts = _write(tmp_path / "p.jsonl", ['{"prompt": "w1"}'])
    (tmp_path / "adir").mkdir()
    with pytest.raises(TLTError, match="--out .*adir is a directory, not a file"):
        main(_args(model_dir, prompts, tmp_path / "adir"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "p.jsonl"]


def test_out_in_a_missing_directory_or_on_the_prompts(model_dir, tmp_path):
    """--out in a directory that does not exist failed at the end, after the whole
    generation (FileNotFoundError); --out equal to --prompts replaced the prompts."""
    prompts = _write(tmp_path / "p.jsonl", ['{"prompt": "w1"}'])
    with pytest.raises(TLTError, match="--out .*o.jsonl: directory .*nodir does not exist"):
        main(_args(model_dir, prompts, tmp_path / "nodir" / "o.jsonl"))
    before = prompts.read_text()
    with pytest.raises(TLTError, match="is the --prompts file; the results would replace the prompts"):
        main(_args(model_dir, prompts, prompts))
    assert prompts.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_missing_prompts_file(model_dir, tmp_path):
    with pytest.raises(TLTError, match="--prompts file not found"):
        main(_args(model_dir, tmp_path / "nope.jsonl", tmp_path / "o.jsonl"))


def test_token_id_prompts_need_no_tokenizer(hf_models, tmp_path):
    model_dir = hf_models["llama"][0]  # no tokenizer files
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_id": 9, "prompt_token_ids": [3, 4]}])
    out = tmp_path / "out.jsonl"
    assert main(_args(model_dir, prompts, out, "--temperature", "0")) == 0
    (line,) = [json.loads(l) for l in out.read_text().splitlines()]
    assert line["text"] is None and len(line["token_ids"]) == 6 and line["finish_reason"] == "length"
    text_prompts = _write(tmp_path / "t.jsonl", [{"prompt": "w3"}])
    with pytest.raises(TLTError, match="cannot load the tokenizer"):
        main(_args(model_dir, text_prompts, out))
