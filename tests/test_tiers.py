"""One contract every tier passes: local NVMe, shared POSIX filesystem, S3 (real SeaweedFS)."""

from __future__ import annotations

import os

import pytest

from tiered.errors import CheckpointNotFoundError, FormatError, TieredError
from tiered.format.manifest import MANIFEST_NAME


def extents(n: int, size: int = 4096 * 300, seed: int = 0) -> list[bytes]:
    rng = __import__("random").Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


class TierContract:
    """Subclasses provide the `tier` fixture."""

    def write_step(self, tier, step: int, parts: list[bytes], commit: bool = True) -> None:
        tier.begin_step(step)
        w = tier.open_data_writer(step, "rank_00000.data", device=False)
        offset = 0
        for p in parts:
            w.write_host(offset, memoryview(p))
            offset += len(p)
        assert w.close() == offset
        tier.write_file(step, "rank_00000.index.json", b'{"index": %d}' % step)
        if commit:
            tier.commit(step, b'{"manifest": %d}' % step)

    @staticmethod
    def names(tier) -> list[str]:
        """Every file or object name under the tier, committed or not."""
        if hasattr(tier, "client"):
            return [o["Key"] for o in tier.client.list_objects_v2(Bucket=tier.bucket).get("Contents", ())]
        return [os.path.join(d, f) for d, _, files in os.walk(tier.root) for f in files]

    def test_a_prefetched_range_reads_the_same_bytes(self, tier):
        data = os.urandom(6 * 4096)
        self.write_step(tier, 1, [data])
        r = tier.open_data_reader(1, "rank_00000.data", device=False)
        head = memoryview(bytearray(3 * 4096))
        taken = r.prefetch(4096, head)  # a remote tier fetches it now; a file declines
        assert taken or not any(head)
        assert bytes(r.read_host(4096, 4096)) == data[4096:8192]  # inside it
        assert bytes(r.read_host(2 * 4096, 3 * 4096)) == data[2 * 4096:5 * 4096]  # from inside it past its end
        assert bytes(r.read_host(0, 2 * 4096)) == data[:2 * 4096]  # from before it
        r.close()
        if taken:
            assert bytes(head) == data[4096:4 * 4096]  # written, and left alone once closed

    def test_empty(self, tier):
        assert tier.steps() == [] and not tier.has_step(1)
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(1)

    def test_round_trip_and_ranged_reads(self, tier):
        parts = extents(12)  # ~14.7 MB: several multipart parts on S3
        self.write_step(tier, 5, parts)
        self.write_step(tier, 7, parts[:1])
        assert tier.steps() == [5, 7] and tier.has_step(5)
        assert tier.read_manifest(5) == b'{"manifest": 5}'
        assert tier.read_file(5, "rank_00000.index.json", 1 << 20) == b'{"index": 5}'
        r = tier.open_data_reader(5, "rank_00000.data", device=False)
        try:
            data = b"".join(parts)
            assert r.size == len(data)
            for off, n in ((0, 4096), (4096 * 299, 8192), (len(data) - 4096, 4096), (123, 5_000_000)):
                assert bytes(r.read_host(off, n)) == data[off:off + n]
            with pytest.raises(TieredError, match="truncated"):
                r.read_host(len(data) - 4096, 8192)
        finally:
            r.close()

    def test_uncommitted_step_is_invisible_and_cleared(self, tier):
        self.write_step(tier, 1, extents(2))
        self.write_step(tier, 2, extents(2), commit=False)
        assert tier.steps() == [1] and not tier.has_step(2)
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(2)
        self.write_step(tier, 2, extents(1, seed=9))  # debris of the first attempt is replaced
        r = tier.open_data_reader(2, "rank_00000.data", device=False)
        assert r.size == len(extents(1, seed=9)[0])
        r.close()

    def test_committed_step_is_immutable(self, tier):
        self.write_step(tier, 3, extents(1))
        with pytest.raises(TieredError, match="already committed"):
            tier.begin_step(3)
        tier.discard(3)  # never removes a committed step
        assert tier.steps() == [3]

    def test_discard_removes_uncommitted(self, tier):
        self.write_step(tier, 4, extents(1), commit=False)
        tier.discard(4)
        with pytest.raises(CheckpointNotFoundError):  # on opening (a file), or on the first read (S3: no HEAD)
            tier.open_data_reader(4, "rank_00000.data", device=False).read_host(0, 4096)

    def test_delete_uncommits_first_then_removes(self, tier):
        self.write_step(tier, 8, extents(2))
        self.write_step(tier, 9, extents(2))
        tier.delete(8)
        assert tier.steps() == [9] and not tier.has_step(8)
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(8)
        tier.begin_step(8)  # nothing of the deleted step is left in the way
        assert tier.read_manifest(9) == b'{"manifest": 9}'

    def test_probe_bandwidth_leaves_nothing_behind(self, tier):
        self.write_step(tier, 3, extents(1))
        bw = tier.probe_bandwidth(8 << 20)
        assert bw > 0
        assert tier.steps() == [3] and tier.read_manifest(3) == b'{"manifest": 3}'
        assert not any(".tiered-probe" in name for name in self.names(tier))

    def test_names_must_stay_inside_the_step(self, tier):
        self.write_step(tier, 6, extents(1))
        for bad in ("../x", "/etc/passwd", "a/b", ".."):
            with pytest.raises(FormatError, match="not a plain file name"):
                tier.read_file(6, bad, 1 << 20)

    def test_size_limit_on_small_files(self, tier):
        self.write_step(tier, 8, extents(1))
        with pytest.raises(FormatError, match="larger than"):
            tier.read_file(8, "rank_00000.index.json", 4)

    def test_empty_data_file_commits(self, tier):
        # A rank with no tensor bytes: close() reports 0 and the step commits (readers skip the file).
        self.write_step(tier, 9, [])
        self.write_step(tier, 10, extents(1))
        assert tier.steps() == [9, 10]

    def test_ranks_write_beside_each_other(self, tier):
        # Two ranks of one step in one place: each clears only its own leftovers.
        def write_rank(rank: int, parts: list[bytes]) -> None:
            tier.begin_rank(11, rank)
            w = tier.open_data_writer(11, f"rank_{rank:05d}.data", device=False)
            off = 0
            for p in parts:
                w.write_host(off, memoryview(p))
                off += len(p)
            w.close()
            tier.write_file(11, f"rank_{rank:05d}.index.json", b'{"rank": %d}' % rank)

        write_rank(0, extents(1))
        write_rank(1, extents(2, seed=3))
        write_rank(1, extents(1, seed=4))  # rank 1 starts over: rank 0's files stay
        assert tier.file_size(11, "rank_00000.index.json") == len(b'{"rank": 0}')
        assert tier.file_size(11, "rank_00001.data") == len(extents(1, seed=4)[0])
        assert tier.file_size(11, "rank_00002.index.json") is None
        tier.discard_rank(11, 1)
        assert tier.file_size(11, "rank_00001.index.json") is None
        assert tier.file_size(11, "rank_00000.data") == len(extents(1)[0])
        write_rank(1, extents(1, seed=5))
        tier.commit(11, b'{"manifest": 11}')
        with pytest.raises(TieredError, match="already committed"):
            tier.begin_rank(11, 1)
        tier.discard_rank(11, 0)  # never in a committed step
        assert tier.file_size(11, "rank_00000.data") == len(extents(1)[0])
        assert tier.steps() == [11]


