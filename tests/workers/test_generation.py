"""Tokenizer and `kvfleet score`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cluster.cli import main as cli_main
from workers.tokenizer import Tokenizer, TokenizerError


def test_tokenizer_roundtrip_and_eos(tiny):
    tok = Tokenizer.from_dir(tiny())
    text = "The quick brown fox counts to 1024."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text)
    assert tok.eos_ids == (1,) and tok.bos_id == 0
    assert tok.encode(text, add_bos=True)[0] == 0
    assert Tokenizer.from_dir(tiny("multi_eos")).eos_ids == (1, 2)


def test_generation_config_that_is_not_utf8_names_the_file(tiny, tmp_path):
    """Bytes that are not UTF-8 were a bare UnicodeDecodeError naming no file."""
    d = tmp_path / "m"
    shutil.copytree(tiny(), d)
    (d / "generation_config.json").write_bytes(b'{"eos_token_id": "\xff\xfe"}')
    with pytest.raises(TokenizerError, match=r"generation_config\.json: not a JSON object"):
        Tokenizer.from_dir(d)


def test_text_prompts_get_the_post_processors_special_tokens(tiny, tmp_path):
    """As HF tokenizers and vLLM encode a prompt: a tokenizer.json whose post-processor adds
    a BOS gives it to encode_prompt (kvfleet dropped it); encode adds none; kvfleet-mini's
    tokenizer has no post-processor, so its prompts are unchanged."""
    import shutil
    d = tmp_path / "bos"
    shutil.copytree(tiny(), d)
    spec = json.loads((d / "tokenizer.json").read_text())
    bos = spec["added_tokens"][0]
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {bos["content"]: {"id": bos["content"],
                                                                  "ids": [bos["id"]],
                                                                  "tokens": [bos["content"]]}}}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    tok, plain = Tokenizer.from_dir(d), Tokenizer.from_dir(tiny())
    text = "the quick brown fox"
    assert tok.encode_prompt(text) == [bos["id"]] + tok.encode(text)
    assert plain.encode_prompt(text) == plain.encode(text)


def test_score_command_prefill_and_decode(tiny, tmp_path, capsys):
    d = tiny()
    ids = [3, 200, 45, 9, 311, 77]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    assert cli_main(["score", "--model", str(d), "--tokens", str(tmp_path / "ids.json"),
                     "--out", str(tmp_path / "p.npy")]) == 0
    assert cli_main(["score", "--model", str(d), "--tokens", str(tmp_path / "ids.json"),
                     "--out", str(tmp_path / "d.npy"), "--mode", "decode"]) == 0
    p, q = np.load(tmp_path / "p.npy"), np.load(tmp_path / "d.npy")
    assert p.shape == (6, 512) and p.dtype == np.float32
    assert np.abs(p - q).max() < 1e-5 * np.abs(p).max()


def test_score_command_writes_the_out_path_it_names(tiny, tmp_path, capsys):
    """--out without a .npy suffix: np.save(path) wrote logits.npy and the command said
    'wrote .../logits'."""
    (tmp_path / "ids.json").write_text(json.dumps([3, 200, 45]))
    out = tmp_path / "logits"
    assert cli_main(["score", "--model", str(tiny()), "--tokens", str(tmp_path / "ids.json"),
                     "--out", str(out)]) == 0
    assert f"wrote {out}:" in capsys.readouterr().out
    assert np.load(out).shape == (3, 512) and not (tmp_path / "logits.npy").exists()
    rc = cli_main(["score", "--model", str(tiny()), "--tokens", str(tmp_path / "ids.json"),
                   "--out", str(tmp_path)])  # a directory: a usage error, no tmp_path.npy beside it
    assert rc == 2 and "is a directory" in capsys.readouterr().err


def _limited(code: str, *args: str, fsize: int) -> subprocess.CompletedProcess:
    """`code` run in a python whose files cannot grow past `fsize` bytes (a write past it
    fails with EFBIG, as on a full disk), from this checkout."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-c", code, *args], cwd=root, preexec_fn=limit,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          text=True, timeout=300)


