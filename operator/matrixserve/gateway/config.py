"""What the gateway's parts share: its settings (:class:`GatewayConfig`, from ``__main__``'s
flags) and its metrics (:class:`GatewayMetrics`, one registry). The app composes the forwarder
and the API keys and hands them both; they live here so that neither imports the app.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from matrixserve.domain.gateway.completions import MAX_CHOICES
from matrixserve.domain.gateway.reoffer import ReofferOutcome, ReofferStage
from matrixserve.domain.gateway.routing import Policy


@dataclass(frozen=True)
class GatewayConfig:
    policy: Policy = Policy.ON_DEMAND
    time_scale: float = 1.0  # engines' emulated seconds per wall second
    default_ttft_ms: int = 2000
    max_prompt_chars: int = 200_000
    max_tokens_limit: int = 8192
    max_choices: int = MAX_CHOICES  # prompts x n per request
    report_interval: float = 0.1  # least-loaded baseline: queue report period (emulated s)
    # wall s a prefill has to accept or reject (its answer's head; an engine answers
    # at admission) before it is passed over and the next is tried: a hung one answers nothing
    answer_timeout: float = 1.0
    require_keys: bool = False  # API keys configured: /v1/* needs "Authorization: Bearer <key>"
    rate_limit: float = 0.0  # requests per second per key (0: unlimited)
    rate_burst: float = 10.0


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "matrixserve_gateway_requests",
            "Requests by scenario and outcome",
            ["scenario", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "matrixserve_gateway_ttft_seconds",
            "Time to first token seen by the gateway (wall s)",
            ["scenario"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
            registry=r,
        )
        self.attempts = Counter(
            "matrixserve_gateway_forward_attempts",
            "Prefill tries, by answer",
            ["answer"],
            registry=r,
        )
        self.open_streams = Gauge(
            "matrixserve_gateway_open_streams", "Open SSE streams", registry=r
        )
        self.in_prefill = Gauge(
            "matrixserve_gateway_prompts_in_prefill",
            "Choices accepted by a prefill and without a first token yet, as this gateway counts",
            registry=r,
        )
        self.slots_held = Gauge(
            "matrixserve_gateway_prefill_slots_held",
            "Prefill slots this gateway's choices hold (until their second token or end)",
            registry=r,
        )
        self.engine_connections = Gauge(
            "matrixserve_gateway_engine_connections",
            "Connections to engines: idle (pooled) or in use (a try, a stream, a linger)",
            ["state"],
            registry=r,
        )
        self.zookeeper_connected = Gauge(
            "matrixserve_gateway_zookeeper_connected",
            "1 while entrances come from ZooKeeper, 0 while they come from PDGroup status",
            registry=r,
        )
        self.migrations = Counter(
            "matrixserve_gateway_migrations",
            "Choices offered to another entrance after theirs was lost, by"
            " stage (before_first_token, mid_stream) and outcome (moved, no_capacity, bound)",
            ["stage", "outcome"],
            registry=r,
        )
        for stage in ReofferStage:  # every series from the start, at 0
            for outcome in ReofferOutcome:
                self.migrations.labels(stage=stage, outcome=outcome)
        self.zookeeper_sessions_lost = Counter(
            "matrixserve_gateway_zookeeper_sessions_lost",
            "ZooKeeper sessions expired under the gateway (its watches were re-armed)",
            registry=r,
        )
