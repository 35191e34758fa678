"""An asyncio HTTP server that embeds a TieringEngine with a disk tier below its CPU tier.

    .venv/bin/python examples/server.py --disk /tmp/tiering-example [--port 8000]

It prints ``serving on http://127.0.0.1:PORT`` once it listens (``--port 0``, the
default, takes a free port), and serves, with the standard library only:

- ``GET /generate?prompt=TEXT``: one request, as an inference server runs it. The
  prompt's bytes are its tokens, 16 to a GPU block; each full block is a chunk whose
  key is its prefix hash. The chunks the CPU tier holds are loaded, those it lacks are
  promoted from the disk tier first, and the rest are "computed" (their KV bytes
  derived from their hash) and stored. The answer says how many came from where, and
  whether every loaded byte was the one computed for its chunk. A prompt of more
  blocks than the GPU KV cache has is 413; one that finds too few free now (the
  requests in flight hold them), 503: try again. An ``X-Tiering-Hint`` header carries
  the request's retention hint, as JSON (`tiering.hints`): ``{"retain_s": 600}``
  (the conversation goes on: keep its prefix), ``{"release": true}`` (it is over: its
  chunks go first), with an optional ``"priority"``; a bad one is 400, in one line.
- ``GET /metrics``: the engine's Prometheus metrics (the CPU tier's and the disk
  tier's, ``tier="cpu"`` and ``tier="disk"``).

SIGTERM or SIGINT stops it: no new connection, the write-throughs to the disk tier
finish, and the engine closes. The next start over the same ``--disk`` folder finds
what this one wrote, and serves it from the disk tier. A bad flag, config file or
size, or a port it cannot listen on, is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import msgspec
import torch
from prometheus_client import CONTENT_TYPE_LATEST

from tiering import GPULoadStoreSpec, OffloadingConfig, TieringEngine, make_offload_key
from tiering.config import load_config
from tiering.errors import ChunkStateError, TieringError
from tiering.hints import Hint, HintError, payload_hint
from tiering.metrics import render_metrics
from tiering.secondary.disk import DiskTier

CONFIG = Path(__file__).with_name("tiering.toml")  # layers, block size, dtype, engine_id
HEADS, HEAD_DIM = 8, 64  # with the config's: its worker_kv_bytes_per_block
GPU_BLOCKS = 256  # the emulated GPU KV cache's blocks, shared by the requests in flight


class EmulatedGPU:
    """The GPU KV cache as the engine sees it: one block-major tensor per layer, here on
    the CPU, ``(blocks, K and V, tokens_per_block, HEADS, HEAD_DIM)``, and the blocks
    free for requests. A server gives the engine its real KV tensors instead."""

    def __init__(self, config: OffloadingConfig) -> None:
        group = config.groups[0]
        dtype = getattr(torch, config.model.storage_dtype)
        shape = (GPU_BLOCKS, 2, group.tokens_per_block, HEADS, HEAD_DIM)
        self.kv = {name: torch.zeros(shape, dtype=dtype) for name in group.layer_names}
        self.free = list(range(GPU_BLOCKS))

    def take(self, count: int) -> list[int] | None:
        if count > len(self.free):
            return None
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def _computed(self, digest: bytes, like: torch.Tensor) -> torch.Tensor:
        """The KV bytes of the chunk of ``digest``, as attention would have made them."""
        seed = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big"))
        return torch.randn(like.shape, generator=seed).to(like.dtype)

    def compute(self, blocks: list[int], digests: list[bytes]) -> None:
        for tensor in self.kv.values():
            for block, digest in zip(blocks, digests, strict=True):
                tensor[block] = self._computed(digest, tensor[block])

    def holds(self, blocks: list[int], digests: list[bytes]) -> bool:
        """Whether ``blocks`` hold exactly what `compute` makes for ``digests``."""
        return all(
            torch.equal(tensor[block], self._computed(digest, tensor[block]))
            for tensor in self.kv.values()
            for block, digest in zip(blocks, digests, strict=True)
        )


def prefix_hashes(prompt: str, tokens_per_block: int) -> list[bytes]:
    """One hash per full block of the prompt's tokens (its UTF-8 bytes), each over the
    previous one and the block's tokens: a block's hash names its whole prefix."""
    tokens = prompt.encode()
    hashes, parent = [], b""
    for end in range(tokens_per_block, len(tokens) + 1, tokens_per_block):
        parent = hashlib.sha256(parent + tokens[end - tokens_per_block : end]).digest()
        hashes.append(parent)
    return hashes


class Refused(Exception):
    """A request not served: its HTTP status and why."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class Unusable(Exception):
    """Something the operator gave that cannot be used: one line, exit code 2."""


