"""Storage tiers: where offloaded blocks live (pinned host memory, local disk, a remote store), the
block index, and the counts stats() assembles. Below the facade; imports ``workers/``, ``cuda/``, ``base/``."""
