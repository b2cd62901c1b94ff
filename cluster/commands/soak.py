"""`kvfleet soak`: A/B soak of two configurations over the same prompts, with a report.

    kvfleet soak --config A.yaml [--vs B.yaml] --prompts FILE.jsonl
                 (--duration 30m | --rounds N) --out DIR [--kill-worker-every 2m]
                 [--round-timeout 30m]

Exit code 0 when the gate (thresholds in A's `soak.gate`) passes, 1 when it fails (the
failing metrics are printed), 2 on bad input, 130 on Ctrl-C and 143 on SIGTERM (the soak's
handler replaces Ray's, whose exit 15 wrote nothing): summary.json and report.html are then
written for the rounds that finished (summary.json `interrupted`), and an --out where none
had finished is left as it was. An interrupted soak is not resumed: its --out is refused
on a rerun (remove it to start over). Each arm's build (checkout, git commit, tree state)
and withheld job variables are printed after the gate line; an arm whose rounds fell back
from a native path (kvfleet_fallbacks) is named on stderr with the paths and counts.
"""
from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

from cluster.cli import UsageError

_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str, flag: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"{flag} {text!r}: give a positive duration like 90s, 30m or 1.5h")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def register(sub) -> None:
    p = sub.add_parser("soak", help="A/B soak test with a report and a regression gate")
    p.add_argument("--config", required=True, type=Path, help="arm A: job config YAML (+ soak:)")
    p.add_argument("--vs", type=Path, help="arm B: job config YAML (+ soak:)")
    p.add_argument("--prompts", required=True, type=Path)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--duration", help="run rounds until this much time is spent (e.g. 30m)")
    g.add_argument("--rounds", type=int, help="number of rounds (each runs A, then B)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--kill-worker-every", help="kill a worker actor at this interval (e.g. 20s)")
    p.add_argument("--round-timeout", default="30m",
                   help="a round still running after this is stopped, a failed round whose "
                        "unserved requests count as lost (default 30m)")
    p.set_defaults(func=run, interrupted=interrupted)


def interrupted(args) -> str:
    """What an interrupted soak left (cluster/cli.py prints it after a Ctrl-C, run() after
    a SIGTERM)."""
    try:
        cut = json.loads((args.out / "summary.json").read_text()).get("interrupted")
    except (OSError, ValueError, AttributeError):
        cut = None
    if not isinstance(cut, dict):
        return f"no round had finished: nothing was kept, and --out {args.out} can be given again"
    return (f"the {cut.get('rounds_kept')} rounds that finished are in {args.out}/summary.json "
            f"and {args.out}/report.html (marked interrupted; round {cut.get('cut_round')} arm "
            f"{cut.get('cut_arm')} was cut and is left out), their files in "
            f"{args.out / 'rounds'}; a soak is not resumed: give another --out, or remove "
            f"{args.out} to start over")


def run(args) -> int:
    from cluster.cli import Stopped
    from cluster.soak.config import load_arm
    from cluster.soak.report import arm_lines
    from cluster.soak.runner import SoakPlan, run_soak
    if args.rounds is not None and args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds} must be >= 1")
    if not args.prompts.exists():
        raise UsageError(f"--prompts {args.prompts}: no such file")
    arms = [load_arm(args.config, "A")] + ([load_arm(args.vs, "B")] if args.vs else [])
    plan = SoakPlan(arms=arms, prompts=args.prompts, out=args.out, rounds=args.rounds,
                    duration_s=parse_duration(args.duration, "--duration") if args.duration else None,
                    kill_every_s=parse_duration(args.kill_worker_every, "--kill-worker-every")
                    if args.kill_worker_every else None,
                    round_timeout_s=parse_duration(args.round_timeout, "--round-timeout"))
    try:
        summary, code = run_soak(plan)
    except Stopped:
        print(f"kvfleet soak: stopped by SIGTERM; {interrupted(args)}", file=sys.stderr)
        return 128 + signal.SIGTERM
    gate = summary["gate"]
    print(f"soak: {summary['rounds']} rounds -> {args.out}/report.html; gate "
          + ("passed" if gate["passed"] else "FAILED: " + "; ".join(gate["failures"])))
    for line in arm_lines(summary):
        print(line)
    _warn_fallbacks(summary)
    f = summary["faults"]
    tested = f["kills"] - f.get("kills_unseen", 0) - f.get("kills_unknown", 0)
    if plan.kill_every_s and not tested:  # (a pass that tested no recovery)
        reasons = [f"{n} {what}" for n, what in (
            (f.get("kills_unseen"), "killed an idle worker that the job never stepped again"),
            (f.get("kills_unknown"), "landed in rounds whose run recorded no deaths count"),
            (f.get("kills_after_end"), "landed after their round's last step")) if n]
        why = ("of its kills, " + ", ".join(reasons) + ", which tests no recovery" if reasons
               else "every round ended before "
               "the injector found two live workers (it spares the last one)")
        print(f"soak: warning: --kill-worker-every {args.kill_worker_every} killed no worker "
              f"that a round's job found dead: {why}; give a shorter interval, more prompts, or "
              f"at least two workers", file=sys.stderr)
    return code


def _warn_fallbacks(summary: dict) -> None:
    """One stderr line per arm whose rounds fell back from a native path (each round's
    generate warns only in its own log): that arm's figures are the slower path's."""
    for key, label in summary.get("labels", {}).items():
        fell = summary.get("metrics", {}).get(key, {}).get("counters", {}).get("fallbacks") or {}
        if fell:
            print(f"soak: warning: arm {key} ({label}) fell back from native paths in its rounds: "
                  + ", ".join(f"{path} {n}x" for path, n in sorted(fell.items()))
                  + f"; its figures are those of the slower path (summary.json "
                    f"metrics.{key}.counters.fallbacks)", file=sys.stderr)
