"""The server's Prometheus metrics, under vLLM's names with Kiln's prefix (`kiln:num_requests_running`, ...).

Engine state (running and waiting requests, KV-cache usage, prefix-cache queries and hits, prompt and
generation tokens) is read at scrape time from the engine's latest stats snapshot (sent with each step);
latencies are histograms observed by the request handlers, as a client sees them: time to first token, the
time between tokens after the first, and end-to-end.

With several HTTP processes (--api-servers N) each one's histograms and counters live in prometheus_client's
multiprocess files (one per process, in a folder the server makes and removes), and a scrape of any process
sums them all; the engine's numbers come from that process's latest snapshot of the one engine, so every
process reports the same engine.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, stats, model: str):
        self._stats, self._model = stats, model

    def collect(self):
        s = self._stats()
        labels = ["model_name"]
        for name, doc, key in (("kiln:num_requests_running", "Sequences being decoded or prefilled.", "num_running"),
                               ("kiln:num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
                               ("kiln:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                                "kv_cache_usage"),
                               ("kiln:kv_cache_blocks_free", "Free KV-cache blocks.", "kv_blocks_free"),
                               ("kiln:kv_cache_blocks_total", "KV-cache blocks in the pool.", "kv_blocks_total")):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self._model], float(s.get(key, 0)))
            yield g
        for name, doc, key in (("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                "prefix_cache_queries"),
                               ("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                "prefix_cache_hits"),
                               ("kiln:prompt_tokens", "Prompt tokens admitted.", "prompt_tokens_total"),
                               ("kiln:generation_tokens", "Tokens generated.", "generation_tokens_total"),
                               ("kiln:num_preemptions", "Sequences preempted for KV-cache space.", "num_preemptions")):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self._model], float(s.get(key, 0)))
            yield c


def use_multiprocess_files(folder: str) -> None:
    """This process's metric values from now on in prometheus_client's per-process files in `folder` (what
    PROMETHEUS_MULTIPROC_DIR set before the import would have chosen)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()


class ServerMetrics:
    def __init__(self, stats, model: str, multiprocess_dir: str | None = None):
        """multiprocess_dir: the folder of every HTTP process's metric files (use_multiprocess_files)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model))
        own = self.registry
        if multiprocess_dir is not None:  # values go to the files; a scrape reads every process's
            use_multiprocess_files(multiprocess_dir)
            MultiProcessCollector(self.registry, path=multiprocess_dir)
            own = None
        self.model = model
        self.ttft = Histogram("kiln:time_to_first_token_seconds", "Time from arrival to the first token.",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=own)
        self.itl = Histogram("kiln:inter_token_latency_seconds", "Time between two tokens of a request.",
                             ["model_name"], buckets=_TOKEN_BUCKETS, registry=own)
        self.e2e = Histogram("kiln:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=own)
        self.finished = Counter("kiln:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=own)
        self.rejected = Counter("kiln:request_rejected", "Requests refused, by HTTP status.",
                                ["model_name", "status"], registry=own)
        self.aborted = Counter("kiln:request_aborted", "Requests whose client went away before the end.",
                               ["model_name"], registry=own)