def test_score_out_that_cannot_be_written_is_one_line_and_keeps_the_old_file(tiny, tmp_path,
                                                                             capsys):
    """--out /dev/full: an OSError traceback after the forward pass; and np.save wrote over
    the old file in place, so a write cut short (a full disk) left a truncated .npy."""
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([3, 200, 45, 9, 311, 77]))
    rc = cli_main(["score", "--model", str(tiny()), "--tokens", str(ids), "--out", "/dev/full"])
    assert rc == 2 and capsys.readouterr().err == (
        "kvfleet score: error: --out /dev/full: cannot write it (No space left on device); the "
        "forward pass ran, nothing was written\n")
    assert Path("/dev/full").is_char_device()  # (written in place, never renamed over)
    out = tmp_path / "logits.npy"
    old = np.array([1.5, np.nan, -np.inf, 0.0, 3e38], np.float32)
    np.save(out, old)
    p = _limited("import sys; from cluster.cli import main; sys.exit(main(sys.argv[1:]))",
                 "score", "--model", str(tiny()), "--tokens", str(ids), "--out", str(out),
                 fsize=4096)  # (6 x 512 float32 logits: 12 KiB)
    assert p.returncode == 2 and p.stderr.splitlines()[-1] == (
        f"kvfleet score: error: --out {out}: cannot write it (File too large); the forward "
        "pass ran, nothing was written"), p.stderr
    np.testing.assert_array_equal(np.load(out), old)  # (NaN where it was NaN: untouched)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["ids.json", "logits.npy"]


@pytest.mark.parametrize("content,match", [
    ("[1, 2", "not valid JSON"), ('{"a": 1}', "non-empty JSON list"), ("[1, 512]", r"ids \[512\] are outside"),
])
def test_score_command_bad_tokens(tiny, tmp_path, capsys, content, match):
    f = tmp_path / "t.json"
    f.write_text(content)
    rc = cli_main(["score", "--model", str(tiny()), "--tokens", str(f), "--out", str(tmp_path / "o.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and str(f) in err
    assert __import__("re").search(match, err)


def test_score_command_checks_tokens_before_loading_weights(tiny, tmp_path, capsys):
    """A bad --tokens file failed only after the weights had loaded (minutes for a real
    checkpoint): a model dir whose weights cannot load shows which input is checked first."""
    d = tmp_path / "m"
    shutil.copytree(tiny(), d)
    (d / "model.safetensors").write_bytes(b"\x00" * 4)  # unloadable weights, a valid config.json
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.write_text("[1, 512]")
    good.write_text("[1, 2]")
    rc = cli_main(["score", "--model", str(d), "--tokens", str(bad), "--out", str(tmp_path / "o.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--tokens {bad}: ids [512] are outside the vocabulary [0, 512)" in err
    rc = cli_main(["score", "--model", str(d), "--tokens", str(good), "--out", str(tmp_path / "o.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--model {d}:" in err and "model.safetensors" in err
    assert not (tmp_path / "o.npy").exists()


def test_score_command_missing_model(tmp_path, capsys):
    (tmp_path / "t.json").write_text("[1]")
    rc = cli_main(["score", "--model", str(tmp_path / "nope"), "--tokens", str(tmp_path / "t.json"),
                   "--out", str(tmp_path / "o.npy")])
    assert rc == 2 and "nope: no such directory" in capsys.readouterr().err


def test_score_command_quantized_tier_prefill_equals_decode(tiny, tmp_path):
    d = tiny()
    (tmp_path / "ids.json").write_text(json.dumps([3, 200, 45, 9, 311, 77, 5]))
    outs = {}
    for kv in ("f32", "kv8"):
        for mode in ("prefill", "decode"):
            out = tmp_path / f"{kv}-{mode}.npy"
            assert cli_main(["score", "--model", str(d), "--tokens", str(tmp_path / "ids.json"),
                             "--out", str(out), "--kv", kv, "--mode", mode]) == 0
            outs[kv, mode] = np.load(out)
    top = np.abs(outs["f32", "prefill"]).max()
    assert np.abs(outs["kv8", "prefill"] - outs["kv8", "decode"]).max() < 1e-5 * top
    assert np.abs(outs["kv8", "prefill"] - outs["f32", "prefill"]).max() > 1e-3 * top
