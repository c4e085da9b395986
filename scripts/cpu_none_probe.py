"""CPU tensors saved with `codec: none`: how soon each save of a 1 GiB state (256 fp32 tensors of
4 MiB) is durable on a local tier, four saves (the first one cold), and the same disk's O_DIRECT
write ceiling right after (4 threads of 16 MiB requests).

    python scripts/cpu_none_probe.py [--dir ./.tiered/cpu-none-probe]
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiered  # noqa: E402
from baselines import disk_ceilings  # noqa: E402


def main() -> None:
    root = Path(sys.argv[sys.argv.index("--dir") + 1] if "--dir" in sys.argv else "./.tiered/cpu-none-probe")
    shutil.rmtree(root, ignore_errors=True)
    state = {f"t{i}": torch.randn(1 << 20) for i in range(256)}
    raw = sum(t.numel() * t.element_size() for t in state.values())
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(root / "local"), "codec": "none"}]}
    with tiered.Engine.from_config(cfg) as engine:
        for step in range(4):
            t0 = time.perf_counter()
            handle = engine.save(step, state)
            call = time.perf_counter() - t0
            handle.wait()
            durable = time.perf_counter() - t0
            print(f"step {step}: call {1e3 * call:.0f} ms, durable {durable:.2f} s ({raw / durable / 1e9:.2f} GB/s)",
                  flush=True)
            engine.catalog.fast.delete(step)
    disk = disk_ceilings(root / "ceiling", 1 << 30)
    shutil.rmtree(root, ignore_errors=True)
    print(f"same disk, right after: O_DIRECT write {disk['write_gbps']} GB/s, read {disk['read_gbps']} GB/s "
          f"({disk['threads']} threads, {disk['block_mib']} MiB)")


if __name__ == "__main__":
    main()
