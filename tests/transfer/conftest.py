"""Rigs for the transfer tests: KV tensors, a pool and a backend, by backend name.

Test modules reach the helpers through the fixtures (``rig.gpu(...)``,
``rig.cpu(...)``), never by importing this file, so they work in every pytest
import mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from tiering.cpu.common import CPULoadStoreSpec
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import (
    HostMemoryPool,
    KVCacheTensor,
    KVLayout,
    TransferBackend,
    TransferResult,
    create_backend,
)

HAS_CUDA = torch.cuda.is_available()

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("mock", id="mock"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")],
    ),
]


@dataclass
class Rig:
    """KV tensors (one per ``(group, page_bytes)``), a pool and a backend over them."""

    layout: KVLayout
    pool: HostMemoryPool
    backend: TransferBackend
    kv: list[torch.Tensor]
    num_chunks: int
    next_id: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(1234))

    @property
    def bpc(self) -> int:
        return self.layout.blocks_per_chunk

    def randomize(self) -> None:
        """Fill every KV tensor with fresh random bytes."""
        for t in self.kv:
            data = self.rng.integers(0, 256, size=t.numel(), dtype=np.uint8)
            t.view(-1).copy_(torch.from_numpy(data).to(t.device))

    def snapshot(self) -> list[torch.Tensor]:
        return [t.detach().cpu().clone() for t in self.kv]

    def tensors_of(self, group: int) -> list[int]:
        return list(self.layout.group_tensors[group])

    @staticmethod
    def gpu(groups: Sequence[Sequence[int]], indices: Sequence[int] | None = None) -> Any:
        """A GPU spec with one list of block ids per group."""
        return gpu_spec(groups, indices)

    @staticmethod
    def cpu(chunks: Sequence[int]) -> Any:
        return cpu_spec(chunks)

    def run(self, src: Any, dst: Any) -> TransferResult:
        """Submit one job, wait for it, and return its result."""
        job_id = self.next_id
        self.next_id += 1
        self.backend.submit(job_id, src, dst)
        assert self.backend.wait([job_id], timeout=60)
        results = self.backend.poll()
        assert [r.job_id for r in results] == [job_id]
        return results[0]


def gpu_spec(groups: Sequence[Sequence[int]], indices: Sequence[int] | None = None) -> Any:
    flat = [b for g in groups for b in g]
    return GPULoadStoreSpec(flat, [len(g) for g in groups], indices)


def cpu_spec(chunks: Sequence[int]) -> Any:
    return CPULoadStoreSpec(list(chunks))


RigFactory = Callable[..., Rig]


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def make_rig(backend_name: str) -> Iterator[RigFactory]:
    """``make_rig(pages=[(group, page_bytes), ...], num_blocks=, bpc=, num_chunks=, **kw)``."""
    made: list[Rig] = []
    device = torch.device("cuda" if backend_name == "cuda" else "cpu")

    def make(
        pages: Sequence[tuple[int, int]] = ((0, 4096), (0, 1024), (1, 2048)),
        *,
        num_blocks: int = 32,
        bpc: int = 4,
        num_chunks: int = 16,
        **kwargs: Any,
    ) -> Rig:
        kv = [torch.zeros(num_blocks, page, dtype=torch.uint8, device=device) for _, page in pages]
        layout = KVLayout(
            [
                KVCacheTensor(t, num_blocks=num_blocks, page_bytes=page, group=g)
                for t, (g, page) in zip(kv, pages, strict=True)
            ],
            blocks_per_chunk=bpc,
        )
        pool = HostMemoryPool(layout.pool_bytes(num_chunks))
        backend = create_backend(backend_name, layout, pool, **kwargs)
        rig = Rig(layout, pool, backend, kv, num_chunks)
        rig.randomize()
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.backend.close()
        rig.pool.close()
