"""`TieringOffloadingWorker`: tiering's transfer backends behind vLLM 0.33's worker calls.

vLLM's worker-side connector hands the spec its KV caches canonicalised
(``CanonicalKVCaches``: per-block byte views, ``(num_blocks, page_bytes)``,
and which of them each KV-cache group uses), then calls ``submit_store``,
``submit_load``, ``get_finished`` and ``wait`` with its own spec types. This
module registers those views with a `tiering.transfer.KVLayout` (one
`KVCacheTensor` per view a group uses), allocates the CPU tier's host memory
(`HostMemoryPool`, ``num_chunks`` rows), and runs the jobs on a tiering
backend: ``cuda`` when the caches are on a GPU, ``cpu`` otherwise (CPU tensors
standing in for GPU memory).

A job the backend refuses at submission (a spec that does not fit the caches,
the backend closed) is not silently lost: ``submit_*`` returns False, which
vLLM's connector treats as fatal, and the reason is logged. A job that fails
while copying is reported with ``success=False``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec as VllmGPULoadStoreSpec

from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import ConfigError, TieringError
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import (
    BACKEND_NAMES,
    HostMemoryPool,
    KVCacheTensor,
    KVLayout,
    TransferBackend,
    create_backend,
    default_backend_name,
)
from tiering.transfer.memory import SHM_DIR, shm_file_name

__all__ = ["TieringOffloadingWorker", "layout_of"]

logger = logging.getLogger(__name__)

#: The backend's bound on jobs in flight here: none that vLLM's own scheduling can reach.
_NO_CAP = 1 << 62


def layout_of(kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> KVLayout:
    """The tiering layout of vLLM's canonical KV caches: group ``g`` holds the views it uses.

    A view two groups share (groups that overlay one allocation) is registered
    once for each; a view named twice by one group (layers aliasing one
    packed allocation) once for it.
    """
    tensors: list[KVCacheTensor] = []
    for group, refs in enumerate(kv_caches.group_data_refs):
        seen: set[int] = set()
        for ref in refs:
            if ref.tensor_idx in seen:
                continue
            seen.add(ref.tensor_idx)
            canonical = kv_caches.tensors[ref.tensor_idx]
            tensor = canonical.tensor
            if tensor.dim() != 2 or tensor.shape[1] != canonical.page_size_bytes:
                raise ConfigError(
                    f"KV cache view {ref.tensor_idx} of group {group} has shape "
                    f"{tuple(tensor.shape)}; tiering needs (num_blocks, page_size_bytes="
                    f"{canonical.page_size_bytes}) bytes"
                )
            if not tensor.is_contiguous():
                raise ConfigError(
                    f"KV cache view {ref.tensor_idx} of group {group} is strided (strides "
                    f"{tuple(tensor.stride())}): its blocks are interleaved with other bytes, "
                    "a layout tiering's backends do not copy; use vLLM's CPUOffloadingSpec"
                )
            tensors.append(
                KVCacheTensor(
                    tensor,
                    int(tensor.shape[0]),
                    int(canonical.page_size_bytes),
                    group=group,
                )
            )
    if not tensors:
        raise ConfigError("vLLM registered no KV cache views for offloading")
    return KVLayout(tensors, blocks_per_chunk)


class TieringOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` over a tiering backend and a host pool of ``num_chunks``.

    ``backend`` is ``"auto"`` (``cuda`` for caches on a GPU, else ``cpu``) or
    one of `tiering.transfer.BACKEND_NAMES`. With ``shm_name`` the host pool is
    the file ``/dev/shm/tiering-<pid>-<shm_name>-row<row bytes>`` (made here,
    0600, ``<pid>`` this process; the scheduler's secondary tier maps it and
    removes the name, or `shutdown` does), so the scheduler can read the rows.
    A file a killed process left is swept at the next start (`sweep_stale_pools`).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_chunks: int,
        blocks_per_chunk: int,
        backend: str = "auto",
        shm_name: str | None = None,
    ) -> None:
        if num_chunks < 1:
            raise ConfigError(f"the CPU tier must hold at least one chunk, got {num_chunks}")
        self.layout = layout_of(kv_caches, blocks_per_chunk)
        name = default_backend_name(self.layout) if backend == "auto" else backend
        if name not in BACKEND_NAMES:
            raise ConfigError(
                f"unknown transfer backend {backend!r}; choose auto or {', '.join(BACKEND_NAMES)}"
            )
        self.num_chunks = num_chunks
        # In /dev/shm when the scheduler's secondary tier reads the rows, named after this
        # process (swept once it is gone) and the row size (the scheduler, without the
        # layout, reads it there).
        shared = None
        if shm_name is not None:
            shared = shm_file_name(f"{shm_name}-row{self.layout.row_bytes}")
        try:
            self.pool = HostMemoryPool(self.layout.pool_bytes(num_chunks), shm_name=shared)
        except FileExistsError:
            raise ConfigError(
                f"{SHM_DIR}/{shared} exists: this process holds the CPU tier of an engine "
                "with this engine_id (kv_transfer_config.engine_id) still; shut that one "
                "down first, or give this engine another engine_id"
            ) from None
        try:
            # vLLM bounds the jobs itself (a load and a store per request per step) and
            # treats a refused submission as fatal, so the backend adds no cap of its own.
            self.backend: TransferBackend = create_backend(
                name, self.layout, self.pool, max_in_flight=_NO_CAP
            )
        except BaseException:
            self.pool.close()
            raise
        self.backend_name = name

    def _submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        try:
            self.backend.submit(job_id, _tiering_spec(src), _tiering_spec(dst))
        except TieringError as exc:
            logger.error("tiering refused transfer job %d: %s", job_id, exc)
            return False
        return True

    def submit_store(
        self, job_id: int, src_spec: VllmGPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, src_spec, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: VllmGPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # Expedited loads are waited on within the step; the backend's load queue is
        # first come, first served, so nothing queues them behind later loads.
        return self._submit(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        results = []
        for result in self.backend.poll():
            if not result.success:
                logger.error("tiering transfer job %d failed: %s", result.job_id, result.error)
            results.append(
                TransferResult(
                    job_id=result.job_id,
                    success=result.success,
                    transfer_size=result.nbytes if result.success else None,
                    transfer_time=result.seconds if result.success else None,
                )
            )
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        self.backend.wait(set(job_ids))

    def shutdown(self) -> None:
        self.backend.close()
        self.pool.close()

    def __repr__(self) -> str:
        return f"<TieringOffloadingWorker {self.backend_name}, {self.num_chunks} chunks>"


def _tiering_spec(spec: object) -> GPULoadStoreSpec | CPULoadStoreSpec:
    """vLLM's GPU or CPU spec as tiering's (the same ids; tiering checks them at submit)."""
    if isinstance(spec, VllmGPULoadStoreSpec):
        return GPULoadStoreSpec(
            spec.block_ids,
            group_sizes=list(spec.group_sizes),
            block_indices=list(spec.block_indices),
        )
    block_ids = getattr(spec, "block_ids", None)
    if block_ids is None:
        raise ConfigError(
            f"tiering's worker moves GPU and CPU block-id specs, got a {type(spec).__name__}"
        )
    return CPULoadStoreSpec(block_ids)
