"""Build an `OffloadingConfig` from a live vLLM configuration, without importing vLLM.

The seed is the original code this project started from (``../shared/DESIGN.md``).
`build_offloading_config` follows the seed's version of vLLM's function of that
name (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py``) and
the helpers it calls (``resolve_kv_cache_block_sizes`` for the prefix-hash block
size, as vLLM 0.33 resolves it; the offloading scheduler's
``get_sliding_window_size_in_chunks``). It is what tiering's own engine and CLI
use. vLLM 0.33's function has moved on (``docs/vllm.md`` lists where the two
differ); inside vLLM a spec is handed vLLM's own ``OffloadingConfig``, which
`from_vllm_offloading_config` converts losslessly. Where vLLM asserts, this
module raises a `ConfigError` that says what was wrong, the value, and what
would be right.

Duck typing
-----------
Any objects with the attributes below work; a missing required attribute is a
`ConfigError` naming its path (e.g. ``vllm_config.parallel_config.rank``).

``vllm_config``
    ``kv_transfer_config.{engine_id, kv_connector_extra_config}``;
    ``parallel_config.{rank, world_size, tensor_parallel_size,
    pipeline_parallel_size, decode_context_parallel_size, data_parallel_index}``;
    ``cache_config.{block_size, cache_dtype}``;
    ``model_config.{model, dtype, max_model_len}``.
    Optional, with vLLM's meaning when absent: ``kv_events_config`` (None: no
    events), ``use_v2_model_runner`` (False),
    ``parallel_config.prefill_context_parallel_size`` (1),
    ``parallel_config.data_parallel_size`` (0: unknown),
    ``parallel_config.data_parallel_rank_local`` (None),
    ``cache_config.prefix_match_unit`` (None: the GCD of the prefix-cacheable
    group block sizes), ``cache_config.kv_cache_layout`` (None).
``kv_cache_config``
    ``num_blocks``, ``kv_cache_tensors[i].size`` (and ``block_stride``, 0 when
    absent: vLLM releases before packed layouts have none),
    ``kv_cache_groups[i].{layer_names, kv_cache_spec}``, and
    ``kv_cache_spec.block_size``; optional: ``kv_cache_spec.prefix_cacheable``
    (True) and, for a Mamba spec, ``mamba_cache_mode`` (else
    ``cache_config.mamba_cache_mode``, else vLLM's default ``"none"``).

KV-cache spec kinds are recognised by the class names in the spec's MRO, as
vLLM names them, so a subclass of a vLLM spec is that kind:

- ``SlidingWindowSpec`` / ``SlidingWindowMLASpec``: a sliding window of
  ``spec.sliding_window`` tokens;
- ``MambaSpec``: one state, a window of one chunk;
- ``FullAttentionSpec`` (``MLAAttentionSpec`` is one): no window;
- ``UniformTypeKVCacheSpecs``: the kind of its first ``kv_cache_specs`` value.

Any other kind (chunked-local, cross-attention, ...) is refused, as in vLLM.
For ``is_parallelism_agnostic`` the single group's spec must also have
``num_kv_heads`` and ``model_config`` a ``get_total_num_kv_heads()`` method.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec
from msgspec import Meta

from tiering._decode import decode, shown
from tiering.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from tiering.errors import ConfigError
from tiering.integrations.vllm.duck import (
    as_int,
    as_iterable,
    attr,
    attr_int,
    from_vllm_offloading_config,
)

__all__ = [
    "build_offloading_config",
    "extra_int",
    "from_vllm_offloading_config",
    "is_kv_cache_tensor_packed",
]

_SLIDING_WINDOW_SPECS = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec"})
_MAMBA_SPEC = "MambaSpec"
_FULL_ATTENTION_SPEC = "FullAttentionSpec"
_MLA_SPEC = "MLAAttentionSpec"
_UNIFORM_SPECS = "UniformTypeKVCacheSpecs"
_KNOWN_SPECS = "FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec or MambaSpec"


# --- reading duck-typed objects --------------------------------------------------------


def _class_names(spec: object) -> frozenset[str]:
    return frozenset(cls.__name__ for cls in type(spec).__mro__)


def _layer_specs(spec: object, path: str) -> list[object]:
    """The per-layer specs of a group's spec (every value of a uniform-type spec)."""
    if _UNIFORM_SPECS not in _class_names(spec):
        return [spec]
    inner = attr(spec, path, "kv_cache_specs")
    if not isinstance(inner, Mapping) or not inner:
        raise ConfigError(f"{path}.kv_cache_specs must be a non-empty mapping, got {inner!r}")
    return list(inner.values())


