"""The codec contract: every codec passes the same tests, on the CPU and on the GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiered.codecs import codec_names, get_codec, get_codec_class
from tiered.config import ZstdSettings
from tiered.format.manifest import CodecSpec

CHUNK = 1 << 20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


def sample(dtype: torch.dtype, nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = nbytes // itemsize
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 0.02).to(dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_registry_names():
    assert codec_names() == ["ans", "none", "zstd"]


class CodecContract:
    """Subclassed once per codec; `name` selects it."""

    name: str

    @pytest.fixture(params=DTYPES, ids=str)
    def spec(self, request):
        return get_codec_class(self.name).spec_for(request.param), request.param

    def test_spec_is_self_describing(self, spec):
        spec, _ = spec
        doc = json.loads(json.dumps(spec.to_json()))
        assert CodecSpec.of(doc["name"], **doc["configuration"]) == spec

    def test_cpu_round_trip(self, spec):
        spec, dtype = spec
        cls = get_codec_class(self.name)
        if not cls.cpu_capable:
            pytest.skip(f"{self.name} has no CPU implementation")
        codec = get_codec(spec, ZstdSettings(level=3))
        for nbytes in (CHUNK, 8192, 16):
            raw = as_bytes(sample(dtype, nbytes)).numpy()
            stored = codec.encode_chunk(memoryview(raw))
            out = np.zeros(len(raw), dtype=np.uint8)
            codec.decode_chunk(memoryview(stored), len(raw), memoryview(out))
            assert out.tobytes() == raw.tobytes()

    @pytest.mark.gpu
    def test_gpu_batch_round_trip(self, spec):
        spec, dtype = spec
        codec = get_codec(spec, ZstdSettings())
        stream = torch.cuda.Stream()
        t = sample(dtype, 3 * CHUNK + 4096 + 32).cuda()
        raw = as_bytes(t)
        n = raw.numel()
        offsets = list(range(0, n, CHUNK))
        sizes = [min(CHUNK, n - o) for o in offsets]
        pack = torch.empty(n, dtype=torch.uint8, device="cuda")
        stride = -(-codec.max_stored_size(CHUNK) // 4096) * 4096
        slab = torch.empty(len(offsets) * stride, dtype=torch.uint8, device="cuda")
        rows = [i * stride for i in range(len(offsets))]
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
            codec.pack(pack, raw, CHUNK)
            stored = codec.encode_batch(stream, CHUNK, pack, offsets, sizes, slab, rows, stride).sizes()
            assert all(0 < s <= stride for s in stored)
            back = torch.zeros_like(pack)
            codec.decode_batch(stream, CHUNK, slab, rows, stored, back, offsets, sizes)
            out = torch.zeros_like(raw)
            codec.unpack(out, back, CHUNK)
        stream.synchronize()
        assert torch.equal(out, raw)


class TestNone(CodecContract):
    name = "none"


class TestZstd(CodecContract):
    name = "zstd"


class TestAns(CodecContract):
    name = "ans"

    def test_cpu_decode_says_gpu_needed(self):
        from tiered.errors import CodecUnavailableError

        codec = get_codec(CodecSpec.of("ans", data_type="<f4"))
        with pytest.raises(CodecUnavailableError, match="needs an NVIDIA GPU"):
            codec.decode_chunk(memoryview(b"x"), 1, memoryview(bytearray(1)))

    def test_data_type_follows_dtype(self):
        assert [get_codec_class("ans").spec_for(d).params["data_type"] for d in
                (torch.float32, torch.float16, torch.bfloat16, torch.int64)] == ["<f4", "<f2", "<f2", "|u1"]


def test_zstd_shuffle_layout_on_cpu():
    from tiered.codecs.zstd import shuffle_np, unshuffle_np

    raw = np.arange(16, dtype=np.uint8)
    assert shuffle_np(memoryview(raw), 4).tolist() == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
    out = np.zeros(16, dtype=np.uint8)
    unshuffle_np(memoryview(shuffle_np(memoryview(raw), 4)), 4, out)
    assert out.tolist() == raw.tolist()


def test_zstd_frames_are_standard():
    import zstandard

    codec = get_codec(CodecSpec.of("zstd", shuffle=1))
    raw = b"tiered" * 1000
    frame = codec.encode_chunk(memoryview(raw))
    assert zstandard.ZstdDecompressor().decompress(frame) == raw


def test_zstd_shuffles_by_the_element_size_of_every_stored_dtype():
    """The zstd description's byte shuffle is the dtype's element size (as the format has always
    written it), for every dtype the format stores; asked per tensor, it makes no tensor."""
    from tiered.format.manifest import DTYPES

    for name, dtype in DTYPES.items():
        assert get_codec_class("zstd").spec_for(dtype).params["shuffle"] == \
            torch.empty((), dtype=dtype).element_size(), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_zstd_cpu_and_gpu_read_each_others_frames(dtype):
    """The portable format: CPU-written frames decode on the GPU and GPU-written ones on the CPU."""
    spec = get_codec_class("zstd").spec_for(dtype)
    codec = get_codec(spec)
    raw = as_bytes(sample(dtype, CHUNK + 8192, seed=5))
    n = raw.numel()
    offsets, sizes = [0, CHUNK], [CHUNK, n - CHUNK]
    stream = torch.cuda.Stream()
    stride = -(-codec.max_stored_size(CHUNK) // 4096) * 4096
    # GPU -> CPU
    graw = raw.cuda()
    pack = torch.empty_like(graw)
    slab = torch.zeros(2 * stride, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        codec.pack(pack, graw, CHUNK)
        stored = codec.encode_batch(stream, CHUNK, pack, offsets, sizes, slab, [0, stride], stride).sizes()
    stream.synchronize()
    host = slab.cpu().numpy()
    for (off, size), row, s in zip(zip(offsets, sizes), (0, stride), stored):
        out = np.zeros(size, dtype=np.uint8)
        codec.decode_chunk(memoryview(host[row:row + s]), size, memoryview(out))
        assert out.tobytes() == raw[off:off + size].numpy().tobytes()
    # CPU -> GPU
    frames = [codec.encode_chunk(memoryview(raw[off:off + size].numpy())) for off, size in zip(offsets, sizes)]
    slab.zero_()
    for row, f in zip((0, stride), frames):
        slab[row:row + len(f)] = torch.frombuffer(bytearray(f), dtype=torch.uint8).cuda()
    back = torch.zeros_like(graw)
    out = torch.zeros_like(graw)
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        codec.decode_batch(stream, CHUNK, slab, [0, stride], [len(f) for f in frames], back, offsets, sizes)
        codec.unpack(out, back, CHUNK)
    stream.synchronize()
    assert torch.equal(out.cpu(), raw)


@pytest.mark.gpu
def test_gpu_compression_does_not_wait_for_the_default_stream():
    """A save compresses on its own stream beside training, whose kernels queue on the default
    stream: no nvCOMP call may wait for them (its own pinned allocations did, so a guarded save's
    drain stood still during the forward and backward; docs/benchmarks.md). Ordering,
    not timing: the round trip is over while a long kernel still runs on the default stream."""
    import threading

    spec = get_codec_class("ans").spec_for(torch.float32)
    codec = get_codec(spec)
    raw = as_bytes(sample(torch.float32, 8 * CHUNK, seed=9)).cuda()
    offsets, sizes = [i * CHUNK for i in range(8)], [CHUNK] * 8
    stride = -(-codec.max_stored_size(CHUNK) // 4096) * 4096
    slab = torch.zeros(8 * stride, dtype=torch.uint8, device="cuda")
    pack, back, out = torch.empty_like(raw), torch.empty_like(raw), torch.zeros_like(raw)
    stream = torch.cuda.Stream()
    rows = [i * stride for i in range(8)]

    def round_trip() -> None:
        with torch.cuda.stream(stream):
            codec.pack(pack, raw, CHUNK)
            stored = codec.encode_batch(stream, CHUNK, pack, offsets, sizes, slab, rows, stride).sizes()
            codec.decode_batch(stream, CHUNK, slab, rows, stored, back, offsets, sizes)
            codec.unpack(out, back, CHUNK)
        stream.synchronize()

    round_trip()  # (nvCOMP's first use sets itself up, and may synchronize once)
    torch.cuda.synchronize()
    out.zero_()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a single kernel on the default stream (cycles)
    worker = threading.Thread(target=round_trip)
    worker.start()
    worker.join()
    still_busy = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    assert torch.equal(out, raw)
    assert still_busy, "the compression waited for the default stream's kernel"


_CS = 64 << 10


def _staged(state: dict, emit):
    """Stage `state` (GPU tensors) with ans on a GpuDevice of its own (64 KiB chunks, a pack buffer
    of four, a 64 MiB slab), handing each wave's segment to `emit`; returns the device."""
    from tiered.config import Budgets
    from tiered.format.tree import flatten
    from tiered.gpu.device import GpuDevice
    from tiered.stage.plan import make_plan
    from tiered.stage.pools import HostPool

    dev = GpuDevice(torch.cuda.current_device(), _CS, Budgets(gpu_buffer=64 << 20, pack_buffer=4 * _CS),
                    ZstdSettings(), HostPool(16 << 20))
    _, leaves = flatten(state)
    plan = make_plan(leaves, "ans", _CS, gpu_codecs=True)
    dev.stage(plan.gpu[torch.cuda.current_device()], [leaf.tensor for leaf in leaves], emit, lambda: None)
    return dev


