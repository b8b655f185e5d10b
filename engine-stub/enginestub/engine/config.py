"""The engine's configuration, from command-line flags with environment defaults (the node
emulator and the operator set the environment, read through its one contract,
:class:`~matrixserve.api.engine_settings.EngineEnv`). Invalid configurations exit with status 2
and one clear message, never a traceback."""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from enginestub import calibration as cal
from enginestub import timing
from enginestub.fabric import Plane
from matrixserve import httpserving
from matrixserve.api import catalog
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import HBM_USABLE_FRACTION, PRESETS, ModelShape
from matrixserve.api.engine_settings import EngineEnv
from matrixserve.coordination import add_auth_flags, auth_from

Role = Literal["prefill", "decode", "colocated", "expert", "attention", "auto"]

# An engine's clients: the gateway's pool, which keeps idle connections for as long as the engine
# does and passes over one the engine closed (a longer idle limit keeps more of it warm), and other
# engines and the node emulator through httpx and aiohttp, whose pools let go first (5 s, 15 s).
CONNECTION_LIMITS = httpserving.ConnectionLimits(idle_timeout=300.0)


class ConfigError(Exception):
    pass


LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


def _loopback(host: str) -> None:
    """Engines bind loopback addresses only (every pod IP of the emulated cluster is one)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is None or address not in LOOPBACK:
        raise ValueError(f"host {host!r}: engines bind loopback addresses (127.0.0.0/8) only")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    model: ModelShape
    # This pod's devices, as its node grants them: its dies, its NPUs (the device plugin's
    # ASCEND_VISIBLE_DEVICES). An instance of several pods has ``ranks`` times as many dies.
    dies: list[int] = Field(min_length=1)
    npus: list[int] = []
    # The instance's RoCE IPs by device: this pod's (one per die), and, once the leader of an
    # instance of several pods has gathered its ranks, every rank's in rank order (see
    # :meth:`formed`): what its peers link to, probe and pull KV over.
    roce_ips: list[str]
    ub_addresses: list[str] = []
    node: str = "local"
    superpod: str = "local"
    tp: int = Field(ge=1)
    ep: int = Field(default=1, ge=1)
    mtp: bool = False
    max_batch: int = Field(ge=1, le=4096)
    # The TPOT SLO (CloudMatrix-Infer §5.2: the decode batch is chosen to meet the TPOT SLO): a
    # decode admits a request only while the modelled step of the batch with it stays within
    # this many emulated ms (None: the batch size alone limits)
    tpot_slo_ms: float | None = Field(default=None, gt=0, le=600000)
    max_prompt_tokens: int = Field(default=32768, ge=1)
    max_output_tokens: int = Field(default=8192, ge=1)
    time_scale: float = Field(default=1.0, gt=0, le=1e6)
    kv_plane: Plane = Plane.ROCE
    load_source: timing.LoadSource = timing.LoadSource.SHARED_FILE_SERVICE
    # an engine without ZooKeeper: how many read the shared file service with it (one in a
    # group counts the readers in ZooKeeper as they come and go: enginestub.engine.bucket)
    concurrent_loaders: int = Field(default=1, ge=1)
    instance: str = "engine"
    # An instance of several pods, one per server (CloudMatrix-Infer §4.1: EP32 prefills on 2
    # servers, an EP320 decode on 20): this pod's rank (0: the leader, which serves) and the
    # pods' number. Every pod has the same dies.
    rank: int = Field(default=0, ge=0)
    ranks: int = Field(default=1, ge=1, le=1024)
    pod: str = ""  # the pod's name (downward API): a fork target names it to its source
    pod_uid: str = ""  # the pod's UID (downward API), reported as part of who this engine is
    pod_namespace: str = "default"
    group: str | None = None  # "<namespace>/<name>" of the P/D group in ZooKeeper
    zookeeper: str | None = None
    zookeeper_auth: zl.Credentials | None = None  # the digest identity (None: open znodes)
    fault_injection: bool = False  # POST/DELETE /v1/faults answered (else 403)
    connection_limits: httpserving.ConnectionLimits = CONNECTION_LIMITS
    health_interval: float = Field(default=cal.HEALTH_REPORT_INTERVAL_SECONDS, gt=0)
    # DeepServe's TE-Pre-Load (Python, NPU state, HCCL), emulated seconds at start.
    pre_load_seconds: float = Field(default=cal.TE_PRE_LOAD_SECONDS, ge=0)
    link_timeout: float = Field(default=60.0, gt=0)
    # The fault-detection tiers (docs/engine-stub.md, "Detection"), emulated seconds.
    loop_beat_interval: float = Field(default=cal.LOOP_BEAT_INTERVAL_SECONDS, gt=0)
    hang_bound: float = Field(default=cal.LOOP_BEAT_INTERVAL_SECONDS * cal.HANG_MISSED_BEATS, gt=0)
    link_probe_interval: float = Field(default=cal.LINK_PROBE_INTERVAL_SECONDS, gt=0)
    device_status_file: Path | None = None
    decode_peers: list[str] = []  # host:port, when there is no ZooKeeper (tests, colocated demos)
    # "absolute": decode steps on absolute deadlines (overhead never accumulates); "relative":
    # the naive loop that sleeps one step after its work - kept as the benchmark's baseline.
    step_scheduling: Literal["absolute", "relative"] = "absolute"
    # "reject" (P/D-Serve: prefill never queues) or "queue": a local FIFO at the prefill, the
    # paper's original version, kept as the gateway benchmark's baseline.
    admission: Literal["reject", "queue"] = "reject"
    # Experts as a service (enginestub.engine.experts, .attention): the pool "<ns>/<name>" an
    # expert server or attention client belongs to, the mode (eaas: a client drops a failed
    # server and re-sends to a replica; monolithic: the baseline's static group, EaaS §2.2), a
    # server's slots per layer (None: as many as fit its HBM), a client's failover timeout
    # (emulated s, EaaS §3.4), the experts' popularity and the microbatches per iteration
    # (xDeepServe §5.2: two).
    expert_pool: str | None = None
    expert_mode: Literal["eaas", "monolithic"] = "eaas"
    expert_slots: int | None = Field(default=None, ge=1, le=4096)
    expert_failover: float = Field(default=cal.EXPERT_FAILOVER_SECONDS, gt=0, le=3600)
    expert_popularity: str = "uniform"
    microbatches: int = Field(default=cal.DISAGGREGATED_MICROBATCHES, ge=1, le=16)

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        _loopback(self.host)
        if self.rank >= self.ranks:
            raise ValueError(
                f"rank {self.rank} of an instance of {self.ranks} pod(s): "
                f"ranks are 0..{self.ranks - 1}"
            )
        if self.ranks > 1 and self.group is None:
            raise ValueError(
                f"an instance of {self.ranks} pods needs a group "
                f"({EngineEnv.name('group')}): its ranks meet in ZooKeeper"
            )
        if self.instance_dies % self.tp:
            raise ValueError(f"tp {self.tp} does not divide the {self._dies_said()}")
        if self.roce_ips and len(self.roce_ips) not in (len(self.dies), self.instance_dies):
            raise ValueError(f"{len(self.roce_ips)} RoCE IPs for {len(self.dies)} dies")
        if self.group is not None and self.group.count("/") != 1:
            raise ValueError(f"group {self.group!r} must be <namespace>/<name>")
        if self.group is not None and self.zookeeper is None:
            raise ValueError(f"a group needs a ZooKeeper address ({EngineEnv.name('zookeeper')})")
        if self.role in ("prefill", "colocated") and self.expert_pool is not None:
            raise ValueError(
                f"a {self.role} engine keeps its experts: an expert pool's clients are decodes "
                f"(EaaS §5.1, decoding only); unset {EngineEnv.name('expert_pool')}"
            )
        if self.role == "expert" or self.attention_client:
            self._check_expert_pool()
        if self.hang_bound <= self.loop_beat_interval:
            raise ValueError(
                f"--hang-bound {self.hang_bound:g} must be more than --loop-beat-interval "
                f"{self.loop_beat_interval:g}: a hang is beats missed, not one beat late"
            )
        if self.kv_capacity_bytes <= 0:
            need = self.weights_bytes / self.instance_dies / cal.GB
            raise ValueError(
                f"model {self.model.name} does not fit: {need:.1f} GB of weights per die against "
                f"{catalog.DIE_HBM_BYTES / cal.GB * HBM_USABLE_FRACTION:.1f} GB usable HBM per die; "
                "give the instance more dies"
            )
        return self

    @property
    def attention_client(self) -> bool:
        """Its MoE layers are served by its expert pool (:mod:`.attention`): the attention
        role, or a group's decode with a pool (``decode``, or ``auto``, whose role the RoCE map
        gives: a pool is only ever given to a decode, EaaS §5.1)."""
        if self.role == "attention":
            return True
        return self.expert_pool is not None and self.role in ("decode", "auto")

    def _check_expert_pool(self) -> None:
        name = EngineEnv.name("expert_pool")
        who = "an expert" if self.role == "expert" else "an attention client (decode)"
        if self.model.moe is None:
            raise ValueError(f"{who} engine needs an MoE model; {self.model.name} has none")
        if self.expert_pool is None or self.expert_pool.count("/") != 1:
            raise ValueError(
                f"{who} engine needs its expert pool as <namespace>/<name> "
                f"({name}), not {self.expert_pool!r}"
            )
        zl.ExpertPoolPaths(*self.expert_pool.split("/"))  # valid names, or ValueError
        if self.zookeeper is None:
            raise ValueError(
                f"{who} engine needs ZooKeeper ({EngineEnv.name('zookeeper')}): "
                "the pool's map and servers are there"
            )
        if self.ranks > 1:
            raise ValueError(f"{who} engine is an instance of one pod")

    @property
    def slots(self) -> int:
        """An expert server's slots per MoE layer: as configured, else as many experts as its
        dies' usable HBM holds in every MoE layer."""
        if self.expert_slots is not None:
            return self.expert_slots
        moe = self.model.moe
        if moe is None:
            return 1
        one = moe.moe_layers * self.model.expert_params_per_layer * self.model.weight_bytes
        hbm = self.instance_dies * catalog.DIE_HBM_BYTES * HBM_USABLE_FRACTION
        return max(1, int(hbm // one))

    def _dies_said(self) -> str:
        dies = len(self.dies)
        if self.ranks == 1:
            return f"{dies} dies granted"
        return f"instance's {self.instance_dies} dies ({dies} granted to each of its {self.ranks} pods)"

    @property
    def instance_dies(self) -> int:
        """The whole instance's dies: this pod's times its pods (every pod has the same)."""
        return len(self.dies) * self.ranks

    @property
    def shape(self) -> timing.InstanceShape:
        """The whole instance's shape, every rank's dies: the leader of an instance of several
        pods is timed for all of them (their EP dispatch and combine are the timing model's)."""
        return timing.InstanceShape(dies=self.instance_dies, tp=self.tp, ep=self.ep, mtp=self.mtp)

    @property
    def weights_bytes(self) -> float:
        """The whole instance's weights (every rank's dies): an expert server's are its slots'
        in every MoE layer, an attention client's everything but the experts."""
        if self.role == "expert" and self.model.moe is not None:
            per_slot = self.model.expert_params_per_layer * self.model.weight_bytes
            return self.slots * self.model.moe.moe_layers * per_slot
        if self.attention_client:
            return timing.non_expert_weights_per_die(self.model, self.shape) * self.instance_dies
        return timing._weights_per_die(self.model, self.shape) * self.instance_dies

    @property
    def kv_capacity_bytes(self) -> float:
        """The whole instance's HBM for KV (every rank's dies), after its weights."""
        hbm = self.instance_dies * catalog.DIE_HBM_BYTES * HBM_USABLE_FRACTION
        return hbm - self.weights_bytes

    @property
    def own_roce_ips(self) -> list[str]:
        """This pod's RoCE IPs (the first of :attr:`roce_ips`: the leader is rank 0)."""
        return self.roce_ips[: len(self.dies)]

    def formed(self, roce_ips: list[str]) -> EngineConfig:
        """The leader's configuration once its instance is formed: ``roce_ips``, every rank's
        in rank order (its own first), the instance's devices. ValueError for a count that is
        not the instance's or a list that does not begin with its own."""
        if len(roce_ips) != self.instance_dies or roce_ips[: len(self.dies)] != self.own_roce_ips:
            raise ValueError(
                f"an instance of {self.ranks} pods of {len(self.dies)} dies has "
                f"{self.instance_dies} RoCE IPs, its leader's first; not {roce_ips}"
            )
        return self.model_copy(update={"roce_ips": list(roce_ips)})


def _given(value: str | None, otherwise: str) -> str:
    """An environment variable's value, ``otherwise`` when it is not set (set empty, it is
    ``""``)."""
    return otherwise if value is None else value


def _items(value: str | None) -> list[str]:
    """A comma-separated list variable's items (none when unset or empty)."""
    return [x for x in (value or "").split(",") if x]


def _parser() -> argparse.ArgumentParser:
    """Every flag, with its environment default (read now: a claimed warm pod's environment is
    updated by its assignment before it parses again)."""
    env = EngineEnv.from_env(os.environ)
    parser = argparse.ArgumentParser(
        prog="python -m enginestub", description="MatrixServe engine stub"
    )
    parser.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a pre-warmed, model-agnostic engine: TE-Pre-Load, then wait for an assignment in "
        f"ZooKeeper (default: ${EngineEnv.name('warm')}=1)",
    )
    parser.add_argument(
        "--pre-load-seconds",
        type=_non_negative,
        default=_given(env.pre_load_seconds, str(cal.TE_PRE_LOAD_SECONDS)),
        help="emulated s of TE-Pre-Load at start: Python, NPU state, HCCL (DeepServe §6.1)",
    )
    parser.add_argument(
        "--role",
        default=_given(env.role, "colocated"),
        help="prefill | decode | colocated | expert | attention | auto (role from the RoCE map)",
    )
    parser.add_argument("--host", default=env.node_pod_ip or env.pod_ip or "127.0.0.1")
    parser.add_argument("--port", type=int, default=_given(env.port, "8000"))
    parser.add_argument(
        "--model",
        default=_given(env.model, "llama3-8b"),
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a JSON file with a ModelShape",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=_given(env.tp, "0"),
        help="tensor parallel degree (default: all dies of the instance, every rank's)",
    )
    parser.add_argument("--ep", type=int, default=_given(env.ep, "1"))
    parser.add_argument("--mtp", action="store_true", default=env.mtp == "1")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=_given(env.max_batch, "0"),
        help="prefill slots (default 8) or decode batch (default 64)",
    )
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=_given(env.max_prompt_tokens, "32768")
    )
    parser.add_argument(
        "--max-output-tokens", type=int, default=_given(env.max_output_tokens, "8192")
    )
    parser.add_argument("--time-scale", type=float, default=_given(env.time_scale, "1"))
    parser.add_argument("--kv-plane", default=_given(env.kv_plane, Plane.ROCE.value))
    parser.add_argument(
        "--load-source",
        default=_given(env.load_source, timing.LoadSource.SHARED_FILE_SERVICE.value),
    )
    parser.add_argument(
        "--concurrent-loaders", type=int, default=_given(env.concurrent_loaders, "1")
    )
    parser.add_argument("--group", default=env.group)
    parser.add_argument(
        "--rank",
        type=int,
        default=_given(env.rank, "0"),
        help="this pod's rank in an instance of several pods: 0 the leader (it serves), 1.. its "
        f"workers (they hold their dies) (default: ${EngineEnv.name('rank')} or 0)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=_given(env.ranks, "1"),
        help=f"pods in the instance, one per server (default: ${EngineEnv.name('ranks')} or 1)",
    )
    parser.add_argument("--zookeeper", default=env.zookeeper)
    add_auth_flags(parser)
    parser.add_argument(
        "--fault-injection",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accept POST/DELETE /v1/faults "
        f"(default: ${EngineEnv.name('fault_injection')}=1; else 403)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=_given(env.health_interval, str(cal.HEALTH_REPORT_INTERVAL_SECONDS)),
    )
    parser.add_argument(
        "--tpot-slo-ms",
        type=_positive,
        default=env.tpot_slo_ms or None,
        help="a decode admits a request only while its batch's modelled step stays within this "
        "many emulated ms (the group's slo.tpotMilliseconds; default: no limit but the batch)",
    )
    parser.add_argument("--link-timeout", type=float, default=_given(env.link_timeout, "60"))
    parser.add_argument(
        "--loop-beat-interval",
        type=_positive,
        default=_given(env.loop_beat_interval, str(cal.LOOP_BEAT_INTERVAL_SECONDS)),
        help="emulated s between the serving loop's heartbeats",
    )
    parser.add_argument(
        "--hang-bound",
        type=_positive,
        default=_given(env.hang_bound, str(cal.LOOP_BEAT_INTERVAL_SECONDS * cal.HANG_MISSED_BEATS)),
        help="emulated s without a beat before the engine says it is hung (at least "
        f"{cal.HANG_WALL_FLOOR_SECONDS:g} wall s)",
    )
    parser.add_argument(
        "--link-probe-interval",
        type=_positive,
        default=_given(env.link_probe_interval, str(cal.LINK_PROBE_INTERVAL_SECONDS)),
        help="emulated s between a prefill's probes of its decodes' sub-links",
    )
    parser.add_argument(
        "--decode-peer",
        action="append",
        default=_items(env.decode_peers),
        help="host:port of a decode instance (repeatable), when not using ZooKeeper",
    )
    parser.add_argument(
        "--dies",
        default=_given(env.dies, "0,1"),
        help=f"die ids granted (default: ${EngineEnv.name('dies')} from the node emulator)",
    )
    parser.add_argument(
        "--admission",
        default=_given(env.admission, "reject"),
        help="reject (default) or queue",
    )
    parser.add_argument(
        "--step-scheduling",
        default=_given(env.step_scheduling, "absolute"),
        help="decode step scheduling: absolute deadlines (default) or relative (naive baseline)",
    )
    parser.add_argument(
        "--expert-pool",
        default=env.expert_pool,
        help="<namespace>/<name> of the expert pool of an expert server or attention client",
    )
    parser.add_argument("--expert-mode", default=_given(env.expert_mode, "eaas") or "eaas")
    parser.add_argument(
        "--expert-slots",
        type=int,
        default=_given(env.expert_slots, "0"),
        help="an expert server's slots per MoE layer (default: as many as fit its HBM)",
    )
    parser.add_argument(
        "--expert-failover-ms",
        type=_positive,
        default=_given(env.expert_failover_ms, str(cal.EXPERT_FAILOVER_SECONDS * 1000)),
        help="emulated ms an attention client waits for a server's answer before it drops it "
        "and re-sends its part to a replica (EaaS §3.4)",
    )
    parser.add_argument(
        "--expert-popularity",
        default=_given(env.expert_popularity, "uniform"),
        help="uniform | zipf (the hottest expert 30x the mean) | a JSON trace file",
    )
    httpserving.add_arguments(parser, "ENGINE_", CONNECTION_LIMITS)
    return parser


