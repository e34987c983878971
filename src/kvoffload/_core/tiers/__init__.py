"""Storage tiers: where offloaded blocks live (pinned host memory; local disk next)."""
