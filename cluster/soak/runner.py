"""`kvfleet soak`: the same prompts on arm A and (optionally) arm B, interleaved A B A B, each
round one `python -m cluster generate` run on a shared Ray cluster, until --rounds are done
or --duration is spent. A round that has started runs to its end: past the duration it
still gets twice the longest earlier round of its arm (so the last round of a --duration soak
is not killed for running late, nor a slower B for being slower than A), and a round that
takes longer than its limit is a timeout whose unserved requests count as lost. A round whose run exits non-zero (it crashed, was
killed, or rows failed at run time: generate's exit status 1) or times out, or whose rows
hold errors made at run time (a worker's step raised, no live worker was left: an arm
running an older build exits 0 on those), is a failed round: the gate's max_failed_rounds
(default 0) fails the soak on it, whatever rows it had served (those still count, as in any
round); its throughput, latency and memory figures are partial, left out of the medians and
the B/A ratios (cluster/soak/summary.py).

While it runs, the soak publishes the B/A ratios of each round pair whose runs both completed
(`kvfleet_soak_ratio`, tag `metric`) and the failed rounds per arm
(`kvfleet_soak_failed_rounds`, tag `arm`) through ray.util.metrics.

Each round runs in its arm's working directory (another checkout of the code, or this one),
joins the soak's Ray cluster through RAY_ADDRESS, and leaves a Parquet of results and a
stats JSON (`generate --stats`). A fault injector may kill a worker actor every interval;
the job must recover (every id exactly once), and the soak counts what was lost.

Each arm runs its own job config as written: the job settings of the soak's environment
(KV8, KV_TQ, KVFLEET_SLOTS, ...: cluster/config.py JOB_ENV, and those that the arm's own
checkout declares: cluster/soak/config.py) are not passed to its rounds, where they would
override the config. DIR must be new or empty (the rounds of an earlier soak there would be
resumed, not rerun).

Ctrl-C or SIGTERM stops the soak (its SIGTERM handler replaces Ray's, whose sys.exit(15) left
nothing): the round that was running is cut (its run killed, its --out's lock file removed,
its files left in rounds/ but out of the figures), and summary.json and report.html are
written for the rounds that finished, summary.json's `interrupted` naming the signal and the
cut round. With no round finished, the directories it made are removed. A soak is not
resumed: its rounds pair A and B in time on one cluster, which a restart would break, so a
rerun on an interrupted DIR is refused like any used one, saying to give another or remove it.

Output under DIR:
    rounds/rNNN_<arm>.parquet, rounds/rNNN_<arm>.stats.json, rounds/rNNN_<arm>.log
    requests.parquet   one row per request and round (with the temperature it ran at)
    rounds.parquet     one row per round and arm (soak.summary.ROUND_METRICS + faults;
                       `failed`: the round's run exited non-zero, timed out or left
                       `runtime_errors` rows, `returncode`; the run's scheduler counters
                       worker_deaths, recoveries, requeued, and fallbacks.<path> and
                       kv_cache.<event> columns from its --stats, worker_deaths None where
                       the run recorded none; kills (while its job ran), of them kills_unseen
                       and kills_unknown, kills_after_end (KILL_COLUMNS), and steps_done_at:
                       when its job took its last step)
    faults.parquet     one row per injected kill, none left out; `outcome` (classify_kills):
                       found (the job found the death), unseen (the worker was idle: the job
                       never stepped it again, found no death, had nothing to recover),
                       unknown (the run recorded no deaths count), after_end (it landed after
                       its round's job had taken its last step: no kill of that round; also
                       the `after_end` column)
    summary.json       medians, min/max, pairwise A/B ratios, parity, faults, gate;
                       per arm, `build`: its checkout, git commit and tree state, version
                       (cluster/soak/build.py, read once at the start), `config_check`: the
                       code that checked its job config, and
                       `job_env`: the code that declared the job variables withheld from its
                       rounds (`from`), those variables, and of them the ones set here;
                       `interrupted` (a stopped soak): signal, rounds_kept, cut_round, cut_arm;
                       a failed round's `stats_error`: its --stats could not be read
    report.html        the self-contained report
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from cluster.cli import UsageError
from cluster.config import REPO_ROOT
from cluster.metrics import KeptGauges
from cluster.requests import Request, is_input_error, read_requests, result_key
from cluster.cli import Stopped, stop_on_sigterm  # (a second SIGTERM ends it at once)
from cluster.soak.build import build_info
from cluster.soak.config import FLAGS, SoakArm, checkout_env
from cluster.soak.faults import WorkerKiller
from cluster.soak.report import write_report
from cluster.soak.summary import COUNTER_GROUPS, OK_FINISH, apply_gate, parity_table, summarize

log = logging.getLogger(__name__)


@dataclass
class SoakPlan:
    arms: list[SoakArm]
    prompts: Path
    out: Path
    rounds: int | None = None
    duration_s: float | None = None
    kill_every_s: float | None = None
    round_timeout_s: float = 1800.0
    extra_env: dict[str, str] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_prompts(prompts: Path) -> tuple[set[str], dict[int, float]]:
    """The result key (cluster/requests.py) of every input line, as generate reads them,
    and the lines that set their own temperature (line -> temperature)."""
    try:
        items = list(read_requests(prompts))
    except OSError as e:  # a directory, an unreadable file
        raise UsageError(f"--prompts {prompts}: {e.strerror}") from None
    return ({result_key(item.id, item.line) for item in items},
            {item.line: item.temperature for item in items
             if isinstance(item, Request) and item.temperature is not None})


def _expected_keys(prompts: Path) -> set[str]:
    return _read_prompts(prompts)[0]


def with_temperatures(req: pd.DataFrame, own: dict[int, float], default: float) -> pd.DataFrame:
    """A round's rows with the temperature each line ran at in this arm: its own, else the
    arm's job temperature (as cluster/jobs/generate.py resolves it)."""
    if not len(req):
        return req
    return req.assign(temperature=[float(own.get(int(n), default)) for n in req.line])