class TestLocalTier(TierContract):
    @pytest.fixture
    def tier(self, tmp_path):
        from tiered.tiers import LocalTier

        return LocalTier("local", tmp_path / "nvme")


class TestPosixTier(TierContract):
    @pytest.fixture
    def tier(self, tmp_path):
        from tiered.tiers import PosixTier

        return PosixTier("shared", tmp_path / "lustre")

    def test_host_memory_only(self, tier):
        tier.begin_step(1)
        with pytest.raises(TieredError, match="host memory only"):
            tier.open_data_writer(1, "rank_00000.data", device=True)


class TestS3Tier(TierContract):
    @pytest.fixture
    def tier(self, s3_server, s3_bucket):
        from tiered.tiers.s3 import S3Tier

        return S3Tier("s3", s3_bucket, "runs/run-1", endpoint_url=s3_server.endpoint_url, region="us-east-1",
                      part_size=5 * 1024 * 1024, max_concurrency=3)

    def test_layout_is_plain_objects_the_files_in_their_writers_folder(self, tier):
        from tiered.tiers.s3 import FILES_META
        from tiered.tiers.writers import parse_writer_id

        self.write_step(tier, 1, extents(1))
        keys = sorted(o["Key"] for o in tier.client.list_objects_v2(Bucket=tier.bucket)["Contents"])
        folder = tier.client.head_object(Bucket=tier.bucket, Key=keys[0])["Metadata"][FILES_META]
        assert parse_writer_id(folder) is not None
        assert keys == [f"runs/run-1/step_000000000001/{n}" for n in
                        (MANIFEST_NAME, f"{folder}/rank_00000.data", f"{folder}/rank_00000.index.json")]

    def test_objects_gone_before_the_commit_are_not_committed(self, tier, s3_server):
        """An object this writer uploaded that the server no longer lists (removed under it, or
        lost by the server) keeps the manifest from being put: the step is not committed, the
        error says why, and the next attempt commits it whole."""
        from helpers import s3_client

        self.write_step(tier, 3, extents(3), commit=False)
        data_key = next(k for k in self.names(tier) if k.endswith("rank_00000.data"))
        s3_client(s3_server).delete_object(Bucket=tier.bucket, Key=data_key)
        with pytest.raises(TieredError, match=r"step 3: 1 object\(s\) uploaded to tier 's3' are gone or of another "
                                              r"size before the commit .*rank_00000\.data"):
            tier.commit(3, b'{"manifest": 3}')
        assert not tier.has_step(3) and MANIFEST_NAME not in {k.rsplit("/", 1)[-1] for k in self.names(tier)}
        self.write_step(tier, 3, extents(3))  # the next attempt: a folder of its own, committed whole
        assert tier.has_step(3)
        assert bytes(tier.open_data_reader(3, "rank_00000.data", device=False).read_host(0, 4096)) == extents(3)[0][:4096]

    def test_unfinished_multipart_uploads_are_aborted(self, tier):
        tier.begin_step(2)
        w = tier.open_data_writer(2, "rank_00000.data", device=False)
        w.write_host(0, memoryview(b"x" * (6 * 1024 * 1024)))  # starts a multipart upload
        w.wait()
        assert tier.client.list_multipart_uploads(Bucket=tier.bucket).get("Uploads")
        tier.discard(2)  # as after a crash: nothing committed, the upload is cleaned up
        assert not tier.client.list_multipart_uploads(Bucket=tier.bucket).get("Uploads")

    def test_a_size_hint_splits_a_small_object_into_parallel_parts(self, s3_server, s3_bucket):
        from tiered.tiers.s3 import S3Tier

        # 64 MiB parts by default: without the hint a 17 MB file would go out as one PUT at close.
        tier = S3Tier("s3", s3_bucket, "hinted", endpoint_url=s3_server.endpoint_url, region="us-east-1",
                      max_concurrency=4)
        calls: list[str] = []
        tier.client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
        data = os.urandom(17 * 1024 * 1024 + 12345)
        tier.begin_step(1)
        w = tier.open_data_writer(1, "rank_00000.data", device=False, size_hint=len(data))
        for off in range(0, len(data), 1 << 20):  # in 1 MiB pieces, as a migration writes windows
            w.write_host(off, memoryview(data)[off:off + (1 << 20)])
        assert w.close() == len(data)
        assert calls.count("UploadPart") == 4 and "CompleteMultipartUpload" in calls and "PutObject" not in calls
        assert bytes(tier.open_data_reader(1, "rank_00000.data", device=False).read_host(0, len(data))) == data

    def test_parts_start_at_5_mib_and_double_up_to_the_part_size(self, s3_server, s3_bucket):
        from tiered.tiers.s3 import S3Tier

        mib = 1024 * 1024
        tier = S3Tier("s3", s3_bucket, "ramp", endpoint_url=s3_server.endpoint_url, region="us-east-1",
                      part_size=16 * mib, max_concurrency=4)
        sizes: list[int] = []
        tier.client.meta.events.register("provide-client-params.s3.UploadPart",
                                         lambda params, **_: sizes.append(len(params["Body"])))
        data = os.urandom(60 * mib + 4096)
        tier.begin_step(1)
        w = tier.open_data_writer(1, "rank_00000.data", device=False)
        for off in range(0, len(data), 3 * mib):  # pieces that straddle the part boundaries
            w.write_host(off, memoryview(data)[off:off + 3 * mib])
        assert w.close() == len(data)
        assert sizes == [5 * mib, 10 * mib, 16 * mib, 16 * mib, 13 * mib + 4096]
        assert bytes(tier.open_data_reader(1, "rank_00000.data", device=False).read_host(0, len(data))) == data

    def test_a_read_is_one_round_trip(self, tier):
        data = os.urandom(3 * 4096)
        self.write_step(tier, 1, [data])
        calls: list[str] = []
        tier.client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
        r = tier.open_data_reader(1, "rank_00000.data", device=False)
        assert bytes(r.read_host(4096, 4096)) == data[4096:8192]
        assert calls == ["GetObject"]  # no HEAD first: a small step's copy from S3 is a few round trips
        assert r.size == len(data) and calls == ["GetObject", "HeadObject"]  # asked for only where wanted

    def test_a_large_range_is_read_as_parallel_pieces_exactly(self, tier):
        from tiered.tiers.s3 import READ_PIECE

        calls: list[str] = []
        data = os.urandom(2 * READ_PIECE + 3 * 4096 + 17)  # three pieces, the last a short one
        tier.begin_step(1)
        w = tier.open_data_writer(1, "rank_00000.data", device=False, size_hint=len(data))
        w.write_host(0, memoryview(data))
        w.close()
        tier.client.meta.events.register("before-call.s3.GetObject", lambda **_: calls.append("get"))
        r = tier.open_data_reader(1, "rank_00000.data", device=False)
        assert bytes(r.read_host(4096, len(data) - 4096 - 5)) == data[4096:-5]
        assert len(calls) == 3
        out = bytearray(len(data) - 4096 - 5 + 100)
        r.read_into(4096, memoryview(out)[:len(data) - 4096 - 5])  # into a caller's (larger) buffer
        assert bytes(out[:len(data) - 4096 - 5]) == data[4096:-5] and not any(out[len(data) - 4096 - 5:])
        with pytest.raises(TieredError, match="truncated"):
            r.read_host(len(data) - 10, 11)

    def test_a_prefetch_goes_out_one_get_per_connection_and_is_not_read_twice(self, tier):
        mib = 1024 * 1024
        data = os.urandom(5 * mib + 4096)
        tier.begin_step(1)
        w = tier.open_data_writer(1, "rank_00000.data", device=False, size_hint=len(data))
        w.write_host(0, memoryview(data))
        w.close()
        ranges: list[str] = []
        tier.client.meta.events.register("provide-client-params.s3.GetObject",
                                         lambda params, **_: ranges.append(params["Range"]))
        r = tier.open_data_reader(1, "rank_00000.data", device=False)
        head = memoryview(bytearray(4 * mib))
        assert r.prefetch(0, head)
        # max_concurrency 3: three GETs of 2 MiB (pieces are whole MiB), the last one short.
        assert bytes(r.read_host(mib, 2 * mib)) == data[mib:3 * mib]
        assert bytes(r.read_host(3 * mib, 2 * mib + 4096)) == data[3 * mib:]  # past the prefetch: one GET more
        r.close()
        assert sorted(ranges) == sorted([f"bytes=0-{2 * mib - 1}", f"bytes={2 * mib}-{4 * mib - 1}",
                                         f"bytes={4 * mib}-{5 * mib + 4095}"])

    def test_a_prefetch_past_the_end_fails_the_read_that_needs_it(self, tier):
        data = os.urandom(2 * 4096)
        self.write_step(tier, 1, [data])
        r = tier.open_data_reader(1, "rank_00000.data", device=False)
        r.prefetch(0, memoryview(bytearray(3 * 4096)))  # the manifest said more than the object holds
        with pytest.raises(TieredError, match="truncated"):
            r.read_host(0, 3 * 4096)
        r.close()  # waits for the GETs, raises nothing more

    def test_wrong_credentials_fail_fast_with_a_clear_message(self, s3_server, s3_bucket, monkeypatch):
        from tiered.tiers.s3 import S3Tier

        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        tier = S3Tier("s3", s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
        with pytest.raises(TieredError, match="SignatureDoesNotMatch: the secret key does not match") as err:
            tier.steps()
        assert "not-the-secret" not in str(err.value) and s3_server.secret_key not in str(err.value)

    def test_missing_bucket_is_a_clear_error(self, s3_server):
        from tiered.tiers.s3 import S3Tier

        tier = S3Tier("s3", "no-such-bucket-here", endpoint_url=s3_server.endpoint_url, region="us-east-1")
        with pytest.raises(TieredError, match="NoSuchBucket: the bucket does not exist"):
            tier.steps()


def test_s3_part_buffers_are_reused_by_size_up_to_a_limit():
    from tiered.tiers.s3 import PartBuffers

    spare = PartBuffers(limit=30)
    a, b, c = spare.take(10), spare.take(10), spare.take(20)
    for buf in (a, b, c):
        spare.give(buf)  # a and b kept (20 bytes); c would pass the limit: dropped
    assert spare.take(10) is b and spare.take(10) is a
    assert spare.take(20) is not c and len(spare.take(10)) == 10  # fresh ones once none is kept


@pytest.mark.parametrize("hint, part_size, concurrency, expected", [
    (None, 64 << 20, 8, 64 << 20),                # no hint: the tier's part size
    (0, 64 << 20, 8, 64 << 20),
    (34_000_000, 64 << 20, 8, 5 * 1024 * 1024),   # small: S3's 5 MiB minimum, 7 parts in flight
    (300 << 20, 64 << 20, 8, 38 << 20),           # 8 parts in flight, whole MiB
    (10 << 30, 64 << 20, 8, 64 << 20),            # large: never over the tier's part size
    (3 << 20, 64 << 20, 8, 5 * 1024 * 1024),      # under one part: one PUT at close anyway
])
def test_s3_part_size_follows_the_object(hint, part_size, concurrency, expected):
    from tiered.tiers.s3 import part_size_for

    assert part_size_for(hint, part_size, concurrency) == expected


def test_make_tier_from_example_config(tmp_path):
    from pathlib import Path

    from tiered.config import load_config
    from tiered.tiers import LocalTier, PosixTier, make_tier

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "example-cluster.yaml")
    assert isinstance(make_tier(cfg.tiers[0]), LocalTier) and isinstance(make_tier(cfg.tiers[1]), PosixTier)
    pytest.importorskip("boto3", reason="the S3 tier needs boto3 (not on the lent GPU machines)")
    s3 = make_tier(cfg.tiers[2])
    assert s3.root == "s3://my-team-checkpoints/run-042" and not s3.reads_into_gpu


