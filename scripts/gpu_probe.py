"""Probe the exact nvCOMP / KvikIO behaviours the engine relies on (run on a GPU machine)."""
import os, time, tempfile
import torch
from nvidia import nvcomp
import kvikio, kvikio.defaults
import zstandard

print("nvcomp", nvcomp.__version__, "cuda", nvcomp.__cuda_version__, "kvikio", kvikio.__version__)
print("kvikio compat preferred:", kvikio.defaults.is_compat_mode_preferred(), "compat_mode:", kvikio.defaults.get("compat_mode"))
dev = torch.device("cuda")
s = torch.cuda.Stream()
CH = 1 << 20

def carve(buf, offsets, sizes):
    return nvcomp.as_arrays(buf, offsets, sizes, cuda_stream=s.cuda_stream)

# 1. ANS typed over a carved batch, out= carved slab
x = torch.randn(3 * CH // 4 + 1000, device=dev)  # 3 full chunks + tail
raw = x.view(torch.uint8)
n = raw.numel()
offs = list(range(0, n, CH)); sizes = [min(CH, n - o) for o in offs]
codec = nvcomp.Codec(algorithm="ANS", data_type="<f4", uncomp_chunk_size=CH,
                     bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=s.cuda_stream)
print("ans align comp/decomp", codec.get_required_compression_alignment(), codec.get_required_decompression_alignment())
src = carve(raw, offs, sizes)
try:
    mx = codec.max_compressed_buffer_size(CH) if hasattr(codec, "max_compressed_buffer_size") else None
except Exception as e:
    mx = f"err {e}"
print("max_compressed_buffer_size attr:", [a for a in dir(codec) if not a.startswith("_")], mx)
stride = 2 * CH
slab = torch.zeros(len(offs) * stride, dtype=torch.uint8, device=dev)
out = carve(slab, [i * stride for i in range(len(offs))], [stride] * len(offs))
with torch.cuda.stream(s):
    res = codec.encode(src, out=out)
print("res type", type(res), "res sizes", res.buffer_sizes, "out sizes", out.buffer_sizes, "same obj", res is out)
csz = res.buffer_sizes
print("ratio", sum(csz) / n)
# decode back into a carved buffer
dst = torch.empty_like(raw)
comp = carve(slab, [i * stride for i in range(len(offs))], csz)
dout = carve(dst, offs, sizes)
t = codec.decode(comp, out=dout)
s.synchronize()
print("decode sizes", t.buffer_sizes, "ANS roundtrip ok", torch.equal(dst, raw))
# does decode fail cleanly on corruption?
slab[5] ^= 0xFF
try:
    t = codec.decode(carve(slab, [i * stride for i in range(len(offs))], csz), out=carve(dst, offs, sizes)); s.synchronize()
    print("corrupt decode no exception; equal:", torch.equal(dst, raw))
except Exception as e:
    print("corrupt decode raised", type(e).__name__, e)

# bf16 typed with <f2
xb = torch.randn(CH, device=dev).to(torch.bfloat16).view(torch.uint8)
c2 = nvcomp.Codec(algorithm="ANS", data_type="<f2", uncomp_chunk_size=CH, bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=s.cuda_stream)
r2 = c2.encode(carve(xb, [0, CH], [CH, CH]))
print("bf16 ratio random", sum(r2.buffer_sizes) / (2 * CH))

# 2. zstd RAW GPU -> CPU and CPU -> GPU
z = nvcomp.Codec(algorithm="Zstd", uncomp_chunk_size=CH, bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=s.cuda_stream)
data = (torch.arange(CH, device=dev) % 251).to(torch.uint8)
zr = z.encode(carve(data, [0], [CH]))
zs = zr.buffer_sizes
arr = zr[0]
host = bytes(memoryview(arr.cpu()))[: zs[0]] if hasattr(arr, "cpu") else None
print("zstd gpu sizes", zs, "host len", len(host))
d = zstandard.ZstdDecompressor().decompress(host, max_output_size=CH)
print("GPU zstd -> CPU ok", d == data.cpu().numpy().tobytes())
cpu_frame = zstandard.ZstdCompressor(level=3).compress(data.cpu().numpy().tobytes())
g = torch.frombuffer(bytearray(cpu_frame), dtype=torch.uint8).to(dev)
o = torch.empty(CH, dtype=torch.uint8, device=dev)
z.decode(carve(g, [0], [len(cpu_frame)]), out=carve(o, [0], [CH])); s.synchronize()
print("CPU zstd -> GPU ok", torch.equal(o, data))

# 3. kvikio from torch tensors
d = tempfile.mkdtemp(dir=os.environ.get("PROBE_DIR", "/tmp"))
p = os.path.join(d, "f.bin")
big = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device=dev)
with kvikio.CuFile(p, "w") as f:
    futs = [f.pwrite(big[i:i + (4 << 20)], file_offset=i) for i in range(0, big.numel(), 4 << 20)]
    print("written", sum(fu.get() for fu in futs))
    print("direct io supported", f.is_direct_io_supported() if hasattr(f, "is_direct_io_supported") else "?")
back = torch.zeros_like(big)
with kvikio.CuFile(p, "r") as f:
    print("read", f.pread(back).get())
print("kvikio roundtrip", torch.equal(back, big))

# 4. timing: ANS over 2.4 GB packed fp32
N = 600 << 20  # floats -> 2.4 GB
w = (torch.randn(N, device=dev) * 0.02)
rawb = w.view(torch.uint8); nb = rawb.numel()
offs = list(range(0, nb, CH)); sizes = [min(CH, nb - o) for o in offs]
t0 = time.perf_counter(); src = carve(rawb, offs, sizes); t1 = time.perf_counter()
print(f"as_arrays of {len(offs)} chunks: {1e3*(t1-t0):.2f} ms")
stride = CH + 64 * 1024
slab = torch.empty(len(offs) * stride, dtype=torch.uint8, device=dev)
outb = carve(slab, [i * stride for i in range(len(offs))], [stride] * len(offs))
for rep in range(3):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = codec.encode(src, out=outb)
    t1 = time.perf_counter()
    s.synchronize()
    t2 = time.perf_counter()
    sz = r.buffer_sizes
    t3 = time.perf_counter()
    print(f"encode call {1e3*(t1-t0):.2f} ms, gpu done {1e3*(t2-t0):.2f} ms, sizes read {1e3*(t3-t2):.2f} ms, saved {100*(1-sum(sz)/nb):.1f}%  {nb/(t2-t0)/1e9:.0f} GB/s")
print("max compressed chunk", max(sz))
