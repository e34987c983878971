"""CUDA primitives: driver calls, batched copies (the CUDA copier), copy kernels, cancel flags,
completion bridges. Imports only ``base/``.

Only the completion bridges (``events``, plain Python) are imported on every machine; the rest is
imported only when the KV cache lives on a GPU, so that kvoffload imports and runs on machines
without CUDA.
"""