def _served_keys(req: pd.DataFrame) -> set[str]:
    return {result_key(None if pd.isna(i) else str(i), int(n)) for i, n in zip(req.id, req.line)}


def round_timeout(plan: SoakPlan, deadline: float, walls: list[float]) -> float:
    """Seconds a round may run: round_timeout_s, at most the time left to the duration but
    never less than twice the longest of `walls`, its arm's earlier rounds (an arm's first
    round: round_timeout_s; the other arm's rounds say nothing of this one's speed)."""
    if not walls:
        return plan.round_timeout_s
    return max(1.0, min(plan.round_timeout_s,
                        max(deadline - time.monotonic(), 2.0 * max(walls))))


def _run_round(plan: SoakPlan, arm: SoakArm, rnd: int, address: str, timeout: float) -> dict:
    rdir = plan.out / "rounds"
    stem = f"r{rnd:03d}_{arm.key}"
    out, stats, logf = rdir / f"{stem}.parquet", rdir / f"{stem}.stats.json", rdir / f"{stem}.log"
    cfg = arm.write_job_config(rdir / f"{arm.key}.job.yaml")
    wd = arm.working_dir or REPO_ROOT
    env = checkout_env(wd, arm.job_env, {**plan.extra_env, "RAY_ADDRESS": address})
    # every path absolute: the round runs in the arm's checkout, not in this process's cwd
    cmd = [sys.executable, "-m", "cluster", "generate", "--config", str(cfg.resolve()),
           "--prompts", str(plan.prompts.resolve()), "--out", str(out.resolve()),
           "--stats", str(stats.resolve())]
    start = time.time()
    with open(logf, "w") as lf:
        try:
            rc = subprocess.run(cmd, cwd=wd, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except BaseException:  # (Ctrl-C, SIGTERM: subprocess.run has killed and reaped it)
            # its results store's flock died with it, but not the file, which would stay
            # in rounds/ as if a run still held this round's --out
            out.with_name(out.name + ".lock").unlink(missing_ok=True)
            raise
    end = time.time()
    return {"round": rnd, "arm": arm.key, "label": arm.label, "start_s": start, "end_s": end,
            "returncode": str(rc), "parquet": out, "stats": stats, "log": logf}


def _read_results(path: Path) -> pd.DataFrame:
    """A round's result rows: its Parquet, or, when the round was killed or crashed before
    generate merged them, the part files it had flushed (cluster/jobs/results_store.py:
    OUT.parts/part-NNNNNN.parquet, the newest row per key), so served rows are not lost."""
    if path.exists():
        return pq.read_table(path).to_pandas()
    parts = sorted((path.parent / (path.name + ".parts")).glob("part-*.parquet"))
    if not parts:
        return pd.DataFrame()
    req = pd.concat([pq.read_table(p).to_pandas() for p in parts], ignore_index=True)
    keys = [result_key(None if pd.isna(i) else str(i), int(n)) for i, n in zip(req.id, req.line)]
    return req[~pd.Series(keys).duplicated(keep="last").to_numpy()].reset_index(drop=True)


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


KILL_OUTCOMES = ("found", "unseen", "unknown", "after_end")  # faults.parquet `outcome`


def classify_kills(kills: list[dict], rounds: pd.DataFrame) -> list[dict]:
    """The injector's kills, each with `after_end` and `outcome` (one of KILL_OUTCOMES).

    after_end (outcome "after_end"): it landed outside the steps of its round's job, after
    the job had taken its last step (its --stats' steps_done_at; where a run has none, an
    older build's or one that crashed, the end of the run) or before the run began (the
    previous round's workers, not yet gone). Such a kill had nothing left to run: the job
    cannot find it or recover from it, so it is no kill of that round (rounds' `kills` and
    the summary's faults.kills leave it out; `kills_after_end` counts it).

    A kill while the job ran is "found" when the job's scheduler found a worker death for it
    (its --stats' worker_deaths) and "unseen" when it did not: the job steps a worker only
    while one of its sequences is in flight there, so a worker killed while idle (its slots
    empty, e.g. the queue had drained onto its peers) is never stepped again: no death is
    found, nothing needed recovering, and nothing was lost. (A worker killed while it was
    still loading is found: the groups report it as dead at start and the job counts it.)
    The job counts its deaths, not which worker each was, so a round with more kills than
    deaths found has its latest kills taken as unseen
    (the ones most likely to find their worker idle, as the queue drains); the counts per
    round are exact. "unknown": the run left no count of the deaths it found (it crashed or
    timed out before writing --stats, or its build writes none), so nothing says which."""
    spans = {(r.round, r.arm): (r.start_s, r.end_s if pd.isna(r.steps_done_at)
                                else min(r.steps_done_at, r.end_s))
             for r in rounds.itertuples()}
    deaths = {(r.round, r.arm): None if pd.isna(r.worker_deaths) else int(r.worker_deaths)
              for r in rounds.itertuples()} if "worker_deaths" in rounds else {}
    found: dict[tuple, int] = {}
    out: list[dict] = [{} for _ in kills]  # (in the order given; decided in time order)
    for i in sorted(range(len(kills)), key=lambda i: kills[i]["time_s"]):
        k = kills[i]
        key = (k["round"], k["arm"])
        span = spans.get(key)  # (none: a kill before the first round)
        late = span is None or not span[0] <= k["time_s"] < span[1]
        if late:
            outcome = "after_end"
        elif deaths.get(key) is None:
            outcome = "unknown"
        elif found.get(key, 0) < deaths[key]:
            outcome, found[key] = "found", found.get(key, 0) + 1
        else:
            outcome = "unseen"
        out[i] = {**k, "after_end": late, "outcome": outcome}
    return out


# rounds.parquet's and summary.json's kill counts, by classify_kills' outcome: `kills` are
# those while a round's job ran (found + unseen + unknown), the others each outcome apart
KILL_COLUMNS = {"kills": ("found", "unseen", "unknown"), "kills_unseen": ("unseen",),
                "kills_unknown": ("unknown",), "kills_after_end": ("after_end",)}


def _read_stats(path: Path) -> tuple[dict, str | None]:
    """A round's --stats ({} where its run wrote none), and why it cannot be read, where it
    cannot (a run killed while writing it, an older build's partial write): that round
    fails, the soak goes on."""
    if not path.exists():
        return {}, None
    try:
        stats = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, f"{path.name}: {getattr(e, 'strerror', None) or e}"
    if not isinstance(stats, dict):
        return {}, f"{path.name}: not a JSON object"
    return stats, None


def _round_rows(meta: dict, expected: set[str]) -> tuple[dict, pd.DataFrame]:
    """One rounds.parquet row and the round's request rows."""
    req = _read_results(meta["parquet"])
    stats, stats_error = _read_stats(meta["stats"])
    ok = errors = input_errors = runtime_errors = req
    if len(req):
        ok, errors = req[req.finish_reason.isin(OK_FINISH)], req[req.finish_reason == "error"]
        is_input = errors.error.fillna("").map(is_input_error).astype(bool)
        input_errors, runtime_errors = errors[is_input], errors[~is_input]
    served = _served_keys(ok) | _served_keys(input_errors) if len(req) else set()
    workers = stats.get("workers", [])

    def wsum(k):
        vals = [w[k] for w in workers if w.get(k) is not None]
        return float(sum(vals)) if vals else None

    hit = [w["expert_hit_rate"] for w in workers if w.get("expert_hit_rate") is not None]
    row = {
        "round": meta["round"], "arm": meta["arm"], "label": meta["label"],
        "start_s": meta["start_s"], "end_s": meta["end_s"], "wall_s": meta["end_s"] - meta["start_s"],
        "returncode": meta["returncode"],
        "failed": meta["returncode"] != "0" or len(runtime_errors) > 0 or stats_error is not None,
        "stats_error": stats_error,
        "requests": len(req),
        "throughput_tok_s": (stats["tokens"] / stats["wall_s"]) if stats.get("wall_s") else None,
        "ttft_median_s": float(ok.ttft_s.median()) if len(ok) else None,
        "decode_tok_s_median": float(ok.decode_tokens_per_s.median()) if len(ok) else None,
        "tokens_per_forward": (stats["decode_tokens"] / stats["decode_steps"])
        if stats.get("decode_steps") else None,
        "expert_pins": wsum("expert_pins"),
        "expert_hit_rate": float(np.mean(hit)) if hit else None,
        "kv_bytes": stats.get("kv_bytes_peak"),
        "rss_bytes": wsum("rss_bytes"),
        "device_mem_bytes": wsum("device_mem_bytes"),
        "errors": len(errors),
        "runtime_errors": len(runtime_errors),
        # None: not recorded (no --stats, or a build that writes none); classify_kills reads it
        "worker_deaths": int(stats["worker_deaths"]) if "worker_deaths" in stats else None,
        "recoveries": int(stats.get("recoveries", 0)),
        "requeued": int(stats.get("requeued", 0)),
        "lost_requests": len(expected - served),
        "steps_done_at": _finite(stats.get("steps_done_at")),
    }
    for group in COUNTER_GROUPS:  # path / event -> count, one column each
        for k, n in (stats.get(group) or {}).items():
            row[f"{group}.{k}"] = int(n)
    if len(req):
        req = req.assign(round=meta["round"], arm=meta["arm"], id=req.id.astype(str))
    return row, req


class RatioGauge:
    """Publishes each round's B/A ratios as the `kvfleet_soak_ratio` gauge (tag `metric`),
    so a dashboard shows them while a long soak runs. Ray exports a gauge only for about
    twice its report interval after its last set (~20 s), and a round pair takes minutes:
    a thread sets the last ratios again every `every_s` until stop() (KeptGauges)."""
    METRICS = ("throughput_tok_s", "ttft_median_s", "decode_tok_s_median", "kv_bytes", "rss_bytes")

    def __init__(self, every_s: float = 5.0):
        from ray.util.metrics import Gauge
        self.gauge = Gauge("kvfleet_soak_ratio", "B/A ratio of the last soak round",
                           tag_keys=("metric",))
        self.last: dict[str, float] = {}
        self.kept = KeptGauges(every_s)
        self.kept.start("soak-ratio-gauge")

    def publish(self, a: dict, b: dict) -> None:
        """This round's ratios (a and b: its rounds.parquet rows). A ratio this round cannot
        make (a value missing, A's 0, or not finite; any ratio when either run failed, as its
        figures are partial) is left out, or set to NaN where an earlier round had set it: the
        gauge then shows a gap, not the earlier round's ratio as the last one."""
        failed = bool(a.get("failed") or b.get("failed"))
        for m in self.METRICS:
            av, bv = a.get(m), b.get(m)
            if (not failed and av is not None and bv is not None and av != 0
                    and math.isfinite(av) and math.isfinite(bv)):
                self.last[m] = bv / av
            elif m in self.last:
                self.last[m] = math.nan
            else:
                continue
            self.kept.set(self.gauge, self.last[m], metric=m)

    def stop(self) -> None:
        self.kept.stop()


class FailedRoundsCounter:
    """Publishes the soak's failed rounds (a run that exited non-zero, timed out or left rows
    that failed at run time) as the `kvfleet_soak_failed_rounds` counter (tag `arm`), so a
    dashboard shows a crashing build while the soak still runs. Each arm's series starts at 0
    (as cluster/metrics.py's counters do: increase() misses a series' first sample, which
    would hide the first failure)."""

    def __init__(self, arms: list[str]):
        from ray.util.metrics import Counter
        self.counter = Counter("kvfleet_soak_failed_rounds", "soak rounds whose run exited "
                               "non-zero, timed out or had rows fail at run time",
                               tag_keys=("arm",))
        record = getattr(self.counter, "_record", None)  # (Counter.inc refuses 0)
        if record is not None:
            for arm in arms:
                record(0, tags={"arm": arm})

    def failed(self, arm: str) -> None:
        self.counter.inc(1, tags={"arm": arm})


def _refuse_used_out(out: Path) -> None:
    """A soak is not resumed: its rounds are a time series on one cluster, paired A B in
    time, and a restart would pair rounds across it (another machine state, perhaps
    another build). An interrupted soak's --out is refused like any used one, saying so."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    try:
        cut = json.loads((out / "summary.json").read_text()).get("interrupted")
    except (OSError, ValueError, AttributeError):
        cut = None
    what = (f"holds a soak interrupted by {cut.get('signal')} after {cut.get('rounds_kept')} "
            "rounds (its summary.json and report.html are of those); a soak is not resumed"
            if isinstance(cut, dict) else "not a new or empty directory (an earlier soak's "
            "rounds there would be resumed, not rerun)")
    raise UsageError(f"--out {out}: {what}; give another --out, or remove it (rm -r {out}) to "
                     "start over")


def _stop_on_sigterm() -> object:
    """SIGTERM (kill, a scheduler's stop) stops the soak as Ctrl-C does, raising Stopped
    (in place of Ray's driver handler, sys.exit(15), which left no summary); the previous
    handler, to restore. None off the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, stop_on_sigterm)


def run_soak(plan: SoakPlan) -> tuple[dict, int]:
    """Runs the soak; returns (summary, exit code: 0 pass, 1 gate failed). Ctrl-C
    (KeyboardInterrupt) or SIGTERM (Stopped) during it: summary.json and report.html are
    written for the rounds that finished (summary["interrupted"] says which round was cut)
    and the interruption is raised again; with none finished, the directories it made are
    removed, so --out can be given again."""
    import ray
    _refuse_used_out(plan.out)
    expected, own_temperatures = _read_prompts(plan.prompts)
    if not expected:  # (every round would serve nothing, and the gate pass on nothing)
        raise UsageError(f"--prompts {plan.prompts}: no requests in it (an empty or blank file)")
    for arm in plan.arms[1:]:  # (the section's fields that its file set itself)
        if "gate" in arm.section.model_fields_set:
            log.warning("soak: %s %s: its soak.gate is ignored: the gate is arm %s's (%s %s)",
                        FLAGS.get(arm.key, "arm " + arm.key), arm.path, plan.arms[0].key,
                        FLAGS.get(plan.arms[0].key, "arm"), plan.arms[0].path)
    builds: dict[Path, dict] = {}  # (before OUT is made: it may lie in a checkout)
    for arm in plan.arms:
        wd = arm.working_dir or REPO_ROOT
        builds.setdefault(wd, build_info(wd))
    made_out = not plan.out.exists()
    (plan.out / "rounds").mkdir(parents=True, exist_ok=True)
    ignored: dict[tuple[str, ...], list[str]] = {}  # the variables withheld -> the arms
    for arm in plan.arms:
        ignored.setdefault(tuple(sorted(arm.job_env & set(os.environ))), []).append(arm.key)
    for names, keys in ignored.items():
        if names:
            log.warning("soak: %s set in the environment, not passed to the rounds of arm%s %s "
                        "(each arm runs its own config)", ", ".join(names),
                        "s" if len(keys) > 1 else "", " and ".join(keys))
    joined = ray.is_initialized()  # (a caller's Ray is left running)
    previous = _stop_on_sigterm()
    killer = ratios = None
    rows, reqs, rnd, cut = [], [], 0, None
    arm = plan.arms[0]
    try:
        if not joined:
            address = os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address)
            else:
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                # the dashboard serves the state API that the fault injector lists workers with
                ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2),
                         include_dashboard=True, dashboard_host="127.0.0.1",
                         dashboard_port=_free_port())
            _stop_on_sigterm()  # (ray.init set its own)
        address = ray.get_runtime_context().gcs_address
        killer = WorkerKiller(plan.kill_every_s) if plan.kill_every_s else None
        deadline = time.monotonic() + (plan.duration_s if plan.duration_s else 10 * 365 * 86400.0)
        ratios = RatioGauge() if len(plan.arms) > 1 else None
        failures = FailedRoundsCounter([a.key for a in plan.arms])
        if killer:
            killer.start()
        while (plan.rounds is None or rnd < plan.rounds) and time.monotonic() < deadline:
            for arm in plan.arms:
                if killer:
                    killer.round = (rnd, arm.key)
                log.info("soak round %d arm %s (%s)", rnd, arm.key, arm.label)
                timeout = round_timeout(plan, deadline,
                                        [r["wall_s"] for r in rows if r["arm"] == arm.key])
                meta = _run_round(plan, arm, rnd, address, timeout)
                row, req = _round_rows(meta, expected)
                rows.append(row)
                reqs.append(with_temperatures(req, own_temperatures, arm.temperature))
                if row["failed"]:
                    failures.failed(arm.key)
            if ratios and len(rows) >= 2 and rows[-1]["round"] == rows[-2]["round"] == rnd:
                ratios.publish(rows[-2], rows[-1])
            rnd += 1
    except (KeyboardInterrupt, Stopped) as e:
        cut = e
    finally:
        if killer:
            killer.stop()
        if ratios:
            ratios.stop()
        if not joined and ray.is_initialized():
            ray.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if cut is not None and not rows:  # nothing finished: leave --out as it was
        shutil.rmtree(plan.out / "rounds", ignore_errors=True)
        if made_out:
            shutil.rmtree(plan.out, ignore_errors=True)
        raise cut
    rounds = pd.DataFrame(list(rows))
    kills = classify_kills(killer.events if killer else [], rounds)
    faults = pd.DataFrame(kills, columns=["time_s", "round", "arm", "worker", "pid", "after_end",
                                          "outcome"])
    for col, outcomes in KILL_COLUMNS.items():
        rounds[col] = [sum(1 for k in kills if (k["round"], k["arm"]) == (r, a)
                           and k["outcome"] in outcomes)
                       for r, a in zip(rounds["round"], rounds["arm"])] if len(rounds) else []
    requests = pd.concat([r for r in reqs if len(r)], ignore_index=True) if any(len(r) for r in reqs) \
        else pd.DataFrame(columns=["round", "arm", "id", "line", "completion_tokens",
                                   "finish_reason", "ttft_s", "decode_tokens_per_s", "temperature"])
    summary = summarize(requests, rounds)
    summary["labels"] = {a.key: a.label for a in plan.arms}
    summary["build"] = {a.key: builds[a.working_dir or REPO_ROOT] for a in plan.arms}
    if cut is not None:  # (the cut round's files stay in rounds/, left out of the figures)
        summary["interrupted"] = {
            "signal": "SIGINT" if isinstance(cut, KeyboardInterrupt) else "SIGTERM",
            "rounds_kept": summary["rounds"], "cut_round": rnd, "cut_arm": arm.key}
    summary["config_check"] = {a.key: a.checked_by for a in plan.arms}  # (soak/config.py)
    summary["job_env"] = {a.key: {"from": a.job_env_from, "variables": sorted(a.job_env),
                                  "withheld": sorted(a.job_env & set(os.environ))}
                          for a in plan.arms}
    for col, outcomes in KILL_COLUMNS.items():
        summary["faults"][col] = sum(k["outcome"] in outcomes for k in kills)
    fails = apply_gate(summary, plan.arms[0].section.gate)
    summary["gate"] = {"passed": not fails, "failures": [str(f) for f in fails]}
    requests.to_parquet(plan.out / "requests.parquet")
    rounds.to_parquet(plan.out / "rounds.parquet")
    faults.to_parquet(plan.out / "faults.parquet")
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=1))
    title = "soak: " + " vs ".join(a.label for a in plan.arms)
    write_report(plan.out / "report.html", summary, rounds, parity_table(requests)
                 if len(plan.arms) > 1 else pd.DataFrame(columns=["round", "id", "first_diff",
                                                                  "compared", "sampled"]),
                 faults, title)
    if cut is not None:
        raise cut
    return summary, 0 if not fails else 1
