"""Headless Chromium for report checks: load a page, return its DOM after load, the console
errors it logged and a screenshot. Skips the calling test when no Chromium is installed."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0"]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.skip("no Chromium installed (Debian package `chromium`; .ci/run installs it)")
    return exe


def load_page(path: Path, screenshot: Path) -> tuple[str, list[str]]:
    """(DOM after load, console/page error lines) of a local HTML file; writes a PNG screenshot."""
    exe = chromium()
    with tempfile.TemporaryDirectory() as profile:
        common = [exe, *FLAGS, f"--user-data-dir={profile}"]
        dom = subprocess.run([*common, "--dump-dom", path.resolve().as_uri()], capture_output=True,
                             text=True, timeout=120)
        shot = subprocess.run([*common, f"--screenshot={screenshot}", "--window-size=1300,3000",
                               path.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    errors = [ln for ln in (dom.stderr + shot.stderr).splitlines()
              if "CONSOLE" in ln and ("Uncaught" in ln or ":ERROR:" in ln or "error" in ln.lower())]
    return dom.stdout, errors
