"""scripts/ncu_sass_summary.py on a small CSV shaped like ncu's source page."""
import csv

import pytest

from scripts import ncu_sass_summary as ns

HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
        "L1 Wavefronts Shared", "stall_barrier", "stall_wait", "stall_wait (Not Issued)"]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "attn_wg", ""])  # ncu's title line comes first
        w.writerow(HEAD)
        w.writerows(rows)


def test_reasons_opcodes_and_unlisted_samples(tmp_path):
    p = tmp_path / "src.csv"
    _write(p, [
        ["0x0", "  HGMMA.64x64x16.F32 R24, R184, gdesc[UR20], R24", "120", "32,768", "131072",
         "0", "16", "8"],
        ["0x10", "@!P0  BRA 0x7f", "9", "100", "0", "0", "3", "1"],
        ["0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "372", "32768", "0", "369", "2", "0"],
        ["0x30", "truncated row"],
    ])
    names, rows = ns.load(str(p))
    assert names == ["barrier", "wait"] and len(rows) == 3
    assert [ns.opcode(r["sass"]) for r in rows] == ["HGMMA", "BRA", "WARPGROUP"]
    assert rows[0]["executed"] == 32768  # (thousands separators)
    why = ns.reasons(rows)
    assert why["barrier"] == 369 and why["wait"] == 21
    assert why["unlisted"] == 120 - 16 + 9 - 3 + 372 - 371  # samples no column claims
    text = ns.summary(rows, top=2, block=2)
    assert "501 samples" in text and "HGMMA 131072" in text
    assert text.index("DEPBAR") < text.index("HGMMA.64x64x16")  # hottest first


def test_not_an_ncu_source_page(tmp_path, capsys):
    p = tmp_path / "other.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="Source"):
        ns.load(str(p))
    assert ns.main([str(p)]) == 2
    assert "other.csv" in capsys.readouterr().err


def test_second_kernel_is_not_merged_and_range_prints(tmp_path, capsys):
    p = tmp_path / "two.csv"
    one = [["0x0", "FMUL R1, R2, R3", "5", "10", "0", "1", "4", "0"]]
    _write(p, one)
    with open(p, "a", newline="") as f:  # a second kernel's page after the first
        w = csv.writer(f)
        w.writerow(["Kernel Name", "attn_combine", ""])
        w.writerow(HEAD)
        w.writerow(["0x0", "LDG R0, [R2]", "50", "10", "0", "0", "0", "0"])
    _, rows = ns.load(str(p))
    assert [r["sass"] for r in rows] == ["FMUL R1, R2, R3"]
    assert ns.main([str(p), "--range", "-3", "9"]) == 0
    assert "FMUL R1, R2, R3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ns.main([str(p), "--top", "-1"])
