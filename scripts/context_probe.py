"""Which GPU library call opens a CUDA context on GPU 0 in a process that works on GPU 1.

A process that chose GPU 1 (`torch.cuda.set_device(1)`) and then finds GPU 0's primary context
active has taken some 0.5 GB of another rank's GPU. Each case runs in a fresh process, on a
thread made as the engine makes its threads (GPU 1 current), and reports after each of its steps
whether GPU 0's primary context is active, and at the end how much memory the process holds on
each GPU (nvidia-smi: what such a context costs GPU 0). Needs 2 GPUs, nvCOMP and KvikIO.

    python3 scripts/context_probe.py            # every case
    python3 scripts/context_probe.py CASE ...   # some
"""

from __future__ import annotations

import json
import subprocess
import sys

CASES = {
    "nvcomp bound, default stream": "bound(torch.cuda.current_stream())",
    "nvcomp bound, side stream": "bound(torch.cuda.Stream(1))",
    "nvcomp encode+decode, default stream": "roundtrip(torch.cuda.current_stream())",
    "nvcomp encode+decode, side stream": "roundtrip(torch.cuda.Stream(1))",
    "nvcomp bound, on the main thread": "MAIN",
    "nvcomp bound, codec without device_id": "bound(torch.cuda.Stream(1), device_id=None)",
    "nvcomp bound, torch's allocators": "allocators(); bound(torch.cuda.Stream(1))",
    "nvcomp encode, torch's allocators": "allocators(); roundtrip(torch.cuda.Stream(1))",
    "nvcomp stream borrowed on GPU 1": "bound(torch.cuda.Stream(1), borrow=True)",
    "kvikio compat check": "import kvikio.defaults; step('kvikio imported'); kvikio.defaults.is_compat_mode_preferred()",
    "tiered max_compressed (the stager's call)": "from tiered.codecs import _nvcomp; _nvcomp.max_compressed('ANS', 1 << 20, '<f2')",
}

_CHILD = r"""
import ctypes, json, sys, threading, torch
torch.cuda.set_device(1)
libcuda = ctypes.CDLL("libcuda.so.1")
steps = []

def step(name):
    flags, active = ctypes.c_uint(), ctypes.c_int()
    libcuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active))
    steps.append([name, bool(active.value)])

class Buf:
    def __init__(self, nbytes, stream, **where):
        self.t = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, **where)
        self.ptr = self.t.data_ptr()

def allocators():
    from nvidia import nvcomp
    nvcomp.set_device_allocator(lambda n, s: Buf(n, s, device="cuda:1"))
    nvcomp.set_pinned_allocator(lambda n, s: Buf(n, s, pin_memory=True))
    step("torch's allocators set")

def bound(stream, device_id=1, borrow=False):
    from nvidia import nvcomp
    step("nvcomp imported")
    probe = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:1")
    kw = {} if device_id is None else {"device_id": device_id}
    cs = nvcomp.CudaStream.borrow(stream.cuda_stream, 1) if borrow else stream.cuda_stream
    c = nvcomp.Codec(algorithm="ANS", cuda_stream=cs, uncomp_chunk_size=1 << 20,
                     bitstream_kind=nvcomp.BitstreamKind.RAW, **kw)
    step("codec made")
    a = nvcomp.as_array(probe, cuda_stream=stream.cuda_stream)
    step("array made")
    c.get_max_comp_buffer_size(a)
    step("bound asked")

def roundtrip(stream):
    from nvidia import nvcomp
    x = torch.randn(1 << 20, device="cuda:1").half()
    c = nvcomp.Codec(algorithm="ANS", device_id=1, cuda_stream=stream.cuda_stream, uncomp_chunk_size=1 << 16,
                     bitstream_kind=nvcomp.BitstreamKind.RAW, data_type="<f2")
    step("codec made")
    with torch.cuda.stream(stream):
        enc = c.encode(nvcomp.as_array(x.view(torch.uint8), cuda_stream=stream.cuda_stream))
        step("encoded")
        dec = c.decode(enc)
        stream.synchronize()
    step("decoded")

def run():
    torch.cuda.set_device(1)  # as tiered.threads starts the engine's threads
    step("thread on GPU 1")
    try:
        exec(sys.argv[1])
    except Exception as exc:
        steps.append(["error", repr(exc)[:300]])
    step("done")

if sys.argv[1] == "MAIN":
    sys.argv[1] = "bound(torch.cuda.Stream(1))"
    run()
else:
    t = threading.Thread(target=run)
    t.start()
    t.join()
try:  # what this process holds on each GPU now, as nvidia-smi sees it (MiB)
    import os, subprocess
    uuids = {"GPU-" + str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    rows = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30).stdout.splitlines()
    held = {f"cuda:{uuids.get(u.strip(), u.strip())}": int(m) for p, u, m in (r.split(",") for r in rows if r.strip())
            if p.strip() == str(os.getpid())}
    steps.append(["MiB held", held])
except Exception as exc:
    steps.append(["MiB held", repr(exc)[:200]])
print(json.dumps(steps))
"""


def main() -> int:
    names = sys.argv[1:] or list(CASES)
    for name in names:
        done = subprocess.run([sys.executable, "-c", _CHILD, CASES[name]], capture_output=True, text=True, timeout=120)
        try:
            steps = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            print(f"{name}: FAILED: {done.stderr[-1500:]}")
            continue
        held = next((v for s, v in steps if s == "MiB held"), None)
        steps = [x for x in steps if x[0] != "MiB held"]
        opened = next((s for s, on in steps if on is True), None)
        print(f"{name}: GPU 0's context {'opened at: ' + opened if opened else 'never opened'}  {steps}; "
              f"held at the end (nvidia-smi, MiB): {held}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
