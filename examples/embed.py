"""Embed a TieringEngine: offload a request's KV blocks, then load them back elsewhere."""

import asyncio

import torch

from tiering import GPULoadStoreSpec, OffloadingConfig, TieringEngine, make_offload_key


async def main() -> None:
    layers = ["model.layers.0.attn", "model.layers.1.attn"]
    config = OffloadingConfig.for_full_attention(
        layers, model="example/tiny", dtype="bfloat16", tokens_per_block=16
    )
    # One block-major KV tensor per layer: (num_blocks, K and V, 16 tokens, 8 heads, 64).
    kv = {name: torch.randn(64, 2, 16, 8, 64, dtype=torch.bfloat16) for name in layers}
    original = {name: t.clone() for name, t in kv.items()}
    keys = [make_offload_key(h) for h in (0x5EED01, 0x5EED02, 0x5EED03)]  # a hash per block
    async with TieringEngine(config, kv, cpu_bytes=64 << 20) as engine:
        store = await engine.submit_store(keys, GPULoadStoreSpec([0, 1, 2]))
        await engine.flush([0, 1, 2])  # GPU blocks 0-2 may be reused from here on
        stored = await store
        for t in kv.values():
            t.zero_()  # reused: their contents are gone
        found = engine.lookup(keys)  # 3 ready, 0 pending, 0 missing
        load = await engine.submit_load(keys[: found.ready], GPULoadStoreSpec([10, 11, 12]))
        loaded = await load
    same = all(torch.equal(kv[name][10:13], original[name][0:3]) for name in layers)
    if not (stored.success and loaded.success and same):
        raise SystemExit(f"round trip failed: {stored}, {loaded}, bytes equal: {same}")
    print(f"stored and loaded {found.ready} chunks ({loaded.nbytes} bytes): bytes verified")


if __name__ == "__main__":
    asyncio.run(main())
