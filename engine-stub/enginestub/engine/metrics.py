"""Engine metrics (Prometheus, prefix ``matrixserve_engine_``), in emulated seconds.

One registry per engine, so several engines can live in one test process. The gauges of what the
engine holds (decode batch, prefill slots, HBM) read its state at each scrape, and the info
gauge's one series follows the role: :class:`enginestub.engine.core.Engine` wires both."""

from __future__ import annotations

from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from enginestub.engine.migration import OUTCOMES
from matrixserve.api import zk_layout as zl

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


@dataclass
class LoadStats:
    """Cumulative counters of what this engine process served, in the health report's
    :class:`~matrixserve.api.zk_layout.Load`: the operator's ratio control observes the engines
    through them, one ZooKeeper write per health report, no scraping."""

    offered: int = 0
    refused: int = 0
    prefilled: int = 0
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    slot_s: float = 0.0
    kv_wait_s: float = 0.0
    decoded: int = 0
    output_tokens: int = 0
    tokens: int = 0
    tpot_s: float = 0.0
    kv_pulls: int = 0
    kv_s: float = 0.0
    decode_s: float = 0.0
    iterations: int = 0
    batch_sum: float = 0.0

    def report(self, busy_s: float) -> zl.Load:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        rounded = {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}
        return zl.Load.model_validate({**rounded, "busy_s": round(busy_s, 6)})


class EngineMetrics:
    def __init__(self, role: str) -> None:
        self.load = LoadStats()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "matrixserve_engine_requests",
            "Requests by stage (prefill, decode) and outcome (accepted, queued, rejected,"
            " rejected_deadline, timeout, kv_timeout, failed)",
            ["stage", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "matrixserve_engine_ttft_seconds",
            "Time to first token (emulated s)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "matrixserve_engine_tpot_seconds",
            "Time per output token (emulated s)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Counter(
            "matrixserve_engine_kv_bytes",
            "KV cache bytes moved, by plane and direction",
            ["plane", "direction"],
            registry=r,
        )
        self.kv_seconds = Histogram(
            "matrixserve_engine_kv_transfer_seconds",
            "KV pull time (emulated s)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Gauge(
            "matrixserve_engine_decode_batch_size",
            "Requests in the running decode batch",
            registry=r,
        )
        self.prefill_slots = Gauge(
            "matrixserve_engine_prefill_slots_used", "Prefill slots in use", registry=r
        )
        self.hbm_used = Gauge(
            "matrixserve_engine_hbm_used_bytes", "HBM used: weights plus reserved KV", registry=r
        )
        self.hbm_capacity = Gauge(
            "matrixserve_engine_hbm_capacity_bytes", "Usable HBM of the instance", registry=r
        )
        self.load_seconds = Gauge(
            "matrixserve_engine_model_load_seconds",
            "Model load time (emulated s)",
            ["source"],
            registry=r,
        )
        self.phase_seconds = Gauge(
            "matrixserve_engine_setup_phase_seconds",
            "Start-up phase durations (emulated s): DeepServe's TEPreLoad, TELoad, TEPostLoad;"
            " the resident process's gather, link, load",
            ["phase"],
            registry=r,
        )
        self.forks = Counter(
            "matrixserve_engine_forks",
            "NPU-fork requests served as a source, by outcome (served, invalid_request,"
            " fork_not_assigned, fork_mismatch, plane_unreachable, not_ready, fork_busy,"
            " fork_in_progress, fork_aborted)",
            ["outcome"],
            registry=r,
        )
        self.fork_bytes = Counter(
            "matrixserve_engine_fork_bytes",
            "Weights and compiled artefacts broadcast to fork targets, by plane",
            ["plane"],
            registry=r,
        )
        self.fork_targets = Gauge(
            "matrixserve_engine_fork_targets",
            "Fork targets this source is broadcasting to now (their pipeline filling included)",
            registry=r,
        )
        self.dram_preloads = Counter(
            "matrixserve_engine_dram_preloads",
            "Models a warm engine pre-loaded into its server's host DRAM from the shared file"
            " service, as its node's DRAM plan asked (DeepServe §6.2), by model",
            ["model"],
            registry=r,
        )
        self.migrations = Counter(
            "matrixserve_engine_migrations",
            "A prefill's moves of a request whose decode was lost mid-stream,"
            " by outcome: pull and reprefill moved it (the KV still here, or prefilled again"
            " with the output so far); bound, unavailable, no_decode and no_slot did not",
            ["outcome"],
            registry=r,
        )
        self.migration_stall = Histogram(
            "matrixserve_engine_migration_stall_seconds",
            "From a decode's loss to the first token of the decode that took the request on"
            " (emulated s): a re-prefill and the hand-over to that decode",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.faults = Gauge(
            "matrixserve_engine_fault_active",
            "1 while an injected fault is active",
            ["kind"],
            registry=r,
        )
        # Experts as a service (enginestub.engine.experts, .attention)
        self.expert_tokens = Counter(
            "matrixserve_engine_expert_tokens",
            "Tokens an expert server computed (each token once per expert it went to)",
            registry=r,
        )
        self.expert_queue_wait = Histogram(
            "matrixserve_engine_expert_queue_wait_seconds",
            "An expert server's wait for its device beside other clients' work, per message"
            " (emulated s)",
            buckets=(0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.expert_messages_received = Counter(
            "matrixserve_engine_expert_messages_received",
            "Messages an expert server answered, by outcome (served, not_held)",
            ["outcome"],
            registry=r,
        )
        self.expert_repeats = Counter(
            "matrixserve_engine_expert_repeated_messages",
            "First sends (not re-sends) from a client in an iteration it had already sent this"
            " server one in: at most one message per client and server per iteration",
            registry=r,
        )
        self.expert_iteration = Histogram(
            "matrixserve_engine_expert_iteration_seconds",
            "An attention client's iteration (emulated s): scheduling, MTP, layers and hops",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.expert_moe = Histogram(
            "matrixserve_engine_expert_moe_seconds",
            "An attention client's iteration's MoE part (emulated s): each MoE layer's and "
            "microbatch's slowest server, summed",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.expert_messages = Histogram(
            "matrixserve_engine_expert_messages_per_iteration",
            "Messages an attention client sent in one iteration, re-sends included",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.expert_resends = Counter(
            "matrixserve_engine_expert_resends",
            "Parts of an iteration an attention client re-sent to a replica",
            registry=r,
        )
        self.expert_failovers = Counter(
            "matrixserve_engine_expert_failovers",
            "Servers an attention client dropped from its routes, by why (gone: its znode;"
            " timeout: no answer in the failover timeout; unreachable: refused or failed)",
            ["why"],
            registry=r,
        )
        self.expert_halts = Counter(
            "matrixserve_engine_expert_halts",
            "Iterations held: monolithic mode waiting for every server, or an expert without"
            " a copy waiting for a map that covers it",
            ["why"],
            registry=r,
        )
        self.info = Gauge(
            "matrixserve_engine_info", "Constant 1, labelled with the role", ["role"], registry=r
        )
        self.info.labels(role=role).set(1)
        for outcome in OUTCOMES:  # every outcome's series from the start, at 0
            self.migrations.labels(outcome=outcome)
