"""cluster/atomic.py write_atomic: a whole file or the old one, never a part; the process's
own descriptors and devices are written in place."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.atomic import write_atomic

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"from cluster.atomic import write_atomic\n{code}"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)


def test_dev_stdout_into_a_pipe_and_into_a_file(tmp_path):
    """`generate --stats /dev/stdout | jq`: /dev/stdout is a link into /proc that realpath
    cannot resolve, and the temporary file beside it could not be made (exit 2). Into a
    file (`> f`) a rename would have replaced the file and dropped what was printed."""
    code = "print('before', flush=True)\nwrite_atomic('/dev/stdout', b'{\"ok\": 1}\\n')\nprint('after')"
    r = _child(code, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == 'before\n{"ok": 1}\nafter\n'
    out = tmp_path / "log.txt"
    with open(out, "w") as f:
        assert _child(code, stdout=f).returncode == 0
    assert out.read_text() == 'before\n{"ok": 1}\nafter\n'


def test_a_write_cut_short_leaves_the_old_file_and_no_part(tmp_path):
    target = tmp_path / "stats.json"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    code = (f"import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
            f"import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"write_atomic({str(target)!r}, b'x' * 5000)")
    r = _child(code, capture_output=True, text=True)
    assert r.returncode != 0 and "File too large" in r.stderr
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and (target.stat().st_mode & 0o777) == 0o640


def test_a_device_is_written_in_place():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(OSError, match="No space left"):
        write_atomic(Path("/dev/full"), b"x")
    assert os.path.exists("/dev/full") and not Path("/dev/full").is_file()
