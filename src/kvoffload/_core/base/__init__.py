"""Primitives every layer uses: errors, block layout, options, cross-thread calls, the foreign-call
boundary, the O_DIRECT disk file, cache identity, the persistent format, deadlines, helper threads.
The bottom layer: imports nothing else from ``kvoffload._core``."""
