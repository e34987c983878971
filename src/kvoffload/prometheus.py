"""Prometheus metrics of offloaders (needs ``pip install 'kvoffload[prometheus]'``).

>>> from kvoffload.prometheus import register
>>> register(off)                # into prometheus_client's default REGISTRY: offloader="0"
>>> register(off2, name="gpu1")  # a second offloader, same collector: offloader="gpu1"

Every scrape reads one :meth:`Offloader.stats` snapshot per offloader. The names, types and labels
are listed in the table of docs/how-to/metrics.md and stay stable; every series carries the ``offloader``
label, so any number of offloaders share one registry.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import REGISTRY, CollectorRegistry

from . import Offloader, OffloaderStats

__all__ = ["OffloaderCollector", "register"]


class OffloaderCollector:
    """A ``prometheus_client`` collector for any number of offloaders, each under its own
    ``offloader`` label. Register one per registry (or let :func:`register` do it): a second
    collector in the same registry would repeat every metric name, and the registry refuses it."""

    def __init__(self, offloader: Offloader | None = None, name: str | None = None) -> None:
        self._lock = threading.Lock()
        self._offloaders: dict[str, Offloader] = {}
        """Label value -> offloader, in the order they were added."""
        if offloader is not None:
            self.add(offloader, name)

    def add(self, offloader: Offloader, name: str | None = None) -> str:
        """Export ``offloader`` under the label ``offloader=name`` and return the name. Without a
        name: the lowest of ``"0"``, ``"1"``, ... not taken in this collector, fixed from now on.
        A name taken, or an offloader added already, is a ``ValueError``."""
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        with self._lock:
            if name in self._offloaders:
                raise ValueError(f"offloader={name!r} is taken in this collector; give each offloader its own name")
            for taken, off in self._offloaders.items():
                if off is offloader:
                    raise ValueError(f"this offloader is exported already, as offloader={taken!r}")
            if name is None:
                name = next(str(i) for i in range(len(self._offloaders) + 1) if str(i) not in self._offloaders)
            self._offloaders[name] = offloader
            return name

    def remove(self, offloader: Offloader) -> None:
        """Stop exporting ``offloader`` (its series leave the next scrape); ``KeyError`` if it is not here."""
        with self._lock:
            for name, off in self._offloaders.items():
                if off is offloader:
                    del self._offloaders[name]
                    return
        raise KeyError("this offloader is not exported by this collector")

    def describe(self) -> list[Metric]:
        """Every family this collector may export, without samples: the registry checks the names
        at registration."""
        return list(_families([], remote=True))

    def collect(self) -> Iterator[Metric]:
        """The offloaders' metrics now (called by the registry at every scrape)."""
        with self._lock:
            offloaders = list(self._offloaders.items())
        if offloaders:
            snapshots = [(name, off.stats(), off.options.remote is not None) for name, off in offloaders]
            yield from _families(snapshots, remote=any(has_remote for _, _, has_remote in snapshots))


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, OffloaderCollector] = weakref.WeakKeyDictionary()
"""The collector :func:`register` made for each registry."""
_collectors_lock = threading.Lock()


def register(offloader: Offloader, name: str | None = None, registry: CollectorRegistry = REGISTRY) -> OffloaderCollector:
    """Export ``offloader`` through ``registry`` (default: prometheus_client's ``REGISTRY``) under
    the label ``offloader=name`` (see :meth:`OffloaderCollector.add`). The first call for a
    registry registers a collector there; later calls add to it. Returns that collector."""
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = OffloaderCollector()
            registry.register(collector)
            _collectors[registry] = collector
    collector.add(offloader, name)
    return collector


Figure = Callable[[OffloaderStats], float]
"""One figure of a snapshot (``lambda s: s.spilled``)."""


