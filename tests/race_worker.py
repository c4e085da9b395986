"""Processes that race each other over one tier, for tests/test_step_life.py.

    python tests/race_worker.py save CONFIG WRITER STEPS GO      # Engine.save of each step (comma list)
    python tests/race_worker.py tier SPEC WRITER STEPS GO        # a tier's begin/write/commit of each step
    python tests/race_worker.py stress CONFIG WRITER N GO SEED   # N saves of random steps (see stress_saves)
    python tests/race_worker.py read CONFIG GO STOP              # load the newest steps until STOP exists
    python tests/race_worker.py gc CONFIG GO STOP                # `tiered gc` until STOP exists

Each waits until the file GO exists (after creating GO.<WRITER>.ready), so that the racers start
together, and prints one JSON line of what happened. A step's state names its writer and is a
function of (writer, step), so a reader can tell whether a step holds one writer's state whole.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import zlib
from pathlib import Path

import torch


def state_of(writer: str, step: int) -> dict:
    g = torch.Generator().manual_seed(zlib.crc32(f"{writer}/{step}".encode()))
    return {"writer": writer, "step": step, "w": torch.randn(64, 1024, generator=g),
            "b": torch.randn(5000, generator=g).to(torch.bfloat16)}


def holds_its_writers_state(got: dict, step: int) -> bool:
    """`got` (a loaded step) is exactly the state its recorded writer saved for `step`."""
    want = state_of(got["writer"], step)
    return got["step"] == step and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                       for k in ("w", "b"))


def start(go: Path, writer: str) -> None:
    Path(f"{go}.{writer}.ready").touch()
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no start signal within 120 s")
        time.sleep(0.005)


def save(config: str, writer: str, steps: list[int], go: Path) -> dict:
    from tiered import Engine

    out = {}
    with Engine.from_config(config) as engine:
        start(go, writer)
        for step in steps:
            try:
                engine.save(step, state_of(writer, step)).wait()
                out[step] = "ok"
            except Exception as exc:  # noqa: BLE001 - the racer reports it; the test judges it
                out[step] = f"{type(exc).__name__}: {exc}"
    return out


def tier_of(spec: str):
    """A tier from a JSON spec: {"kind": "posix", "path": ...} or {"kind": "s3", "bucket": ...}."""
    from tiered.tiers import PosixTier

    args = json.loads(spec)
    if args["kind"] == "posix":
        return PosixTier("shared", Path(args["path"]))
    from tiered.tiers.s3 import S3Tier

    return S3Tier("s3", args["bucket"], args["prefix"], endpoint_url=args["endpoint_url"], region="us-east-1")


def tier_writes(spec: str, writer: str, steps: list[int], go: Path) -> dict:
    """Each step written as a migration writes it (begin_step, the data file, the index, the
    commit), with this writer's bytes."""
    tier = tier_of(spec)
    start(go, writer)
    out = {}
    for step in steps:
        data = (writer.encode() * 40000)[:4096 * 8]
        try:
            tier.begin_step(step)
            w = tier.open_data_writer(step, "rank_00000.data", device=False)
            w.write_host(0, memoryview(data))
            w.close()
            tier.write_file(step, "rank_00000.index.json", writer.encode())
            tier.commit(step, json.dumps({"writer": writer, "step": step}).encode())
            out[step] = "ok"
        except Exception as exc:  # noqa: BLE001
            tier.discard(step)
            out[step] = f"{type(exc).__name__}: {exc}"
    return out


def stress_saves(config: str, writer: str, n: int, go: Path, seed: int) -> dict:
    """`n` saves of steps drawn at random from a small, growing range that the other savers draw
    from too: many steps are raced for, some are already committed when asked for."""
    from tiered import Engine

    rng = random.Random(seed)
    ok, failed = [], 0
    with Engine.from_config(config) as engine:
        start(go, writer)
        for i in range(n):
            step = i + rng.randrange(0, 6)
            try:
                engine.save(step, state_of(writer, step)).wait()
                ok.append(step)
            except Exception as exc:  # noqa: BLE001
                if "committed" not in str(exc):
                    raise  # only the other writer's commit may refuse a save here
                failed += 1
    return {"ok": ok, "refused": failed}


def read(config: str, go: Path, stop: Path) -> dict:
    """Load the newest steps while the others write and collect; count every load, and every
    load that found a step gone (collected between the listing and the read: allowed)."""
    from tiered import Engine
    from tiered.errors import CheckpointNotFoundError

    loads = gone = 0
    with Engine.from_config(config) as engine:
        start(go, "reader")
        while not stop.exists():
            for step in engine.steps()[-2:]:
                try:
                    got = engine.load(step)
                except CheckpointNotFoundError:
                    gone += 1
                    continue
                if not holds_its_writers_state(got, step):
                    raise AssertionError(f"step {step} loaded, but is not one writer's whole state")
                loads += 1
    return {"loads": loads, "gone": gone}


def gc(config: str, go: Path, stop: Path) -> dict:
    from tiered.cli import main

    start(go, "gc")
    runs = 0
    while not stop.exists():
        if main(["gc", "--config", config, "-q"]) != 0:
            raise AssertionError("tiered gc failed")
        runs += 1
    return {"runs": runs}


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "save":
        result = save(args[0], args[1], [int(s) for s in args[2].split(",")], Path(args[3]))
    elif mode == "tier":
        result = tier_writes(args[0], args[1], [int(s) for s in args[2].split(",")], Path(args[3]))
    elif mode == "stress":
        result = stress_saves(args[0], args[1], int(args[2]), Path(args[3]), int(args[4]))
    elif mode == "read":
        result = read(args[0], Path(args[1]), Path(args[2]))
    elif mode == "gc":
        result = gc(args[0], Path(args[1]), Path(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    os._exit(0)  # (the result is out; no slow interpreter teardown)