# --- O_DIRECT host reads of the file tiers (tiered.tiers.local.DIRECT_READ_MIN) ---------------
def _aligned_buffer(size: int) -> memoryview:
    import mmap

    return memoryview(mmap.mmap(-1, size))


def _data_file(tmp_path, size: int) -> tuple:
    """A local tier step directory whose data file is `size` random bytes."""
    data = os.urandom(size)
    path = tmp_path / "nvme" / "step_000000000001" / "rank_00000.data"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return data, path


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_file_reads_return_the_file_whatever_their_alignment(tmp_path, direct_io):
    from tiered.tiers import LocalTier

    size = (3 << 20) + 1000  # a tail that is not a whole page
    data, _ = _data_file(tmp_path, size)
    r = LocalTier("local", tmp_path / "nvme", direct_io).open_data_reader(1, "rank_00000.data", device=False)
    try:
        for offset, n in [(0, size), (4096, 2 << 20), (8192, size - 8192), (100, 2 << 20), (0, 4096)]:
            out = _aligned_buffer(n)  # page-aligned memory: O_DIRECT where the range allows it
            r.read_into(offset, out)
            assert bytes(out) == data[offset:offset + n], (offset, n)
            unaligned = memoryview(bytearray(n + 1))[1:]  # never O_DIRECT
            r.read_into(offset, unaligned)
            assert bytes(unaligned) == data[offset:offset + n], (offset, n)
        with pytest.raises(TieredError, match="truncated"):
            r.read_into(4096, _aligned_buffer(size))
    finally:
        r.close()


