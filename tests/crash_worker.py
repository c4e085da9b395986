"""A process for tests/test_crash.py to SIGKILL at random moments.

    python tests/crash_worker.py save CONFIG     # save steps 1, 2, ... (continuing after the newest
                                                 # committed step), migrating in process if configured
    python tests/crash_worker.py migrate CONFIG  # `tiered migrate` once: copy pending steps, apply retention

Every step's state is a function of its step number (`expected_state`), so whoever checks a
step after a crash knows what it must hold.
"""

from __future__ import annotations

import sys
import time

import torch


def expected_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(256, 1024, generator=g),                  # 1 MiB: 16 chunks of 64 KiB
                      "b": torch.randn(20000, generator=g).to(torch.bfloat16),
                      "ids": torch.randint(0, 1 << 40, (3000,), generator=g)},
            "step": step, "note": f"step {step}"}


def save_forever(config: str) -> None:
    from tiered import Engine

    with Engine.from_config(config) as engine:
        step = (engine.latest_step() or 0) + 1
        while True:
            engine.save(step, expected_state(step))
            if step % 3 == 0:
                engine.wait()  # some steps wait for durability, others overlap the next save
            print(step, flush=True)
            step += 1
            time.sleep(0.05)  # a training step


def main() -> None:
    mode, config = sys.argv[1], sys.argv[2]
    if mode == "save":
        save_forever(config)
    else:
        from tiered.cli import main as cli

        sys.exit(cli(["migrate", "--config", config, "--full-speed"]))


if __name__ == "__main__":
    main()
