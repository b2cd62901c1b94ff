"""Saved KV per conversation on a worker: a sequence resumes from the prefix its slot file
shares with the prompt, and its KV goes back into that file when it ends.

The scheduler names a sequence's cache (`Prepared.cache`: the request's `cache` field or
its id) in `StepBatch.attach` with the step that carries its first prompt chunk. Per
sequence:

    attach   lock the slot file (kvstore/slots.py; a busy file = the request runs without
             reuse, logged and counted), load it under kvstore's load rules (upgrade /
             reject with a clean start / self-heal), take the records whose tokens equal the
             prompt's first tokens but at most len(prompt) - 1 of them, so the model still
             computes the last prompt token and its logits, and copy them into the pool slot
             as stored (kvstore/prefix.py to_pool: no re-encode). The step then drops its
             prompt rows below that count and `StepOutput.loaded` tells the scheduler where
             prefill resumes. A file of the slot's old name beside its file, which an older
             kvfleet still writes and this one does not read, is counted ("legacy_ignored";
             kvstore/slots.py warns).
    steps    the tokens the worker forwards are kept by position; `done` is the KV length
             that completed forwards have written.
    release  the file is made to hold the sequence's tokens [0, done) -- the prompt and the
             completion minus the last sampled token, which never went through the model:
             it is cut back to the longest prefix it shares with them (a prompt that
             diverged or shrank truncates it) and the rows past that are appended (one
             fsync'd append); then the lock is let go. A file with other hard links (a
             `cp -al` snapshot of the cache dir) is first given a file of its own, so the
             snapshot keeps its bytes (kvstore/cachefile.py; counted as "detached").

The cut happens at release, not at attach: a rerun of the same prompt that produces the
same tokens finds the file already right and writes nothing (no partial-batch rewrite, no
fsync), and a request that fails leaves the saved conversation whole. Rows the file keeps
past the loaded prefix have the same tokens as the recomputed ones (same cache contents up
to float rounding of the batch shape). A file that load upgraded (v1 under a quantized
tier) or found torn is always written at release, so it is rewritten / healed.

A DSA model (index_* fields) would need its indexer rows saved too, which the model does
not compute yet: persistence refuses it (`unsupported_reason`) rather than write fake rows.
"""
from __future__ import annotations

import logging
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvstore.cachefile import CacheFile
from kvstore.fingerprint import Fingerprint
from kvstore.prefix import common_prefix, from_pool, to_pool
from kvstore.slots import SlotBusyError, SlotFiles

log = logging.getLogger(__name__)


def unsupported_reason(cfg) -> str | None:
    """Why a model (workers.config.ModelConfig) cannot persist its KV, or None."""
    if getattr(cfg, "index_n_heads", 0):
        return (f"KV cache persistence (kv_cache_dir) does not support DSA models yet "
                f"(index_n_heads={cfg.index_n_heads}, index_head_dim={cfg.index_head_dim}): "
                f"their cache files need the indexer rows, which kvfleet does not compute; "
                f"unset kv_cache_dir / KVFLEET_KV_CACHE_DIR / --kv-cache-dir")
    return None


@dataclass
class _Open:
    """One attached sequence: its locked file and what its slot holds."""
    name: str
    stack: ExitStack  # holds the slot file's lock
    file: CacheFile
    tokens: np.ndarray  # int32[capacity] the sequence's tokens by position
    loaded: int  # prompt tokens loaded from the file
    saved: np.ndarray  # int32 tokens of the records in the file
    rewrite: bool  # load upgraded or self-healed the file: write it at release even if unchanged
    done: int  # KV rows [0, done) written by completed forwards (or loaded)


# every name SlotPersist counts in `events` (the kvfleet_kv_cache metric's `event` tag,
# started at 0 on the metrics endpoint: cluster/metrics.py)
CACHE_EVENTS = ("hits", "misses", "busy", "errors", "rejected", "upgraded", "loaded_tokens",
                "saved_tokens", "save_errors", "truncated", "detached", "legacy_ignored")


