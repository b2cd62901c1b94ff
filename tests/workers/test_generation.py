"""Tokenizer, sampling, in-process generation and `kvfleet score`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.cli import main as cli_main
from workers.generate import generate_ids, generate_text
from workers.model import Model
from workers.sampling import SamplingParams, probabilities, sample
from workers.tokenizer import Tokenizer


def test_tokenizer_roundtrip_and_eos(tiny):
    tok = Tokenizer.from_dir(tiny())
    text = "The quick brown fox counts to 1024."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text)
    assert tok.eos_ids == (1,) and tok.bos_id == 0
    assert tok.encode(text, add_bos=True)[0] == 0
    assert Tokenizer.from_dir(tiny("multi_eos")).eos_ids == (1, 2)


def test_probabilities_top_p_top_k():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    np.testing.assert_allclose(p, [[0.5, 0.3, 0.15, 0]] / np.float64(0.95))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.01))
    np.testing.assert_allclose(p, [[1, 0, 0, 0]])


def test_sample_greedy_seeded_and_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    assert (sample(logits, SamplingParams(), rng) == logits.argmax(-1)).all()
    params = SamplingParams(temperature=0.9, top_p=0.8, seed=5)
    a = sample(logits, params, params.rng())
    b = sample(logits, params, params.rng())
    assert (a == b).all()
    row = np.log(np.array([[0.6, 0.3, 0.1]]))
    draws = [sample(row, SamplingParams(temperature=1.0), rng)[0] for _ in range(3000)]
    freq = np.bincount(draws, minlength=3) / 3000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)


def test_generate_stops_on_any_eos(tiny):
    model = Model.load(tiny("multi_eos"))
    prompt = [5, 6, 7]
    greedy = generate_ids(model, prompt, SamplingParams(max_tokens=6))
    assert greedy.finish_reason == "length" and len(greedy.ids) == 6
    stop_at = greedy.ids[2]
    g = generate_ids(model, prompt, SamplingParams(max_tokens=6), eos_ids=(999, stop_at))
    assert g.finish_reason == "stop" and g.ids == greedy.ids[:greedy.ids.index(stop_at)]


def test_generate_text_matches_greedy_prefill(tiny):
    d = tiny()
    model, tok = Model.load(d), Tokenizer.from_dir(d)
    text = generate_text(model, tok, "Question: what is", max_tokens=4)
    ids = tok.encode("Question: what is", add_bos=True)
    from kvstore.pool import KVPool
    for _ in range(4):  # greedy by repeated full prefills in fresh pools
        pool = KVPool.for_model(model.config, "f32", 1, 64)
        s = pool.alloc_slot()
        nxt = int(model.forward(ids, [s] * len(ids), np.arange(len(ids)), pool)[-1].argmax())
        if nxt in tok.eos_ids:
            break
        ids.append(nxt)
    assert text == tok.decode(ids[len(tok.encode("Question: what is", add_bos=True)):])


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
