"""CUDA primitives: driver calls, batched copies (the CUDA copier), copy kernels, cancel flags,
what copies complete with (``events``). Imports only ``base/``.

Only ``events`` (plain Python) is imported on every machine; the rest is
imported only when the KV cache lives on a GPU, so that kvoffload imports and runs on machines
without CUDA.
"""
