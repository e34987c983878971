"""Copy workers: one per direction with its loop, its copier and its completion bridge, and the
transfer handle / control they end. Below ``tiers/``; imports ``cuda/`` and ``base/`` only."""
