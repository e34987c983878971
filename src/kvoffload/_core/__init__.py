"""The implementation of kvoffload. Private: import the public names from ``kvoffload``.

Data flows one way: the facade (``offloader``) -> the index and the tiers
(``index``, ``tiers/``) -> the copy engines and the worker loops (``lane``,
``loops``, ``movers``, ``cuda/``) -> the primitives (``diskfile``, ``hostmem``,
``layout``, ``wakeup``). Completion flows back through the worker loops.
"""
