"""`kvfleet bench`: benchmarks, one sub-subcommand each.

    kvfleet bench codecs [--json] [--model DIR] [--tiers ...] [--tokens 8192] [--heads 16]

Add a benchmark by writing cluster/bench/<module>.py and listing it in BENCHES. A module
provides add_arguments(parser) and run(args); run returns either a dict (this command
prints it: JSON with --json, else module.render(result)) or an exit code (the module printed
its own report). HELP (else the docstring's first line) is its help line; --json is added
unless the module adds it. Entries whose module does not exist yet are left out of
`kvfleet bench --help`.
"""
from __future__ import annotations

import argparse
import importlib
import json

from cluster.cli import UsageError

# sub-benchmark name -> module under cluster/bench/
BENCHES = {
    "codecs": "cluster.bench.codecs",
    "attention": "cluster.bench.attention",
    "quality": "cluster.bench.quality",
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return None  # a benchmark not built yet


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (codecs, ...)", description=__doc__.splitlines()[0])
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, module_name in BENCHES.items():
        module = _load(module_name)
        if module is None:
            continue
        doc = getattr(module, "HELP", None) or (module.__doc__ or name).strip().splitlines()[0]
        bp = benches.add_parser(name, help=doc, description=doc)
        module.add_arguments(bp)
        if "--json" not in bp._option_string_actions:
            bp.add_argument("--json", action="store_true", help="print one JSON object")
        bp.set_defaults(func=lambda args, m=module: _run(m, args))


def _run(module, args: argparse.Namespace) -> int:
    for flag in ("rows", "tokens", "heads", "repeat"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UsageError(f"--{flag} must be >= 1, got {value}")
    model = getattr(args, "model", None)
    if model is not None and not (model / "config.json").is_file():
        raise UsageError(f"--model {model}: no config.json in that directory")
    from workers.config import ConfigError
    from workers.safetensors_io import WeightsError
    from workers.tokenizer import TokenizerError
    try:
        result = module.run(args)
    except (ConfigError, WeightsError, TokenizerError) as e:  # a broken checkpoint, as score says
        raise UsageError(f"--model {model}: {e}" if model is not None else str(e)) from None
    if not isinstance(result, dict):
        return int(result or 0)  # the module printed its own report
    print(json.dumps(result, indent=2) if args.json else module.render(result))
    return 0
