"""Which build a soak arm ran: its checkout, git commit and tree state, and kvfleet version,
read once before the first round (summary.json `build`, the report's arms table).

    {"checkout": "/src/kvfleet-new", "commit": "<40 hex digits>" | null,
     "dirty": true | false | null, "changed_files": 3 | null, "version": "0.1.0" | null,
     "git_error": null | "why commit/dirty are null", "version_error": null | "why"}

A checkout that is not a git repository, or a machine without git, records nulls with the
reason; nothing here raises. `changed_files` counts `git status --porcelain` entries
(modified, staged, untracked) of the repository that holds the checkout.
"""
from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

GIT_TIMEOUT_S = 30.0


def _git(wd: Path, *args: str) -> tuple[str | None, str]:
    """(stdout, "") of `git -C wd ARGS`, or (None, why it said nothing)."""
    try:
        p = subprocess.run(["git", "-C", str(wd), *args], capture_output=True, text=True,
                           timeout=GIT_TIMEOUT_S)
    except FileNotFoundError:
        return None, "no git binary on PATH"
    except subprocess.TimeoutExpired:
        return None, f"git {args[0]} ran past {GIT_TIMEOUT_S:.0f}s"
    except OSError as e:
        return None, f"cannot run git ({e.strerror})"
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or [f"git exit status {p.returncode}"])[-1]
    return p.stdout, ""


def _version(wd: Path) -> tuple[str | None, str | None]:
    """(the checkout's pyproject.toml [project] version, None) or (None, why)."""
    try:
        project = tomllib.loads((wd / "pyproject.toml").read_text()).get("project")
    except FileNotFoundError:
        return None, "no pyproject.toml"
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return None, f"pyproject.toml: {getattr(e, 'strerror', None) or e}"
    version = project.get("version") if isinstance(project, dict) else None
    if not isinstance(version, str):
        return None, "pyproject.toml has no [project] version"
    return version, None


def build_info(checkout: Path) -> dict:
    """The build record of one arm's checkout (the module docstring's fields)."""
    info: dict = {"checkout": str(checkout), "commit": None, "dirty": None,
                  "changed_files": None, "git_error": None}
    head, why = _git(checkout, "rev-parse", "--verify", "HEAD")
    status, why2 = _git(checkout, "status", "--porcelain") if head is not None else (None, why)
    if head is None or status is None:
        info["git_error"] = why or why2
    else:
        changed = [line for line in status.splitlines() if line.strip()]
        info.update(commit=head.strip(), dirty=bool(changed), changed_files=len(changed))
    info["version"], info["version_error"] = _version(checkout)
    return info

