"""A drained wave's rows on their way to pinned host memory (tiered.gpu.drain): the host's share
(the pages that hold each extent's padding) runs everywhere; the batched copies and the read-only
checksum on a GPU."""

import numpy as np
import pytest
import torch

from tiered.format.chunks import extent_runs


def test_the_host_zeroes_each_padded_extents_last_page_and_the_copies_land_over_it():
    from tiered.gpu.drain import zero_tails

    sizes = [5000, 4096, 0, 1, 12000, 8192]
    extents, bounds, offsets = extent_runs(sizes, 1 << 20)
    assert bounds == [(0, 6, sum(extents))]
    run = np.full(sum(extents), 0xAB, dtype=np.uint8)
    zero_tails(run, offsets, np.asarray(sizes), extents)
    for off, size, extent in zip(offsets.tolist(), sizes, extents):
        assert (run[off + size:off + extent] == 0).all()
        if size % 4096 == 0:  # (no padding: every byte is left to the copy)
            assert (run[off:off + extent] == 0xAB).all()
        else:  # (only the last page: the bytes before it are left alone)
            assert (run[off:off + size // 4096 * 4096] == 0xAB).all()
    for off, size in zip(offsets.tolist(), sizes):  # the copies, issued after it
        run[off:off + size] = 7
    for off, size, extent in zip(offsets.tolist(), sizes, extents):
        assert (run[off:off + size] == 7).all() and (run[off + size:off + extent] == 0).all()


def test_a_batch_of_mismatched_lengths_is_refused_naming_them():
    from tiered.gpu import batch_copy

    with pytest.raises(ValueError, match="2 destinations, 1 sources and 2 sizes"):
        batch_copy.copy_batch([1, 2], [3], [4, 5], None)


def test_where_the_driver_cannot_batch_copies_the_error_says_why():
    from tiered.gpu import batch_copy

    if batch_copy.available():
        pytest.skip("this driver batches copies")
    assert batch_copy.why_not()
    with pytest.raises(RuntimeError, match="batched copies are not available here: " + batch_copy.why_not()[:20]):
        batch_copy.copy_batch([1], [2], [3], None)


@pytest.mark.gpu
def test_a_batch_copies_each_row_to_its_place_and_touches_nothing_between():
    from tiered.gpu import batch_copy

    assert batch_copy.available(), batch_copy.why_not()
    rows = torch.randint(0, 256, (300, 8192), dtype=torch.uint8, device="cuda")
    sizes = torch.randint(1, 8193, (300,)).tolist()
    extents, _, offsets = extent_runs(sizes, 1 << 30)
    host = torch.full((sum(extents),), 7, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    batch_copy.copy_batch(host.data_ptr() + offsets, [rows[r].data_ptr() for r in range(300)], sizes, stream)
    stream.synchronize()
    cpu = rows.cpu()
    for r, (off, size, extent) in enumerate(zip(offsets.tolist(), sizes, extents)):
        assert torch.equal(host[off:off + size], cpu[r, :size]), r
        assert (host[off + size:off + extent] == 7).all(), r


@pytest.mark.gpu
def test_the_read_only_checksum_equals_the_one_that_zeroes_the_padding_and_leaves_the_rows():
    from tiered.gpu import pack

    if not pack.available():
        pytest.skip("Triton is missing here")
    rows = torch.randint(0, 256, (40, 3 * 4096), dtype=torch.uint8, device="cuda")
    sizes = torch.randint(1, 3 * 4096 + 1, (40,), device="cuda")
    before = rows.clone()
    read_only = torch.empty(40, dtype=torch.int64, device="cuda")
    pack.checksum_rows(rows, sizes, read_only)
    torch.cuda.synchronize()
    assert torch.equal(rows, before)
    padded = torch.empty(40, dtype=torch.int64, device="cuda")
    pack.pad_and_checksum(rows, sizes, padded)
    torch.cuda.synchronize()
    assert torch.equal(read_only, padded)
    assert not torch.equal(rows, before)  # (the other one did zero the padding: the two differ in that)
