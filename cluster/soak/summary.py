"""Soak summaries: medians with min/max per metric, A/B ratios pair by pair, greedy parity,
and the regression gate.

Inputs are two tables (pandas DataFrames read from the soak's Parquet files):

    requests: one row per request and round: round, arm ("A"/"B"), id, line, ttft_s,
              decode_tokens_per_s, completion_tokens (list), finish_reason, error,
              temperature (the line's own, else its arm's job temperature), ...
    rounds:   one row per round and arm: round, arm, the ROUND_METRICS below, the
              fault counters kills (while the round's job ran), of them kills_unseen
              (the job found no death for them: the worker was idle, nothing to
              recover) and kills_unknown (the run recorded no deaths count),
              kills_after_end (kills that landed after the round's job had taken its
              last step: no kill of the round; runner.classify_kills), recoveries,
              lost_requests, the run's scheduler
              counters (COUNTERS, and per path / event the COUNTER_GROUPS columns
              "fallbacks.<path>", "kv_cache.<event>"), and `failed` with the run's
              `returncode` ("0", another exit status, or "timeout").

A ratio is B/A of the same round (rounds interleave A B A B, so a pair shares the machine's
state); the summary gives the median, min and max of those per-round ratios.

The performance figures (each arm's ROUND_METRICS but `errors`, its per-request TTFT and decode
rate, and the ratios) come from completed rounds only: a failed round's figures are those of
a run cut short (the rows it served before it crashed, a wall time that ends at its crash or
timeout), and a ratio needs both rounds of its pair completed. A failed round still counts
in the accounting: its served rows, lost requests and error rows, `errors` per round (the
gate's max_errors) and the fault counters.

Parity is decided line by line: a line that is greedy (temperature 0) in both arms must give
the same tokens in A and B; a line that samples in either arm (its own `temperature`, or its
arm's job temperature when it gives none) is not compared token by token, nor on anything
else (seeded sampling from two builds' slightly different distributions diverges at the
first differing draw, and one prompt-round is no sample of a distribution): it counts only in
the served, lost and error counts and the timings, and the parity summary says how many there
were (`sampled`). `greedy` is decided from the prompt-rounds both arms served; with none (an
arm served no row at all) it is None, not evaluated, and the gate fails the parity rule.

Each arm's `ok_requests` counts its rows that finished with stop or length, failed rounds
included; an arm with none served nothing, and the gate fails it whatever its thresholds.

Each arm's `counters` sum the scheduler counters that its runs' `generate --stats` carry
(worker deaths, recoveries, re-queued sequences, rows failed at run time, fallbacks per
native path, saved-KV events) over all its rounds, failed ones included: like the fault
counters they account for what happened, they are not performance figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

# Per-round metrics; True = higher is better (for the report's wording only).
ROUND_METRICS = {
    "throughput_tok_s": True,
    "ttft_median_s": False,
    "decode_tok_s_median": True,
    "tokens_per_forward": True,
    "expert_pins": True,
    "expert_hit_rate": True,
    "kv_bytes": False,
    "rss_bytes": False,
    "device_mem_bytes": False,
    "errors": False,
    "wall_s": False,
}


def _stats(values) -> dict:
    """Median, min and max of the finite values (None, NaN, pd.NA and infinities left out)."""
    v = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").to_numpy(np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
            "n": int(v.size)}


def first_difference(a, b) -> int | None:
    """Index of the first token where two completions differ (a length difference counts
    at the shorter length); None when they are identical."""
    a, b = list(a), list(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def parity_table(requests: pd.DataFrame) -> pd.DataFrame:
    """Per (round, input line): the first differing token index between A and B, or None
    (keyed by line: every line has one row a round, error rows without an id too). A pair is
    compared when both rows are served and the line is greedy in both arms; `sampled` marks
    a pair that is not because either arm sampled it (temperature > 0)."""
    a = requests[requests.arm == "A"].set_index(["round", "line"])
    b = requests[requests.arm == "B"].set_index(["round", "line"])
    rows = []
    for key in a.index.intersection(b.index):
        ra, rb = a.loc[key], b.loc[key]
        sampled = bool(ra.temperature > 0 or rb.temperature > 0)
        ok = ra.finish_reason != "error" and rb.finish_reason != "error" and not sampled
        rows.append({"round": key[0], "id": ra.id,
                     "first_diff": first_difference(ra.completion_tokens, rb.completion_tokens)
                     if ok else None,
                     "compared": bool(ok), "sampled": sampled})
    return pd.DataFrame(rows, columns=["round", "id", "first_diff", "compared", "sampled"])


OK_FINISH = ("stop", "length")  # a request served successfully; "error" is the other reason

# per-round counts that account for what was served, failed rounds included (not performance)
ACCOUNTING = frozenset({"errors"})
# the scheduler counters of a round's run (cluster/scheduler.py SchedulerStats, in its
# --stats), summed per arm; a group's columns are "<group>.<key>" (path or event -> count)
COUNTERS = ("worker_deaths", "recoveries", "requeued", "runtime_errors")
COUNTER_GROUPS = ("fallbacks", "kv_cache")


def completed(rounds: pd.DataFrame) -> pd.DataFrame:
    """The rounds whose run exited 0 (all of them in a table without `failed`)."""
    return rounds[~rounds.failed.astype(bool)] if "failed" in rounds else rounds


def failed(rounds: pd.DataFrame) -> pd.DataFrame:
    """The rounds whose run exited non-zero, timed out or left rows that failed at run time
    (none in a table without `failed`)."""
    return rounds[rounds.failed.astype(bool)] if "failed" in rounds else rounds.iloc[:0]


def summarize(requests: pd.DataFrame, rounds: pd.DataFrame) -> dict:
    arms = sorted(rounds.arm.unique())
    out: dict = {"arms": arms, "rounds": int(rounds["round"].nunique()), "metrics": {}}
    done = completed(rounds)
    done_keys = set(zip(done["round"], done.arm))
    perf_requests = requests[[k in done_keys for k in zip(requests["round"], requests.arm)]] \
        if len(requests) else requests
    for arm in arms:
        r, rd = rounds[rounds.arm == arm], done[done.arm == arm]
        out["metrics"][arm] = {m: _stats((r if m in ACCOUNTING else rd)[m])
                               for m in ROUND_METRICS if m in r}
        q = perf_requests[perf_requests.arm == arm]
        out["metrics"][arm]["request_ttft_s"] = _stats(q.ttft_s)
        out["metrics"][arm]["request_decode_tok_s"] = _stats(q.decode_tokens_per_s)
        out["metrics"][arm]["completed_rounds"] = len(rd)
        # rows that finished with stop or length, in any round (failed ones too): an arm
        # with none served nothing, and the gate fails it whatever its other rules say
        out["metrics"][arm]["ok_requests"] = int(
            requests.finish_reason[requests.arm == arm].isin(OK_FINISH).sum()) if len(requests) else 0
        out["metrics"][arm]["counters"] = counters(r)
    if "B" in arms:
        a = done[done.arm == "A"].set_index("round")
        b = done[done.arm == "B"].set_index("round")
        common = a.index.intersection(b.index)
        ratios = {}
        for m in ROUND_METRICS:
            if m in a and m in b:
                with np.errstate(divide="ignore", invalid="ignore"):
                    ra = (b.loc[common, m].astype(float) / a.loc[common, m].astype(float))
                ratios[m] = _stats(ra.replace([np.inf, -np.inf], np.nan).tolist())
        out["ratio_B_over_A"] = ratios
        par = parity_table(requests)
        diffs = par[par.compared & par.first_diff.notna()]
        # greedy: some line is greedy in both arms, so parity applies (and must be measured);
        # None when no prompt-round was served by both arms (an arm served no row at all):
        # then nothing says which lines were greedy, and the gate fails the parity rule
        greedy = bool((~par.sampled).any()) if len(par) else None
        out["parity"] = {"greedy": greedy, "compared": int(par.compared.sum()),
                         "sampled": int(par.sampled.sum()), "breaks": int(len(diffs)),
                         "first_diff_min": None if diffs.empty else int(diffs.first_diff.min())}
    out["faults"] = {k: int(rounds[k].sum()) for k in ("kills", "kills_unseen", "kills_unknown",
                                                       "kills_after_end", "recoveries",
                                                       "lost_requests") if k in rounds}
    if "failed" in rounds:
        bad = failed(rounds)
        out["faults"]["failed_rounds"] = len(bad)
        runtime = bad["runtime_errors"].fillna(0) if "runtime_errors" in bad else [0] * len(bad)
        unread = bad["stats_error"] if "stats_error" in bad else [None] * len(bad)
        out["failed_rounds"] = [{"round": int(r), "arm": a, "returncode": str(rc),
                                 "runtime_errors": int(n),
                                 **({"stats_error": str(e)} if isinstance(e, str) else {})}
                                for r, a, rc, n, e in zip(bad["round"], bad.arm, bad.returncode,
                                                          runtime, unread)]
        for arm in arms:
            out["metrics"][arm]["failed_rounds"] = int((bad.arm == arm).sum())
    return out


def counters(rounds: pd.DataFrame) -> dict:
    """The COUNTERS and COUNTER_GROUPS of these rounds, summed (a group: key -> count, its
    keys with a count only); a figure no round has is left out."""
    def total(col) -> int:
        return int(pd.to_numeric(rounds[col], errors="coerce").fillna(0).sum())
    out: dict = {k: total(k) for k in COUNTERS if k in rounds}
    for group in COUNTER_GROUPS:
        sums = {col[len(group) + 1:]: total(col) for col in sorted(rounds.columns)
                if col.startswith(group + ".")}
        out[group] = {k: n for k, n in sums.items() if n}
    return out


def describe_failure(f: dict) -> str:
    """How a failed round (a summary["failed_rounds"] entry) failed, as words: "timed out",
    "exit status 1, 3 rows failed at run time", "killed by signal 9", "exit status 0, its
    --stats unreadable (r000_A.stats.json: ...)"."""
    how = [describe_returncode(f["returncode"])]
    n = f.get("runtime_errors") or 0
    if n:
        how.append(f"{n} rows failed at run time")
    if f.get("stats_error"):
        how.append(f"its --stats unreadable ({f['stats_error']})")
    return ", ".join(how)


