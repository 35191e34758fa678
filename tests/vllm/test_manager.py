"""`TieringOffloadingManager` and `TieringOffloadingWorker` under vLLM's own types."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tiering.integrations.vllm import TieringOffloadingManager, TieringOffloadingWorker


def keys(request: int, n: int) -> list[bytes]:
    return [make_offload_key(bytes([request, i]) * 16, 0) for i in range(n)]


def request(req_id: str, offered: list[bytes]) -> ReqContext:
    context = ReqContext(req_id=req_id)
    for position, key in enumerate(offered):
        context.set_offload_key_position(key, 16 * (position + 1))
    return context


def store(manager: TieringOffloadingManager, batch: list[bytes], context: ReqContext) -> bool:
    out = manager.prepare_store(batch, context)
    if out is None:
        return False
    manager.complete_store(out.keys_to_store, context)
    return True


def test_a_long_request_evicts_its_own_prefix_only_when_nothing_else_makes_room():
    manager = TieringOffloadingManager(10, "lru")
    other = keys(1, 4)
    store(manager, other, request("other", other))
    long = keys(2, 30)
    context = request("long", long)
    # 30 chunks into a tier of 10: every store succeeds, as under vLLM's native manager.
    for start in range(0, 30, 2):
        assert store(manager, long[start : start + 2], context)
    held = [key for key in long if manager.tier.holds(key)]
    assert len(held) == 10
    assert not any(manager.tier.holds(key) for key in other)  # the others went first
    assert manager.tier.statistics().allocation_failures_total == 0
    assert manager.tier.statistics().pinned == 0


def test_a_store_evicts_other_requests_chunks_before_its_own_loaded_prefix():
    manager = TieringOffloadingManager(6, "lru")
    prefix, older = keys(1, 3), keys(2, 3)
    store(manager, prefix, request("a", prefix))
    store(manager, older, request("b", older))  # newer than the prefix in LRU order
    tail = keys(3, 3)
    context = request("c", [*prefix, *tail])
    spec = manager.prepare_load(prefix, context)
    manager.complete_load(prefix, context)  # loaded: the request now uses the prefix
    assert len(spec.block_ids) == 3
    assert store(manager, tail, context)
    assert all(manager.tier.holds(key) for key in prefix)
    assert not any(manager.tier.holds(key) for key in older)


@pytest.mark.parametrize("self_describing", [False, True])
def test_a_reset_announces_removals_only_where_vllm_can_describe_them(self_describing):
    manager = TieringOffloadingManager(
        8, "aslru", enable_events=True, self_describing_events=self_describing
    )
    held = keys(1, 4)
    store(manager, held, request("a", held))
    assert [e.removed for e in manager.take_events()] == [False]
    manager.reset_cache()
    events = list(manager.take_events())
    if self_describing:
        # vLLM drops the payloads it would describe these removals with: say nothing.
        assert events == []
    else:
        assert len(events) == 1
        assert events[0].removed
        assert sorted(events[0].keys) == sorted(held)


def test_the_worker_takes_every_job_vllm_submits_past_any_backend_cap():
    pages = torch.zeros(64, 4096, dtype=torch.int8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(pages, 4096)],
        group_data_refs=[[CanonicalKVCacheRef(0, 4096)]],
    )
    worker = TieringOffloadingWorker(caches, num_chunks=8, blocks_per_chunk=1, backend="cpu")
    try:
        jobs = 5000  # past tiering's default bound of 4096 jobs in flight
        for job in range(jobs):
            src = GPULoadStoreSpec([job % 64], group_sizes=[1], block_indices=[0])
            assert worker.submit_store(job, src, CPULoadStoreSpec([job % 8]))
        worker.wait(set(range(jobs)))
        finished = worker.get_finished()
        assert len(finished) == jobs
        assert all(result.success for result in finished)
    finally:
        worker.shutdown()
