"""`kvfleet kv inspect FILE` and `kvfleet kv convert IN OUT --to TIER [--format arrow|coli]`.

Both read either on-disk format (kvfleet's Arrow stream or the C engine's `.coli_kv`),
told apart by their first bytes. `inspect` prints the header, the record count and what a
loader would do with the file (torn tail, repaired rows, and, with --model/--tier, whether
that model would resume it). `convert` rewrites the records in another format and/or tier
(same tier: a byte copy of the records; f32 -> quantized: encode_rows; otherwise decode then
encode, which is lossy); the output is written atomically, under the output's slot lock
(kvstore/slots.py), so a file that a running job holds is refused, never renamed under it;
convert deletes that lock file again as it lets go (a busy output's lock, which another
process holds, is left alone). An output with other hard links (a `cp -al` snapshot) is
replaced by a file of its own, never written in place: its other names keep their bytes
(convert says so in a note). An output folder that does not exist is created (mkdir -p;
convert says so), and removed again when convert writes nothing.
Both refuse a file that a loader would throw away whole (a clean start). `inspect` of a slot
file whose older name (an older kvfleet's, kvstore/slots.py) is there too as another file,
or of that file, adds a `legacy:` line: what an older kvfleet writes there is not read.
"""
from __future__ import annotations

import os

import numpy as np

from cluster.cli import UsageError
from kernels.tiers import TIERS, TierError, get_tier, tier_from_tag
from kvstore import coli, disk
from kvstore.cachefile import check_regular, unresolved_link
from kvstore.fingerprint import Fingerprint, HeaderError, plan_load, tier_label
from kvstore.records import RecordLayout, requantize
from kvstore.slots import SlotBusyError, SlotLock, unread_legacy

SUFFIX_FORMAT = {".coli_kv": "coli", ".arrow": "arrow", ".arrows": "arrow", ".kvarrow": "arrow"}


def register(sub) -> None:
    p = sub.add_parser("kv", help="inspect and convert on-disk KV caches")
    kv = p.add_subparsers(dest="kv_command", required=True, metavar="ACTION")
    ins = kv.add_parser("inspect", help="print a KV cache file's header and health")
    ins.add_argument("file")
    ins.add_argument("--model", help="model dir or config.json: also say whether it would resume")
    ins.add_argument("--kv", choices=sorted(TIERS), help="running KV tier for the --model check "
                     "(default: the file's)")
    ins.set_defaults(func=inspect_cmd)
    cv = kv.add_parser("convert", help="rewrite a KV cache in another format and/or tier")
    cv.add_argument("input")
    cv.add_argument("output")
    cv.add_argument("--to", required=True, choices=sorted(TIERS), help="tier of the output")
    cv.add_argument("--format", choices=["arrow", "coli"],
                    help="output format (default: from the output suffix .arrow / .coli_kv)")
    cv.set_defaults(func=convert_cmd, interrupted=lambda args: _unchanged(args.output))


def _unchanged(output: str) -> str:
    return (f"{output} is unchanged unless the conversion had finished (the new file replaces "
            f"it in one rename, once complete)")


def _io_error(path: str, what: str, e: OSError) -> str:
    """An OSError as one line naming the file: kvstore's own errors name it already, the
    system's (a full disk, EIO, EACCES) often do not."""
    why = e.strerror or str(e)
    return why if path in why else f"{path}: {what} failed ({why})"