def request_hint(header: str | None) -> Hint | None:
    """The retention hint of a request's ``X-Tiering-Hint`` header (None without one)."""
    if header is None:
        return None
    try:
        return payload_hint(msgspec.json.decode(header), "the X-Tiering-Hint header")
    except HintError as error:
        raise Refused("400 Bad Request", str(error)) from None
    except msgspec.DecodeError as error:
        raise Refused(
            "400 Bad Request",
            f"the X-Tiering-Hint header is not JSON ({error}); "
            'send one such as {"retain_s": 600}',
        ) from None


async def generate(
    engine: TieringEngine, gpu: EmulatedGPU, prompt: str, hint: Hint | None = None
) -> dict[str, object]:
    """Serve one request's prefix: load what the tiers hold, compute and store the rest;
    its ``hint`` goes with its use and its store, and to the chunks it loaded in every
    tier (written below by earlier requests)."""
    digests = prefix_hashes(prompt, engine.config.groups[0].tokens_per_block)
    keys = [make_offload_key(digest) for digest in digests]
    if len(keys) > GPU_BLOCKS:  # never fits, however long it waits
        raise Refused(
            "413 Content Too Large",
            f"the prompt takes {len(keys)} GPU blocks; the GPU KV cache has {GPU_BLOCKS}",
        )
    blocks = gpu.take(len(keys))
    if blocks is None:
        raise Refused("503 Service Unavailable", "no free GPU blocks now; try again")
    try:
        # The CPU tier's leading ready chunks, then the ones after them that the disk
        # tier holds, read into fresh CPU slots (one call to it for the request).
        cpu_hits = engine.lookup(keys).ready
        disk_hits = 0
        if cpu_hits < len(keys):
            promotion = await engine.promote(keys, cpu_hits)
            disk_hits = promotion.ready
        hits = cpu_hits + disk_hits
        load = None
        if hits:
            try:
                load = await engine.submit_load(keys[:hits], GPULoadStoreSpec(blocks[:hits]))
            except ChunkStateError:  # evicted since the lookup, for another request: recompute
                cpu_hits = disk_hits = hits = 0
        gpu.compute(blocks[hits:], digests[hits:])  # what no tier held: the model computes it
        store = None
        if hits < len(keys):
            store = await engine.submit_store(
                keys[hits:], GPULoadStoreSpec(blocks[hits:]), hint=hint
            )
        loaded = await load if load is not None else None
        verified = gpu.holds(blocks[:hits], digests[:hits]) if loaded and loaded.success else None
        if loaded is not None and not loaded.success:  # a failed load is a result: recompute
            gpu.compute(blocks[:hits], digests[:hits])
        await engine.flush(blocks)  # the store has read the blocks: they may be reused
        stored = await store if store is not None else None
        engine.touch(keys, hint)  # the request's recency, head first, and its hint
        if hint is not None and hits:
            await engine.hint(keys[:hits], hint)
    finally:
        gpu.give_back(blocks)
    return {
        "blocks": len(keys),
        "cpu_hits": cpu_hits,
        "disk_hits": disk_hits,
        "computed": len(keys) - hits,
        "loaded": loaded is not None and loaded.success,
        "stored": stored is not None and stored.success,
        "verified": verified,
    }


