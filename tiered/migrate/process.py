"""`migration: process` (the default): the engine's migrator runs in a child process of its own.

Migration decodes, recompresses and writes whole checkpoints; on threads of the training process
it contends with training for the GIL (a step ran 30-125% slower while a step migrated:
docs/benchmarks.md). In a child process it cannot, and it runs at a lower CPU priority (nice +10,
every thread: `tiered.migrate.migrator.lower_process_priority`) on a quarter of the cores.

The child is `python -m tiered.migrate.process`. It runs a `tiered.migrate.migrator.BackgroundMigrator`
(the same code as `migration: in_process`: one migrator per fast tier by its lock file, steps an
earlier run left unmigrated resumed, failed steps retried with backoff) and talks to the engine
over pipes, one line each:

    engine -> child (stdin):    a committed step number; end of file: finish the queue and exit
    child -> engine (stdout):   {"ready": true} | {"inactive": holder} | {"resumed"|"done"|"failed": step, ...}

Supervision: if the child dies (killed, out of memory), the engine logs it, reports it through
`Engine.wait_migrated()`, and starts a new one after 1 s (doubling to 60 s), which resumes the
unfinished steps; a copy cut off leaves nothing partial (each step is committed on a tier last).
`close()` closes the child's stdin and waits for it to finish the queue. If the training process
is killed, the child (in a session of its own, so a Ctrl-C or SIGTERM to the job's process group
does not reach it) sees its stdin close and finishes the queue the same way; what it cannot
finish, the next engine or `tiered migrate` resumes.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from tiered import threads
from tiered.errors import TieredError
from tiered.migrate.migrator import MigrationLedger

log = logging.getLogger("tiered")

EXIT_INACTIVE = 3
"""The child's exit status when another migrator holds the fast tier's lock."""
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 60.0


def child_env(env: dict[str, str], gpu: int | None) -> dict[str, str]:
    """The migrator process's environment: it decodes on the engine's GPU `gpu` (an index among
    the devices this process sees), and sees that GPU alone (`CUDA_VISIBLE_DEVICES`): a library
    that opens a context on GPU 0 whatever GPU it works on (nvCOMP 6.0 does)
    would otherwise take that context's memory from another rank."""
    if gpu is None:
        return env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpu + 1)]
    if gpu < len(ids):
        return {**env, "CUDA_VISIBLE_DEVICES": ids[gpu], "TIERED_MIGRATOR_GPU": "0"}
    return {**env, "TIERED_MIGRATOR_GPU": str(gpu)}  # (a GPU the list does not name: left as the driver sees it)


class MigratorProcess(MigrationLedger):
    """The interface of `BackgroundMigrator` (`submit`, `wait`, `stop`, `active`), its work done by
    a supervised child process."""

    def __init__(self, config: Any):
        super().__init__()
        self._config_json = json.dumps(config.document, default=str)
        self._stopping = False
        self.pid: int | None = None
        """The child's process id (a new one after a restart)."""
        self._proc: subprocess.Popen | None = None
        self._gpu = threads.current_gpu()
        self._start()
        self._watch = threading.Thread(target=self._supervise, name="tiered-migrator-watch", daemon=True)
        self._watch.start()

    def _start(self) -> None:
        env = child_env(dict(os.environ, TIERED_MIGRATOR_CONFIG=self._config_json), self._gpu)
        self._proc = subprocess.Popen([sys.executable, "-m", "tiered.migrate.process"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1, env=env, start_new_session=True)
        self.pid = self._proc.pid
        with self._lock:
            pending = sorted(self._pending)
        for step in pending:
            self._send(step)

    def _send(self, step: int) -> None:
        proc = self._proc
        try:
            assert proc is not None and proc.stdin is not None
            proc.stdin.write(f"{step}\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the child is gone: the supervisor starts another and sends it the pending steps

    def submit(self, step: int) -> None:
        if self._track(step):
            self._send(step)

    def stop(self) -> None:
        """Let the child finish the queue (it retries failed steps only while they are due), then join."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        self._watch.join()

    def _on_message(self, msg: dict) -> None:
        if "ready" in msg:
            self._scanned.set()
        elif "inactive" in msg:
            log.warning("tiered: another migrator (pid %s) holds the fast tier's migration lock: this engine leaves "
                        "migration to it", msg["inactive"])
            self._deactivate()
            self._scanned.set()
        elif "resumed" in msg:
            self._track(int(msg["resumed"]))
        elif "done" in msg:
            self._settle(int(msg["done"]))
        elif "failed" in msg:
            self._fail(TieredError(f"step {msg['failed']}: {msg.get('error', '')}"))

    def _supervise(self) -> None:
        delay = RESTART_FIRST_S
        while True:
            proc = self._proc
            assert proc is not None and proc.stdout is not None
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict):
                    self._on_message(msg)
                    if "done" in msg:
                        delay = RESTART_FIRST_S
            code = proc.wait()
            if code == EXIT_INACTIVE or (self._stopping and code == 0) or not self.active:
                self._scanned.set()
                return
            if self._stopping:
                log.error("tiered: the migrator process exited with status %s while finishing its queue: the next "
                          "engine, or `tiered migrate`, resumes the unfinished steps", code)
                self._scanned.set()
                return
            err = TieredError(f"the migrator process (pid {proc.pid}) exited with status {code}; it is restarted "
                              f"in {delay:g} s and resumes the unfinished steps")
            log.error("tiered: %s", err)
            self._fail(err)
            time.sleep(delay)
            delay = min(RESTART_MAX_S, delay * 2)
            if self._stopping:
                self._scanned.set()
                return
            self._start()


def _child() -> int:
    """The child process: a BackgroundMigrator fed from stdin, reporting on stdout."""
    from tiered.config import load_config
    from tiered.gpu.runtime import gpu_stack_available
    from tiered.migrate.migrator import BackgroundMigrator, lower_process_priority, make_gpu_recoder
    from tiered.tiers.catalog import TierCatalog

    handler = logging.StreamHandler(sys.stderr)  # its own progress, in the engine's stderr; not other libraries'
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    lower_process_priority()  # training owns the machine
    config = load_config(json.loads(os.environ["TIERED_MIGRATOR_CONFIG"]))
    out_lock = threading.Lock()

    def say(msg: dict) -> None:
        with out_lock:
            try:
                sys.stdout.write(json.dumps(msg) + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass  # the engine is gone: the work goes on

    gpu = os.environ.get("TIERED_MIGRATOR_GPU")
    index = int(gpu) if gpu is not None and gpu_stack_available() else None  # (no GPU codecs: no GPU work)
    migrator = BackgroundMigrator(config, TierCatalog(config).get, lambda: make_gpu_recoder(config, index),
                                  on_event=lambda kind, step, detail: say({kind: step, "error": detail}), gpu=index)
    migrator.scanned()
    # This process's own start-up objects (torch's and botocore's modules, ~180,000) never become
    # garbage: kept out of Python's full collections, which otherwise took 100-230 ms each on the
    # 2-core machine in the middle of a step's copy (docs/benchmarks.md).
    gc.freeze()
    if not migrator.active:
        say({"inactive": migrator.holder()})
        migrator.stop()
        return EXIT_INACTIVE
    say({"ready": True})
    for line in sys.stdin:
        line = line.strip()
        if line.isdigit():
            migrator.submit(int(line))
    migrator.stop()  # stdin closed: the engine closed, or died; finish the queue
    return 0


if __name__ == "__main__":
    sys.exit(_child())
