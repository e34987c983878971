"""The served example (examples/served.py) on a real uvicorn server on 127.0.0.1, driven over HTTP.

A client that hangs up while its load is held cancels that load; a request past its deadline gets
504 once its transfer stopped; an overloaded host tier is answered 503 with Retry-After, never 500;
a prefix evicted between lookup and load is recomputed; nothing stays pinned, pending or in flight,
every cache block goes back, and the server still answers. The example's own demo hangs up while
the server loads a long prefix, and that load ends cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import socket
import threading
from pathlib import Path

import pytest

from support.waiting import spin_until

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

EXAMPLE = Path(__file__).parent.parent / "examples" / "served.py"


def load_example():
    spec = importlib.util.spec_from_file_location("served_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def serving(num_blocks: int = 64, host_blocks: int = 256):
    """The example app on a real server in a thread of its own; yields (base url, service)."""
    # CPU tensors: the tests hold transfers with a gate on the worker's copy; a GPU transfer's copies
    # are enqueued in the caller's thread (here, the server's), which the gate would hold instead.
    app = load_example().make_app(num_blocks=num_blocks, host_blocks=host_blocks, device="cpu")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, name="uvicorn")
    thread.start()
    spin_until(lambda: srv.started or not thread.is_alive(), what="the server started")
    assert srv.started
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app.state.service
    finally:
        srv.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def server():
    with serving() as (url, service):
        yield url, service


def post_and_hang_up(url: str, body: dict) -> socket.socket:
    """Send a whole POST /generate on a raw connection and return it, unread (close it to hang up)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def assert_nothing_leaked(service) -> None:
    s = service.off.stats()
    assert (s.in_flight, s.pending, s.pinned) == (0, 0, 0), s
    assert sorted(service.free_blocks) == list(range(service.off.layout.num_blocks)), "a request kept cache blocks"


def test_served_example_caches_prefixes_and_survives_hang_ups_and_deadlines(server, faults):
    url, service = server
    tokens = list(range(16 * 6))
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/generate", json={"tokens": tokens}).json() == {"blocks": 6, "hits": 0, "stored": 6}
        assert client.post("/generate", json={"tokens": tokens}).json() == {"blocks": 6, "hits": 6, "stored": 0}

        # 1. The client hangs up while its load is held: the load is cancelled, and ends once let go.
        gate = faults.gate(service.off, "to_device")
        sock = post_and_hang_up(url, {"tokens": tokens})
        gate.wait_entered()
        sock.close()
        spin_until(lambda: service.abandoned["disconnect"] == 1, what="the server noticed the hang-up")
        assert gate.in_flight == 1 and service.off.stats().in_flight == 1  # the cancelled load waits for its copy
        gate.open()
        spin_until(lambda: service.off.stats().cancelled == 1 and len(service.free_blocks) == 64,
                   what="the hung-up request's load ended cancelled and its handler gave its blocks back")
        assert_nothing_leaked(service)

        # 2. A deadline passes while the load is held: 504, sent once the transfer stopped.
        gate = faults.gate(service.off, "to_device")

        def open_once_the_deadline_passed() -> None:
            spin_until(lambda: service.abandoned["deadline"] == 1, what="the server gave up at the deadline")
            gate.open()

        opener = threading.Thread(target=open_once_the_deadline_passed)
        opener.start()
        r = client.post("/generate", json={"tokens": tokens, "deadline_s": 0.05})
        opener.join()
        assert r.status_code == 504 and gate.in_flight == 0
        assert service.off.stats().cancelled == 2 and service.abandoned["deadline"] == 1
        assert_nothing_leaked(service)
        gate.remove()

        # 3. Still serving, and the cached prefix is intact.
        assert client.post("/generate", json={"tokens": tokens + [7]}).json() == {"blocks": 6, "hits": 6, "stored": 0}
        assert_nothing_leaked(service)


def test_the_demo_shows_a_hang_up_cancelling_the_load_in_flight(capsys, faults):
    # On CPU tensors, as above. The demo's load of 64 MiB outlasts the hang-up by far on an idle
    # machine; so that a busy one cannot finish it first, its copies are held from the hang-up on
    # until the server has given up on the request.
    openers = []

    def hold_loads_until_the_server_gave_up(service) -> None:
        gate = faults.gate(service.off, "to_device")

        def open_once_given_up() -> None:
            try:
                spin_until(lambda: service.abandoned["disconnect"] == 1, what="the server noticed the hang-up")
            finally:
                gate.open()

        openers.append(threading.Thread(target=open_once_given_up))
        openers[0].start()

    asyncio.run(load_example()._demo(device="cpu", before_hang_up=hold_loads_until_the_server_gave_up))
    openers[0].join()
    out = capsys.readouterr().out
    after = re.search(r"after a hang-up: (\d+) transfers in flight, (\d+) keys pinned, (\d+) cancelled", out)
    assert after, out
    in_flight, pinned, cancelled = map(int, after.groups())
    assert cancelled >= 1 and (in_flight, pinned) == (0, 0), out
    assert "still answers:" in out, out