def _layer_kind_spec(spec: object, path: str) -> object:
    """The spec that says what kind of layers a group holds (unwraps uniform-type specs)."""
    return _layer_specs(spec, path)[0]


def is_kv_cache_tensor_packed(kv_cache_tensor: object) -> bool:
    """Whether a vLLM ``KVCacheTensor`` uses a packed layout (a non-zero ``block_stride``).

    A tensor without ``block_stride`` (vLLM releases before packed layouts)
    or with ``block_stride`` None is not packed. A negative or non-integer
    stride is a `ConfigError`.
    """
    stride = getattr(kv_cache_tensor, "block_stride", 0)
    if stride is None:
        return False
    return as_int(stride, "kv_cache_tensor.block_stride", 0) != 0


# --- the pieces of the config ----------------------------------------------------------


def _tokens_per_hash(
    vllm_config: object, block_sizes: Sequence[int], specs: Sequence[object]
) -> int:
    """The prefix-hash block size, as vLLM 0.33's ``resolve_kv_cache_block_sizes`` resolves it.

    An offloading connector is always configured here, so block hashing is
    active. One group: its block size (x DCP x PCP, the seed's tokens per
    block); a ``prefix_match_unit`` other than that is refused, as in vLLM.
    Several groups: the whole scheduler block (the LCM) when a Mamba group is
    not in ``"align"`` mode, else ``prefix_match_unit`` when set, else the GCD
    of the prefix-cacheable groups' block sizes (of all, where none is).
    """
    cache_config = attr(vllm_config, "vllm_config", "cache_config")
    cache_path = "vllm_config.cache_config"
    parallel_config = attr(vllm_config, "vllm_config", "parallel_config")
    parallel_path = "vllm_config.parallel_config"
    dcp = attr_int(parallel_config, parallel_path, "decode_context_parallel_size", 1)
    pcp = attr_int(parallel_config, parallel_path, "prefill_context_parallel_size", 1, 1)
    cache_block_size = attr_int(cache_config, cache_path, "block_size", 1)
    requested = attr(cache_config, cache_path, "prefix_match_unit", None)
    unit = None if requested is None else as_int(requested, f"{cache_path}.prefix_match_unit", 1)
    if len(block_sizes) <= 1:
        size = cache_block_size * dcp * pcp
        if block_sizes and unit is not None and unit != size:
            raise ConfigError(
                f"{cache_path}.prefix_match_unit={unit}, but with a single KV-cache group "
                f"prefix-cache hits land on its block of {size} tokens; unset it or set it "
                f"to {size}"
            )
        return size
    if dcp != 1 or pcp != 1:
        raise ConfigError(
            f"the model has {len(block_sizes)} KV-cache groups (a hybrid model) and runs with "
            f"decode_context_parallel_size={dcp}, prefill_context_parallel_size={pcp}; "
            "hybrid KV-cache groups do not support context parallelism: set both to 1"
        )
    default_mode = attr(cache_config, cache_path, "mamba_cache_mode", "none")
    for index, spec in enumerate(specs):
        path = f"kv_cache_config.kv_cache_groups[{index}].kv_cache_spec"
        for layer_spec in _layer_specs(spec, path):
            if _MAMBA_SPEC not in _class_names(layer_spec):
                continue
            if getattr(layer_spec, "mamba_cache_mode", default_mode) != "align":
                # Mamba groups outside "align" mode break divisibility: hash whole
                # scheduler blocks.
                return math.lcm(*block_sizes)
    hashing = [
        size
        for size, spec in zip(block_sizes, specs, strict=True)
        if getattr(spec, "prefix_cacheable", True)
    ] or list(block_sizes)
    if unit is None:
        return math.gcd(*hashing)
    if any(size % unit for size in hashing):
        raise ConfigError(
            f"{cache_path}.prefix_match_unit={unit} does not divide every prefix-cacheable "
            f"KV-cache group block size {hashing}; use a common divisor, e.g. their GCD "
            f"{math.gcd(*hashing)}, or leave it unset"
        )
    return unit


