"""Use the offloader from plain threads (no event loop): Transfer.result() and done callbacks.

python examples/from_threads.py
"""

import threading

import torch

import kvoffload


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv_caches = {"kv": torch.randn(128, 2, 16, 8, 64, device=device)}
    with kvoffload.Offloader(kv_caches, host_blocks=128) as off:

        def worker(first: int) -> None:
            for i in range(first, first + 32):
                off.store({i: i}).result(timeout=30)  # blocks this thread only

        threads = [threading.Thread(target=worker, args=(n,)) for n in (0, 32, 64, 96)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("stored from 4 threads:", off.lookup(range(128)))

        finished = threading.Event()
        transfer = off.load({i: 127 - i for i in range(128)})
        transfer.add_done_callback(lambda tr: finished.set())  # runs on the worker thread
        finished.wait(30)
        print("load done:", transfer.result().nbytes, "bytes")


if __name__ == "__main__":
    main()
