"""Benchmarks behind `kvfleet bench <name>` (cluster/commands/bench.py lists them).

A sub-benchmark is a module here with HELP (one line), add_arguments(parser),
run(args) -> dict (JSON-ready; `--json` prints it) and render(result) -> str (the text
report). Shared timing helpers live in timing.py.
"""
