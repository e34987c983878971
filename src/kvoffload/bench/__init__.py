"""``kvoffload bench``: kvoffload beside the hardware ceiling and the seed-style baseline, in one run.

One module per family of scenarios (``host_tier``, ``layouts``, ``busy_caller``, ``under_compute``,
``load_timing``, ``disk_tier``, ``remote_tier``, ``ttft``, ``small_transfers``, ``engine_loop``,
``latency``), each a function ``(rep, ...)`` adding rows to a :class:`Report`; ``command`` parses
the options and runs them; ``seed_baseline`` is the baseline, ``prefix_cache_model`` the
transformers model the time-to-first-token rows run. Run ``kvoffload bench --help`` or
``python -m kvoffload.bench --help``.
"""

from __future__ import annotations

from .cache_layout import Layout
from .command import main
from .report import Report

__all__ = ["Layout", "Report", "main"]
