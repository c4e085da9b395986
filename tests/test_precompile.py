"""The save's kernels compiled in a child process where Triton's cache may lack them
(tiered.gpu.precompile): the child runs once per marker, a failing child leaves the compile to
the process, and on a GPU the child's kernels are the ones the process then launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiered.gpu import precompile

ROOT = Path(__file__).resolve().parents[1]


def test_a_child_runs_once_and_leaves_a_marker(tmp_path):
    marker, ran = tmp_path / "cache" / "tiered-kernels-x", tmp_path / "ran"
    child = [sys.executable, "-c", f"open({str(ran)!r}, 'a').write('.'); print('compiled')"]
    first = precompile.run_once(marker, child)
    assert (first.ran, first.ok, first.why) == (True, True, "")
    assert marker.read_text().strip() == "compiled"
    again = precompile.run_once(marker, child)
    assert (again.ran, again.ok) == (False, True)
    assert ran.read_text() == "."  # (the second call ran nothing)


def test_a_failing_child_leaves_no_marker_and_says_why(tmp_path):
    marker = tmp_path / "tiered-kernels-x"
    out = precompile.run_once(marker, [sys.executable, "-c", "import sys; sys.exit('no compiler here')"])
    assert (out.ran, out.ok) == (True, False)
    assert "exit status 1" in out.why and "no compiler here" in out.why
    assert not marker.exists()
    slow = precompile.run_once(marker, [sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert (slow.ran, slow.ok) == (True, False) and "no result within" in slow.why
    assert not marker.exists()
    missing = precompile.run_once(marker, [str(tmp_path / "no-such-program")])
    assert (missing.ran, missing.ok) == (True, False) and missing.why


@pytest.mark.gpu
def test_the_child_refuses_another_architecture():
    out = subprocess.run([sys.executable, "-m", "tiered.gpu.precompile", "--capability", "1.0"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 3 and "not 1.0" in out.stderr


_LAUNCH = """
import json, sys
import torch
from tiered.gpu import pack, precompile
outcome = precompile.ensure(0) if sys.argv[1] == "child" else None
cache = precompile.cache_dir()
before = sorted(str(p.relative_to(cache)) for p in cache.rglob("*.cubin"))
pack.warm_up(0)  # (compiles here whatever the cache lacks, and launches every kernel)
after = sorted(str(p.relative_to(cache)) for p in cache.rglob("*.cubin"))
print(json.dumps({"outcome": outcome and outcome.__dict__, "before": before, "after": after,
                  "ok": pack.available(), "deliver": pack.can_deliver()}))
"""


@pytest.mark.gpu
def test_the_child_compiles_what_the_process_launches(tmp_path):
    """In a cold cache, a child compiles the kernels; the process's warm-up then compiles no
    more of them (their cache keys match) and every kernel runs."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def run(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _LAUNCH, mode], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run("child")
    assert first["outcome"]["ran"] and first["outcome"]["ok"], first["outcome"]
    assert len(first["before"]) >= 5  # three variants of the rows kernel, the sums, the delivery
    assert first["after"] == first["before"]
    assert first["ok"] and first["deliver"]
    second = run("child")  # (the marker is there: no child, nothing compiled)
    assert not second["outcome"]["ran"] and second["outcome"]["ok"]
    assert second["after"] == first["before"]
