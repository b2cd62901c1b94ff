"""Crash-safe, resumable result output: part files under OUT.parts/, merged into OUT at the end.

Every `flush_every` results (or at the first result after `flush_s` seconds: there is
no timer, so a row can wait in memory until the next one) the buffered rows become one
Parquet part file, written to a temporary name, fsync'd and renamed into place, so a job killed at any
moment keeps every part it finished. A rerun with the same OUT reads the final file and the
parts, treats every key whose newest row is not an error as done (unless the row's
request_digest differs from its line's now: the prompt or the line's settings changed), and `finalize` merges everything
into OUT (the newest row per key wins, rows sorted by input line) and removes the parts.
Given the current input's keys, `finalize` keeps only their rows, at their current lines
(a line removed or fixed in the prompts file leaves no stale row behind).

`settings` (the job's tier, model, sampling defaults, context) go into every file's schema
metadata; a rerun whose settings differ from those of the rows already there is refused,
so one OUT never mixes results of two configurations. Every file is written with page
checksums and a digest of its rows and read back verified (cluster/jobs/results_file.py):
a damaged OUT or part is refused, naming it, and left as it is for the operator.

One run at a time per OUT: the store holds an exclusive lock on OUT.lock from its start to
close() (kvstore/slots.py SlotLock, as `kvfleet kv convert` locks its output), and a second
run is refused. Two runs (a `ray job submit` resubmitted while the first still runs, which
a Ctrl-C of the submitting client does not stop) numbered their parts alike and removed
each other's: after doing all its work, one ended on a part the other was replacing ("cannot
read earlier results", exit 2), a part the other's finalize had removed (FileNotFoundError)
or a parts folder the other was still writing into (OSError "Directory not empty").
"""
from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import pyarrow as pa

from cluster.config import JobConfigError
from cluster.jobs.results_file import ResultsFile, ResultsFileError, read_results, write_results
from cluster.requests import SCHEMA, Result, result_key, results_table
from kvstore.slots import SlotBusyError, SlotLock

log = logging.getLogger(__name__)
PART = re.compile(r"^part-(\d{6})\.parquet$")


