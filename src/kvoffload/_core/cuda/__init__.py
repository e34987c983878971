"""CUDA primitives: driver calls, pinned host memory, batched copies, completion bridges.

Everything here is imported only when the KV cache lives on a GPU, so that
kvoffload imports and runs on machines without CUDA.
"""