#: An integer, or a string of one, as vLLM's extra config allows.
_IntLike = Annotated[int | str | None, Meta(description="an integer")]


class _ExtraKeys(msgspec.Struct, frozen=True, kw_only=True):
    """The chunk-size keys of ``kv_connector_extra_config`` (the other keys are vLLM's,
    or another spec's: not refused). ``canonical_layout`` is read apart, for the
    message that says what vLLM would make of a string."""

    block_size: _IntLike = None
    blocks_per_chunk: _IntLike = None


def extra_int(
    value: int | str | None, key: str, minimum: int = 1, right: str = "a positive integer"
) -> int | None:
    """``value`` of the ``kv_connector_extra_config`` key ``key`` as vLLM's ``int()`` reads
    it (an int, or a string of one; not a float, which ``int()`` would cut), at least
    ``minimum`` (``right`` says what is right, in words); None stays None."""
    if value is None:
        return None
    where = f"kv_connector_extra_config[{key!r}]"
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
        if number is None or number < minimum:
            raise ConfigError(f"{where} must be {right}, got {shown(value, key)}")
        return number
    return as_int(value, where, minimum)


def _blocks_per_chunk(extra: _ExtraKeys, tokens_per_block: Sequence[int]) -> int:
    """GPU blocks per chunk, from ``block_size`` (tokens per chunk) or ``blocks_per_chunk``."""
    tokens_per_chunk = extra_int(extra.block_size, "block_size")
    blocks_per_chunk = extra_int(extra.blocks_per_chunk, "blocks_per_chunk")
    if tokens_per_chunk is not None and blocks_per_chunk is not None:
        raise ConfigError(
            f"kv_connector_extra_config sets both 'block_size' ({tokens_per_chunk} tokens per "
            f"chunk) and 'blocks_per_chunk' ({blocks_per_chunk}); set only one of them"
        )
    if blocks_per_chunk is not None:
        return blocks_per_chunk
    if tokens_per_chunk is None:
        return 1
    distinct = sorted(set(tokens_per_block))
    if len(distinct) != 1:
        raise ConfigError(
            f"kv_connector_extra_config['block_size']={tokens_per_chunk} needs every KV-cache "
            f"group to have the same block size, but the groups have tokens_per_block "
            f"{list(tokens_per_block)}; remove 'block_size' (or use 'blocks_per_chunk') for "
            "this model"
        )
    block = distinct[0]
    if tokens_per_chunk % block:
        lower = max(block, tokens_per_chunk // block * block)
        raise ConfigError(
            f"kv_connector_extra_config['block_size']={tokens_per_chunk} is not a multiple of "
            f"the GPU block size {block} tokens; use a multiple such as {lower} or "
            f"{lower + block}"
        )
    return tokens_per_chunk // block


def _window_in_chunks(spec: object, path: str, tokens_per_chunk: int) -> int | None:
    """Chunks a request needs in a group of this spec; None for full attention."""
    kind_spec = _layer_kind_spec(spec, path)
    kinds = _class_names(kind_spec)
    if kinds & _SLIDING_WINDOW_SPECS:
        window = attr_int(kind_spec, path, "sliding_window", 1)
        return -(-window // tokens_per_chunk)
    if _MAMBA_SPEC in kinds:
        return 1  # a Mamba layer depends on one state: its last chunk
    if _FULL_ATTENTION_SPEC in kinds:
        return None
    raise ConfigError(
        f"{path} is a {type(kind_spec).__name__}; offloading supports KV-cache groups of "
        f"{_KNOWN_SPECS} specs"
    )


def _worker_kv_bytes_per_block(kv_cache_config: object) -> int:
    path = "kv_cache_config"
    num_blocks = attr_int(kv_cache_config, path, "num_blocks", 0)
    if num_blocks == 0:
        return 0  # the scheduler side does not know the GPU layout
    tensors = list(
        as_iterable(attr(kv_cache_config, path, "kv_cache_tensors"), path, "kv_cache_tensors")
    )
    packed = [is_kv_cache_tensor_packed(tensor) for tensor in tensors]
    is_packed = any(packed)
    if is_packed and not all(packed):
        raise ConfigError(
            f"{path}.kv_cache_tensors mixes packed tensors (non-zero block_stride, indices "
            f"{[i for i, p in enumerate(packed) if p]}) with unpacked ones (indices "
            f"{[i for i, p in enumerate(packed) if not p]}); all must use one layout"
        )
    sizes = [
        attr_int(tensor, f"{path}.kv_cache_tensors[{index}]", "size", 0)
        for index, tensor in enumerate(tensors)
    ]
    # Packed tensors are views of one allocation: the first one's size is the whole.
    total = sizes[0] if is_packed else sum(sizes)
    return total // num_blocks


def _is_parallelism_agnostic(
    vllm_config: object, specs: Sequence[object], dcp: int, pcp: int, tp: int
) -> bool:
    """True only for one full-attention, non-MLA group whose heads are sharded, not replicated.

    Also false for the V2 model runner (its layout is not known to be agnostic),
    under context parallelism (tokens are sharded across ranks) and with
    per-token-head KV quantization (scales ride with the layout).
    """
    if attr(vllm_config, "vllm_config", "use_v2_model_runner", False):
        return False
    if len(specs) != 1 or dcp != 1 or pcp != 1:
        return False
    spec = specs[0]
    kinds = _class_names(spec)
    if _FULL_ATTENTION_SPEC not in kinds or _MLA_SPEC in kinds:
        return False
    quant_mode = getattr(spec, "kv_quant_mode", None)
    if getattr(quant_mode, "is_per_token_head", False):
        return False
    path = "kv_cache_config.kv_cache_groups[0].kv_cache_spec"
    heads = attr_int(spec, path, "num_kv_heads", 1)
    model_config = attr(vllm_config, "vllm_config", "model_config")
    total_heads = attr(model_config, "vllm_config.model_config", "get_total_num_kv_heads")
    if not callable(total_heads):
        raise ConfigError("vllm_config.model_config.get_total_num_kv_heads must be a method")
    total = as_int(total_heads(), "vllm_config.model_config.get_total_num_kv_heads()", 1)
    return heads * tp == total


def _cache_dtype(vllm_config: object) -> str:
    cache_config = attr(vllm_config, "vllm_config", "cache_config")
    dtype = attr(cache_config, "vllm_config.cache_config", "cache_dtype")
    where = "vllm_config.cache_config.cache_dtype"
    if dtype == "auto":
        model_config = attr(vllm_config, "vllm_config", "model_config")
        dtype = attr(model_config, "vllm_config.model_config", "dtype")
        where = "vllm_config.model_config.dtype"
    text = str(dtype)
    if not (isinstance(dtype, str) and dtype) and not text.startswith("torch."):
        raise ConfigError(
            f"{where} must be a dtype name such as 'bfloat16' or a torch.dtype, got {dtype!r}"
        )
    return text.removeprefix("torch.")


# --- the entry point --------------------------------------------------------------------


def build_offloading_config(vllm_config: object, kv_cache_config: object) -> OffloadingConfig:
    """The `OffloadingConfig` vLLM builds for this engine, from duck-typed vLLM objects.

    Guarantees, with vLLM's semantics:

    - one group per KV-cache group, in order; ``tokens_per_block`` is the
      group's block size × decode × prefill context-parallel size;
    - every ``tokens_per_block`` is a multiple of ``cache.tokens_per_hash``;
    - ``cache.blocks_per_chunk`` comes from ``kv_connector_extra_config``:
      ``block_size`` (tokens per chunk; every group must have the same block
      size, which must divide it) or ``blocks_per_chunk``; 1 by default;
    - ``sliding_window_size_in_chunks`` is ceil(window / tokens per chunk) for
      a sliding-window group, 1 for a Mamba group, None for full attention;
    - ``worker_kv_bytes_per_block`` is the first tensor's size when the KV
      tensors are packed (all must be), else the sum of their sizes, divided
      by ``num_blocks``; 0 when ``num_blocks`` is 0 (the scheduler side);
    - ``parallel.is_parallelism_agnostic`` as `_is_parallelism_agnostic` says
      (vLLM 0.33 widens it under ``canonical_layout``; the seed does not);
    - each group's ``group_id`` is its index in ``kv_cache_groups`` (the seed
      offloads every group);
    - ``parallel.data_parallel_size`` and ``data_parallel_rank_local`` are
      ``parallel_config``'s (0 and None where it has none), ``kv_cache_layout``
      is ``cache_config.kv_cache_layout`` (None where unset);
    - ``canonical_layout`` is ``kv_connector_extra_config['canonical_layout']``,
      which must be a bool (False when absent);
    - ``replicated_layout`` is always False: vLLM's rule reads what the seed's
      inputs do not carry (``model_config.use_mla``,
      ``kv_cache_config.kv_tp_replicas``, the executor backend, the nodes per DP
      rank), so the seed never claims one host copy serves every worker.

    Every problem, including a missing attribute, is a `ConfigError`.
    """
    transfer = attr(vllm_config, "vllm_config", "kv_transfer_config")
    if transfer is None:
        raise ConfigError(
            "vllm_config.kv_transfer_config is None; offloading needs a KV transfer config "
            "(vLLM's --kv-transfer-config naming an offloading connector)"
        )
    transfer_path = "vllm_config.kv_transfer_config"
    extra = attr(transfer, transfer_path, "kv_connector_extra_config")
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping) or not all(isinstance(key, str) for key in extra):
        raise ConfigError(
            f"{transfer_path}.kv_connector_extra_config must be a mapping with string keys, "
            f"got {shown(extra)}"
        )
    engine_id = attr(transfer, transfer_path, "engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        raise ConfigError(
            f"{transfer_path}.engine_id must be a non-empty string, got {engine_id!r}; "
            "vLLM sets one per data-parallel rank (or pass --kv-transfer-config with engine_id)"
        )

    parallel_config = attr(vllm_config, "vllm_config", "parallel_config")
    parallel_path = "vllm_config.parallel_config"
    dcp = attr_int(parallel_config, parallel_path, "decode_context_parallel_size", 1)
    pcp = attr_int(parallel_config, parallel_path, "prefill_context_parallel_size", 1, 1)
    tp = attr_int(parallel_config, parallel_path, "tensor_parallel_size", 1)

    groups_path = "kv_cache_config.kv_cache_groups"
    raw_groups = list(
        as_iterable(
            attr(kv_cache_config, "kv_cache_config", "kv_cache_groups"),
            "kv_cache_config",
            "kv_cache_groups",
        )
    )
    specs: list[object] = []
    block_sizes: list[int] = []
    layer_names: list[tuple[str, ...]] = []
    for index, group in enumerate(raw_groups):
        path = f"{groups_path}[{index}]"
        spec = attr(group, path, "kv_cache_spec")
        specs.append(spec)
        block_sizes.append(attr_int(spec, f"{path}.kv_cache_spec", "block_size", 1))
        names = tuple(as_iterable(attr(group, path, "layer_names"), path, "layer_names"))
        if not all(isinstance(name, str) for name in names):
            raise ConfigError(f"{path}.layer_names must hold strings, got {list(names)!r}")
        layer_names.append(names)

    tokens_per_block = [size * dcp * pcp for size in block_sizes]
    tokens_per_hash = _tokens_per_hash(vllm_config, block_sizes, specs)
    for index, tokens in enumerate(tokens_per_block):
        if tokens % tokens_per_hash:
            raise ConfigError(
                f"KV-cache group {index} has tokens_per_block={tokens} (block size "
                f"{block_sizes[index]} x dcp {dcp} x pcp {pcp}), which is not a multiple of "
                f"tokens_per_hash={tokens_per_hash}, the prefix-hash block size. Hybrid models "
                "(e.g. Mamba + attention) need prefix caching enabled (--enable-prefix-caching) "
                "so that every group's block size aligns with the hash block size"
            )

    keys = decode(_ExtraKeys, dict(extra), where="kv_connector_extra_config")  # as extra_int
    blocks_per_chunk = _blocks_per_chunk(keys, tokens_per_block)
    groups = tuple(
        OffloadingGroupConfig(
            tokens_per_block=tokens,
            layer_names=names,
            sliding_window_size_in_chunks=_window_in_chunks(
                spec, f"{groups_path}[{index}].kv_cache_spec", tokens * blocks_per_chunk
            ),
            group_id=index,
        )
        for index, (spec, tokens, names) in enumerate(
            zip(specs, tokens_per_block, layer_names, strict=True)
        )
    )

    events_config = attr(vllm_config, "vllm_config", "kv_events_config", None)
    enable_events = events_config is not None and bool(
        attr(events_config, "vllm_config.kv_events_config", "enable_kv_cache_events")
    )
    canonical_layout = extra.get("canonical_layout", False)
    if not isinstance(canonical_layout, bool):
        raise ConfigError(
            f"{transfer_path}.kv_connector_extra_config['canonical_layout'] must be true or "
            f"false, got {canonical_layout!r} of type {type(canonical_layout).__name__} "
            "(vLLM would take any value by its truth, the string 'false' as true)"
        )
    cache_config = attr(vllm_config, "vllm_config", "cache_config")
    kv_cache_layout = attr(cache_config, "vllm_config.cache_config", "kv_cache_layout", None)
    if kv_cache_layout is not None and not (isinstance(kv_cache_layout, str) and kv_cache_layout):
        raise ConfigError(
            "vllm_config.cache_config.kv_cache_layout must be the name of a KVCacheLayout "
            f"(e.g. 'LBNHC') or None, got {kv_cache_layout!r}"
        )
    dp_rank_local = attr(parallel_config, parallel_path, "data_parallel_rank_local", None)
    model_config = attr(vllm_config, "vllm_config", "model_config")
    model_path = "vllm_config.model_config"
    model_name = attr(model_config, model_path, "model")
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError(f"{model_path}.model must be a non-empty string, got {model_name!r}")
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=_worker_kv_bytes_per_block(kv_cache_config),
        enable_kv_cache_events=enable_events,
        extra_config=dict(extra),
        engine_id=engine_id,
        model=OffloadingModelConfig(
            name=model_name,
            dtype=_cache_dtype(vllm_config),
            max_model_len=attr_int(model_config, model_path, "max_model_len", 0),
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=attr_int(parallel_config, parallel_path, "rank", 0),
            world_size=attr_int(parallel_config, parallel_path, "world_size", 1),
            tp_size=tp,
            pp_size=attr_int(parallel_config, parallel_path, "pipeline_parallel_size", 1),
            pcp_size=pcp,
            dcp_size=dcp,
            data_parallel_index=attr_int(parallel_config, parallel_path, "data_parallel_index", 0),
            is_parallelism_agnostic=_is_parallelism_agnostic(vllm_config, specs, dcp, pcp, tp),
            data_parallel_size=attr_int(parallel_config, parallel_path, "data_parallel_size", 0, 0),
            data_parallel_rank_local=(
                None
                if dp_rank_local is None
                else as_int(dp_rank_local, f"{parallel_path}.data_parallel_rank_local", 0)
            ),
        ),
        replicated_layout=False,
        canonical_layout=canonical_layout,
        kv_cache_layout=kv_cache_layout,
    )
