"""The server's Prometheus metrics (GET /metrics), in a registry of its own so that several servers in one
process keep their counts apart.

    metrics = Metrics(); metrics.watch(scheduler)      # queue, rows and prefix cache read when scraped
    metrics.requests.labels("/v1/completions", "200").inc()
    text, content_type = metrics.render()
"""

from __future__ import annotations

import time

# seconds: from a few milliseconds (a small model's token on a CPU) to a long prefill on a busy machine
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Counters the routes and the engine thread move; gauges read from the scheduler when scraped."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        by = ["route", "status"]
        self.requests = Counter("nanogpt_requests", "HTTP requests by route and status.", by, registry=r)
        self.prompt_tokens = Counter("nanogpt_prompt_tokens", "Prompt tokens of the rows admitted.", registry=r)
        self.generated_tokens = Counter("nanogpt_generated_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(
            "nanogpt_time_to_first_token_seconds",
            "From a row's request queued to its first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "nanogpt_inter_token_latency_seconds", "Between two tokens of one row.", buckets=ITL_BUCKETS, registry=r
        )

    def watch(self, scheduler) -> None:
        """Report the scheduler's queue, rows in use and prefix cache at each scrape."""
        from prometheus_client import Gauge

        r = self.registry
        Gauge("nanogpt_queue_depth", "Rows waiting for a free row.", registry=r).set_function(lambda: scheduler.waiting)
        Gauge("nanogpt_active_rows", "Rows in the running batch.", registry=r).set_function(lambda: scheduler.active)
        Gauge("nanogpt_max_batch", "Rows the batch holds.", registry=r).set(scheduler.engine.max_batch)
        prefix = scheduler.engine.prefix_cache
        if prefix is not None:
            r.register(_PrefixCollector(prefix))
        draft = getattr(scheduler.engine, "draft", None)
        if draft is not None:
            r.register(_DraftCollector(draft.stats))

    # --- called from the engine thread ---

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def token(self, job) -> None:
        """One token of a job: its first token's latency from the queue, or the gap since its last."""
        now = time.monotonic()
        self.generated_tokens.inc()
        if job.last_token is None:
            self.ttft.observe(now - job.submitted)
        else:
            self.itl.observe(now - job.last_token)
        job.last_token = now

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixCollector:
    """The prefix cache's counts (inference/prefix.py PrefixStats) as Prometheus metrics, read when scraped."""

    def __init__(self, prefix):
        self.prefix = prefix

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, p = self.prefix.stats, self.prefix
        yield CounterMetricFamily("nanogpt_prefix_cache_lookups", "Prompts looked up in the prefix cache.", s.lookups)
        yield CounterMetricFamily("nanogpt_prefix_cache_hits", "Prompts that started from a stored prefix.", s.hits)
        yield CounterMetricFamily(
            "nanogpt_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache, not prefilled.", s.tokens
        )
        yield CounterMetricFamily("nanogpt_prefix_cache_evictions", "Entries dropped for the budget.", s.evicted)
        yield GaugeMetricFamily("nanogpt_prefix_cache_bytes", "Bytes of keys and values held.", p.bytes)
        yield GaugeMetricFamily("nanogpt_prefix_cache_entries", "Prefixes held.", len(p.entries))


class _DraftCollector:
    """A speculative draft's counts (inference/speculative.py DraftStats), read when scraped."""

    def __init__(self, stats):
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats
        yield CounterMetricFamily(
            "nanogpt_draft_proposed_tokens", "Tokens proposed (draft model or lookup).", s.proposed
        )
        yield CounterMetricFamily("nanogpt_draft_accepted_tokens", "Proposed tokens the model kept.", s.accepted)
        yield CounterMetricFamily("nanogpt_draft_rounds", "Speculative rounds (one check of the model each).", s.rounds)
        yield GaugeMetricFamily("nanogpt_draft_acceptance_rate", "Accepted over proposed draft tokens.", s.rate)