def open_any(path: str):
    """(format name, CacheFile opened with the file's own model and tier, loaded records,
    the header's tag word). A file that load() would throw away whole is a UsageError."""
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a directory; give one KV cache file in it (*.arrow, *.coli_kv)")
    if os.path.islink(path) and not os.path.exists(path):  # e.g. onto a share not mounted
        raise UsageError(unresolved_link(path).strerror)
    if not os.path.lexists(path):
        raise UsageError(f"{path}: no such file")
    try:  # a FIFO would block the read; a device is no cache
        check_regular(path)
    except OSError as e:
        raise UsageError(e.strerror) from None
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if head.startswith(b"COLIKV"):
            fmt, cls = "coli", coli.ColiKVFile
            version, fp, nrec, tag, size = coli.read_header(path)
            tier = tier_from_tag(version, tag)
            rec = RecordLayout(fp, tier).record_bytes
            whole = (size - coli.HEADER_BYTES) // rec
            if nrec > whole:
                raise UsageError(f"{path}: impossible header: nrec={nrec} but the file holds only "
                                 f"{whole} complete records ({size} bytes, {rec} bytes per record); "
                                 f"a loader would keep {whole}")
        elif head.startswith(b"\xff\xff\xff\xff"):
            fmt, cls = "arrow", disk.ArrowKVFile
            version, tag, fp, _ = disk.read_header(path)
            tier = tier_from_tag(version, tag)
        else:
            raise UsageError(f"{path}: not a KV cache (starts with {head!r}; expected a kvfleet "
                             f"Arrow KV stream or a .coli_kv file with magic COLIKV1/2/3)")
    except (HeaderError, TierError) as e:
        raise UsageError(f"{path}: {e}" if path not in str(e) else str(e)) from None
    except OSError as e:
        raise UsageError(_io_error(path, "reading it", e)) from None
    f = cls(path, fp, tier)
    try:
        recs = f.load()
    except OSError as e:
        raise UsageError(_io_error(path, "reading it", e)) from None
    # load() started clean (a HeaderError from _read leaves no plan): it keeps nothing of the
    # file, so there is nothing to inspect or convert; a cut tail still has a "load" plan
    if f.plan is None or f.plan.action == "reject":
        raise UsageError(f"{f.message or path + ': unreadable'} (a loader keeps none of this "
                         f"file: it starts clean)")
    return fmt, f, recs, tag


def inspect_cmd(args) -> int:
    fmt, f, recs, tag = open_any(args.file)
    t, fp = f.tier, f.fp
    size = os.path.getsize(args.file)
    print(f"file:         {args.file}")
    print(f"format:       {fmt} ({'Arrow IPC stream' if fmt == 'arrow' else 'C engine .coli_kv'})")
    print(f"tier:         {tier_label(t)}  tag {tag:#x}")
    print(f"model:        {fp.describe()}")
    print(f"record bytes: {f.layout.record_bytes}  ({t.token_bytes(fp.kv_lora, fp.rope)} per layer)")
    print(f"records:      {len(recs)}")
    print(f"file bytes:   {size}")
    if fmt == "arrow":
        print(f"batches:      {len(f._bounds) - 1}")
    if len(recs):
        shown = " ".join(map(str, recs.tokens[:8].tolist())) + (" ..." if len(recs) > 8 else "")
        print(f"tokens:       {shown}")
        bad_tok = int(((recs.tokens < 0) | (recs.tokens >= max(fp.vocab, 1))).sum()) if fp.vocab else 0
        print(f"tokens outside vocab: {bad_tok}")
        if t.quantized:
            s = np.concatenate([recs.l_scale.ravel(), recs.r_scale.ravel()])
            print(f"scales:       min {s.min():.4g}  max {s.max():.4g}  zero {int((s == 0).sum())}")
        else:
            x = np.concatenate([recs.l_codes.ravel(), recs.r_codes.ravel()])
            print(f"non-finite values: {int((~np.isfinite(x)).sum())}")
    print(f"health:       {f.message or 'ok'}")
    _legacy_note(args.file, f.suffix)
    if args.model:
        return _model_check(args, f, tag)
    return 0


def _legacy_note(path: str, suffix: str) -> None:
    """A line when `path` is one of a slot's two files, its own and the one an older kvfleet
    named and still writes, and both are there (kvstore/slots.py unread_legacy)."""
    pair = unread_legacy(path, suffix)
    if pair is None:
        return
    name, new, old = pair
    if os.path.basename(path) == os.path.basename(old):
        print(f"legacy:       not read: the file an older kvfleet gives cache {name!r}; this "
              f"version reads {new} instead, so what an older kvfleet writes here is not "
              f"loaded (stop or upgrade it)")
    else:
        print(f"legacy:       {old} is there too: an older kvfleet still writes cache {name!r} "
              f"under its old name; this version does not read that file")


def _model_check(args, f, tag: int) -> int:
    from workers.config import ConfigError, ModelConfig
    from workers.persist import unsupported_reason
    path = os.path.join(args.model, "config.json") if os.path.isdir(args.model) else args.model
    try:
        cfg = ModelConfig.from_file(path)
        model_fp = Fingerprint.from_config(cfg)
    except (ConfigError, OSError) as e:
        raise UsageError(f"--model {args.model}: {e}") from None
    tier = get_tier(args.kv or f.tier.name)
    why = unsupported_reason(cfg)
    if why:  # the worker refuses persistence for this model whatever the file holds
        print(f"resume with {tier.name}: not resumable by kvfleet: {why}")
        return 0
    plan = plan_load(f.path, f.tier.version, tag, f.fp, model_fp, tier)
    if plan.action == "reject":  # the verdict on stdout, its reason once, as the error
        print(f"resume with {tier.name}: reject")
        raise UsageError(plan.message)
    print(f"resume with {tier.name}: {plan.action}" + (f" ({plan.message})" if plan.message else ""))
    return 0