def _cached_pages(path, size: int) -> int:
    """Pages of the file's first `size` bytes in the page cache (mincore on a private mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(m)))
        assert libc.mincore(addr, ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)
    finally:
        del addr
        m.close()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_a_large_aligned_read_leaves_the_page_cache_to_training(tmp_path, direct_io):
    """A migration or restore reads windows of a data file that nothing will read again: with
    O_DIRECT they cost no kernel copy and evict nothing training keeps in the page cache. (`off`
    reads through the cache: the control.)"""
    from tiered.tiers import LocalTier

    if not hasattr(os, "O_DIRECT") or not hasattr(os, "posix_fadvise"):
        pytest.skip("no O_DIRECT or posix_fadvise on this platform")
    size = 8 << 20
    _, path = _data_file(tmp_path, size)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT (tmpfs)")
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _cached_pages(path, size) > 16:
        pytest.skip("the page cache kept the file after POSIX_FADV_DONTNEED")
    r = LocalTier("local", tmp_path / "nvme", direct_io).open_data_reader(1, "rank_00000.data", device=False)
    try:
        r.read_into(0, _aligned_buffer(size))
    finally:
        r.close()
    cached = _cached_pages(path, size)
    if direct_io == "off":
        assert cached > size // 4096 // 2
    else:
        assert cached <= 16, f"{cached} pages of the file entered the page cache"


def test_o_direct_reads_refused_fall_back_or_fail_by_the_tiers_setting(tmp_path, monkeypatch):
    from tiered.tiers import LocalTier, local

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    size = 2 << 20
    data, _ = _data_file(tmp_path, size)
    real_open = os.open
    asked = []

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            asked.append(path)
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local.os, "open", no_direct)
    r = LocalTier("local", tmp_path / "nvme", "auto").open_data_reader(1, "rank_00000.data", device=False)
    out = _aligned_buffer(size)
    r.read_into(0, out)
    r.read_into(0, out)
    r.close()
    assert bytes(out) == data and len(asked) == 1  # asked once, then buffered
    r = LocalTier("local", tmp_path / "nvme", "on").open_data_reader(1, "rank_00000.data", device=False)
    with pytest.raises(TieredError, match="cannot open with O_DIRECT.*direct_io: auto or off"):
        r.read_into(0, out)
    r.close()
