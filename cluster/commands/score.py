"""`kvfleet score`: the logits a model gives a fixed token sequence, saved as .npy.

    kvfleet score --model DIR --tokens IDS.json --out LOGITS.npy [--kv TIER] [--mode prefill|decode]

Writes float32 logits [T, vocab]: row t is the distribution of token t+1 given ids[0..t].
--mode prefill runs one forward over all ids; --mode decode is teacher forcing, one token per
forward, so row t comes from decoding ids[t] through a cache that holds positions < t (and
then t itself: every layer writes its row before it attends). Both read every key through
the KV pool in the --kv tier, so the two modes agree up to float32 summation order; decode
exercises the per-step path.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from cluster.atomic import write_atomic
from cluster.cli import UsageError
from kernels.tiers import TIERS


def register(sub) -> None:
    p = sub.add_parser("score", help="logits of a token sequence (prefill or teacher-forced decode)")
    p.add_argument("--model", required=True, type=Path, help="checkpoint dir (config.json, *.safetensors)")
    p.add_argument("--tokens", required=True, type=Path, help="JSON list of token ids")
    p.add_argument("--out", required=True, type=Path, help="output .npy (float32 [T, vocab])")
    p.add_argument("--kv", default="f32", choices=sorted(TIERS), help="KV cache tier (default f32)")
    p.add_argument("--mode", default="prefill", choices=("prefill", "decode"))
    p.set_defaults(func=run)


def read_ids(path: Path, vocab: int) -> list[int]:
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--tokens {path}: no such file") from None
    except OSError as e:  # a directory, no permission
        raise UsageError(f"--tokens {path}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--tokens {path}: not valid JSON ({e})") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UsageError(f"--tokens {path}: expected a non-empty JSON list of integers")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"--tokens {path}: ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return ids


def score(model, ids: list[int], tier: str = "f32", mode: str = "prefill") -> np.ndarray:
    from kvstore.pool import KVPool
    n = len(ids)
    pool = KVPool.for_model(model.config, tier, slots=1, max_ctx=n)
    slot = pool.alloc_slot()
    if mode == "prefill":
        return model.forward(ids, [slot] * n, np.arange(n), pool)
    out = np.empty((n, model.config.vocab_size), np.float32)
    for t, tok in enumerate(ids):
        out[t] = model.forward([tok], [slot], [t], pool)[0]
    return out


def run(args) -> int:
    from workers.config import ConfigError, ModelConfig
    from workers.model import Model
    from workers.safetensors_io import WeightsError
    if not args.model.is_dir():
        raise UsageError(f"--model {args.model}: no such directory")
    if args.out.is_dir():
        raise UsageError(f"--out {args.out}: is a directory; give the .npy file to write")
    try:  # (before the weights load and the forward run)
        args.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create its folder {args.out.parent} "
                         f"({e.strerror})") from None
    try:  # every input is checked before the weights load (the slow part)
        vocab = ModelConfig.from_file(args.model / "config.json").vocab_size
        ids = read_ids(args.tokens, vocab)
        model = Model.load(args.model)
    except (ConfigError, WeightsError) as e:
        raise UsageError(f"--model {args.model}: {e}") from None
    logits = score(model, ids, args.kv, args.mode)
    buf = io.BytesIO()  # (np.save to a path would append ".npy" when it lacks one)
    np.save(buf, logits)
    try:  # (atomic: an earlier file there stays whole if this write fails)
        write_atomic(args.out, buf.getvalue())
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot write it ({e.strerror or e}); the "
                         "forward pass ran, nothing was written") from None
    print(f"wrote {args.out}: logits {list(logits.shape)} float32 ({args.mode}, kv {args.kv})")
    return 0
