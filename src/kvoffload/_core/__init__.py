"""The implementation of kvoffload. Private: import the public names from ``kvoffload``.

Its folders are its layers, and imports go one way: the facade here (``offloader``,
``runtime``) -> ``tiers/`` -> ``workers/`` -> ``cuda/`` -> ``base/``. The map of every module is
in docs/design.md, section "Shape".
"""