class SlotPersist:
    """The worker's persistence; `files` None = off (attach requests are ignored)."""

    def __init__(self, files: SlotFiles | None, capacity: int):
        self.files, self.capacity = files, capacity
        self.events: Counter[str] = Counter()  # drained into StepOutput.cache_events
        self._open: dict[int, _Open] = {}
        self._plain: set[int] = set()  # attached keys that run without a file (busy, error)
        self._warned_off = False

    @classmethod
    def for_worker(cls, spec, model, pool) -> "SlotPersist":
        """From WorkerSpec.kv_cache_dir / kv_cache_format; off when the dir is None."""
        cache_dir = getattr(spec, "kv_cache_dir", None)
        if cache_dir is None:
            return cls(None, 0)
        why = unsupported_reason(model.config)
        if why:
            raise ValueError(f"worker {spec.name}: {why}")
        fp = Fingerprint.from_config(model.config)
        files = SlotFiles(cache_dir, fp, spec.tier, fmt=getattr(spec, "kv_cache_format", "arrow"))
        log.info("worker %s: KV cache files in %s (%s, tier %s)", spec.name, cache_dir,
                 files.cls.__name__, spec.tier)
        return cls(files, pool.capacity_tokens)

    # -- attach -----------------------------------------------------------------------------
    def attach(self, batch, pool, slot_of: dict[int, int]) -> tuple[Any, dict[int, int]]:
        """Load the attached sequences' prefixes into their slots. Returns the batch without
        the prompt rows the loaded prefixes cover, and {key: prompt tokens loaded}. A rerun
        of the same batch (cluster/ep_group.py) finds its keys attached and loads nothing."""
        loaded: dict[int, int] = {}
        for key, (name, prompt) in batch.attach.items():
            key = int(key)
            if key in self._open:
                loaded[key] = self._open[key].loaded
            elif key in self._plain:
                loaded[key] = 0
            elif self.files is None:
                loaded[key] = 0
                if not self._warned_off:
                    self._warned_off = True
                    log.warning("cache %r: this worker has no kv_cache_dir; sequences run "
                                "without saved KV", name)
            else:
                loaded[key] = self._attach_one(key, str(name), np.asarray(prompt, np.int32),
                                               pool, slot_of[key])
        return skip_loaded(batch, loaded), loaded

    def _attach_one(self, key: int, name: str, prompt: np.ndarray, pool, slot: int) -> int:
        stack = ExitStack()
        try:
            f = stack.enter_context(self.files.open(name))
        except SlotBusyError as e:
            log.warning("cache %r: %s; the request runs without its saved prefix", name, e)
            self.events["busy"] += 1
            self._plain.add(key)
            return 0
        except OSError as e:  # (e.g. a link onto a share where its lock file cannot be made)
            log.error("cache %r: opening it failed, the request runs without it: %s", name, e)
            self.events["errors"] += 1
            self._plain.add(key)
            return 0
        try:
            recs = f.load()
            n = min(common_prefix(recs.tokens, prompt), len(prompt) - 1)
            to_pool(pool, slot, recs.slice(0, n))
        except (OSError, ValueError) as e:  # the request still runs, from its prompt
            stack.close()
            pool.truncate(slot, 0)
            log.error("cache %r (%s): loading failed, the request runs without it: %s",
                      name, f.path, e)
            self.events["errors"] += 1
            self._plain.add(key)
            return 0
        if f.legacy is not None:  # an older kvfleet writes it; kvstore logged it (once)
            self.events["legacy_ignored"] += 1
        rejected = f.message is not None and (f.plan is None or f.plan.action == "reject")
        if rejected:
            self.events["rejected"] += 1  # kvstore logged the message (once per load)
        elif f.plan is not None and f.plan.action == "upgrade":
            self.events["upgraded"] += 1
        self.events["hits" if n else "misses"] += 1
        self.events["loaded_tokens"] += n
        tokens = np.zeros(self.capacity, np.int32)
        tokens[:len(prompt)] = prompt
        self._open[key] = _Open(name, stack, f, tokens, n, np.array(recs.tokens, np.int32),
                                f.message is not None and not rejected, n)
        log.debug("cache %r: %d of %d prompt tokens loaded from %s", name, n, len(prompt), f.path)
        return n

    # -- steps ------------------------------------------------------------------------------
    def observe(self, batch) -> None:
        """After a completed forward of `batch`: remember its tokens, advance `done`."""
        if not self._open or len(batch.keys) == 0:
            return
        for key in np.unique(batch.keys).tolist():  # per sequence, not per row
            o = self._open.get(key)
            if o is None:
                continue
            m = batch.keys == key
            pos = np.asarray(batch.positions)[m]
            o.tokens[pos] = np.asarray(batch.tokens)[m]
            o.done = max(o.done, int(pos.max()) + 1)

    # -- release ----------------------------------------------------------------------------
    def release(self, key: int, pool, slot: int, save: bool = True) -> None:
        """Append the sequence's new rows to its file and unlock it (before the slot is freed).
        save False (a failed sequence): unlock only, the file stays as it was."""
        self._plain.discard(key)
        o = self._open.pop(key, None)
        if o is None:
            return
        with o.stack:
            if not save:
                return
            c = common_prefix(o.saved, o.tokens[:o.done])
            if c == o.done and not o.rewrite:
                return  # the file holds the whole sequence already
            start = c if c < o.done else None  # None: keep every record (an upgrade or heal)
            try:
                recs = from_pool(pool, slot, o.tokens[:o.done], start=c, end=o.done)
                o.file.append(recs, start=start)
            except OSError as e:  # the output is done; only the saved KV is lost
                log.error("cache %r (%s): saving %d tokens failed: %s", o.name, o.file.path,
                          o.done - c, e)
                self.events["save_errors"] += 1
                return
            finally:
                if o.file.detached:  # (even if the append after the detach failed)
                    self.events["detached"] += 1
            self.events["saved_tokens"] += o.done - c
            if c < min(o.done, len(o.saved)):
                self.events["truncated"] += 1  # the file had diverged from the sequence at c

    def drain_events(self) -> dict[str, int]:
        out = {k: v for k, v in self.events.items() if v}
        self.events.clear()
        return out


def skip_loaded(batch, loaded: dict[int, int]):
    """`batch` without the rows of key k at positions below loaded[k] (their KV is in the
    slot already); sample_at is renumbered. The sampled rows are never dropped: a loaded
    prefix stops before a prompt's last token."""
    if not any(loaded.values()) or len(batch.keys) == 0:
        return batch
    keys = np.asarray(batch.keys, np.int64)
    uniq, inv = np.unique(keys, return_inverse=True)
    lim = np.array([loaded.get(k, 0) for k in uniq.tolist()], np.int64)[inv]
    keep = np.asarray(batch.positions, np.int64) >= lim
    if keep.all():
        return batch
    at = np.asarray(batch.sample_at, np.int64)
    if not keep[at].all():
        raise ValueError(f"a loaded prefix covers sampled rows {at[~keep[at]].tolist()} "
                         f"(loaded {loaded})")
    new_index = np.cumsum(keep) - 1
    return replace(batch, keys=keys[keep], tokens=np.asarray(batch.tokens)[keep],
                   positions=np.asarray(batch.positions)[keep],
                   sample_at=new_index[at].astype(np.int32))
