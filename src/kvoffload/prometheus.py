"""Prometheus metrics of an :class:`~kvoffload.Offloader` (needs ``pip install 'kvoffload[prometheus]'``).

>>> from prometheus_client import REGISTRY
>>> from kvoffload.prometheus import OffloaderCollector
>>> REGISTRY.register(OffloaderCollector(off, name="gpu0"))

Every scrape reads one :meth:`Offloader.stats` snapshot. The names, types and labels are listed
in the README's metrics table and stay stable; every metric carries the ``offloader`` label.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ._core.offloader import Offloader, OffloaderStats

__all__ = ["OffloaderCollector"]


class OffloaderCollector:
    """A ``prometheus_client`` collector for one offloader; register it with a registry."""

    def __init__(self, offloader: Offloader, name: str = "default") -> None:
        self._off = offloader
        self._name = name

    def collect(self) -> Iterator[Metric]:
        """The offloader's metrics now (called by the registry at every scrape)."""
        s = self._off.stats()
        name = self._name

        def counter(metric: str, doc: str, value: float, unit: str = "") -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["offloader"], unit=unit)
            c.add_metric([name], value)
            return c

        def gauge(metric: str, doc: str, values: dict[tuple[str, ...], float], labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["offloader", *labels])
            for label_values, value in values.items():
                g.add_metric([name, *label_values], value)
            return g

        yield gauge("kvoffload_slots", "Block slots per tier.", {("host",): s.host_slots, ("disk",): s.disk_slots}, ("tier",))
        yield gauge("kvoffload_free_slots", "Slots neither holding a key nor reserved, per tier.",
                    {("host",): s.host_free, ("disk",): s.disk_free}, ("tier",))
        yield gauge("kvoffload_ready_keys", "Stored keys visible to lookup, per tier.",
                    {("host",): s.host_ready, ("disk",): s.disk_ready}, ("tier",))
        yield gauge("kvoffload_pending_keys", "Keys being written by running stores.", {(): s.pending})
        yield gauge("kvoffload_pinned_keys", "Stored keys in use by running loads.", {(): s.pinned})
        yield gauge("kvoffload_spilling_keys", "Host entries being written to disk to make room.", {(): s.spilling})
        yield gauge("kvoffload_transfers_in_flight", "Transfers started and not yet finished.", {(): s.in_flight})
        if self._off.options.remote is not None:
            yield from _remote_metrics(s, name)

        transfers = CounterMetricFamily("kvoffload_transfers", "Transfers ended, by kind and outcome.",
                                        labels=["offloader", "kind", "outcome"])
        seconds = HistogramMetricFamily("kvoffload_transfer_seconds", "Transfer latency by kind, outcome and phase "
                                        "(queue: until a worker took it; copy: from then to the end; total).",
                                        labels=["offloader", "kind", "outcome", "phase"], unit="seconds")
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

        yield counter("kvoffload_stored", "Bytes of completed stores.", s.bytes_stored, "bytes")
        yield counter("kvoffload_loaded", "Bytes of completed loads.", s.bytes_loaded, "bytes")
        yield counter("kvoffload_stored_partially", "Bytes published by stores that then failed or were cancelled.",
                      s.bytes_stored_partially, "bytes")
        yield counter("kvoffload_lookups", "lookup() calls.", s.lookups)
        yield counter("kvoffload_lookup_hit_keys", "Leading keys found by lookup(), summed.", s.lookup_hits)
        loaded = CounterMetricFamily("kvoffload_loaded_keys", "Keys of completed loads, by source tier.",
                                     labels=["offloader", "tier"])
        loaded.add_metric([name, "host"], s.keys_loaded_from_host)
        loaded.add_metric([name, "disk"], s.keys_loaded_from_disk)
        yield loaded
        evicted = CounterMetricFamily("kvoffload_evictions", "Entries dropped to make room, by tier.",
                                      labels=["offloader", "tier"])
        evicted.add_metric([name, "host"], s.evicted_host)
        evicted.add_metric([name, "disk"], s.evicted_disk)
        yield evicted
        yield counter("kvoffload_spills", "Entries moved from host memory to disk.", s.spilled)
        yield counter("kvoffload_disk_written", "Bytes written to the disk file.", s.disk_bytes_written, "bytes")
        yield counter("kvoffload_disk_read", "Bytes read from the disk file.", s.disk_bytes_read, "bytes")
        yield counter("kvoffload_disk_io_errors", "Disk IO calls that failed or moved fewer bytes than asked.", s.disk_io_errors)
        yield counter("kvoffload_promoted_keys", "Disk-resident keys a load left a copy of in host memory.", s.promoted)
        yield gauge("kvoffload_clean_disk_copies", "Disk slots holding the disk copy of a key whose current copy is in host memory.",
                    {(): s.disk_clean})
        yield gauge("kvoffload_recovered_keys", "Entries a persistent disk tier found again when the offloader started.",
                    {(): s.recovered})
        yield gauge("kvoffload_dropped_at_open_slots", "Slots of a persistent disk file whose header or checksum did not verify "
                    "when the offloader started.", {(): s.dropped_at_open})
        yield counter("kvoffload_checksum_failures", "Disk slots whose CRC32C did not match when loaded (verify=True).",
                      s.checksum_failures)
        yield gauge("kvoffload_gpu_staging_bytes", "GPU memory held for staging copies.", {(): s.gpu_staging_bytes})


def _remote_metrics(s: OffloaderStats, name: str) -> Iterator[Metric]:
    """The remote tier's metrics (offloaders made with ``remote=``)."""
    pending = GaugeMetricFamily("kvoffload_remote_writes_pending", "Blocks being written to the remote store in the background.",
                                labels=["offloader"])
    pending.add_metric([name], s.remote_writes_pending)
    yield pending
    remote = CounterMetricFamily("kvoffload_remote_keys", "Keys of the remote tier, by event: found by alookup, loaded, "
                                 "missed by a load, rejected by the checks, written, failed to write.", labels=["offloader", "event"])
    for event, value in (
        ("lookup_hit", s.remote_lookup_hits), ("hit", s.remote_hits), ("miss", s.remote_misses), ("bad_value", s.remote_bad_values),
        ("written", s.remote_writes), ("write_failed", s.remote_write_failures),
    ):
        remote.add_metric([name, event], value)
    yield remote
    unavailable = CounterMetricFamily("kvoffload_remote_unavailable", "Remote calls that found the remote store unreachable.",
                                      labels=["offloader"])
    unavailable.add_metric([name], s.remote_unavailable)
    yield unavailable
