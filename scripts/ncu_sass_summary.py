"""Summarise Nsight Compute's per-SASS-instruction page of one kernel (no GPU needed): where
the warps' stall samples fall, which opcodes move shared-memory wavefronts, and the hottest
instructions, so that a profile of attn_wg can be read on a machine without ncu.

On the GPU machine (PC sampling works there; give ncu --clock-control none):

    KVFLEET_CUDA_LINEINFO=1 ncu --clock-control none --kernel-name attn_wg --launch-skip 1 \
        --launch-count 1 --section SourceCounters --section WarpStateStats \
        -o prof python3 tests/gpu/diag_profile.py kv8 64
    ncu -i prof.ncu-rep --page source --csv --print-source sass > src.csv

then here:

    python3 scripts/ncu_sass_summary.py src.csv [--top 40] [--blocks 100] [--range A B]

Counts are samples (a warp's state at a sampling tick), so they weigh time per warp: the
producer warps' waits show up too. Samples that ncu files under a stall reason the CSV has
no column for (the wgmma pipe's, on sm_90) are counted as "unlisted".
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
WAVEFRONTS = "L1 Wavefronts Shared"


def _int(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return 0


def load(path: str) -> tuple[list[str], list[dict]]:
    """(stall reason columns, one dict per SASS instruction) of an ncu source-page CSV (its
    first kernel, when the export holds several)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if head is None:
        raise ValueError(f"{path}: no header row with 'Source' and {SAMPLES!r} "
                         "(expected `ncu -i REP --page source --csv --print-source sass`)")
    names = rows[head]
    stalls = [n for n in names if n.startswith("stall_") and "(Not Issued)" not in n]
    out = []
    for r in rows[head + 1:]:
        if r[:1] == ["Kernel Name"] or r == names:
            break  # a second kernel's page: this reads the first kernel's only
        if len(r) != len(names):
            continue  # (a truncated row)
        d = dict(zip(names, r))
        out.append({"sass": d["Source"].strip(), "samples": _int(d.get(SAMPLES, "0")),
                    "executed": _int(d.get(EXECUTED, "0")),
                    "wavefronts": _int(d.get(WAVEFRONTS, "0")),
                    "stalls": {s[6:]: _int(d[s]) for s in stalls}})
    return [s[6:] for s in stalls], out


def opcode(sass: str) -> str:
    """'@!P0 BRA 0x..' -> 'BRA', 'HGMMA.64x64x16.F32 ..' -> 'HGMMA'."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def reasons(rows: list[dict]) -> collections.Counter:
    c = collections.Counter()
    for r in rows:
        c.update(r["stalls"])
        c["unlisted"] += r["samples"] - sum(r["stalls"].values())
    return c


def summary(rows: list[dict], top: int, block: int) -> str:
    total = sum(r["samples"] for r in rows)
    lines = [f"{len(rows)} instructions, {total} samples"]
    for name, n in reasons(rows).most_common():
        if n > 0:
            lines.append(f"  {name:22s} {n:8d} {100 * n / max(total, 1):5.1f}%")
    wf, ex = collections.Counter(), collections.Counter()
    for r in rows:
        wf[opcode(r["sass"])] += r["wavefronts"]
        ex[opcode(r["sass"])] += r["executed"]
    lines.append("shared wavefronts by opcode: " + ", ".join(
        f"{k} {v}" for k, v in wf.most_common() if v))
    lines.append("executed by opcode: " + ", ".join(f"{k} {v}" for k, v in ex.most_common(20)))
    lines.append(f"top {top} instructions by samples (index, samples, executed, top reasons):")
    for i in sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])[:top]:
        lines.append(_line(i, rows[i]))
    if block:
        lines.append(f"blocks of {block} instructions:")
        for b in range(0, len(rows), block):
            part = rows[b:b + block]
            n = sum(r["samples"] for r in part)
            ops = collections.Counter(opcode(r["sass"]) for r in part).most_common(4)
            why = reasons(part).most_common(3)
            lines.append(f"  [{b:5d}, {b + len(part):5d}) {n:6d} {100 * n / max(total, 1):5.1f}%  "
                         f"{' '.join(f'{k}:{v}' for k, v in why if v)}  "
                         f"({' '.join(f'{k}:{v}' for k, v in ops)})")
    return "\n".join(lines)


def _line(i: int, r: dict) -> str:
    why = sorted(((v, k) for k, v in r["stalls"].items() if v), reverse=True)[:2]
    return (f"  {i:5d} {r['samples']:5d} {r['executed']:8d}  {r['sass'][:64]:64s} "
            + " ".join(f"{k}:{v}" for v, k in why))


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=_count, default=40)
    ap.add_argument("--blocks", type=_count, default=100, help="block size (0: none)")
    ap.add_argument("--range", type=int, nargs=2, metavar=("A", "B"),
                    help="print instructions A..B-1 instead of the summary")
    args = ap.parse_args(argv)
    try:
        _, rows = load(args.csv)
    except (OSError, ValueError) as e:
        print(f"ncu_sass_summary: {e}", file=sys.stderr)
        return 2
    if args.range:
        a, b = args.range
        print("\n".join(_line(i, rows[i]) for i in range(max(a, 0), min(b, len(rows)))))
    else:
        print(summary(rows, args.top, args.blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