async def respond(writer: asyncio.StreamWriter, status: str, body: bytes, kind: str) -> None:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def serve(engine: TieringEngine, gpu: EmulatedGPU, host: str, port: int) -> None:
    # Each connection's task, and whether it has read its request: at a stop, one still
    # reading is dropped, one serving a request is finished (before the engine closes).
    connections: dict[asyncio.Task[None], bool] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connections[task] = False
        try:
            await serve_one(reader, writer, task)
        except asyncio.CancelledError:
            writer.close()  # dropped at a stop before its request was read: not an error
        except ConnectionError:
            writer.close()  # the client went away
        finally:
            del connections[task]

    async def serve_one(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, task: asyncio.Task[None]
    ) -> None:
        try:
            method, target, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
        except (ValueError, asyncio.LimitOverrunError):
            await respond(writer, "400 Bad Request", b"bad request\n", "text/plain")
            return
        connections[task] = True
        url = urlsplit(target)
        if method != "GET":
            await respond(writer, "405 Method Not Allowed", b"GET only\n", "text/plain")
        elif url.path == "/metrics":  # collected here, on the event loop, between requests
            await respond(writer, "200 OK", render_metrics(engine), CONTENT_TYPE_LATEST)
        elif url.path == "/generate":
            prompts = parse_qs(url.query, keep_blank_values=True).get("prompt")
            try:
                if prompts is None:
                    raise Refused("400 Bad Request", "no prompt: GET /generate?prompt=TEXT")
                hint = request_hint(headers.get("x-tiering-hint"))
                answer = await generate(engine, gpu, prompts[0], hint)
            except Refused as refused:
                answer, status = {"error": str(refused)}, refused.status
            else:
                status = "200 OK"
            await respond(writer, status, json.dumps(answer).encode(), "application/json")
        else:
            usage = b"GET /generate?prompt=TEXT or /metrics\n"
            await respond(writer, "404 Not Found", usage, "text/plain")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        server = await asyncio.start_server(handle, host, port)
    except OSError as error:  # in use, not an address of this host: the operator's to fix
        raise Unusable(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    bound = server.sockets[0].getsockname()[1]
    print(f"serving on http://{host}:{bound}", flush=True)
    async with server:
        await stop.wait()
        server.close()  # no new connection
        for task, serving in list(connections.items()):
            if not serving:
                task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)


def port(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0-65535, got {text!r}")
    return value


async def main(args: argparse.Namespace) -> None:
    config = load_config(args.config)
    gpu = EmulatedGPU(config)
    engine = TieringEngine(
        config,
        gpu.kv,
        cpu_bytes=args.cpu_bytes,
        # The tier below the CPU tier, built from the engine's namespace (model, dtype,
        # layout): only engines whose chunk bytes are interchangeable share its values.
        secondary=lambda namespace: DiskTier(args.disk, args.disk_bytes, namespace),
    )
    (disk,) = engine.tiers
    assert isinstance(disk, DiskTier)  # the tier built above
    async with engine:
        # Index what an earlier run left in the folder before serving: until then a
        # lookup waits for the scan at most the tier's timeout, then misses (busy).
        found = await disk.open()
        print(f"disk tier at {args.disk}: {len(found.values)} chunks from earlier runs", flush=True)
        await serve(engine, gpu, args.host, args.port)
        # Stopping: what the CPU tier stored reaches the disk before the engine closes.
        await engine.wait_written_through()
        written = engine.statistics().tiers[0].cascade_written
        print(f"stopped: {written} chunks written through to the disk tier", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--disk", required=True, help="the disk tier's folder (made if missing)")
    parser.add_argument("--disk-bytes", type=int, default=1 << 30, help="its capacity (1 GiB)")
    parser.add_argument("--cpu-bytes", type=int, default=64 << 20, help="the CPU tier's size")
    parser.add_argument("--config", default=CONFIG, help="an OffloadingConfig file (.toml/.json)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=0, help="0: a free port")
    try:
        asyncio.run(main(parser.parse_args()))
    except (TieringError, Unusable) as error:  # a bad config, size or folder; the port
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        sys.exit(2)