def describe_returncode(rc: str) -> str:
    """A round's returncode as words: "timeout", "exit status 1", "killed by signal 9"."""
    if rc == "timeout":
        return "timed out"
    try:
        n = int(rc)
    except ValueError:
        return rc
    return f"killed by signal {-n}" if n < 0 else f"exit status {n}"


@dataclass(frozen=True)
class GateFailure:
    metric: str
    value: float | None  # None: not measured (no data), which fails the rule too
    limit: float
    rule: str

    def __str__(self) -> str:
        if self.value is None:
            return f"{self.metric} = missing (no data to check against {self.limit:g})"
        return f"{self.metric} = {self.value:g} {self.rule} {self.limit:g}"


def _measured(x) -> float | None:
    """A summary figure the gate may compare, or None when it is missing or not finite (NaN
    compares False against every limit, so it would pass any rule)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def apply_gate(summary: dict, gate) -> list[GateFailure]:
    """Check a summary against a gate (an object with min_throughput_ratio,
    max_parity_breaks, max_lost_requests, max_errors, max_failed_rounds; None disables a
    rule). A failed round (its run exited non-zero, timed out or left rows that failed at
    run time) counts against max_failed_rounds even when every request it was given had
    been served.

    Missing data never passes: an enabled rule whose figure is absent, NaN or infinite fails
    (with a B arm: a throughput ratio that no round pair measured; greedy parity with no
    prompt-round compared, or not evaluated because no prompt-round was served by both arms;
    lost requests, an arm's errors or the failed rounds not recorded). And an arm none of
    whose requests finished with stop or length in any round fails the gate whatever the
    rules say (no rule turns this off): a soak that served nothing tested nothing, e.g. one
    whose prompt lines were all invalid, which max_errors (null by default) lets through."""
    fails = []
    for arm, m in summary["metrics"].items():
        if not m.get("ok_requests"):
            fails.append(GateFailure(f"successful requests ({arm}: no request of any round "
                                     "finished with stop or length)", m.get("ok_requests"), 1, "<"))
    ratio = _measured(summary.get("ratio_B_over_A", {}).get("throughput_tok_s", {}).get("median"))
    if (gate.min_throughput_ratio is not None and "ratio_B_over_A" in summary
            and (ratio is None or ratio < gate.min_throughput_ratio)):
        fails.append(GateFailure("throughput ratio B/A (median)", ratio, gate.min_throughput_ratio, "<"))
    par = summary.get("parity")
    if gate.max_parity_breaks is not None and par and par["greedy"] is None:
        fails.append(GateFailure("greedy parity breaks (not evaluated: no prompt-round was "
                                 "served by both arms)", None, gate.max_parity_breaks, ">"))
    elif (gate.max_parity_breaks is not None and par and par["greedy"]
            and (par["compared"] == 0 or par["breaks"] > gate.max_parity_breaks)):
        fails.append(GateFailure("greedy parity breaks", par["breaks"] if par["compared"] else None,
                                 gate.max_parity_breaks, ">"))
    lost = _measured(summary.get("faults", {}).get("lost_requests"))
    if gate.max_lost_requests is not None and (lost is None or lost > gate.max_lost_requests):
        fails.append(GateFailure("lost requests", lost, gate.max_lost_requests, ">"))
    if gate.max_errors is not None:
        for arm, m in summary["metrics"].items():
            errs = _measured(m.get("errors", {}).get("max"))
            if errs is None or errs > gate.max_errors:
                fails.append(GateFailure(f"errors per round ({arm})", errs, gate.max_errors, ">"))
    failed = summary.get("failed_rounds")
    if gate.max_failed_rounds is not None and failed is None:
        fails.append(GateFailure("failed rounds", None, gate.max_failed_rounds, ">"))
    elif gate.max_failed_rounds is not None and len(failed) > gate.max_failed_rounds:
        which = ", ".join(f"round {f['round']} {f['arm']}: {describe_failure(f)}"
                          for f in failed[:4]) + (", ..." if len(failed) > 4 else "")
        fails.append(GateFailure(f"failed rounds ({which})", len(failed), gate.max_failed_rounds, ">"))
    return fails