class ResultStore:
    def __init__(self, out: str | Path, flush_every: int = 32, flush_s: float = 5.0,
                 settings: dict[str, object] | None = None):
        self.out = Path(out)
        self.settings = settings
        self.parts = self.out.parent / (self.out.name + ".parts")
        self.flush_every, self.flush_s = flush_every, flush_s
        self._buf: list[Result] = []
        self._last_flush = time.monotonic()
        self._unchecked: set[Path] = set()  # files without a digest, said once each
        self._read_once: dict[Path, ResultsFile] = {}  # _check_settings' reads, for done_keys
        if self.out.is_dir():  # (read back as an empty dataset: "missing every column")
            raise JobConfigError(f"--out {self.out}: is a directory; give the results file to "
                                 f"write, e.g. {self.out / 'results.parquet'}")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # (e.g. a regular file on the way)
            raise JobConfigError(f"--out {self.out}: cannot create its folder {self.out.parent} "
                                 f"({e.strerror})") from None
        self._lock = _lock_out(self.out)
        try:
            for stale in self.parts.glob("*.tmp") if self.parts.exists() else ():
                stale.unlink()  # a part that was being written when a previous run died
            self._next = 1 + max((int(m.group(1)) for p in self._part_files()
                                  if (m := PART.match(p.name))), default=0)
            if settings is not None:
                self._check_settings()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Lets OUT go for another run (removes OUT.lock). Idempotent."""
        if self._lock is not None:
            self._lock.close(remove=True)
            self._lock = None

    def _check_settings(self) -> None:
        for path in self._sources():
            earlier = self._read_once[path] = self._read(path)
            found = earlier.settings
            if found is None:  # written before settings were recorded: its rows' tier at least
                tiers = set(earlier.table.column("tier").to_pylist())
                if tiers - {self.settings.get("kv")}:
                    raise JobConfigError(f"--out {self.out}: {path.name} holds results of tier "
                                         f"{sorted(t for t in tiers if t)}; this run has kv "
                                         f"{self.settings.get('kv')!r}. Give another --out, or "
                                         f"the same tier to resume")
                continue
            diff = sorted(k for k in set(found) | set(self.settings)
                          if found.get(k) != self.settings.get(k))
            if diff:
                was = ", ".join(f"{k} {found.get(k)!r}" for k in diff)
                now = ", ".join(f"{k} {self.settings.get(k)!r}" for k in diff)
                raise JobConfigError(f"--out {self.out}: {path.name} holds results made with "
                                     f"{was}; this run has {now}. Give another --out, or "
                                     f"the same settings to resume")

    def _sources(self) -> list[Path]:
        """Final file first, then the parts oldest first (later rows win on merge)."""
        return ([self.out] if self.out.exists() else []) + self._part_files()

    def _read(self, path: Path) -> ResultsFile:
        """One earlier file, checked: a damaged one is a JobConfigError naming it (the job
        ends before it writes anything, so the file stays as it is for the operator)."""
        try:
            earlier = read_results(path)
        except ResultsFileError as e:
            where = "" if path == self.out else f"part {path}: "
            raise JobConfigError(f"--out {self.out}: {where}{e}; it is left as it is: move it "
                                 f"away to start over, or give another --out") from None
        if not earlier.checked and path not in self._unchecked:
            self._unchecked.add(path)
            log.warning("--out %s: %s has no row digest (written by an older kvfleet), so "
                        "damage to it cannot be detected; read as it is (the merged OUT this "
                        "run writes has one)", self.out, path)
        return earlier

    def _part_files(self) -> list[Path]:
        if not self.parts.exists():
            return []
        return sorted(p for p in self.parts.iterdir() if PART.match(p.name))

    def _tables(self) -> list[pa.Table]:
        # (a file read at the start is read once: OUT and the parts there were do not change
        # before finalize writes OUT)
        return [(self._read_once.pop(p, None) or self._read(p)).table for p in self._sources()]

    def done_keys(self) -> dict[str, str | None]:
        """Key -> request digest of the newest row of each key, for the keys whose newest
        row is not an error: a rerun skips them where the digest matches its line's (None:
        written before rows had one). Error rows are redone."""
        done: dict[str, str | None] = {}
        for t in self._tables():
            for i, line, reason, digest in zip(*(t.column(c).to_pylist() for c in (
                    "id", "line", "finish_reason", "request_digest"))):
                if reason != "error":
                    done[result_key(i, line)] = digest
                else:  # (finalize keeps the newest row: this one)
                    done.pop(result_key(i, line), None)
        return done

    def add(self, result: Result) -> None:
        self._buf.append(result)
        if (len(self._buf) >= self.flush_every
                or time.monotonic() - self._last_flush >= self.flush_s):
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buf:
            return
        self.parts.mkdir(parents=True, exist_ok=True)
        path = self.parts / f"part-{self._next:06d}.parquet"
        self._next += 1
        write_results(results_table(self._buf), path, self.settings)
        self._buf = []

    def finalize(self, current: dict[str, int] | None = None) -> pa.Table:
        """Flush, merge final file + parts into OUT atomically, remove the parts. current:
        the input's key -> line; rows of other keys are dropped (logged), lines renumbered."""
        self.flush()
        tables = self._tables()
        merged = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
        keys = [result_key(i, n) for i, n in zip(merged.column("id").to_pylist(),
                                                 merged.column("line").to_pylist())]
        last = {k: j for j, k in enumerate(keys)}  # the newest row per key
        if current is not None:
            gone = [k for k in last if k not in current]
            if gone:
                log.warning("%s: %d earlier rows are not in the prompts any more (e.g. %s): "
                            "left out", self.out, len(gone), gone[:3])
            last = {k: j for k, j in last.items() if k in current}
        lines = (merged.column("line").to_pylist() if current is None
                 else [current.get(k) for k in keys])  # (the input's lines, when given)
        rows = sorted(last.values(), key=lambda j: lines[j])
        merged = merged.take(pa.array(rows, pa.int64()))
        if current is not None:
            merged = merged.set_column(merged.schema.get_field_index("line"), SCHEMA.field("line"),
                                       pa.array([lines[j] for j in rows], pa.int32()))
        write_results(merged, self.out, self.settings)
        if self.parts.exists():
            shutil.rmtree(self.parts)
        return merged


def _lock_out(out: Path) -> SlotLock:
    try:
        return SlotLock(str(out))
    except SlotBusyError as e:
        raise JobConfigError(f"--out {out}: another kvfleet generate (pid {e.holder}) is writing "
                             f"it (it holds {e.lock_path}); wait for that run to end or stop it "
                             f"(e.g. `ray job stop`), or give another --out") from None
    except OSError as e:
        raise JobConfigError(f"--out {out}: cannot lock it ({e.strerror}: {out}.lock)") from None