def parse(argv: list[str] | None = None) -> EngineConfig:
    parser = _parser()
    args = parser.parse_args(argv)
    env = EngineEnv.from_env(os.environ)
    try:
        model = _model(args.model)
        dies = [int(d) for d in args.dies.split(",") if d.strip()]
        roce = _items(env.roce_ips) or [f"198.19.255.{d + 1}" for d in dies]
        role = args.role
        max_batch = args.max_batch or (8 if role in ("prefill", "colocated") else 64)
        status_file = env.device_status_file
        return EngineConfig(
            role=role,
            host=args.host,
            port=args.port,
            model=model,
            dies=dies,
            npus=[int(n) for n in _items(env.npus)],
            roce_ips=roce,
            ub_addresses=_items(env.ub_addresses),
            node=_given(env.node_name, "local"),
            superpod=_given(env.superpod, "local"),
            tp=args.tp or len(dies) * args.ranks,
            ep=args.ep,
            mtp=args.mtp,
            max_batch=max_batch,
            tpot_slo_ms=args.tpot_slo_ms,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
            time_scale=args.time_scale,
            kv_plane=Plane(args.kv_plane),
            load_source=timing.LoadSource(args.load_source),
            concurrent_loaders=args.concurrent_loaders,
            # a claimed warm pod reports under its assignment's instance name, not its pod's
            instance=env.instance or _given(env.pod_name, "engine"),
            rank=args.rank,
            ranks=args.ranks,
            pod=_given(env.pod_name, ""),
            pod_uid=_given(env.pod_uid, ""),
            pod_namespace=_given(env.pod_namespace, "default"),
            group=args.group,
            zookeeper=args.zookeeper,
            zookeeper_auth=auth_from(parser, args),
            fault_injection=(
                _switch(env, "fault_injection")
                if args.fault_injection is None
                else args.fault_injection
            ),
            connection_limits=httpserving.limits_from(args),
            health_interval=args.health_interval,
            pre_load_seconds=args.pre_load_seconds,
            link_timeout=args.link_timeout,
            loop_beat_interval=args.loop_beat_interval,
            hang_bound=args.hang_bound,
            link_probe_interval=args.link_probe_interval,
            device_status_file=Path(status_file) if status_file else None,
            decode_peers=args.decode_peer,
            step_scheduling=args.step_scheduling,
            admission=args.admission,
            expert_pool=args.expert_pool or None,
            expert_mode=args.expert_mode,
            expert_slots=args.expert_slots or None,
            expert_failover=args.expert_failover_ms / 1000,
            expert_popularity=args.expert_popularity,
        )
    except ValidationError as exc:
        raise ConfigError(_errors(exc)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class WarmConfig(BaseModel):
    """A pre-warmed engine (DeepServe §6.1): who and where it is, nothing of a model,
    a role or a group; its assignment says those."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    port: int = Field(ge=1, le=65535)
    pod: str = Field(min_length=1)
    pod_uid: str = Field(min_length=1)
    namespace: str
    node: str
    superpod: str
    npus: list[int]
    dies: list[int] = Field(min_length=1)
    roce_ips: list[str]
    zookeeper: str
    zookeeper_auth: zl.Credentials | None = None
    time_scale: float = Field(gt=0, le=1e6)
    pre_load_seconds: float = Field(ge=0)
    connection_limits: httpserving.ConnectionLimits = CONNECTION_LIMITS
    # What its server's local SSD holds (the node emulator's --ssd-models); its host DRAM's
    # models come from the operator's DRAM plan (enginestub.engine.warm).
    ssd_models: list[str] = []

    @model_validator(mode="after")
    def _consistent(self) -> WarmConfig:
        _loopback(self.host)
        if len(self.roce_ips) != len(self.dies):
            raise ValueError(f"{len(self.roce_ips)} RoCE IPs for {len(self.dies)} dies")
        return self


def pod_identity(cfg: EngineConfig | WarmConfig) -> dict[str, Any]:
    """Who and where a pod's engine is, its devices included, as a
    :class:`~matrixserve.api.zk_layout.PodReport` says it (by field name)."""
    return {
        "pod": cfg.pod,
        "pod_uid": cfg.pod_uid,
        "pod_ip": cfg.host,
        "port": cfg.port,
        "node": cfg.node,
        "superpod": cfg.superpod,
        "npus": cfg.npus,
        "dies": cfg.dies,
        "roce_ips": cfg.roce_ips,
    }


def parse_warm(argv: list[str] | None = None) -> WarmConfig | None:
    """The warm engine's configuration with ``--warm`` or ``$ENGINE_WARM=1``; None without.
    A warm engine needs its pod's name and UID (an assignment is bound to both) and ZooKeeper."""
    parser = _parser()
    args = parser.parse_args(argv)
    env = EngineEnv.from_env(os.environ)
    try:
        warm = args.warm if args.warm is not None else _switch(env, "warm")
        if not warm:
            return None
        if not args.zookeeper:
            raise ValueError(
                f"a warm engine needs ZooKeeper ({EngineEnv.name('zookeeper')} or --zookeeper)"
            )
        if not env.pod_name or not env.pod_uid:
            name = EngineEnv.name("pod_uid" if env.pod_name else "pod_name")
            raise ValueError(f"a warm engine needs ${name}: its assignment is bound to it")
        pod, pod_uid = env.pod_name, env.pod_uid
        namespace = _given(env.pod_namespace, "default")
        node = _given(env.node_name, "local")
        paths = zl.WarmPaths(namespace)  # valid names, or exit 2
        paths.pod(pod)
        paths.dram(node)
        dies = [int(d) for d in args.dies.split(",") if d.strip()]
        return WarmConfig(
            host=args.host,
            port=args.port,
            pod=pod,
            pod_uid=pod_uid,
            namespace=namespace,
            node=node,
            superpod=_given(env.superpod, "local"),
            npus=[int(n) for n in _items(env.npus)],
            dies=dies,
            roce_ips=_items(env.roce_ips) or [f"198.19.255.{d + 1}" for d in dies],
            zookeeper=args.zookeeper,
            zookeeper_auth=auth_from(parser, args),
            time_scale=args.time_scale,
            pre_load_seconds=args.pre_load_seconds,
            connection_limits=httpserving.limits_from(args),
            ssd_models=_items(env.ssd_models),
        )
    except ValidationError as exc:
        raise ConfigError(_errors(exc)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()
    )


def _non_negative(text: str) -> float:
    """A finite number >= 0 (argparse names the flag when it is not one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number >= 0 expected")
    return value


def _positive(text: str) -> float:
    """A finite number > 0 (argparse names the flag when it is not one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number > 0 expected")
    return value


def _switch(env: EngineEnv, field: str) -> bool:
    """An on/off variable of the engine's environment: 1/true or 0/false/unset; anything else
    is refused."""
    value = (getattr(env, field) or "").strip().lower()
    if value not in ("", "0", "1", "false", "true"):
        raise ValueError(f"{EngineEnv.name(field)}={value!r}: 1/true or 0/false expected")
    return value in ("1", "true")


def _model(name: str) -> ModelShape:
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"unknown model {name!r}: use one of {', '.join(sorted(PRESETS))} or a JSON file"
        )
    return ModelShape.model_validate(json.loads(path.read_text()))