def test_checked_sizes_names_the_first_chunk_that_failed():
    from tiered.codecs.base import checked_sizes

    assert checked_sizes(np.array([5, 7]), np.array([0, 0], dtype=np.int32)) == [5, 7]
    with pytest.raises(RuntimeError, match=r"chunk 1 of the batch \(status 10; 2 of 3 chunks failed\)"):
        checked_sizes(np.array([5, 7, 9]), np.array([0, 10, 11], dtype=np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_ans_through_the_c_api_writes_the_python_apis_bitstreams(dtype):
    """A save encodes ANS through nvCOMP's C API (tiered.codecs._nvcomp_batched) and restores
    through its Python API: the same chunks give the same sizes and the same bytes both ways."""
    from tiered.codecs import _nvcomp, _nvcomp_batched

    assert _nvcomp_batched.available()
    spec = get_codec_class("ans").spec_for(dtype)
    data_type = get_codec(spec).data_type
    raw = as_bytes(sample(dtype, 5 * CHUNK + 8192, seed=3)).cuda()
    offsets = list(range(0, raw.numel(), CHUNK))
    sizes = [min(CHUNK, raw.numel() - o) for o in offsets]
    stride = -(-get_codec(spec).max_stored_size(CHUNK) // 4096) * 4096
    assert stride >= _nvcomp_batched.max_output(CHUNK, data_type)
    rows = [i * stride for i in range(len(offsets))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    slabs = [torch.zeros(len(offsets) * stride, dtype=torch.uint8, device="cuda") for _ in range(2)]
    with torch.cuda.stream(stream):
        by_python = _nvcomp.encode("ANS", data_type, stream, CHUNK, raw, offsets, sizes, slabs[0], rows, stride).sizes()
        pending = _nvcomp_batched.encode(data_type, stream, CHUNK, raw, offsets, sizes, slabs[1], rows)
        by_c = pending.sizes()
    assert by_c == by_python and all(0 < n < CHUNK for n in by_c[:-1])
    for r, n in zip(rows, by_c):
        assert torch.equal(slabs[0][r:r + n], slabs[1][r:r + n])
    assert pending.statuses.cpu().tolist() == [0] * len(offsets)


@pytest.mark.gpu
def test_an_encode_stream_takes_a_new_wave_only_once_its_last_waves_sizes_are_read(monkeypatch):
    """nvCOMP's Python API reads a batch's sizes after waiting for its whole codec stream, holding
    the GIL: a wave queued behind an unread one would make that read wait for it too
    (tiered.gpu.waves.WaveSizes). (Its C API, which a save uses where it loads, leaves the sizes
    on the GPU: `test_delivered_sizes_are_read_while_the_drains_copies_run`.)"""
    from tiered.gpu.waves import ENCODE_STREAMS

    monkeypatch.setenv("TIERED_NVCOMP_PYTHON_ENCODE", "1")

    waves = 3 * ENCODE_STREAMS
    state = {"w": torch.randn(waves * _CS, device="cuda"),
             "b": torch.randn(_CS // 8, device="cuda", dtype=torch.bfloat16)}
    segments = []

    def emit(seg):
        if len(segments) >= ENCODE_STREAMS:  # the wave before it on the same encode stream
            assert segments[-ENCODE_STREAMS].wave.read, len(segments)
        segments.append(seg)

    _staged(state, emit)
    assert len(segments) >= waves
    unread = [seg for seg in segments if not seg.wave.read]
    assert len(unread) <= ENCODE_STREAMS
    sizes = [n for seg in segments for n in seg.sizes()]
    assert len(sizes) == sum(len(seg.chunks) for seg in segments) and all(0 < n <= 2 * _CS for n in sizes)
    for seg in segments:
        seg.release()


def _drain_like_work(dev) -> torch.cuda.Event:
    """A copy to the host and ~0.2 s of one kernel after it on the device's writer stream, noted
    as a drain's copies are (`note_copies`); the event after them."""
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    host = torch.empty_like(big, device="cpu").pin_memory()
    with torch.cuda.stream(dev.writer_stream):
        host.copy_(big, non_blocking=True)
        torch.cuda._sleep(400_000_000)  # (cycles)
        done = torch.cuda.Event()
        done.record(dev.writer_stream)
    dev.note_copies(done)
    return done


@pytest.mark.gpu
def test_delivered_sizes_are_read_while_the_drains_copies_run():
    """Through nvCOMP's C API a wave's sizes stay on the GPU, and a kernel stores them into pinned
    memory as soon as the wave is encoded (tiered.gpu.pack.deliver): reading them waits for
    nothing a drain issued, so the writer issues the next wave's copies behind the running ones."""
    from tiered.gpu import pack

    segments = []
    dev = _staged({"w": torch.randn(8 * _CS, device="cuda")}, segments.append)
    assert dev.wait_warm(120) and pack.can_deliver()
    assert all(seg.wave.delivers for seg in segments)
    segments[-1].wave.ready.synchronize()
    done = _drain_like_work(dev)
    sizes = [n for seg in segments for n in seg.sizes()]
    assert not done.query(), "the sizes waited for the drain's copies"
    torch.cuda.synchronize()
    assert len(sizes) == sum(len(seg.chunks) for seg in segments) and all(0 < n <= 2 * _CS for n in sizes)
    for seg in segments:
        seg.release()


@pytest.mark.gpu
def test_a_waves_sizes_are_read_after_the_drains_copies_issued_before(monkeypatch):
    """nvCOMP's Python API reads a batch's sizes with a small copy to the host, which the copy
    engine runs after the copies queued before it, and waits for it holding the GIL: the read
    first waits, through torch, for the work a drain issued (here a copy and a kernel after it,
    which nvCOMP's read alone would not wait for)."""
    monkeypatch.setenv("TIERED_NVCOMP_PYTHON_ENCODE", "1")
    segments = []
    dev = _staged({"w": torch.randn(8 * _CS, device="cuda")}, segments.append)
    segments[-1].wave.ready.synchronize()
    done = _drain_like_work(dev)
    assert not done.query()
    sizes = [n for seg in segments for n in seg.sizes()]
    assert done.query(), "the sizes were read before the drain's work was done"
    assert len(sizes) == sum(len(seg.chunks) for seg in segments)
    for seg in segments:
        seg.release()
