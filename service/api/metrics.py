"""Prometheus metrics of the service (own registry; Prometheus naming, no colons).

Graph hit ratios, one PromQL expression each (also in the README):

    sum(rate(capture_service_prefill_batches_total{result="hit"}[5m]))
      / sum(rate(capture_service_prefill_batches_total[5m]))

    sum(rate(capture_service_decode_steps_total{result="hit"}[5m]))
      / sum(rate(capture_service_decode_steps_total[5m]))

Every (result, reason) series is created at start-up with value 0, so rates exist from the first
scrape and the ratio is exact over any window.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from service.buckets import MISS_REASONS
from service.commands import DecodeRecord, GraphRecord
from service.decode_sizes import DECODE_MISS_REASONS
from service.rank_info import SHARED_CHOICES
from service.resolved import ResolvedConfig
from service.scheduling.request import FINISH_TYPES

PREFIX = "capture_service"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prefill_batches = Counter(
            f"{PREFIX}_prefill_batches", "Prefill batches by graph result and miss reason",
            ["result", "reason"], registry=r,
        )  # fmt: skip
        self.padded_tokens = Counter(
            f"{PREFIX}_prefill_padded_tokens", "Padding tokens added by graph replays", registry=r
        )
        self.prefill_tokens = Counter(
            f"{PREFIX}_prefill_tokens", "Real tokens in prefill batches", registry=r
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens", registry=r)
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens", "Generated tokens", registry=r
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Finished requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.capture_seconds = Gauge(
            f"{PREFIX}_capture_seconds", "Capture time per bucket and rank", ["bucket", "rank"],
            registry=r,
        )  # fmt: skip
        self.capture_bytes = Gauge(
            f"{PREFIX}_capture_bytes", "Device memory a bucket's capture added, per rank",
            ["bucket", "rank"], registry=r,
        )  # fmt: skip
        self.agreed_buckets = Gauge(
            f"{PREFIX}_agreed_buckets", "Prefill buckets captured on every rank", registry=r
        )
        self.graphs_enabled = Gauge(
            f"{PREFIX}_prefill_graphs_enabled", "1 when prefill graphs run, 0 on eager fallback",
            registry=r,
        )  # fmt: skip
        self.running = Gauge(f"{PREFIX}_running_requests", "Requests decoding", registry=r)
        self.queued = Gauge(f"{PREFIX}_queued_requests", "Requests waiting", registry=r)
        self.kv_usage = Gauge(f"{PREFIX}_kv_usage_ratio", "Used share of KV slots", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token", registry=r,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{PREFIX}_e2e_latency_seconds", "End-to-end request latency", registry=r,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            f"{PREFIX}_prefill_batch_tokens", "Tokens per prefill batch", registry=r,
            buckets=TOKEN_BUCKETS,
        )  # fmt: skip
        self.decode_steps = Counter(
            f"{PREFIX}_decode_steps", "Decode steps by graph result and miss reason",
            ["result", "reason"], registry=r,
        )  # fmt: skip
        self.decode_padded = Counter(
            f"{PREFIX}_decode_padded_slots", "Padded slots added by decode graph replays",
            registry=r,
        )  # fmt: skip
        self.decode_batch = Histogram(
            f"{PREFIX}_decode_batch_size", "Requests per decode step", registry=r,
            buckets=BATCH_BUCKETS,
        )  # fmt: skip
        self.decode_sizes = Gauge(
            f"{PREFIX}_decode_graph_sizes", "Decode batch sizes captured on every rank", registry=r
        )
        self.decode_capture_seconds = Gauge(
            f"{PREFIX}_decode_capture_seconds", "Capture time per decode size and rank",
            ["size", "rank"], registry=r,
        )  # fmt: skip
        self.decode_capture_bytes = Gauge(
            f"{PREFIX}_decode_capture_bytes", "Device memory a decode size's capture added",
            ["size", "rank"], registry=r,
        )  # fmt: skip
        # 1 per start-up choice (attention, kernels, gate_up, ...): an alert can catch a GPU pod
        # that serves on the torch fallback (e.g. an image without nvcc for FlashInfer)
        self.kernel_info = Gauge(
            f"{PREFIX}_kernel_info", "Kernels chosen at start-up (1), by kernel, name and device",
            ["kernel", "name", "device"], registry=r,
        )  # fmt: skip
        self.engine_healthy = Gauge(
            f"{PREFIX}_engine_healthy", "1 while the engine serves, 0 while failed or rebuilding",
            registry=r,
        )  # fmt: skip
        self.engine_restarts = Counter(
            f"{PREFIX}_engine_restarts", "Engine rebuilds after a failure", registry=r
        )
        self.failed_requests = Counter(
            f"{PREFIX}_failed_requests", "Requests failed by an engine failure", registry=r
        )
        self.prefill_batches.labels("hit", "none")
        for reason in MISS_REASONS:
            self.prefill_batches.labels("miss", reason)
        self.decode_steps.labels("hit", "none")
        for reason in DECODE_MISS_REASONS:
            self.decode_steps.labels("miss", reason)
        for reason in FINISH_TYPES:
            self.requests.labels(reason)

    def set_resolved(self, resolved: ResolvedConfig) -> None:
        self.agreed_buckets.set(len(resolved.plan.buckets))
        self.graphs_enabled.set(1 if resolved.plan.enabled else 0)
        self.decode_sizes.set(len(resolved.decode.sizes))
        device = resolved.limits.device.split(":")[0]  # "cuda:0" -> "cuda"
        for attr, _, _ in SHARED_CHOICES:
            self.kernel_info.labels(attr, getattr(resolved.limits, attr).name, device).set(1)
        for captures, seconds, memory in (
            (resolved.captures, self.capture_seconds, self.capture_bytes),
            (resolved.decode_captures, self.decode_capture_seconds, self.decode_capture_bytes),
        ):
            for cap in captures:
                for stat in cap.stats:
                    labels = (str(stat.num_tokens), str(cap.rank))
                    seconds.labels(*labels).set(stat.seconds)
                    memory.labels(*labels).set(stat.memory_bytes)

    def observe_decode(self, record: DecodeRecord) -> None:
        if record.graph_hit:
            self.decode_steps.labels("hit", "none").inc()
            self.decode_padded.inc(record.padded)
        else:
            self.decode_steps.labels("miss", record.miss_reason or "unknown").inc()
        self.decode_batch.observe(record.batch_size)

    def observe_prefill(self, record: GraphRecord) -> None:
        if record.graph_hit:
            self.prefill_batches.labels("hit", "none").inc()
            self.padded_tokens.inc(record.padded_tokens)
        else:
            self.prefill_batches.labels("miss", record.miss_reason or "unknown").inc()
        self.prefill_tokens.inc(record.num_tokens)
        self.batch_tokens.observe(record.num_tokens)

    def observe_finished(self, meta: dict, ttft: float | None) -> None:
        self.requests.labels(meta["finish_reason"]["type"]).inc()
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.generated_tokens.inc(meta["completion_tokens"])
        self.e2e.observe(meta["e2e_latency"])
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> bytes:
        return generate_latest(self.registry)