def blocks_of_tokens(n: int, seed: int) -> list[int]:
    """``n`` full blocks of tokens no other seed shares."""
    return [seed * 1000 + i for i in range(16 * n)]


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST every body to /generate at once, each on a connection of its own."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        return list(await asyncio.gather(*(client.post("/generate", json=b) for b in bodies)))


def test_an_overloaded_host_tier_is_answered_503_and_the_server_recovers(faults):
    # 6 host slots, 24 requests of 2 new blocks each: the stores that find every slot taken by
    # running stores are overload (503, retry later), not a server error.
    with serving(num_blocks=64, host_blocks=6) as (url, service):
        gate = faults.gate(service.off, "to_host")  # the stores holding the slots stay running
        requests = [{"tokens": blocks_of_tokens(2, seed)} for seed in range(24)]

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
                sent = [asyncio.ensure_future(client.post("/generate", json=b)) for b in requests]
                for answered, fut in enumerate(asyncio.as_completed(sent), 1):
                    await fut
                    if answered == len(requests) - 3:  # all but the 3 whose stores hold the 6 slots
                        gate.open()
                return [f.result() for f in sent]

        answers = asyncio.run(burst())
        codes = sorted(r.status_code for r in answers)
        assert codes == [200] * 3 + [503] * 21, [(r.status_code, r.text) for r in answers]
        for r in answers:
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1 and "error" in r.json()
        assert_nothing_leaked(service)
        gate.remove()

        # The stored prefixes are intact, and the server takes new work.
        stored = [req for req, r in zip(requests, answers) if r.status_code == 200]
        with httpx.Client(base_url=url, timeout=30) as client:
            for req in stored:
                assert client.post("/generate", json=req).json() == {"blocks": 2, "hits": 2, "stored": 0}
            assert client.post("/generate", json={"tokens": blocks_of_tokens(1, 99)}).json() == {"blocks": 1, "hits": 0, "stored": 1}

        # Ungated, 24 requests sharing prefixes race for the 6 slots: each is served or told to retry.
        answers = asyncio.run(post_all(url, [{"tokens": blocks_of_tokens(1 + i % 3, i % 5)} for i in range(24)]))
        assert {r.status_code for r in answers} <= {200, 503}, [(r.status_code, r.text) for r in answers]
        assert_nothing_leaked(service)


def test_a_prefix_evicted_between_lookup_and_load_is_recomputed(server):
    url, service = server
    tokens = blocks_of_tokens(3, 7)
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/generate", json={"tokens": tokens}).json() == {"blocks": 3, "hits": 0, "stored": 3}
        keys = service.keys_for(tokens)
        real = service.off

        class EvictedAfterLookup:
            """The offloader, but another user's store evicts the prefix right after each lookup."""

            def __getattr__(self, name: str):
                return getattr(real, name)

            def lookup(self, ks):
                hits = real.lookup(ks)
                real.discard(keys)
                return hits

        service.off = EvictedAfterLookup()
        try:
            r = client.post("/generate", json={"tokens": tokens})
        finally:
            service.off = real
        assert r.status_code == 200 and r.json() == {"blocks": 3, "hits": 0, "stored": 3}, r.text
        assert client.post("/generate", json={"tokens": tokens}).json() == {"blocks": 3, "hits": 3, "stored": 0}
        assert_nothing_leaked(service)


def test_a_failed_transfer_is_a_500_with_its_reason_and_a_closed_offloader_a_503(server, faults):
    url, service = server
    with httpx.Client(base_url=url, timeout=30) as client:
        broken = faults.fail(service.off, "to_host", OSError(5, "Input/output error"))
        r = client.post("/generate", json={"tokens": blocks_of_tokens(2, 1)})
        assert r.status_code == 500 and "TransferError" in r.json()["error"], r.text
        broken.remove()
        assert_nothing_leaked(service)
        assert client.post("/generate", json={"tokens": blocks_of_tokens(2, 1)}).json() == {"blocks": 2, "hits": 0, "stored": 2}

        service.off.close()  # shutting down: requests are turned away, not failed
        r = client.post("/generate", json={"tokens": blocks_of_tokens(2, 1)})
        assert r.status_code == 503 and "error" in r.json(), r.text
        assert sorted(service.free_blocks) == list(range(64))
