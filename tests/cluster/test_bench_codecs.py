"""`kvfleet bench codecs` end to end at toy sizes: keys, figures that must hold, errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import cli

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--rows", "64", "--tokens", "96", "--heads", "4", "--repeat", "1"]


def bench_json(capsys, *extra):
    assert cli.main(["bench", "codecs", "--json", *SMALL, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_per_tier(capsys):
    res = bench_json(capsys, "--tiers", "f32", "kv8", "tq4", "polar3")
    assert list(res) == ["f32", "kv8", "tq4", "polar3"]
    assert [res[t]["bytes_per_token_layer"] for t in res] == [2304, 584, 296, 188]
    assert res["f32"]["rel_l2_gaussian"] == 0.0
    assert 0.02 < res["kv8"]["rel_l2_gaussian"] < 0.035
    assert 0.09 < res["tq4"]["rel_l2_gaussian"] < 0.105
    assert res["tq4"]["rel_l2_gaussian"] < res["polar3"]["rel_l2_gaussian"]
    for name, e in res.items():
        assert e["rel_l2_model"] is None and "no --model" in e["rel_l2_model_source"]
        a = e["native_vs_staging"]
        assert a["tokens"] == 96 and a["heads"] == 4 and a["max_rel_diff"] < 1e-5, name
        assert a["native_ms"] > 0 and a["staging_ms"] > 0 and a["ratio"] > 0
        assert e["encode_rows_per_s"] > 0 and e["decode_rows_per_s"] > 0
    assert res["polar3"]["native_vs_staging"]["rows_rebuilt_per_call"] == 3 * 96  # L, R, L
    assert res["tq4"]["native_vs_staging"]["rows_rebuilt_per_call"] == 0
    assert res["kv8"]["target"]["metric"] == "encode_values_per_s"
    assert res["tq4"]["target"]["metric"] == "native_vs_staging.ratio"


def test_model_rows_and_widths(capsys, tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(tmp_path)],
                   check=True, capture_output=True)
    res = bench_json(capsys, "--tiers", "tq4", "--model", str(tmp_path))
    e = res["tq4"]
    assert e["widths"] == [512, 64] and e["bytes_per_token_layer"] == 296
    assert 0.05 < e["rel_l2_model"] < 0.15 and str(tmp_path) in e["rel_l2_model_source"]


def test_text_report_and_usage_errors(capsys, tmp_path):
    assert cli.main(["bench", "codecs", *SMALL, "--tiers", "kv8"]) == 0
    out = capsys.readouterr().out
    assert "kv8" in out and "target kv8" in out
    assert cli.main(["bench", "codecs", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert cli.main(["bench", "codecs", "--tokens", "0"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "codecs", "--tiers", "kv9"])


@pytest.mark.parametrize("flags, message", [
    (["--heads", "0"], "--heads must be >= 1, got 0"),
    (["--cpu-divide", "0"], "--cpu-divide must be >= 1, got 0"),
    (["--repeat", "-1"], "--repeat must be >= 1, got -1"),
    (["--shapes", "0x64"], "--shapes entry '0x64': B and T must be >= 1"),
    (["--shapes", "16by64"], "must look like 16x32768"),
])
def test_attention_bench_flags_are_checked(capsys, flags, message):
    """(--heads 0 ran an H=0 'benchmark'; --cpu-divide 0 ended in a ZeroDivisionError)"""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "attention", "--backend", "cpu", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
