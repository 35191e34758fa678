"""vLLM 0.33's engine core minus the model: its real `Scheduler`, with a connector, on CPU.

`build_engine` builds what vLLM's ``EngineCore`` builds before it schedules:
a ``VllmConfig`` for a model folder that holds only a ``config.json``, the KV
cache config from vLLM's own planner (``get_kv_cache_configs``), the block
sizes from ``resolve_kv_cache_block_sizes``, and the ``Scheduler`` with the KV
connector named in ``kv_transfer_config`` (vLLM's ``OffloadingConnector`` by
default). Nothing of vLLM is stubbed. What the model runner would do is done
by `Engine.step`: it takes the connector's metadata, completes the transfer
jobs it carries (through an `OffloadingWorker` when one is given, so real
bytes move; else at once), samples one token per request whose prompt is
computed, and feeds vLLM's ``update_from_output``.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.kv_offload.base import OffloadingWorker
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

#: A small Llama: 2 layers, 2 KV heads of 64 (a 16-token block is 8 KiB per layer).
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
}
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(MODEL["num_hidden_layers"]))


def write_model(folder: Path, **overrides: Any) -> Path:
    """A model folder vLLM accepts with no weights and no tokenizer: a ``config.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**MODEL, **overrides}))
    return folder


def attention_spec(block_size: int = 16, tp: int = 1) -> FullAttentionSpec:
    """One worker's attention spec at tensor-parallel size ``tp`` (its share of the KV
    heads, as vLLM splits them: at least one)."""
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=max(1, MODEL["num_key_value_heads"] // tp),
        head_size=MODEL["head_dim"],
        dtype=torch.float16,
    )


def build_vllm_config(
    model: Path,
    extra_config: Mapping[str, Any],
    *,
    block_size: int = 16,
    max_model_len: int = 16384,
    max_num_batched_tokens: int = 16384,
    max_num_seqs: int = 64,
    kv_events: KVEventsConfig | None = None,
    connector: str = "OffloadingConnector",
    enable_prefix_caching: bool = True,
    tp: int = 1,
) -> VllmConfig:
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float16"
        ),
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra_config),
        ),
        kv_events_config=kv_events,
    )
    # What the engine core resolves from its workers' attention backends.
    config.cache_config.kv_cache_layout = "LBNHC"
    if tp > 1:  # tensor parallel on one node: the scheduler is rank 0's, as in vLLM
        config.parallel_config.tensor_parallel_size = tp
        config.parallel_config.world_size = tp
    return config


def build_kv_cache_config(
    vllm_config: VllmConfig, num_gpu_blocks: int, block_size: int = 16
) -> KVCacheConfig:
    """The scheduler's KV cache config, from vLLM's planner, for ``num_gpu_blocks`` blocks
    (each worker's, at the config's tensor-parallel size)."""
    spec = attention_spec(block_size, vllm_config.parallel_config.tensor_parallel_size)
    specs = [dict.fromkeys(LAYERS, spec)]
    groups = get_global_kv_cache_groups(vllm_config, specs)
    memory = spec.page_size_bytes * len(LAYERS) * num_gpu_blocks
    (worker_config,) = get_kv_cache_configs(vllm_config, specs, [memory], groups)
    config = generate_scheduler_kv_cache_config([worker_config])
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    return config


