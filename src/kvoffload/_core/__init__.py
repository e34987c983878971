"""The implementation of kvoffload. Private: import the public names from ``kvoffload``.

Data flows one way: the facade (``offloader``) -> the index and the tiers
(``index``, ``tiers/``) -> the copy workers and their loops (``copy_worker``,
``worker_loop``, ``block_copy``, ``cuda/``) -> the primitives (``diskfile``, ``hostmem``,
``layout``, ``cross_thread``). Completion flows back through the worker loops.
"""
