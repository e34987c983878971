"""Copy workers: one per direction with its loop, its copier and its landing watcher; a transfer's
job and the handle it ends. Below ``tiers/``; imports ``cuda/`` and ``base/`` only."""