def convert_cmd(args) -> int:
    fmt = args.format or SUFFIX_FORMAT.get(os.path.splitext(args.output)[1])
    if fmt is None:
        raise UsageError(f"{args.output}: cannot tell the output format from its suffix; "
                         f"pass --format arrow|coli")
    if os.path.isdir(args.output):
        raise UsageError(f"{args.output}: is a directory; give the output file; nothing written")
    try:  # a FIFO or a device (a link to /dev/null): never renamed over, no lock beside it
        check_regular(args.output)
    except OSError as e:
        raise UsageError(f"{e.strerror}; nothing written") from None
    if os.path.islink(args.output) and not os.path.exists(args.output):
        raise UsageError(f"{args.output}: a symlink to {os.readlink(args.output)!r} that does "
                         f"not resolve (a loop, or a share that is not mounted); nothing written")
    dst_tier = get_tier(args.to)
    made = _make_folder(args.output)
    try:
        lock = _lock_output(args.output)  # also the input's lock when it is the same file
    except UsageError:
        _remove_folders(made)
        raise
    done = False
    try:
        src_fmt, src, recs, _ = open_any(args.input)
        if src.message:
            print(f"note: {src.message}")
        if src.tier.quantized and dst_tier != src.tier:
            print(f"note: {src.tier.name} -> {dst_tier.name} decodes and re-encodes (lossy)")
        try:
            out = requantize(recs, src.tier, dst_tier, src.fp)
        except TierError as e:
            raise UsageError(f"--to {args.to}: {e}") from None
        cls = disk.ArrowKVFile if fmt == "arrow" else coli.ColiKVFile
        dst = cls(args.output, src.fp, dst_tier)
        try:
            dst.rewrite(out)
        except OSError as e:  # (e.g. the disk is full): no traceback, the file named
            raise UsageError(f"{_io_error(args.output, 'writing it', e)}; "
                             f"{_unchanged(args.output)}") from None
        if dst.detached:
            print(f"note: {args.output} had other hard links; they keep the old file")
        done = True
    finally:
        lock.close(remove=True)  # (held by us: no other process can hold its lock files now)
        if not done:  # (an error or Ctrl-C) "nothing written" holds for the folders as well
            _remove_folders(made)
    if made:
        print(f"note: created the folder {os.path.dirname(args.output)}")
    print(f"wrote {len(out)} records ({dst_tier.name}, {fmt}) to {args.output} "
          f"({os.path.getsize(args.output)} bytes; from {src_fmt} {src.tier.name})")
    return 0


def _make_folder(path: str) -> list[str]:
    """Create the output's missing folders, as `mkdir -p` would (and HF's save_pretrained
    does): the folders made, deepest first. One that cannot be made (a file in the way, no
    permission) is a UsageError naming it, with nothing made."""
    folder = os.path.dirname(os.path.abspath(path))
    missing, d = [], folder
    while not os.path.lexists(d):  # (lexists: a dangling link in the way is not missing)
        missing.append(d)
        d = os.path.dirname(d)
    if not missing:
        return []
    try:
        os.makedirs(folder)
    except OSError as e:  # FileExistsError / NotADirectoryError: a file where a folder goes
        _remove_folders(missing)  # (those made before the one that failed)
        raise UsageError(f"{path}: cannot create its folder {os.path.dirname(path)} "
                         f"({e.strerror}: {e.filename}); nothing written") from None
    return missing


def _remove_folders(folders: list[str]) -> None:
    """rmdir each of `folders` (deepest first) that is there and empty."""
    for d in folders:
        try:
            os.rmdir(d)
        except OSError:  # not made, or something else put a file in it meanwhile: keep it
            pass


def _lock_output(path: str) -> SlotLock:
    """The slot lock of `path` (the one a running job holds on its cache file); a busy or
    unlockable file is a UsageError, before anything is read or written."""
    try:
        return SlotLock(path)
    except SlotBusyError as e:
        raise UsageError(f"{path}: KV cache file is in use by a running job (pid {e.holder} holds "
                         f"{e.lock_path}); nothing written: stop it or convert to another "
                         f"file") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot lock the output ({e.strerror}: {path}.lock); "
                         f"nothing written") from None
