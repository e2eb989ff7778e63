"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """``poss_*`` series:

    - ``poss_requests_total{endpoint, outcome}``: finished HTTP generation requests; outcome is the
      finish reason (``stop``, ``length``, ``cancelled``, ``error``) or ``rejected`` (4xx/5xx before start).
    - ``poss_prompt_tokens_total``, ``poss_generation_tokens_total``: token counters.
    - ``poss_tau``: per request, mean tokens per verify round (accepted draft tokens + 1).
    - ``poss_request_seconds``: from arrival to the last token; ``poss_time_to_first_token_seconds``.
    - ``poss_round_seconds``: per request, its decode time divided by its rounds (mean round time).
    - ``poss_queue_depth``: requests waiting for the engine; ``poss_active_batch``: requests decoding;
      ``poss_batch_size``: the decoding requests after each engine step (how full batches run).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_tau: int = 16):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("poss_requests", "Finished generation requests", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("poss_prompt_tokens", "Prompt tokens of started requests", registry=r)
        self.generation_tokens = Counter("poss_generation_tokens", "Generated tokens", registry=r)
        self.tau = Histogram("poss_tau", "Mean tokens per verify round, per request",
                             buckets=[1 + 0.25 * i for i in range(4 * max_tau + 1)], registry=r)
        self.request_seconds = Histogram("poss_request_seconds", "Request time, arrival to end",
                                         buckets=_TIME_BUCKETS, registry=r)
        self.ttft = Histogram("poss_time_to_first_token_seconds", "Arrival to first text",
                              buckets=_TIME_BUCKETS, registry=r)
        self.round_seconds = Histogram("poss_round_seconds", "Mean verify-round time, per request",
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                       registry=r)
        self.queue_depth = Gauge("poss_queue_depth", "Requests waiting for the engine", registry=r)
        self.active_batch = Gauge("poss_active_batch", "Requests being decoded", registry=r)
        self.batch_size = Histogram("poss_batch_size", "Requests being decoded, after each engine step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
