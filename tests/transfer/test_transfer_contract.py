"""The backend contract, run against every backend (cuda only where there is a GPU)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from tiering.errors import CopyFailedError, ResourceClosedError, SpecError, TransferError
from tiering.transfer import TransferDirection, TransferResult


def _store_then_load(
    rig: Any,
    *,
    chunks_per_group: int,
    skip: int = 0,
    shuffle_chunks: bool = True,
    shuffle_blocks: bool = True,
) -> None:
    """Store random blocks of every group, scribble over the KV, load into other blocks, compare."""
    rng, bpc, groups = rig.rng, rig.bpc, rig.layout.num_groups
    n = chunks_per_group * bpc
    order = rng.permutation if shuffle_blocks else np.arange
    blocks = [order(rig.layout.group_num_blocks[g]) for g in range(groups)]
    src = [b[:n].tolist() for b in blocks]
    dst = [b[n : 2 * n - skip].tolist() for b in blocks]
    chunk_pool = rng.permutation(rig.num_chunks) if shuffle_chunks else np.arange(rig.num_chunks)
    chunks = chunk_pool[: groups * chunks_per_group].tolist()

    stored = rig.run(rig.gpu(src), rig.cpu(chunks))
    assert stored.success, stored.error
    assert stored.direction is TransferDirection.STORE
    assert stored.nbytes == n * sum(rig.layout.group_block_bytes)
    original = rig.snapshot()

    rig.randomize()
    before_load = rig.snapshot()
    loaded = rig.run(rig.cpu(chunks), rig.gpu(dst, [skip] * groups))
    assert loaded.success, loaded.error
    assert loaded.direction is TransferDirection.LOAD
    assert loaded.nbytes == (n - skip) * sum(rig.layout.group_block_bytes)

    after = rig.snapshot()
    for g in range(groups):
        written = set(dst[g])
        untouched = [b for b in range(rig.layout.group_num_blocks[g]) if b not in written]
        for t in rig.tensors_of(g):
            # every byte of every loaded block is the byte stored from its source block
            assert torch.equal(after[t][dst[g]], original[t][src[g][skip:]])
            # and nothing else changed
            assert torch.equal(after[t][untouched], before_load[t][untouched])


@pytest.mark.parametrize("bpc", [1, 4])
def test_round_trip_is_byte_exact(make_rig: Any, bpc: int) -> None:
    rig = make_rig(bpc=bpc)
    _store_then_load(rig, chunks_per_group=3)


@pytest.mark.parametrize("skip", [1, 3])
def test_load_may_start_part_way_into_the_first_chunk(make_rig: Any, skip: int) -> None:
    rig = make_rig(bpc=4)
    _store_then_load(rig, chunks_per_group=2, skip=skip)


@pytest.mark.parametrize(
    ("shuffle_chunks", "shuffle_blocks"), [(False, True), (True, False), (False, False)]
)
@pytest.mark.parametrize("skip", [0, 2])
def test_round_trip_with_runs_of_consecutive_ids(
    make_rig: Any, shuffle_chunks: bool, shuffle_blocks: bool, skip: int
) -> None:
    # Each way of cutting a job into runs: by slots, by blocks, by both.
    rig = make_rig(bpc=4)
    _store_then_load(
        rig,
        chunks_per_group=3,
        skip=skip,
        shuffle_chunks=shuffle_chunks,
        shuffle_blocks=shuffle_blocks,
    )


def test_round_trip_with_odd_page_sizes(make_rig: Any) -> None:
    # 24-byte pages allow 8-byte words, 13-byte pages only bytes.
    rig = make_rig(pages=[(0, 24), (0, 40), (1, 13)], bpc=2)
    assert rig.layout.word_bytes == 1
    _store_then_load(rig, chunks_per_group=4)
    rig = make_rig(pages=[(0, 24), (0, 40)], bpc=2)
    assert rig.layout.word_bytes == 8
    _store_then_load(rig, chunks_per_group=4, skip=1)


def test_one_cross_layer_tensor_per_group(make_rig: Any) -> None:
    rig = make_rig(pages=[(0, 8192)], bpc=4, num_blocks=24, num_chunks=8)
    _store_then_load(rig, chunks_per_group=2, shuffle_chunks=False)


def test_empty_job_completes(make_rig: Any) -> None:
    rig = make_rig()
    result = rig.run(rig.gpu([[], []]), rig.cpu([]))
    assert result.success
    assert result.nbytes == 0


def _bad_specs(rig: Any) -> list[tuple[Any, Any, str]]:
    bpc = rig.bpc
    four = list(range(bpc))
    return [
        (rig.gpu([[99, *four[1:]], []]), rig.cpu([0]), "block id 99"),
        (rig.gpu([four, []]), rig.cpu([rig.num_chunks + 5]), f"chunk id {rig.num_chunks + 5}"),
        (rig.gpu([four, []]), rig.cpu([0, 1]), "covers 1 chunks"),
        (rig.gpu([four[:-1], []]), rig.cpu([0]), "chunk boundary"),
        (rig.gpu([four]), rig.cpu([0]), "1 groups"),
        (rig.gpu([four, four]), rig.cpu([3, 3]), "chunk id 3 appears twice"),
        (rig.cpu([0]), rig.gpu([[1, 1, 2, 3], []]), "block id 1 appears twice"),
        (rig.cpu([0]), rig.cpu([1]), "CPULoadStoreSpec -> CPULoadStoreSpec"),
    ]


def test_bad_specs_raise_before_any_byte_moves(make_rig: Any) -> None:
    rig = make_rig(bpc=4)
    rig.pool.tensor.fill_(7)
    kv_before, pool_before = rig.snapshot(), rig.pool.tensor.clone()
    for src, dst, message in _bad_specs(rig):
        with pytest.raises(SpecError, match=message):
            rig.backend.submit(100, src, dst)
    assert rig.backend.poll() == []
    stats = rig.backend.statistics()
    assert stats.in_flight == stats.succeeded == stats.failed == 0
    assert all(torch.equal(a, b) for a, b in zip(rig.snapshot(), kv_before, strict=True))
    assert torch.equal(rig.pool.tensor, pool_before)


def _sabotage_next_copy(
    rig: Any, monkeypatch: pytest.MonkeyPatch, keep: list[weakref.ref[torch.Tensor]] | None = None
) -> None:
    """Make the next copy of ``rig``'s backend raise inside the backend.

    The failing frame holds a tensor, which ``keep`` gets a weak reference to.
    """
    backend: Any = rig.backend
    target, attr = (backend, "_enqueue") if rig.backend.name == "cuda" else (backend._copier, "run")
    original = getattr(target, attr)
    calls = {"n": 0}

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            held = torch.zeros(1024)
            if keep is not None:
                keep.append(weakref.ref(held))
            raise RuntimeError("the copy engine caught fire")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, attr, broken)


def test_a_failed_copy_is_a_failed_result_and_the_backend_stays_usable(
    make_rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig()
    _sabotage_next_copy(rig, monkeypatch)
    failed = rig.run(rig.gpu([list(range(4)), []]), rig.cpu([0]))
    assert not failed.success
    assert failed.error == "RuntimeError: the copy engine caught fire"
    _store_then_load(rig, chunks_per_group=2)
    stats = rig.backend.statistics()
    assert (stats.failed, stats.succeeded, stats.in_flight) == (1, 2, 0)
    assert (stats.stores.failed, stats.stores.succeeded) == (1, 1)
    assert stats.loads.bytes == 8 * sum(rig.layout.group_block_bytes)


def test_a_failed_result_keeps_the_error_with_its_type_and_cause(
    make_rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig()
    frame_locals: list[weakref.ref[torch.Tensor]] = []
    _sabotage_next_copy(rig, monkeypatch, frame_locals)
    failed = rig.run(rig.gpu([list(range(4)), []]), rig.cpu([0]))
    error = failed.exception
    assert isinstance(error, CopyFailedError)
    assert isinstance(error, TransferError)
    assert type(error.cause) is RuntimeError
    assert error.__cause__ is error.cause
    assert str(error.cause) == "the copy engine caught fire"
    assert str(error) == failed.error
    assert error.job_id == failed.job_id
    # The traceback says where it failed, but its frames hold no locals: a kept
    # result keeps no tensor (nor the backend) alive.
    assert error.cause.__traceback__ is not None
    assert [ref() for ref in frame_locals] == [None]
    ok = rig.run(rig.gpu([list(range(4)), []]), rig.cpu([1]))
    assert ok.success
    assert (ok.error, ok.exception) == (None, None)


def test_jobs_of_a_direction_complete_in_submission_order(make_rig: Any) -> None:
    rig = make_rig(bpc=1, num_chunks=16)
    for job_id in range(8):
        rig.backend.submit(
            job_id, rig.gpu([[job_id], [job_id]]), rig.cpu([2 * job_id, 2 * job_id + 1])
        )
    assert rig.backend.wait(range(8), timeout=60)
    results = rig.backend.poll()
    assert [r.job_id for r in results] == list(range(8))
    assert rig.backend.poll() == []  # each result is returned once


def test_wait_on_unknown_or_finished_jobs_returns_at_once(make_rig: Any) -> None:
    rig = make_rig()
    assert rig.backend.wait([12345])
    rig.run(rig.gpu([list(range(4)), []]), rig.cpu([0]))
    assert rig.backend.wait([0], timeout=0)


def test_on_complete_receives_every_result_from_a_backend_thread(make_rig: Any) -> None:
    seen: list[tuple[TransferResult, threading.Thread]] = []
    done = threading.Event()

    def on_complete(result: TransferResult) -> None:
        seen.append((result, threading.current_thread()))
        if len(seen) == 3:
            done.set()

    rig = make_rig(on_complete=on_complete)
    for job_id in range(3):
        rig.backend.submit(job_id, rig.gpu([list(range(4)), []]), rig.cpu([job_id]))
    assert done.wait(60)
    assert sorted(r.job_id for r, _ in seen) == [0, 1, 2]
    assert all(t is not threading.current_thread() for _, t in seen)
    assert rig.backend.poll() == []  # results went to the callback


def test_close_is_idempotent_and_submit_after_close_raises(make_rig: Any) -> None:
    rig = make_rig()
    rig.backend.submit(0, rig.gpu([list(range(4)), []]), rig.cpu([0]))
    rig.backend.close()  # lets the job in flight finish
    rig.backend.close()
    stats = rig.backend.statistics()
    assert (stats.state, stats.succeeded, stats.in_flight) == ("closed", 1, 0)
    assert [r.job_id for r in rig.backend.poll()] == [0]
    with pytest.raises(ResourceClosedError):
        rig.backend.submit(1, rig.gpu([list(range(4)), []]), rig.cpu([1]))
    assert "closed" in repr(rig.backend)


def test_repr_shows_live_counts(make_rig: Any) -> None:
    rig = make_rig()
    rig.run(rig.gpu([list(range(4)), []]), rig.cpu([0]))
    assert repr(rig.backend).endswith("[jobs: 0 in flight, 1 done, 0 failed]>")
