"""Helpers of the runtime tests: a tiny checkpoint, prompt files, result tables, free ports."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the quick brown fox jumps over lazy dog cache expert latent slot token model "
         "answer question Paris eight four rotated codes").split()


def make_tiny(out_dir: Path, variants: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint of scripts/make_tiny_model.py (seed 0) in out_dir."""
    from scripts.make_tiny_model import make_tiny_model
    return make_tiny_model(out_dir, 0, variants)


def prompt_lines(n: int, seed: int = 0, max_tokens: int = 6) -> list[str]:
    """n JSON lines with prompts of different lengths and per-line max_tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(1, 14)))
        out.append(json.dumps({"id": f"q{i}", "prompt": " ".join(words),
                               "max_tokens": int(max_tokens + i % 3)}))
    return out


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def rows_by_id(path: Path) -> dict:
    rows = pq.read_table(path).to_pylist()
    return {r["id"] if r["id"] is not None else f"#line{r['line']}": r for r in rows}


def prepared(i: int, ids, max_tokens: int = 6):
    """A greedy scheduler item with id r<i>."""
    from cluster.requests import Request
    from cluster.scheduler import Prepared
    return Prepared(Request(id=f"r{i}", line=i + 1), np.asarray(ids, np.int32), max_tokens,
                    0.0, 1.0, 0)


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free right now (all bound at once, so no two are equal)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def job_config(model, **kw):
    """An in-process job config over `model` for tests; keyword args override fields. With
    a fleet, the slots are its nodes' unless given (a job `slots` overrides them all)."""
    from cluster.config import load_job_config
    over = {"model": str(model), "slots": 4, "max_context": 64, "prefill_chunk": 16,
            "workers": {"runtime": "inprocess"}}
    if "fleet" in kw.get("workers", {}) and "slots" not in kw:
        del over["slots"]
    over.update(kw)
    return load_job_config(env={}, overrides=over)
