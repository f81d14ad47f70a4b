"""Prometheus metrics of one runtime: what operators graph and alert on.

Counts (sandboxes by state, snapshots by status) are read from the runtime at scrape time, so they
can never drift from the truth; latencies are histograms observed where the work happens.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import Any

import platform

from prometheus_client import (CollectorRegistry, Counter, Histogram, Info, PlatformCollector, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from forkd.runtime.reclaim import Reclaim

disable_created_metrics()  # the *_created series double the output and say nothing an operator needs

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
# States a gauge shows even at 0, so a dashboard's series exist (and alerts on them work) before the first
# sandbox or snapshot; a state outside these still appears once something is in it.
SANDBOX_STATES = ("running",)
SNAPSHOT_STATES = ("ready", "writing", "failed")


class _StateGauges(Collector):
    def __init__(self, sandbox_states: Callable[[], Iterable[str]], snapshot_states: Callable[[], Iterable[str]]):
        self._sandbox_states = sandbox_states
        self._snapshot_states = snapshot_states

    def collect(self):  # type: ignore[no-untyped-def]
        for name, doc, states, known in (
                ("forkd_sandboxes", "Sandboxes by state", self._sandbox_states, SANDBOX_STATES),
                ("forkd_snapshots", "Snapshots by status", self._snapshot_states, SNAPSHOT_STATES)):
            family = GaugeMetricFamily(name, doc, labels=["state"])
            counts = Tally(dict.fromkeys(known, 0))
            counts.update(states())
            for state, count in sorted(counts.items()):
                family.add_metric([state], count)
            yield family


class _PoolGauges(Collector):
    def __init__(self, pools: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self._pools = pools

    def collect(self):  # type: ignore[no-untyped-def]
        ready = GaugeMetricFamily("forkd_pool_ready", "Ready VMMs waiting in a snapshot's pool", labels=["tag"])
        size = GaugeMetricFamily("forkd_pool_size", "Ready VMMs a snapshot's pool is kept at", labels=["tag"])
        memory = GaugeMetricFamily("forkd_pool_private_dirty_bytes",
                                   "Private_Dirty memory of a pool's idle VMMs, summed", labels=["tag"])
        for pool in self._pools():
            ready.add_metric([pool["tag"]], pool["ready"])
            size.add_metric([pool["tag"]], pool["size"])
            memory.add_metric([pool["tag"]], pool["memory"]["private_dirty_kib"] * 1024)
        yield from (ready, size, memory)


class _IdleGauge(Collector):
    def __init__(self, stopped: Callable[[], int], reclaim: Reclaim) -> None:
        self._stopped = stopped
        self._reclaim = reclaim

    def collect(self):  # type: ignore[no-untyped-def]
        yield GaugeMetricFamily("forkd_sandboxes_idle_stopped",
                                "Live sandboxes whose VMM is stopped for being idle (runtime/idle.py)",
                                value=self._stopped())
        yield CounterMetricFamily("forkd_idle_reclaims", "Idle-stopped children whose memory was paged out "
                                  "to swap (runtime/reclaim.py)", value=self._reclaim.children)
        yield CounterMetricFamily("forkd_idle_reclaimed_bytes", "Private_Dirty memory idle-stopped children "
                                  "paged out to swap, summed over every stop", value=self._reclaim.paged_out_bytes)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.spawn_seconds = Histogram(
            "forkd_spawn_seconds", "Fork request start to the child's first answer, per child",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.spawn_stage_seconds = Histogram(
            "forkd_spawn_stage_seconds", "Time spent in each spawn stage (runtime/timings.py), per child", ["stage"],
            buckets=_STAGE_BUCKETS, registry=self.registry)
        self.spawn_failures = Counter("forkd_spawn_failures", "Children that failed to start, by error code",
                                      ["reason"], registry=self.registry)
        self.branch_seconds = Histogram(
            "forkd_branch_seconds", "BRANCH latency seen by the caller, by mode", ["mode"],
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.branch_pause_seconds = Histogram(
            "forkd_branch_pause_seconds", "Time a branched sandbox was paused, by mode", ["mode"],
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.branch_stage_seconds = Histogram(
            "forkd_branch_stage_seconds", "Time spent in each BRANCH stage (runtime/timings.py), by mode",
            ["mode", "stage"], buckets=_STAGE_BUCKETS, registry=self.registry)
        self.agent_roundtrip_seconds = Histogram(
            "forkd_agent_roundtrip_seconds", "Guest agent request round trip, by op", ["op"],
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.http_requests = Counter("forkd_http_requests", "HTTP requests by route, method and status",
                                     ["route", "method", "status"], registry=self.registry)
        self.http_errors = Counter("forkd_http_errors", "HTTP answers with status >= 400 by route and status",
                                   ["route", "status"], registry=self.registry)
        self.http_request_seconds = Histogram(
            "forkd_http_request_duration_seconds",
            "Request start to the answer's last byte (a stream's whole length), by route template and method",
            ["route", "method"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.build = Info("forkd_build", "The daemon's version, VMM backend and Python", registry=self.registry)
        self.build.info({"version": "unknown", "python": platform.python_version()})
        # process_* (CPU seconds, resident memory, open fds, start time) and python_info, as every exporter has.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def set_build(self, version: str, vmm: str, vmm_version: str) -> None:
        self.build.info({"version": version, "vmm": vmm, "vmm_version": vmm_version,
                         "python": platform.python_version()})

    def watch_states(self, sandbox_states: Callable[[], Iterable[str]],
                     snapshot_states: Callable[[], Iterable[str]]) -> None:
        self.registry.register(_StateGauges(sandbox_states, snapshot_states))

    def watch_pools(self, pools: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self.registry.register(_PoolGauges(pools))

    def watch_idle(self, stopped: Callable[[], int], reclaim: Reclaim) -> None:
        self.registry.register(_IdleGauge(stopped, reclaim))

    def count_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_request_seconds.labels(route, method).observe(seconds)
        if status >= 400:
            self.http_errors.labels(route, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
