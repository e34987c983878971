"""A prefix cache served over HTTP (Starlette on uvicorn).

POST /generate with {"tokens": [...], "deadline_s": 5} looks up the request's prefix, loads the
blocks it finds, "computes" the others (a stand-in for the model), and stores them. A client that
hangs up, or a request past its deadline, cancels the transfer in flight: the handler races the
work against the client's ``http.disconnect`` and the deadline, cancels the work's task, and
answers only once the transfer let go of its blocks. Overload (no free cache block, or every host
slot taken by running stores) is answered 503 with Retry-After; a prefix evicted between lookup
and load is recomputed. GET /stats returns ``Offloader.stats()``.

python examples/served.py     # serves on 127.0.0.1, sends itself a few requests (one hangs up mid-load), stops

Needs starlette, uvicorn and httpx (pip install starlette uvicorn httpx).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import kvoffload

BLOCK_TOKENS = 16
RETRY_AFTER_S = 1
"""What an overloaded server asks clients to wait before trying again."""


class OutOfCacheBlocks(Exception):
    """Every cache block is taken by requests in progress."""


class PrefixCacheService:
    """Cache blocks for requests, and the offloader that keeps their prefixes."""

    def __init__(self, off: kvoffload.Offloader, caches: dict[str, torch.Tensor]) -> None:
        self.off = off
        self.caches = caches
        self.free_blocks = list(range(off.layout.num_blocks))
        self.lock = threading.Lock()
        self.abandoned = {"disconnect": 0, "deadline": 0}
        """Requests whose work was cancelled, by cause (counted once the cancel reached the transfer)."""
        self.on_load: Callable[[kvoffload.Transfer], object] = lambda load: None
        """Called with each load a request starts (the demo hangs up its client then)."""

    @staticmethod
    def keys_for(tokens: list[int]) -> list[bytes]:
        """One key per full block of tokens, chained: a key names its whole prefix."""
        keys, h = [], b""
        for i in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
            h = hashlib.sha256(h + repr(tokens[i : i + BLOCK_TOKENS]).encode()).digest()
            keys.append(h)
        return keys

    def compute(self, key: bytes, block: int) -> None:
        """Stand-in for the model: the block's KV data, derived from its key."""
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        for t in self.caches.values():
            t[block].copy_(torch.randn(t[block].shape, generator=g).to(t.dtype))

    async def serve(self, tokens: list[int]) -> dict[str, Any]:
        keys = self.keys_for(tokens)
        with self.lock:
            if len(keys) > len(self.free_blocks):
                raise OutOfCacheBlocks(f"{len(keys)} cache blocks needed, {len(self.free_blocks)} free")
            blocks = [self.free_blocks.pop() for _ in keys]
        try:
            hits = self.off.lookup(keys)
            if hits:
                try:
                    load = self.off.load(dict(zip(keys[:hits], blocks)))
                except kvoffload.MissingKeysError:
                    hits = 0  # evicted since the lookup (raised at the call: nothing written): a miss
                else:
                    self.on_load(load)
                    await load  # cancelled with this task
            for key, block in zip(keys[hits:], blocks[hits:]):
                self.compute(key, block)
            if len(keys) > hits:
                await self.off.store(dict(zip(keys[hits:], blocks[hits:])))
            return {"blocks": len(keys), "hits": hits, "stored": len(keys) - hits}
        finally:
            # Reached only once no transfer writes these blocks: cancellation waits for that.
            with self.lock:
                self.free_blocks.extend(blocks)


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def generate(request: Request) -> Response:
    body = await request.json()
    service: PrefixCacheService = request.app.state.service
    work = asyncio.ensure_future(service.serve(list(body["tokens"])))
    gone = asyncio.ensure_future(_client_gone(request))
    done, _ = await asyncio.wait({work, gone}, timeout=float(body.get("deadline_s", 10)), return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        gone.cancel()
        try:
            return JSONResponse(work.result())
        except (OutOfCacheBlocks, kvoffload.OffloadError) as e:
            return error_response(e)
    work.cancel()  # cancels the transfer it awaits
    await asyncio.sleep(0)  # one loop turn: the cancellation reaches the transfer
    service.abandoned["disconnect" if gone in done else "deadline"] += 1
    with contextlib.suppress(asyncio.CancelledError, OutOfCacheBlocks, kvoffload.OffloadError):
        await work  # returns once the transfer stopped writing and the blocks are back
    if gone in done:
        return Response(status_code=499)  # nobody reads it: the client has gone
    gone.cancel()
    return JSONResponse({"error": "deadline passed"}, status_code=504)


def error_response(e: OutOfCacheBlocks | kvoffload.OffloadError) -> Response:
    """The answer to a request that kvoffload or the block pool could not serve.

    Overload is 503 with Retry-After: no free cache block, or no host slot (``CapacityError``: every
    slot is taken by running transfers, which end soon). A closed offloader, or a transfer that
    ``close()`` cancelled, is 503 without it: the server is shutting down. Anything else, a failed
    copy or IO (``TransferError``) say, is 500 with the reason; the offloader keeps serving.
    """
    if isinstance(e, (OutOfCacheBlocks, kvoffload.CapacityError)):
        return JSONResponse({"error": f"overloaded: {e}"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, (kvoffload.ClosedError, kvoffload.TransferCancelled)):
        return JSONResponse({"error": f"shutting down: {e}"}, status_code=503)
    return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)


async def stats(request: Request) -> Response:
    service: PrefixCacheService = request.app.state.service
    s = service.off.stats()
    latency = {"/".join(k): {"count": h.count, "p50_s": h.quantile(0.5), "p99_s": h.quantile(0.99)} for k, h in s.latency.items()}
    counters = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "latency"}
    return JSONResponse({**counters, "latency": latency, "abandoned": service.abandoned})


