"""Requests in (JSONL), results out (one Parquet row per input line).

Input line (JSON object): `id` (string or int), `prompt` (text) or `prompt_tokens` (list of
ints), optional `max_tokens`, `temperature`, `top_p`, `seed`, `stop` (string or list),
`cache` (a name for the request's saved KV: with `kv_cache_dir` set, a request whose prompt
starts with what that cache holds resumes from it, and its own KV is saved there; default:
the id; any string, kvstore/slots.py turns it into a safe file name).
A line that cannot become a request is not fatal: it becomes an `InputError` carrying the
line number and the reason, and the job writes an error row for it.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import pyarrow as pa

FIELDS = {"id", "prompt", "prompt_tokens", "max_tokens", "temperature", "top_p", "seed", "stop",
          "cache"}
MAX_CACHE_NAME = 1024
# the samplers take temperature and top_p as float32 (workers/actor.py StepBatch): a larger
# value became inf there (1e300: a RuntimeWarning, then uniform draws over the vocabulary)
FLOAT32_MAX = 3.4028234663852886e38
FINISH_REASONS = ("stop", "length", "error")


@dataclass(frozen=True)
class Request:
    id: str
    line: int  # 1-based line number in the input file
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    max_tokens: int | None = None  # None = the job's sampling defaults
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cache: str | None = None  # saved-KV name (None = the id, when kv_cache_dir is set)


@dataclass(frozen=True)
class InputError:
    """A line that is not a valid request; `id` is known when the JSON parsed far enough."""
    line: int
    error: str
    id: str | None = None
    prompt: str | None = None


def is_input_error(error: str | None) -> bool:
    """Whether an error row's message is an input error's: InputError messages name their
    line ("line N: ..."), those made at run time (cluster/scheduler.py) never do. The one
    rule for both a Result and a results file of any build (the soak reads its arms' rows)."""
    return error is not None and error.startswith("line ")


@dataclass
class Result:
    id: str | None
    line: int
    prompt: str | None = None
    completion: str = ""
    completion_tokens: list[int] = field(default_factory=list)
    prompt_token_count: int = 0
    completion_token_count: int = 0
    finish_reason: str = "error"
    error: str | None = None
    tier: str = ""
    worker: str = ""
    ttft_s: float | None = None  # slot assigned -> first token sampled (queueing excluded)
    decode_tokens_per_s: float | None = None  # (tokens - 1) / (last token - first token)
    cached_prompt_tokens: int = 0  # prompt tokens loaded from saved KV instead of computed
    request_digest: str | None = None  # request_digest() of the line it answers (None: an input error)

    @classmethod
    def failed(cls, bad: InputError, tier: str) -> "Result":
        return cls(id=bad.id, line=bad.line, prompt=bad.prompt, error=bad.error, tier=tier)

    @property
    def runtime_error(self) -> bool:
        """An error row made at run time (the scheduler's: a worker's step raised, no live
        worker was left), not an input error (Result.failed: the line's own fault)."""
        return self.finish_reason == "error" and not is_input_error(self.error)

    @property
    def key(self) -> str:
        """What makes a row 'done' for a resumed job: the id, or the line without one."""
        return result_key(self.id, self.line)


def result_key(id_: str | None, line: int) -> str:
    return id_ if id_ is not None else f"#line{line}"


def request_digest(r: Request) -> str:
    """What a row answers besides the job's settings: the prompt and the line's own sampling
    fields (not its id, line or cache name). A resumed job redoes an id whose digest changed."""
    doc = [r.prompt, r.prompt_tokens, r.max_tokens, r.temperature, r.top_p, r.seed, r.stop]
    return hashlib.blake2b(json.dumps(doc).encode("utf-8"), digest_size=8).hexdigest()


LINE_KEY = re.compile(r"#line[0-9]+")  # result_key's form for rows without an id: no id may take it
MAX_TOKEN_ID = 2 ** 31  # token ids are int32 everywhere past the parser


SCHEMA = pa.schema([
    ("id", pa.string()),
    ("prompt", pa.string()),
    ("completion", pa.string()),
    ("completion_tokens", pa.list_(pa.int32())),
    ("prompt_token_count", pa.int32()),
    ("completion_token_count", pa.int32()),
    ("finish_reason", pa.string()),
    ("error", pa.string()),
    ("tier", pa.string()),
    ("worker", pa.string()),
    ("ttft_s", pa.float64()),
    ("decode_tokens_per_s", pa.float64()),
    ("line", pa.int32()),
    ("cached_prompt_tokens", pa.int32()),
    ("request_digest", pa.string()),
])
# columns added after the first release: results files written before them read as null
LATER_COLUMNS = frozenset({"cached_prompt_tokens", "request_digest"})


def results_table(results: list[Result]) -> pa.Table:
    rows = [asdict(r) for r in results]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def parse_line(text: str, line: int) -> Request | InputError:
    try:  # read_requests keeps bytes that are not UTF-8 as lone surrogates (surrogateescape)
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return InputError(line, f"line {line}: not valid UTF-8 text (at column {e.start + 1})")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return InputError(line, f"line {line}: malformed JSON: {e.msg} at column {e.colno}")
    except ValueError as e:  # valid JSON that Python refuses: an int of more digits than
        # sys.get_int_max_str_digits(), or (below) nesting past the recursion limit; both
        # ended the whole job with a traceback
        return InputError(line, f"line {line}: cannot read its JSON: {str(e).split(';')[0]}")
    except RecursionError:
        return InputError(line, f"line {line}: cannot read its JSON: arrays or objects nested "
                                f"too deeply")
    if not isinstance(obj, dict):
        return InputError(line, f"line {line}: expected a JSON object, got {type(obj).__name__}")
    try:  # a lone surrogate escape ("\ud800") parses, but no tokenizer or Parquet file takes it
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return InputError(line, f"line {line}: {e.object[e.start:e.end]!r} is a lone surrogate, "
                                f"not valid Unicode text")
    except RecursionError:  # (nested just under the parser's limit: not under the encoder's)
        return InputError(line, f"line {line}: cannot read its JSON: arrays or objects nested "
                                f"too deeply")
    raw_id = obj.get("id")
    rid = str(raw_id) if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else None
    prompt = obj.get("prompt") if isinstance(obj.get("prompt"), str) else None

    def bad(why: str) -> InputError:
        return InputError(line, f"line {line}: {why}", rid, prompt)

    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        return bad(f"unknown field(s) {unknown}; allowed: {sorted(FIELDS)}")
    if rid is None or rid == "":
        return bad(f"'id' must be a non-empty string or int, got {raw_id!r}")
    if LINE_KEY.fullmatch(rid):
        return InputError(line, f"line {line}: 'id' {rid!r} is reserved (rows without an id are "
                                f"keyed by their line)", None, prompt)
    has_text, has_tokens = "prompt" in obj, "prompt_tokens" in obj
    if has_text == has_tokens:
        return bad("give exactly one of 'prompt' (text) and 'prompt_tokens' (list of ints)")
    tokens = None
    if has_text:
        if not isinstance(obj["prompt"], str):
            return bad(f"'prompt' must be a string, got {type(obj['prompt']).__name__}")
        if obj["prompt"] == "":
            return bad("empty prompt")
    else:
        t = obj["prompt_tokens"]
        if not isinstance(t, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              and 0 <= x < MAX_TOKEN_ID for x in t):
            return bad(f"'prompt_tokens' must be a list of ints in [0, 2**31), got {str(t)[:80]}")
        if not t:
            return bad("empty prompt_tokens")
        tokens = tuple(t)
    kw = {}
    for name, kind, ok, rule in (
            ("max_tokens", int, lambda v: v >= 1, ">= 1"),
            ("temperature", float, lambda v: 0 <= v <= FLOAT32_MAX,
             f">= 0 and at most {FLOAT32_MAX:.7g} (float32's largest; more is infinite)"),
            ("top_p", float, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("seed", int, lambda v: 0 <= v < 2 ** 64, "in [0, 2**64)")):
        if obj.get(name) is None:
            continue
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and
                                                                      not isinstance(v, int)):
            return bad(f"'{name}' must be {kind.__name__}, got {v!r}")
        if not ok(v):  # (Python compares an int past float range, 10**400, exactly)
            return bad(f"'{name}'={v!r:.80} must be {rule}")
        kw[name] = kind(v)
    stop = obj.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        return bad(f"'stop' must be a non-empty string or a list of them, got {stop!r}")
    cache = obj.get("cache")
    if cache is not None and (not isinstance(cache, str) or not cache
                              or len(cache) > MAX_CACHE_NAME):
        return bad(f"'cache' must be a non-empty string of at most {MAX_CACHE_NAME} "
                   f"characters, got {str(cache)[:80]!r}")
    return Request(id=rid, line=line, prompt=prompt if has_text else None,
                   prompt_tokens=tokens, stop=tuple(stop), cache=cache, **kw)


def read_requests(path: str | Path) -> Iterator[Request | InputError]:
    """Every non-blank line of a JSONL file as a Request or an InputError; a repeated id is
    an error on its later lines, whether its first line was valid or not (so that every
    line keeps a row of its own: rows are keyed by id)."""
    first_line: dict[str, int] = {}
    # utf-8-sig: a byte-order mark at the very start (Windows tools write one) is skipped;
    # json.loads refuses it, so line 1 was an error row. One anywhere else is data: U+FEFF
    # inside a prompt is kept, and a later line that starts with one is malformed JSON.
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            item = parse_line(text, n)
            if item.id is not None and item.id in first_line:
                if isinstance(item, Request):
                    item = InputError(n, f"line {n}: duplicate id {item.id!r} (first on line "
                                         f"{first_line[item.id]})", None, item.prompt)
                else:  # (an error already: keyed by its line instead)
                    item = replace(item, id=None)
            elif item.id is not None:
                first_line[item.id] = n
            yield item
