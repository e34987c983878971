"""The served example (examples/served.py) on a real uvicorn server on 127.0.0.1, driven over HTTP.

A client that hangs up while its load is held cancels that load; a request past its deadline gets
504 once its transfer stopped; nothing stays pinned, pending or in flight, every cache block goes
back, and the server still answers.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
from pathlib import Path

import pytest

from conftest import spin_until

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

EXAMPLE = Path(__file__).parent.parent / "examples" / "served.py"


def load_example():
    spec = importlib.util.spec_from_file_location("served_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def server():
    """The example app on a real server in a thread of its own; yields (base url, service)."""
    # CPU tensors: the test holds loads with a gate on the worker's copy; a GPU load's copies are
    # enqueued in the caller's thread (here, the server's), which the gate would hold instead.
    app = load_example().make_app(num_blocks=64, host_blocks=256, device="cpu")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, name="uvicorn")
    thread.start()
    spin_until(lambda: srv.started or not thread.is_alive(), what="the server started")
    assert srv.started
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", app.state.service
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


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
    assert sorted(service.free_blocks) == list(range(64)), "a request kept cache blocks"


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