def make_app(num_blocks: int = 256, host_blocks: int = 1024, device: str | None = None, **offloader_options: Any) -> Starlette:
    """The ASGI app; its offloader starts and closes with the server (``app.state.service``).
    ``device``: where the KV cache lives (default: the GPU if there is one)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        caches = {f"layer.{i}": torch.zeros(num_blocks, 2, BLOCK_TOKENS, 4, 64, device=dev) for i in range(4)}
        async with kvoffload.Offloader(caches, host_blocks=host_blocks, **offloader_options) as off:
            app.state.service = PrefixCacheService(off, caches)
            yield

    return Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/stats", stats)], lifespan=lifespan)


async def _demo(device: str | None = None, before_hang_up: Callable[[PrefixCacheService], object] = lambda service: None) -> None:
    """Serve on 127.0.0.1 and send a few requests, one from a client that hangs up mid-load.
    ``before_hang_up(service)`` runs just before that client sends its request."""
    import httpx
    import uvicorn

    # 1 MiB chunks: a load stops within a chunk or so of its cancellation (64 chunks for the long prompt)
    app = make_app(num_blocks=640, device=device, chunk_bytes=1 << 20)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    service: PrefixCacheService = app.state.service
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    tokens = list(range(16 * 8))
    long_prompt = list(range(100_000, 100_000 + 16 * 512))  # 512 blocks: 64 MiB of KV
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        print("first request: ", (await client.post("/generate", json={"tokens": tokens})).json())
        print("same prefix:   ", (await client.post("/generate", json={"tokens": tokens + [1, 2, 3]})).json())
        print("a long prompt: ", (await client.post("/generate", json={"tokens": long_prompt})).json())
        # The long prompt again, from a client that hangs up while the server loads its 64 MiB
        # prefix: the server cancels that load, and answers once it stopped writing the blocks.
        loads: asyncio.Queue[kvoffload.Transfer] = asyncio.Queue()
        service.on_load = loads.put_nowait
        before_hang_up(service)
        hanging = asyncio.ensure_future(client.post("/generate", json={"tokens": long_prompt}))
        load = await loads.get()  # the server is loading the prefix
        hanging.cancel()  # the client hangs up: httpx closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await hanging
        await asyncio.wait({load})  # until the load ended (a Transfer works with asyncio.wait)
        s = (await client.get("/stats")).json()
        print(f"after a hang-up: {s['in_flight']} transfers in flight, {s['pinned']} keys pinned, "
              f"{s['cancelled']} cancelled, {s['stores']} stores, {s['loads']} loads")
        print("still answers: ", (await client.post("/generate", json={"tokens": tokens})).json())
    server.should_exit = True
    await serving


if __name__ == "__main__":
    asyncio.run(_demo())