def block_pattern(block_hash: bytes, layer: int, page_bytes: int, rank: int = 0) -> torch.Tensor:
    """The bytes the fake model writes in every page of a full block: its hash, repeated
    (and the worker's rank beyond rank 0: each rank's pages of a block differ)."""
    seed = block_hash + layer.to_bytes(2, "big") + (rank.to_bytes(2, "big") if rank else b"")
    reps = -(-page_bytes // len(seed))
    return torch.frombuffer(bytearray(seed * reps), dtype=torch.uint8)[:page_bytes]


class FakeModel:
    """The worker side of vLLM's offloading, with real bytes and a model that writes KV.

    Builds vLLM's own ``OffloadingConnector`` in the WORKER role and registers
    CPU tensors laid out as vLLM's planner placed them, so the spec's worker
    is made by vLLM's ``register_kv_caches`` and driven by vLLM's own worker
    calls. The "model" writes `block_pattern` of a block's hash into every
    layer's page of a block when its last token is computed, and `verify`
    checks the pages a request starts from (loaded or prefix-cached) hold them.
    """

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        self.num_blocks = kv_cache_config.num_blocks
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.rank = vllm_config.parallel_config.rank
        self.pages: dict[str, torch.Tensor] = {}
        self._buffers = []
        for placement in kv_cache_config.kv_cache_tensors:
            buffer = torch.zeros(placement.size, dtype=torch.uint8)
            self._buffers.append(buffer)
            for index, layer in enumerate(placement.layers):
                start = placement.offset + index * placement.layer_stride
                page = placement.block_stride
                view = buffer[start : start + page * self.num_blocks].view(self.num_blocks, page)
                self.pages[layer] = view
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        # vLLM's runner registers the caches as the attention layers see them.
        self.connector.register_kv_caches(
            {name: page.view(torch.float16) for name, page in self.pages.items()}
        )
        self.verified_blocks = 0

    @property
    def worker(self) -> OffloadingWorker:
        return self.connector.connector_worker.worker

    def wipe(self) -> None:
        """Forget every GPU page (as a GPU whose prefix cache was reset and reused)."""
        for buffer in self._buffers:
            buffer.fill_(0)

    def forward(self, scheduler: Scheduler, output: Any) -> None:
        """Write the pages of the blocks this step's tokens complete."""
        for req_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            after = request.num_computed_tokens
            before = after - count
            (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
            for j in range(before // self.block_size, after // self.block_size):
                if j < len(request.block_hashes):
                    self._write(block_ids[j], bytes(request.block_hashes[j]))

    def verify(self, scheduler: Scheduler, output: Any) -> None:
        """Every full block a scheduled request starts from holds its block's pattern."""
        for req_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            before = request.num_computed_tokens - count
            (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
            for j in range(before // self.block_size):
                expected = bytes(request.block_hashes[j])
                for layer, (name, page) in enumerate(self.pages.items()):
                    want = block_pattern(expected, layer, page.shape[1], self.rank)
                    if not torch.equal(page[block_ids[j]], want):
                        raise AssertionError(
                            f"request {req_id}: rank {self.rank}'s block {j} (GPU block "
                            f"{block_ids[j]}) of layer "
                            f"{name} does not hold its KV: corrupt or not loaded"
                        )
                    self.verified_blocks += 1

    def _write(self, block_id: int, block_hash: bytes) -> None:
        for layer, page in enumerate(self.pages.values()):
            page[block_id] = block_pattern(block_hash, layer, page.shape[1], self.rank)

    def run(self, metadata: Any) -> KVConnectorOutput | None:
        """One step of vLLM's worker-side connector calls, in the runner's order."""
        connector = self.connector
        connector.bind_connector_metadata(metadata)
        connector.handle_preemptions(metadata)
        connector.start_load_kv(None)
        connector.wait_for_save()
        _, finished_recving = connector.get_finished(set())
        meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        if not finished_recving and meta is None:
            return None
        return KVConnectorOutput(
            finished_recving=finished_recving or None, kv_connector_worker_meta=meta
        )


@dataclass
class Engine:
    """vLLM's scheduler driven step by step, as ``EngineCore.step`` drives it."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler: Scheduler
    block_hasher: Any
    #: Moves the bytes of the jobs when given (vLLM's worker calls, in its order).
    worker: OffloadingWorker | None = None
    #: vLLM's worker-side connector with real KV pages (`attach_model`): rank 0's.
    model: FakeModel | None = None
    #: Every worker's, by rank (`attach_model`; one at tensor-parallel size 1).
    models: list[FakeModel] = field(default_factory=list)
    steps: int = 0
    #: Prompt tokens the connector served, and those it was asked for (what the GPU
    #: prefix cache did not have), from vLLM's own connector prefix-cache stats.
    hit_tokens: int = 0
    queried_tokens: int = 0
    #: Seconds spent in vLLM's scheduler (``schedule`` and ``update_from_output``,
    #: which include every connector and manager call), over all steps.
    scheduler_seconds: float = 0.0
    #: The connector's counters as vLLM's metrics got them (``kv_connector_stats``), summed.
    counters: dict[str, float] = field(default_factory=dict)
    #: The same counters by their label values (``(name, labels)``, e.g. a tier's label).
    labelled: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    #: vLLM's connector stats payloads as its metrics loggers get them, in order.
    payloads: list[dict[str, Any]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    _ids: Iterable[int] = field(default_factory=itertools.count)
    _pending: dict[int, str | None] = field(default_factory=dict)  # job -> req (loads)
    _deferred_stores: list[tuple[int, Any, Any]] = field(default_factory=list)
    _aggregator: Any = None  # vLLM's KVOutputAggregator over the workers, at TP > 1

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def offloading(self) -> Any:
        """The connector's scheduler side (``OffloadingConnectorScheduler``)."""
        return self.scheduler.connector.connector_scheduler  # type: ignore[union-attr]

    @property
    def manager(self) -> Any:
        return self.offloading.manager

    def _count_stats(self, results: Mapping[int, Any]) -> None:
        for engine_outputs in results.values():
            stats = engine_outputs.scheduler_stats
            connector = stats.connector_prefix_cache_stats if stats is not None else None
            if connector is not None:
                self.hit_tokens += connector.hits + connector.preempted_hits
                self.queried_tokens += connector.queries + connector.preempted_queries
            payload = stats.kv_connector_stats if stats is not None else None
            if payload:  # what vLLM's metrics receive from the connector: counters add up
                self.payloads.append(payload)
                types, values = payload.get("types", {}), payload.get("data", {})
                for name, by_labels in values.items():
                    if types.get(name) == "counter":
                        total = sum(by_labels.values())
                        self.counters[name] = self.counters.get(name, 0) + total
                        for labels, value in by_labels.items():
                            at = (name, tuple(labels))
                            self.labelled[at] = self.labelled.get(at, 0) + value

    def add(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int = 1,
        req_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        kv_hints: Any = None,
    ) -> Request:
        """Add a request; ``kv_transfer_params`` reach vLLM as an OpenAI-compatible
        server passes them (``SamplingParams.extra_args``), ``kv_hints`` (a
        ``KvHintsEnvelope``) as the request's own."""
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        request = Request(
            request_id=req_id if req_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, extra_args=extra
            ),
            pooling_params=None,
            block_hasher=self.block_hasher,
            kv_hints=kv_hints,
        )
        self.scheduler.add_request(request)
        return request

    def attach_model(self) -> FakeModel:
        """Move real bytes from now on: vLLM's worker connector over CPU KV pages, one per
        worker (rank) at the config's world size; returns rank 0's."""
        self.models = []
        for rank in range(self.vllm_config.parallel_config.world_size):
            config = self.vllm_config
            if rank:  # each worker's own config: its rank
                config = copy.deepcopy(self.vllm_config)
                config.parallel_config.rank = rank
            self.models.append(FakeModel(config, copy.deepcopy(self.kv_cache_config)))
        self.model = self.models[0]
        return self.model

    def _run_models(self, output: Any) -> KVConnectorOutput | None:
        """Every worker's step, their outputs aggregated by vLLM's own `KVOutputAggregator`
        (a job completes once every worker has reported it)."""
        if len(self.models) == 1:
            connector_output = self.models[0].run(output.kv_connector_metadata)
            self.models[0].verify(self.scheduler, output)
            self.models[0].forward(self.scheduler, output)
            return connector_output
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        outputs = []
        for rank, model in enumerate(self.models):
            metadata = output.kv_connector_metadata
            # Each worker gets its own copy of the step's metadata, as over vLLM's RPC.
            connector_output = model.run(metadata if not rank else copy.deepcopy(metadata))
            model.verify(self.scheduler, output)
            model.forward(self.scheduler, output)
            outputs.append(
                ModelRunnerOutput(
                    req_ids=[], req_id_to_index={}, kv_connector_output=connector_output
                )
            )
        if self._aggregator is None:
            self._aggregator = KVOutputAggregator(len(self.models))
        merged = self._aggregator.aggregate(outputs).kv_connector_output  # type: ignore[union-attr]
        return None if merged is None or merged.is_empty() else merged

    def step(self) -> Any:
        """One engine step: schedule, "run the model", update. Returns the SchedulerOutput."""
        started = time.perf_counter()
        output = self.scheduler.schedule()
        self.scheduler_seconds += time.perf_counter() - started
        if self.models:
            connector_output = self._run_models(output)
        else:
            connector_output = self._run_worker(output.kv_connector_metadata)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done_prompt = request.num_computed_tokens >= request.num_prompt_tokens
            sampled.append([7] if done_prompt else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )
        started = time.perf_counter()
        results = self.scheduler.update_from_output(output, runner_output)
        self.scheduler_seconds += time.perf_counter() - started
        self._count_stats(results)
        for engine_outputs in results.values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    self.finished.append(out.request_id)
        self.steps += 1
        return output

    def run(self, max_steps: int = 100_000) -> None:
        """Step until no request is left and the connector has no work pending."""
        for _ in range(max_steps):
            if (
                not self.scheduler.has_requests()
                and not self._pending
                and not (self.manager.has_pending_work())
            ):
                return
            self.step()
        raise AssertionError(f"the engine did not go idle in {max_steps} steps")

    def _run_worker(self, metadata: Any) -> KVConnectorOutput | None:
        """The worker's side of a step: what ``OffloadingConnectorWorker`` does, in its order."""
        if metadata is None:
            return None
        assert isinstance(metadata, OffloadingConnectorMetadata), metadata
        completed: dict[int, int] = {}
        finished_recving: set[str] = set()
        worker = self.worker
        if worker is None:
            # No bytes: every job of this step completes in it.
            for job_id, job in metadata.load_jobs.items():
                completed[job_id] = 1
                if not job.sync:
                    finished_recving.add(job.req_id)
            for job_id in metadata.store_jobs:
                completed[job_id] = 1
        else:
            # Stores of the last step first (vLLM defers them a step), then flushes.
            flush = set(metadata.jobs_to_flush or ())
            for job_id in flush:
                job = metadata.store_jobs.pop(job_id, None)
                if job is not None:
                    self._deferred_stores.append((job_id, job.src_spec, job.dst_spec))
            for job_id, src, dst in self._deferred_stores:
                assert worker.submit_store(job_id, src, dst)
                self._pending[job_id] = None
            self._deferred_stores.clear()
            if flush:
                worker.wait(flush)
            sync = set()
            for job_id, job in metadata.load_jobs.items():
                self._pending[job_id] = None if job.sync else job.req_id
                assert worker.submit_load(job_id, job.src_spec, job.dst_spec, expedited=job.sync)
                if job.sync:
                    sync.add(job_id)
            if sync:
                worker.wait(sync)
            for job_id, job in metadata.store_jobs.items():
                self._deferred_stores.append((job_id, job.src_spec, job.dst_spec))
            if not metadata.store_jobs and not metadata.load_jobs and self._pending:
                worker.wait(set(self._pending))  # nothing new this step: let the rest land
            for result in worker.get_finished():
                assert result.success, result
                completed[result.job_id] = 1
                req_id = self._pending.pop(result.job_id, None)
                if req_id is not None:
                    finished_recving.add(req_id)
        if not completed and not finished_recving:
            return None
        return KVConnectorOutput(
            finished_recving=finished_recving or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=completed),
        )


def build_engine(
    model: Path,
    extra_config: Mapping[str, Any],
    *,
    num_gpu_blocks: int = 2048,
    block_size: int = 16,
    kv_events: KVEventsConfig | None = None,
    log_stats: bool = True,
    **config: Any,
) -> Engine:
    vllm_config = build_vllm_config(
        model, extra_config, block_size=block_size, kv_events=kv_events, **config
    )
    kv_cache_config = build_kv_cache_config(vllm_config, num_gpu_blocks, block_size)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    kv_cache_config.hash_block_size = hash_block_size
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(
        hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens
    )
    return Engine(vllm_config, kv_cache_config, scheduler, hasher)


def native_extra(cpu_bytes: int, **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` of vLLM's own ``CPUOffloadingSpec``."""
    return {"cpu_bytes_to_use": cpu_bytes, **extra}


def tiering_extra(cpu_bytes: int, **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` that loads `tiering.integrations.vllm.TieringSpec`."""
    return {
        "spec_name": "TieringSpec",
        "spec_module_path": "tiering.integrations.vllm",
        "cpu_bytes_to_use": cpu_bytes,
        **extra,
    }


#: The module vLLM's ``SecondaryTierFactory`` loads tiering's lower tiers from.
TIERS_MODULE = "tiering.integrations.vllm"


def disk_entry(folder: Path | str, capacity_bytes: int, **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry of tiering's disk tier over ``folder``."""
    return {
        "type": "DiskSecondaryTier",
        "module_path": TIERS_MODULE,
        "path": str(folder),
        "capacity_bytes": capacity_bytes,
        **options,
    }


def redis_entry(url: str, **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry of tiering's Redis tier at ``url``."""
    return {"type": "RedisSecondaryTier", "module_path": TIERS_MODULE, "url": url, **options}


def prometheus_text(engine: Engine) -> str:
    """What ``vllm serve``'s /metrics renders of the engine's connector stats: its
    payloads observed by vLLM's own `OffloadPromMetrics` over the spec's definitions."""
    import functools

    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    registry = prometheus_client.CollectorRegistry()
    kinds = {
        kind: functools.partial(kind, registry=registry)
        for kind in (
            prometheus_client.Gauge,
            prometheus_client.Counter,
            prometheus_client.Histogram,
        )
    }
    metrics = OffloadPromMetrics(engine.vllm_config, kinds, ["engine"], {0: ["0"]})
    for payload in engine.payloads:
        metrics.observe(payload, 0)
    return prometheus_client.generate_latest(registry).decode()


#: The Mooncake trace of the project (hash ids of 512-token blocks).
TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "conversation_trace.jsonl"
)
#: Trace tokens one hash id stands for.
TRACE_BLOCK_TOKENS = 512


def trace_prompts(path: Path, limit: int | None = None, block_size: int = 16) -> list[list[int]]:
    """The trace's requests as prompts of one vLLM block per hash id (a 512-token block
    scaled down to ``block_size`` tokens: hit rates in blocks are the trace's, 32 times
    cheaper to schedule). Equal hash-id prefixes give equal token prefixes, so vLLM's
    block hashes share exactly the prefixes the trace shares."""
    from tiering.workload.trace import read_trace

    vocab = MODEL["vocab_size"] - 1

    def block(hash_id: int) -> list[int]:  # the id in two tokens, then a filler of its own
        high, low = divmod(hash_id, vocab)
        filler = [1 + (hash_id * block_size + j) % vocab for j in range(block_size - 2)]
        return [1 + low, 1 + high, *filler]

    return [
        [token for hash_id in request.hash_ids for token in block(hash_id)]
        for request in read_trace(path, limit=limit)
    ]


def replay(engine: Engine, prompts: Sequence[Sequence[int]], batch: int = 1) -> Engine:
    """The prompts in arrival order, ``batch`` at a time; the GPU prefix cache is dropped
    before each batch, so every prefix hit is the connector's."""
    for start in range(0, len(prompts), batch):
        assert engine.scheduler.reset_prefix_cache()
        for prompt in prompts[start : start + batch]:
            engine.add(prompt)
        engine.run()
    return engine
