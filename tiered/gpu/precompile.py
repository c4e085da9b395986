"""The save's Triton kernels compiled in a child process, the first time a machine needs them.

Triton compiles a kernel the first time a process launches it and keeps the result in its cache
on disk (`TRITON_CACHE_DIR`, by default ~/.triton/cache); later processes load it in milliseconds.
Its compiler holds the GIL for long stretches, and an engine's warm-up thread compiled the save's
kernels from the moment the engine was made: beside `Engine.reserve`, whose walk of the state on
the training thread then waited for the GIL (docs/architecture.md, "Why `reserve()`, and why it
works on a thread of its own"). So, where this machine's cache may not hold them yet, the warm-up
thread first runs ``python -m tiered.gpu.precompile``: a child process that compiles them
(`tiered.gpu.pack.compile_ahead`: nothing launched, nothing allocated) into the same cache, while
the warm-up thread waits for it without the GIL. The warm-up then loads them from the cache as a
later process would. A marker beside the cache's entries (`marker`) says the child has compiled
this Triton's kernels for this GPU architecture from this source; where the child fails, the
kernels compile in this process, as they did before (logged).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger("tiered")

AHEAD = True
"""Compile in a child process where the marker is missing; False: always in this process."""
TIMEOUT_S = 300.0
"""The child's limit; past it the kernels compile in this process."""


@dataclass(frozen=True)
class Outcome:
    """What `run_once` did: `ran` (a child ran), `ok` (the kernels are in the cache: compiled
    now or before), `seconds` the child took, `why` (what failed, or why nothing ran)."""

    ran: bool
    ok: bool
    seconds: float = 0.0
    why: str = ""


def run_once(marker: Path, command: Sequence[str], timeout: float = TIMEOUT_S,
             env: dict[str, str] | None = None) -> Outcome:
    """Run `command` (the child) unless `marker` exists; write the marker once it exits 0."""
    if marker.exists():
        return Outcome(ran=False, ok=True, why="compiled before")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Outcome(ran=True, ok=False, seconds=time.perf_counter() - t0, why=f"no result within {timeout:.0f} s")
    except OSError as exc:
        return Outcome(ran=True, ok=False, seconds=time.perf_counter() - t0, why=str(exc))
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1]
        return Outcome(ran=True, ok=False, seconds=seconds, why=f"exit status {proc.returncode}: {last}")
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(proc.stdout)
    except OSError as exc:  # (a read-only cache: the next process runs a child again, and finds it all there)
        log.debug("tiered: could not write %s (%s)", marker, exc)
    return Outcome(ran=True, ok=True, seconds=seconds)


def cache_dir() -> Path:
    """Triton's cache directory, as Triton itself resolves it where it can say."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except Exception:  # noqa: BLE001 - a Triton before `knobs`: its documented default
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def marker(capability: tuple[int, int]) -> Path:
    """The marker for this Triton, this GPU architecture and the kernels' source
    (tiered/gpu/pack.py)."""
    import torch
    import triton

    from tiered.gpu import pack

    key = hashlib.sha256()
    for part in (triton.__version__, torch.__version__, f"sm{capability[0]}{capability[1]}"):
        key.update(part.encode() + b"\0")
    key.update(Path(pack.__file__).read_bytes())
    return cache_dir() / f"tiered-kernels-{key.hexdigest()[:24]}"


def ensure(index: int) -> Outcome:
    """Before the warm-up of device `index` compiles anything in this process: have a child compile
    the save's kernels into Triton's cache where the marker says it has not yet (module docstring).
    Never raises; the outcome is logged."""
    if not AHEAD:
        return Outcome(ran=False, ok=False, why="off")
    try:
        import torch

        from tiered.gpu import pack

        if not pack.available():
            return Outcome(ran=False, ok=False, why="the kernels do not compile here")
        capability = torch.cuda.get_device_capability(index)
        mark = marker(capability)
    except Exception as exc:  # noqa: BLE001 - the warm-up compiles in this process
        return Outcome(ran=False, ok=False, why=f"{type(exc).__name__}: {exc}")
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "tiered.gpu.precompile", "--capability", f"{capability[0]}.{capability[1]}"]
    outcome = run_once(mark, command, env=env)
    if outcome.ran and outcome.ok:
        log.info("tiered: cuda:%d: compiled the save's GPU kernels in a child process in %.1f s (Triton's cache "
                 "had not held them)", index, outcome.seconds)
    elif outcome.ran:
        log.info("tiered: cuda:%d: compiling the save's GPU kernels in a child process failed (%s); they compile "
                 "in this process", index, outcome.why)
    return outcome


def _context_active() -> bool | None:
    """Whether this process holds a CUDA context on device 0 (None: the driver cannot say)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        flags, active = ctypes.c_uint(), ctypes.c_int()
        if lib.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return None
        return bool(active.value)
    except (OSError, AttributeError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """The child: compile the save's kernels for device 0 of this process, which must be of the
    given architecture (`--capability 9.0`); print what it compiled."""
    parser = argparse.ArgumentParser(prog="python -m tiered.gpu.precompile", description=main.__doc__)
    parser.add_argument("--capability", required=True, help="the GPU architecture the kernels are for, as 9.0")
    args = parser.parse_args(argv)
    import torch

    from tiered.gpu import pack

    if not pack.available():
        print("Triton is not installed here", file=sys.stderr)
        return 2
    found = "{}.{}".format(*torch.cuda.get_device_capability(0))
    if found != args.capability:
        print(f"device 0 here is of architecture {found}, not {args.capability}", file=sys.stderr)
        return 3
    try:  # (Triton asks for the current stream even when it only compiles; no CUDA context is needed for that)
        from triton.runtime import driver

        driver.active.get_current_stream = lambda *_: 0
    except Exception:  # noqa: BLE001 - Triton's own call serves, at the cost of a context
        pass
    t0 = time.perf_counter()
    pack.compile_ahead()
    print(f"compiled for sm{args.capability} in {time.perf_counter() - t0:.2f} s; CUDA context in the compiling "
          f"process: {_context_active()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