def _families(snapshots: list[tuple[str, OffloaderStats, bool]], remote: bool) -> Iterator[Metric]:
    """One family per metric, holding the samples of every ``(name, stats, has a remote tier)``
    snapshot; the remote tier's families too when ``remote``."""

    def counter(metric: str, doc: str, value: Figure, unit: str = "") -> CounterMetricFamily:
        c = CounterMetricFamily(metric, doc, labels=["offloader"], unit=unit)
        for name, s, _ in snapshots:
            c.add_metric([name], value(s))
        return c

    def gauge(metric: str, doc: str, values: Callable[[OffloaderStats], Mapping[tuple[str, ...], float]],
              labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        g = GaugeMetricFamily(metric, doc, labels=["offloader", *labels])
        for name, s, _ in snapshots:
            for label_values, value in values(s).items():
                g.add_metric([name, *label_values], value)
        return g

    def per_tier(host: Figure, disk: Figure) -> Callable[[OffloaderStats], Mapping[tuple[str, ...], float]]:
        return lambda s: {("host",): host(s), ("disk",): disk(s)}

    def alone(value: Figure) -> Callable[[OffloaderStats], Mapping[tuple[str, ...], float]]:
        return lambda s: {(): value(s)}

    yield gauge("kvoffload_slots", "Block slots per tier.", per_tier(lambda s: s.host_slots, lambda s: s.disk_slots), ("tier",))
    yield gauge("kvoffload_free_slots", "Slots neither holding a key nor reserved, per tier.",
                per_tier(lambda s: s.host_free, lambda s: s.disk_free), ("tier",))
    yield gauge("kvoffload_ready_keys", "Stored keys visible to lookup, per tier.",
                per_tier(lambda s: s.host_ready, lambda s: s.disk_ready), ("tier",))
    yield gauge("kvoffload_pending_keys", "Keys being written by running stores.", alone(lambda s: s.pending))
    yield gauge("kvoffload_pinned_keys", "Stored keys in use by running loads.", alone(lambda s: s.pinned))
    yield gauge("kvoffload_spilling_keys", "Host entries being written to disk to make room.", alone(lambda s: s.spilling))
    yield gauge("kvoffload_transfers_in_flight", "Transfers started and not yet finished.", alone(lambda s: s.in_flight))
    if remote:
        yield from _remote_families([(name, s) for name, s, has_remote in snapshots if has_remote])

    transfers = CounterMetricFamily("kvoffload_transfers", "Transfers ended, by kind and outcome.",
                                    labels=["offloader", "kind", "outcome"])
    seconds = HistogramMetricFamily("kvoffload_transfer_seconds", "Transfer latency by kind, outcome and phase "
                                    "(queue: until a worker took it; copy: from then to the end; total).",
                                    labels=["offloader", "kind", "outcome", "phase"], unit="seconds")
    for name, s, _ in snapshots:
        for (kind, outcome, phase), h in sorted(s.latency.items()):
            if phase == "total":
                transfers.add_metric([name, kind, outcome], h.count)
            cumulative, buckets = 0, []
            for bound, n in zip(h.bounds, h.counts):
                cumulative += n
                buckets.append((repr(bound), cumulative))
            buckets.append(("+Inf", h.count))
            seconds.add_metric([name, kind, outcome, phase], buckets, sum_value=h.sum)
    yield transfers
    yield seconds

    yield counter("kvoffload_stored", "Bytes of completed stores.", lambda s: s.bytes_stored, "bytes")
    yield counter("kvoffload_loaded", "Bytes of completed loads.", lambda s: s.bytes_loaded, "bytes")
    yield counter("kvoffload_stored_partially", "Bytes published by stores that then failed or were cancelled.",
                  lambda s: s.bytes_stored_partially, "bytes")
    yield counter("kvoffload_lookups", "lookup() calls.", lambda s: s.lookups)
    yield counter("kvoffload_lookup_hit_keys", "Leading keys found by lookup(), summed.", lambda s: s.lookup_hits)
    loaded = CounterMetricFamily("kvoffload_loaded_keys", "Keys of completed loads, by source tier.",
                                 labels=["offloader", "tier"])
    evicted = CounterMetricFamily("kvoffload_evictions", "Entries dropped to make room, by tier.",
                                  labels=["offloader", "tier"])
    for name, s, _ in snapshots:
        loaded.add_metric([name, "host"], s.keys_loaded_from_host)
        loaded.add_metric([name, "disk"], s.keys_loaded_from_disk)
        evicted.add_metric([name, "host"], s.evicted_host)
        evicted.add_metric([name, "disk"], s.evicted_disk)
    yield loaded
    yield evicted
    yield counter("kvoffload_spills", "Entries moved from host memory to disk.", lambda s: s.spilled)
    yield counter("kvoffload_disk_written", "Bytes written to the disk file.", lambda s: s.disk_bytes_written, "bytes")
    yield counter("kvoffload_disk_read", "Bytes read from the disk file.", lambda s: s.disk_bytes_read, "bytes")
    yield counter("kvoffload_disk_io_errors", "Disk IO calls that failed or moved fewer bytes than asked.",
                  lambda s: s.disk_io_errors)
    yield counter("kvoffload_promoted_keys", "Disk-resident keys a load left a copy of in host memory.", lambda s: s.promoted)
    yield gauge("kvoffload_clean_disk_copies",
                "Disk slots holding the disk copy of a key whose current copy is in host memory.", alone(lambda s: s.disk_clean))
    yield gauge("kvoffload_recovered_keys", "Entries a persistent disk tier found again when the offloader started.",
                alone(lambda s: s.recovered))
    yield gauge("kvoffload_dropped_at_open_slots", "Slots of a persistent disk file whose header or checksum did not verify "
                "when the offloader started.", alone(lambda s: s.dropped_at_open))
    yield counter("kvoffload_checksum_failures", "Disk slots whose CRC32C (verify=True) or seal (remote_secret's MAC, encryption_key's decryption) failed when loaded.",
                  lambda s: s.checksum_failures)
    yield gauge("kvoffload_gpu_staging_bytes", "GPU memory held for staging copies.", alone(lambda s: s.gpu_staging_bytes))


def _remote_families(snapshots: list[tuple[str, OffloaderStats]]) -> Iterator[Metric]:
    """The remote tier's metrics, with samples of the offloaders made with ``remote=``."""
    pending = GaugeMetricFamily("kvoffload_remote_writes_pending", "Blocks being written to the remote store in the background.",
                                labels=["offloader"])
    remote = CounterMetricFamily("kvoffload_remote_keys", "Keys of the remote tier, by event: found by alookup, loaded, "
                                 "missed by a load, rejected by the checks, written, failed to write.", labels=["offloader", "event"])
    unavailable = CounterMetricFamily("kvoffload_remote_unavailable", "Remote calls that found the remote store unreachable.",
                                      labels=["offloader"])
    for name, s in snapshots:
        pending.add_metric([name], s.remote_writes_pending)
        for event, value in (
            ("lookup_hit", s.remote_lookup_hits), ("hit", s.remote_hits), ("miss", s.remote_misses),
            ("bad_value", s.remote_bad_values), ("written", s.remote_writes), ("write_failed", s.remote_write_failures),
            ("write_dropped", s.remote_writes_dropped),
        ):
            remote.add_metric([name, event], value)
        unavailable.add_metric([name], s.remote_unavailable)
    yield pending
    yield remote
    yield unavailable
