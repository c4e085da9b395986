"""Every script in examples/ runs as a user would run it (tiny sizes, on the CPU), and does what its
docstring says: a resumed run ends where an uninterrupted one does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*argv: str, timeout: float = 240) -> str:
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=EXAMPLES.parent)
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def last(pattern: str, text: str) -> str:
    found = re.findall(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return found[-1]


def test_every_example_is_run_here():
    tested = {"plain_loop.py", "scale_loop.py", "lightning_resume.py", "hf_trainer.py", "fsdp_dcp.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_every_example_says_what_it_shows_and_how_to_run_it():
    for path in EXAMPLES.glob("*.py"):
        doc = path.read_text().split('"""')[1]
        assert f"examples/{path.name}" in doc, f"{path.name}: its docstring does not say how to run it"


def test_plain_loop_resumes_where_it_stopped(tmp_path):
    first = run("examples/plain_loop.py", "--dir", str(tmp_path), "--steps", "40", "--every", "20")
    assert "committed steps: [20, 40]" in first
    again = run("examples/plain_loop.py", "--dir", str(tmp_path), "--steps", "60", "--every", "20")
    assert "resumed from step 40" in again and "committed steps: [20, 40, 60]" in again
    straight = run("examples/plain_loop.py", "--dir", str(tmp_path / "straight"), "--steps", "60", "--every", "20")
    assert last(r"step 60: loss (\S+)", again) == last(r"step 60: loss (\S+)", straight)


def test_scale_loop_guards_and_reserves(tmp_path):
    out = run("examples/scale_loop.py", "--dir", str(tmp_path), "--width", "64", "--layers", "2", "--steps", "8",
              "--every", "4")
    assert "step 4 durable on tier 'local'" in out and "step 8 durable on tier 'local'" in out


def test_lightning_example_resumes_from_last(tmp_path):
    pytest.importorskip("lightning")
    run("examples/lightning_resume.py", "--dir", str(tmp_path / "a"), "--max-steps", "40")
    resumed = run("examples/lightning_resume.py", "--dir", str(tmp_path / "a"), "--max-steps", "80", "--resume")
    straight = run("examples/lightning_resume.py", "--dir", str(tmp_path / "b"), "--max-steps", "80")
    pattern = r"global step 80, weights checksum (\S+)"
    assert last(pattern, resumed) == last(pattern, straight)


def test_hf_example_resumes_after_a_stop(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    stopped = run("examples/hf_trainer.py", "--dir", str(tmp_path / "a"), "--stop-at", "8")
    assert "global step 8" in stopped and "a first run" in stopped
    resumed = run("examples/hf_trainer.py", "--dir", str(tmp_path / "a"))
    assert "checkpoint-8" in resumed
    straight = run("examples/hf_trainer.py", "--dir", str(tmp_path / "b"))
    pattern = r"global step 16, last loss (\S+)"
    assert last(pattern, resumed) == last(pattern, straight)


def test_fsdp_example_saves_at_two_ranks_and_restores_at_one_and_two(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    saved = run(*torchrun[1:], "--nproc-per-node", "2", "examples/fsdp_dcp.py", "--dir", str(tmp_path), "--steps", "20")
    assert "2 ranks saved steps [10, 20]" in saved
    want = last(r"weights checksum (\S+)", saved)
    for n in ("1", "2"):
        out = run(*torchrun[1:], "--nproc-per-node", n, "examples/fsdp_dcp.py", "--dir", str(tmp_path), "--check")
        assert f"restored Engine step 20 (weights checksum {want})" in out
        assert f"dcp.save step 20 (weights checksum {want})" in out
