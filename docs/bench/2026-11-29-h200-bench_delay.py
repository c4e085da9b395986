"""Trial (not committed): the scale bench with the stager thread of a deferred save (the default
guard, once the walk is deferred) waiting DELAY_MS before it walks, plans and stages, on every
other deferred save (odd-numbered saves of the row: 3, 5, 7; even ones start at once)."""
import os
import runpy
import sys
import time

sys.path.insert(0, ".")
from tiered import save as save_mod  # noqa: E402

DELAY = float(os.environ.get("DELAY_MS", "250")) / 1e3
orig = save_mod.SavePipeline._plan_deferred
count = {"n": 1}  # (save 1 walks in its call)


def delayed(self, job):
    count["n"] += 1
    wait = DELAY if count["n"] % 2 == 1 else 0.0
    print(f"# delay trial: save {count['n']} (step {job.step}) stager waits {1e3 * wait:.0f} ms", flush=True)
    if wait:
        time.sleep(wait)
    return orig(self, job)


save_mod.SavePipeline._plan_deferred = delayed
sys.argv = ["scripts/bench.py"] + sys.argv[1:]
runpy.run_path("scripts/bench.py", run_name="__main__")
