"""The ZooKeeper layout shared by the operator, the engine stubs and the gateway.

P/D-Serve §3.2-3.4 keeps engine-level membership in ZooKeeper: RoCE IPs gathered per group,
an init order, the RoCE map, verified links, health, the decode meta pushed to prefills, the
entrances, logical removals. The operator's own state stays in Kubernetes. Pure: paths and the
JSON payloads (pydantic), no client. ``docs/zookeeper.md`` has the table of who writes what.

::

    /matrixserve/v1/groups/<ns>/<group>/
        reports/<instance>     EPHEMERAL  Report: RoCE IPs ordered by device id   (engine)
        ranks/<instance>.<k>   EPHEMERAL  RankReport: rank k >= 1 of a multi-pod
                                          instance, its dies and its heartbeat  (engine)
        init-order             PERSISTENT InitOrder, once reports == expected     (operator)
        roce-map               PERSISTENT RoceMap {P: [...], D: [...]}, versioned  (operator)
        links/<p>--<d>         PERSISTENT Link: verified sub-links (kvmapping)     (engine)
        health/<instance>      EPHEMERAL  Health, refreshed every few tens of s    (engine)
        decode-meta            PERSISTENT DecodeMeta, pushed to every prefill     (operator)
        entrances/<instance>   PERSISTENT Entrance: a prefill open for requests    (operator)
        joining/<instance>     EPHEMERAL  Report of a role-less container joining  (engine)
        removed/<instance>     PERSISTENT Removal: logically removed, no traffic   (operator)
        draining/<instance>    PERSISTENT Drain: no new work, finish what it has  (operator)
    /matrixserve/v1/warm/<ns>/
        pods/<pod>             EPHEMERAL  WarmReport: a warm pod past TE-Pre-Load   (engine)
        assignments/<pod>      PERSISTENT Assignment: what a claimed pod becomes   (operator)
        dram/<node>            PERSISTENT DramPlan: models to keep in host DRAM    (operator)
    /matrixserve/v1/forksources/<ns>/<source key>/<group>.<instance>
                               EPHEMERAL  ForkSource: a live instance that can fork (engine)
    /matrixserve/v1/expertpools/<ns>/<pool>/
        map                    PERSISTENT ExpertMapPointer: the version in force  (operator)
        map/v<N>               PERSISTENT ExpertMapVersion: servers, phase       (operator)
        map/v<N>/<layer>       PERSISTENT ExpertMapLayer: slots per server       (operator)
        servers/<id>           EPHEMERAL  ExpertServerReport, one per server     (engine)

Who may touch it: with :class:`Credentials` configured, every znode under ``/matrixserve`` belongs
to one digest identity that the operator, the gateway and the engines share; nobody else may read,
write or delete them. A group's subtree (:func:`group_root_of`) is the unit of an upgrade: it stays
open, and what is made in it open too, until every pod of the group carries the credential.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

from matrixserve.api import engine_settings, kvmapping, roles

# Known here too (the payloads carry these roles, an assignment these settings), as most modules
# that read the payloads name them.
Role = roles.Role
ASSIGNMENT_ENV = engine_settings.ASSIGNMENT_ENV
RETIRED_ASSIGNMENT_ENV = engine_settings.RETIRED_ASSIGNMENT_ENV

TOP = "/matrixserve"  # every version's tree: what the ACLs protect
ROOT = f"{TOP}/v1"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _check(name: str, what: str) -> str:
    if not _NAME.fullmatch(name) or len(name) > 253:
        raise ValueError(f"invalid {what} {name!r}: lower-case DNS name expected")
    return name


def groups_root(namespace: str | None = None) -> str:
    """The folder of every group's subtree (of one namespace's, if given)."""
    if namespace is None:
        return f"{ROOT}/groups"
    return f"{ROOT}/groups/{_check(namespace, 'namespace')}"


def group_path(namespace: str, group: str) -> str:
    return f"{groups_root(namespace)}/{_check(group, 'group')}"


def group_root_of(path: str) -> str | None:
    """The root of the group subtree ``path`` is in (``path`` itself if it is a group's root),
    or None outside every group's subtree."""
    prefix = groups_root() + "/"
    if not path.startswith(prefix):
        return None
    parts = path[len(prefix) :].split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        return None
    return f"{prefix}{parts[0]}/{parts[1]}"


def is_group_root(path: str) -> bool:
    return group_root_of(path) == path


class GroupPaths:
    """All paths of one P/D group."""

    def __init__(self, namespace: str, group: str) -> None:
        self.root = group_path(namespace, group)
        self.reports = f"{self.root}/reports"
        self.ranks = f"{self.root}/ranks"
        self.init_order = f"{self.root}/init-order"
        self.roce_map = f"{self.root}/roce-map"
        self.links = f"{self.root}/links"
        self.health = f"{self.root}/health"
        self.decode_meta = f"{self.root}/decode-meta"
        self.entrances = f"{self.root}/entrances"
        self.joining = f"{self.root}/joining"
        self.removed = f"{self.root}/removed"
        self.draining = f"{self.root}/draining"

    def report(self, instance: str) -> str:
        return f"{self.reports}/{_check(instance, 'instance')}"

    def rank(self, instance: str, k: int) -> str:
        """Rank ``k``'s report of a multi-pod instance (its workers': the leader, rank 0,
        reports under ``reports/``)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"invalid rank {k!r}: an integer >= 0 expected")
        return f"{self.ranks}/{_check(instance, 'instance')}.{k}"

    def link(self, prefill: str, decode: str) -> str:
        return f"{self.links}/{_check(prefill, 'instance')}--{_check(decode, 'instance')}"

    def health_of(self, instance: str) -> str:
        return f"{self.health}/{_check(instance, 'instance')}"

    def entrance(self, instance: str) -> str:
        return f"{self.entrances}/{_check(instance, 'instance')}"

    def joining_of(self, instance: str) -> str:
        return f"{self.joining}/{_check(instance, 'instance')}"

    def removed_of(self, instance: str) -> str:
        return f"{self.removed}/{_check(instance, 'instance')}"

    def draining_of(self, instance: str) -> str:
        return f"{self.draining}/{_check(instance, 'instance')}"

    def all_folders(self) -> list[str]:
        """The folders engines write into (made by whoever starts first: an engine at start, or
        the operator). ``entrances/`` is not one: it appears with the first entrance, so the
        gateway can tell "no entrance open" from "not known here" (a server that lost the
        group's data) and keep routing by the group's status meanwhile."""
        return [
            self.reports,
            self.ranks,
            self.links,
            self.health,
            self.joining,
            self.removed,
            self.draining,
        ]


def warm_root() -> str:
    return f"{ROOT}/warm"


class WarmPaths:
    """The warm pods of one namespace (DeepServe §6.1): each warm engine reports itself under
    ``pods/`` and waits for its ``assignments/`` znode, which the operator writes when a group
    claims the pod."""

    def __init__(self, namespace: str) -> None:
        self.root = f"{warm_root()}/{_check(namespace, 'namespace')}"
        self.pods = f"{self.root}/pods"
        self.assignments = f"{self.root}/assignments"

    def pod(self, name: str) -> str:
        return f"{self.pods}/{_check(name, 'pod')}"

    def assignment(self, name: str) -> str:
        return f"{self.assignments}/{_check(name, 'pod')}"

    def dram(self, node: str) -> str:
        """The models the namespace's pools want in this server's host DRAM (a DramPlan)."""
        return f"{self.root}/dram/{_check(node, 'node')}"


def loaders_root() -> str:
    """The shared file service's readers now (one ephemeral znode each): the bucket's bandwidth
    is divided among them (001 Table 2; :mod:`enginestub.engine.bucket`). One bucket for the
    cluster, so one folder for every namespace."""
    return f"{ROOT}/loading/sharedfs"


def loader_path(name: str) -> str:
    return f"{loaders_root()}/{_check(name, 'loader')}"


def fork_sources_root(namespace: str | None = None) -> str:
    if namespace is None:
        return f"{ROOT}/forksources"
    return f"{ROOT}/forksources/{_check(namespace, 'namespace')}"


def fork_source_key(model: str, artifacts: str, expert_map: int | None = None) -> str:
    """A fork source's content address (after ModelExpress's): the model, its compiled
    artefacts' identity (:func:`artifact_id`) and, for MoE, the expert map's version. Only a
    source with the same key can fork a target."""
    base = re.sub(r"[^a-z0-9.-]", "-", model.lower()).strip("-.") or "model"
    key = f"{base}.{artifacts}" + ("" if expert_map is None else f".em{expert_map}")
    return _check(key, "fork source key")


def fork_source_path(namespace: str, key: str, group: str, instance: str) -> str:
    return (
        f"{fork_sources_root(namespace)}/{_check(key, 'fork source key')}/"
        f"{_check(group, 'group')}.{_check(instance, 'instance')}"
    )


def artifact_id(model: str, tp: int, ep: int, dies: int, engine_version: str) -> str:
    """The identity of an instance's compiled artefacts (graphs, kernels): they depend on the
    model, its parallelism, the dies they run on and the engine that compiled them. A target
    forked from a source carries the source's artefacts, so both must agree on all of these
    (Dynamo's ModelExpress: weights without the compiled caches leave minutes of work)."""
    text = f"{model}|tp{tp}|ep{ep}|d{dies}|{engine_version}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- operations
@dataclass(frozen=True)
class Put:
    """Set the znode's data, creating it (and its parents) if absent. ``new``: it most likely
    is absent (a version written for the first time): created first, set if it exists, one
    round trip instead of two."""

    path: str
    data: bytes
    new: bool = False


@dataclass(frozen=True)
class Delete:
    """Delete the znode (with its children if ``recursive``); an absent one is fine."""

    path: str
    recursive: bool = False


ZnodeOp = Put | Delete


# --------------------------------------------------------------------------- who may touch it
USER = "matrixserve"  # the identity's user name (the chart's and the dev cluster's)
CREDENTIALS_KEY = "auth"  # the key of "user:password" in the Secrets that carry it
_UNSAFE = re.compile(r"[\s\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Credentials:
    """MatrixServe's ZooKeeper digest identity, ``user:password``; shared by the operator, the
    gateway and the engines. The password stays out of ``repr`` (configurations get logged)."""

    user: str
    password: str = field(repr=False)

    @classmethod
    def parse(cls, text: str) -> Credentials:
        """From ``user:password`` (the password may hold colons; ZooKeeper splits at the first)."""
        user, colon, password = text.partition(":")
        if not colon or not user or not password:
            raise ValueError("ZooKeeper credentials must be user:password, both non-empty")
        if _UNSAFE.search(text):
            # A Secret written with `echo` ends in a newline: refused, never silently a
            # different identity than the other processes'.
            raise ValueError(
                "ZooKeeper credentials must not contain whitespace or control characters"
            )
        return cls(user, password)

    def text(self) -> str:
        return f"{self.user}:{self.password}"


def expert_pools_root(namespace: str | None = None) -> str:
    if namespace is None:
        return f"{ROOT}/expertpools"
    return f"{ROOT}/expertpools/{_check(namespace, 'namespace')}"


def expert_pool_path(namespace: str, pool: str) -> str:
    return f"{expert_pools_root(namespace)}/{_check(pool, 'pool')}"


class ExpertPoolPaths:
    """All paths of one expert pool (EaaS §3.1, §4.4: the monitor is ZooKeeper).

    The map is too big for one znode as JSON at scale (58 layers x 256 experts x replicas, and
    ZooKeeper refuses a znode over 1 MB), so each version is written whole as immutable znodes,
    ``map/v<N>`` (the version: its server table and phase) and one ``map/v<N>/<layer>`` per
    layer, and only then put in force by rewriting the pointer ``map``. A reader reads the
    pointer, then that version's znodes: it never sees half a version. Old versions are deleted
    once no longer in force (the last two are kept: a reader may be between the pointer and the
    layers)."""

    def __init__(self, namespace: str, pool: str) -> None:
        self.root = expert_pool_path(namespace, pool)
        self.map = f"{self.root}/map"
        self.servers = f"{self.root}/servers"

    def version(self, version: int) -> str:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"invalid map version {version!r}: an integer >= 1 expected")
        return f"{self.map}/v{version}"

    def layer(self, version: int, layer: int) -> str:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"invalid layer {layer!r}: an integer >= 0 expected")
        return f"{self.version(version)}/{layer}"

    def server(self, server: str) -> str:
        return f"{self.servers}/{_check(server, 'server')}"

    @staticmethod
    def version_of(child: str) -> int | None:
        """The version a child of ``map/`` names (``v12`` -> 12); None for anything else."""
        if child.startswith("v") and child[1:].isdigit() and not child[1:].startswith("0"):
            return int(child[1:])
        return None


# --------------------------------------------------------------------------- payloads
class _Payload(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    def dump(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Self:
        return cls.model_validate_json(raw)


class RankEntry(_Payload):
    """One pod of a multi-pod instance, as its leader's :class:`Report` lists it: which rank,
    which pod on which server, its NPUs, dies and their RoCE IPs, and its engine's
    incarnation (a restarted worker is someone else: the instance re-forms)."""

    rank: int = Field(ge=0)
    pod: str
    pod_uid: str = Field(default="", alias="podUid")
    node: str
    superpod: str
    npus: list[int] = Field(default_factory=list)
    dies: list[int]
    roce_ips: list[str] = Field(alias="roceIps")
    incarnation: str


class Report(_Payload):
    """What an instance reports: its RoCE IPs ordered by device id (P/D-Serve §3.2 step 1), and
    who it is: the pod (its UID) and the engine process (a nonce per start, its incarnation: a
    restarted engine keeps pod, IPs and RoCE IPs but has lost every link)."""

    instance: str
    role: Role | None = None  # None: a role-less container (dynamic RoCE construction)
    pod_ip: str = Field(alias="podIP")
    port: int
    node: str
    superpod: str
    dies: list[int]
    roce_ips: list[str] = Field(alias="roceIps")
    ts: float
    pod_uid: str = Field(default="", alias="podUid")
    incarnation: str = ""
    # The engine's tensor-parallel degree (its --tp; None: an engine from before, whose TP is
    # its dies): the RoCE map carries it to the peers, which pair dies by it (kvmapping).
    tp: int | None = Field(default=None, ge=1)
    # An instance of several pods: every rank (the leader, which writes this report, first),
    # and then ``dies`` and ``roce_ips`` above are every rank's, concatenated in rank order
    # (device k of the instance is the k-th). Empty for an instance of one pod.
    ranks: list[RankEntry] = Field(default_factory=list)

    def identity(self) -> Identity:
        return Identity(self.pod_ip, self.port, tuple(self.roce_ips), self.incarnation)

    def dump(self) -> bytes:
        """As every payload, without ``ranks`` when there are none: an instance of one pod
        writes no rank list."""
        return self.model_dump_json(
            by_alias=True, exclude=None if self.ranks else {"ranks"}
        ).encode()

    @field_validator("roce_ips")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("an instance reports at least one RoCE IP")
        return value


class InitOrder(_Payload):
    epoch: int
    roce_map_version: int = Field(alias="roceMapVersion")


class Identity(NamedTuple):
    """Who a member is: where its engine listens, its dies' RoCE IPs and the engine's
    incarnation. A member whose identity changed is someone else: it rejoins the group."""

    pod_ip: str
    port: int
    roce_ips: tuple[str, ...]
    incarnation: str


class MapEntry(_Payload):
    """A member as the map names it. ``tp``: its engine's tensor-parallel degree, from its
    report; the peers need it to pair dies when the two sides differ in size (CloudMatrix-Infer
    §4.3.3, :mod:`~matrixserve.api.kvmapping`). Absent (a map or report from before it was
    carried): the member's dies, as the engine's own default, so old payloads parse and pair
    as they did (the same size pairs device k with device k whatever the TP)."""

    instance: str
    pod_ip: str = Field(alias="podIP")
    port: int
    roce_ips: list[str] = Field(alias="roceIps")
    incarnation: str = ""
    tp: int | None = Field(default=None, ge=1)

    def identity(self) -> Identity:
        return Identity(self.pod_ip, self.port, tuple(self.roce_ips), self.incarnation)

    def side(self) -> kvmapping.Side:
        """Its dies and TP as the mapping takes them (ValueError if its TP does not divide
        its dies)."""
        return kvmapping.Side.of(len(self.roce_ips), self.tp)


class RoceMap(_Payload):
    """⟨P, {⟨IP1..IPK⟩, ...}⟩ and ⟨D, ...⟩ (P/D-Serve §3.2), versioned."""

    version: int
    prefill: list[MapEntry] = Field(alias="P")
    decode: list[MapEntry] = Field(alias="D")

    def entry(self, instance: str) -> MapEntry | None:
        return next((e for e in (*self.prefill, *self.decode) if e.instance == instance), None)

    def role_of(self, instance: str) -> Role | None:
        if any(e.instance == instance for e in self.prefill):
            return Role.PREFILL
        if any(e.instance == instance for e in self.decode):
            return Role.DECODE
        return None

    def peers_of(self, instance: str) -> list[MapEntry]:
        role = self.role_of(instance)
        if role is Role.PREFILL:
            return list(self.decode)
        if role is Role.DECODE:
            return list(self.prefill)
        return []

    def expected_links(self) -> int:
        """The sub-links of every P-D pair, summed: one per decode die each (either rule of
        :mod:`~matrixserve.api.kvmapping`), so n_p · n_d · K when every instance has K dies."""
        return len(self.prefill) * sum(len(d.roce_ips) for d in self.decode)


class SubLink(_Payload):
    """One sub-link: ``device`` is the decode die's index (rank order), ``prefillDevice`` the
    prefill die it pulls from (the same index when both sides are the same size; absent in
    links written before it was said)."""

    device: int
    prefill_ip: str = Field(alias="prefillIp")
    decode_ip: str = Field(alias="decodeIp")
    prefill_device: int | None = Field(default=None, alias="prefillDevice")


class Link(_Payload):
    """A verified P↔D link: each decode die paired with the prefill die the mapping gives it
    (:mod:`~matrixserve.api.kvmapping`: device k with device k for the same size), between the
    two engines of the incarnations named (a link proves nothing for later ones)."""

    prefill: str
    decode: str
    sub_links: list[SubLink] = Field(alias="subLinks")
    verified_at: float = Field(alias="verifiedAt")
    initiator: str
    prefill_incarnation: str = Field(default="", alias="prefillIncarnation")
    decode_incarnation: str = Field(default="", alias="decodeIncarnation")

    def joins(self, prefill: MapEntry, decode: MapEntry) -> bool:
        """Whether this link was verified between exactly these two members: their current
        RoCE IPs paired as the mapping pairs them now, and their current incarnations (a pair
        the mapping cannot pair joins nothing)."""
        try:
            expected = [(s.prefill_ip, s.decode_ip) for s in verify_sub_links(prefill, decode)]
        except ValueError:
            return False
        return (
            self.prefill == prefill.instance
            and self.decode == decode.instance
            and self.prefill_incarnation == prefill.incarnation
            and self.decode_incarnation == decode.incarnation
            and [(s.prefill_ip, s.decode_ip) for s in self.sub_links] == expected
        )


class HealthState(StrEnum):
    SERVING = "Serving"
    DEGRADED = "Degraded"  # serves, short of something (a link delayed or blocked, stuck slots)
    FAULTY = "Faulty"  # cannot serve: a device fault or a hang (see ``Health.faults``)


class EngineFaultKind(StrEnum):
    """What an engine says is wrong with itself (the fault-detection tiers it sees first)."""

    DIE = "die"  # a die of this instance down (the node's device status file, or injected)
    NPU = "npu"  # a whole NPU of this instance down (both its dies)
    HBM = "hbm"  # an uncorrectable HBM error
    HANG = (
        "hang"  # alive, but its serving loop made no progress for the hang bound (xDeepServe §6.1)
    )
    RANK = "Rank"  # a rank (another pod) of a multi-pod instance lost, faulty or not refreshed


class EngineFault(_Payload):
    kind: EngineFaultKind
    since: float  # wall time (epoch s) the engine first saw it: detection latency counts from it
    detail: str = ""
    dies: list[int] = Field(default_factory=list)  # the faulty dies (die, NPU, HBM faults)


class PodReport(_Payload):
    """A pod's engine as it reports itself outside a group's membership (a warm pod, a worker
    of a multi-pod instance): the pod, where it runs, its devices, its engine's incarnation and
    the wall time (epoch s) of its last report."""

    pod: str
    pod_uid: str = Field(alias="podUid")
    pod_ip: str = Field(alias="podIP")
    port: int
    node: str
    superpod: str
    npus: list[int] = Field(default_factory=list)
    dies: list[int]
    roce_ips: list[str] = Field(alias="roceIps")
    incarnation: str
    ts: float


class RankReport(PodReport):
    """What a worker (rank k >= 1) of a multi-pod instance keeps under ``ranks/`` while it holds
    its dies: who and where it is, and its heartbeat (``ts``, every health interval) and state,
    rewritten at once when it changes (a die, NPU or HBM fault of its own: ``Faulty`` with the
    typed faults). Its RoCE IPs are identities in the instance's report, never a connection
    target: it serves nothing, its leader does."""

    instance: str
    rank: int = Field(ge=1)
    state: HealthState
    faults: list[EngineFault] = Field(default_factory=list)

    def entry(self) -> RankEntry:
        """This rank as its leader's report lists it."""
        return RankEntry(
            rank=self.rank,
            pod=self.pod,
            podUid=self.pod_uid,
            node=self.node,
            superpod=self.superpod,
            npus=self.npus,
            dies=self.dies,
            roceIps=self.roce_ips,
            incarnation=self.incarnation,
        )


class LinkState(StrEnum):
    """A sub-link's probe outcome (xDeepServe §6.1: a dummy payload delivered late is decode-side
    saturation, one never delivered is a link fault)."""

    DELAYED = "Delayed"
    BLOCKED = "Blocked"


class LinkProbe(_Payload):
    peer: str  # the peer instance
    device: int  # the sub-link: its decode die's index (kvmapping; k <-> k for the same size)
    peer_roce_ip: str = Field(alias="peerRoceIp")
    state: LinkState
    since: float  # wall time (epoch s) the probe first saw this state
    # The instance whose device status says this sub-link's port is down (the prober's own, or
    # the peer's as its answer says): a physical fault, which relinking over cannot help and
    # replacing that end can. "" when no device status says so (the probe went unanswered).
    down_at: str = Field(default="", alias="downAt")

    @property
    def device_down(self) -> bool:
        return bool(self.down_at)


class Load(_Payload):
    """What an engine has served since its process started: cumulative counters the operator's ratio
    control differences between two health reports of one incarnation (P/D-Serve §3.3: "The monitor
    records the averaged E2E latency and TTFT"). Emulated seconds; a role's counters stay 0 on the
    other role."""

    offered: int = 0  # prefill: requests offered (admitted or refused)
    refused: int = 0  # ... refused at admission (busy: no slot, no HBM, a TTFT budget)
    prefilled: int = 0  # ... prompts prefilled
    ttft_s: float = Field(default=0.0, alias="ttftSeconds")  # the sum of their TTFTs
    prompt_tokens: int = Field(default=0, alias="promptTokens")
    busy_s: float = Field(default=0.0, alias="busySeconds")  # prefill compute with a prompt in it
    slot_s: float = Field(default=0.0, alias="slotSeconds")  # slot time held, admission to release
    # ... of which after the prompt's prefill, until a decode took its KV (§3.5 back-pressure)
    kv_wait_s: float = Field(default=0.0, alias="kvWaitSeconds")
    decoded: int = 0  # decode: requests finished
    # ... the tokens it generated for them (§2.1's G; the first token is the prefill's)
    output_tokens: int = Field(default=0, alias="outputTokens")
    tokens: int = 0  # decode steps taken by requests (TPOT samples)
    tpot_s: float = Field(default=0.0, alias="tpotSeconds")  # ... their sum
    kv_pulls: int = Field(default=0, alias="kvPulls")  # KV transfers pulled in
    kv_s: float = Field(default=0.0, alias="kvSeconds")  # ... their sum (ξ)
    decode_s: float = Field(default=0.0, alias="decodeSeconds")  # per request, KV pull to done
    iterations: int = 0  # decode loop steps
    batch_sum: float = Field(default=0.0, alias="batchSum")  # ... their batch sizes' sum


class Drain(_Payload):
    """An instance leaving the group in order (a scale-in or a ratio move): it gets no
    new work (its entrance closed, out of the decode meta, and it refuses with 503
    ``draining``) and finishes what it has; it leaves the map once its health says it holds
    nothing (``inflight`` 0) or ``at`` + the drain bound has passed. A fault's removal is not a
    drain: it ends the instance's streams at once (:class:`Removal`)."""

    instance: str
    reason: str
    at: float  # wall time (epoch s) the operator asked


class Health(_Payload):
    instance: str
    role: Role
    state: HealthState
    seq: int
    ts: float
    message: str = ""
    pod_ip: str = Field(alias="podIP")
    port: int
    incarnation: str = ""
    # Why the engine is Faulty (empty otherwise), its sub-links that probe unhealthy,
    # and the wall time of its serving loop's last beat (a heartbeat from the loop, not from the
    # writer: a hung loop leaves it behind while ``ts`` keeps moving).
    faults: list[EngineFault] = Field(default_factory=list)
    links: list[LinkProbe] = Field(default_factory=list)
    loop_beat: float = Field(default=0.0, alias="loopBeat")
    # Wall seconds from the engine process's start to its first Serving health (register, link,
    # load): with the pod's own start, what a cold replacement costs (the recovery planner's
    # estimate, learned from the group's members). 0: not said (an older engine).
    ready_after: float = Field(default=0.0, alias="readyAfter")
    # ... and to the RoCE map naming it: for a member of the group's first setup that includes
    # waiting for every other member to report, which a lone replacement does not wait for.
    gathered_after: float = Field(default=0.0, alias="gatheredAfter")
    # The engine's own DeepServe phases (emulated seconds: "TEPreLoad", "TELoad",
    # "TEPostLoad"; a claimed warm pod's TEPreLoad was paid before the claim and is 0) and where
    # its weights came from (a LoadSource value: a fork that failed says its fallback).
    phases: dict[str, float] = Field(default_factory=dict)
    load_source: str = Field(default="", alias="loadSource")
    # ... and, from the shared file service, its TE-Load over a lone load's (the readers it
    # shared the bucket with on average; 1: alone or another source; 0: not said): a lone load
    # is TE-Load / loadShare
    load_share: float = Field(default=0.0, alias="loadShare", ge=0)
    warm: bool = False  # a claimed warm pod (its engine was up before the claim)
    load: Load | None = None  # what it has served, for the ratio (None: an older engine)
    # Asked to drain (its ``draining/`` znode), and the requests it still holds (its
    # open streams: a prefill's last until its decode ends, as it relays them)
    draining: bool = False
    drain_at: float = Field(default=0.0, alias="drainAt")  # the marker's ``at`` it answers
    inflight: int = Field(default=0, ge=0)


class DecodeMeta(_Payload):
    """The decode instances every prefill may forward to (P/D-Serve §3.3 step 3)."""

    version: int
    decodes: list[MapEntry]


class Entrance(_Payload):
    instance: str
    pod_ip: str = Field(alias="podIP")
    port: int


class Removal(_Payload):
    instance: str
    reason: str
    at: float


def build_roce_map(reports: Iterable[Report], roles: dict[str, Role], version: int) -> RoceMap:
    """The map from the gathered reports; instances without a role are left out. Entries are
    sorted by instance name so the same reports always give the same map."""
    by_role: dict[Role, list[MapEntry]] = {Role.PREFILL: [], Role.DECODE: []}
    for report in sorted(reports, key=lambda r: r.instance):
        role = roles.get(report.instance, report.role)
        if role is None:
            continue
        by_role[role].append(
            MapEntry(
                instance=report.instance,
                podIP=report.pod_ip,
                port=report.port,
                roceIps=report.roce_ips,
                incarnation=report.incarnation,
                tp=report.tp,
            )
        )
    return RoceMap(version=version, P=by_role[Role.PREFILL], D=by_role[Role.DECODE])


def verify_sub_links(prefill: MapEntry, decode: MapEntry) -> list[SubLink]:
    """The pair's sub-links, one per decode die (:func:`kvmapping.source_dies`: device k <-> k
    for the same size, P/D-Serve §2.1, §3.7; CloudMatrix-Infer §4.3.3's mapping otherwise).
    Raises ValueError naming the two and the preconditions they break."""
    try:
        sources = kvmapping.source_dies(prefill.side(), decode.side())
    except ValueError as exc:
        raise ValueError(f"{prefill.instance} and {decode.instance}: {exc}") from None
    return [
        SubLink(
            device=j,
            prefillIp=prefill.roce_ips[i],
            decodeIp=decode.roce_ips[j],
            prefillDevice=i,
        )
        for j, i in enumerate(sources)
    ]


# --------------------------------------------------------------------------- warm pods
class WarmReport(PodReport):
    """A warm engine, past TE-Pre-Load (Python, NPU state, HCCL up; no model, no role), waiting
    for an assignment (DeepServe §6.1). ``dramModels``: what its server's host DRAM holds."""

    pre_load_seconds: float = Field(default=0.0, alias="preLoadSeconds")  # emulated
    dram_models: list[str] = Field(default_factory=list, alias="dramModels")
    ssd_models: list[str] = Field(default_factory=list, alias="ssdModels")


class ForkRef(_Payload):
    """Where a forked target pulls its weights and compiled artefacts from."""

    group: str  # "<namespace>/<name>" of the source's group
    instance: str
    pod_ip: str = Field(alias="podIP")
    port: int
    plane: str  # "UB" inside the SuperPod, "RoCE" across (enginestub.fabric.Plane values)
    key: str  # the source's content address (fork_source_key): checked by the source


class Assignment(_Payload):
    """What a claimed warm pod becomes (operator -> engine): the settings a cold pod of that
    instance would have in its environment, the instance name it reports under, and how to load
    (a fork first when given, ``fallback`` if the fork fails). Bound to the pod's UID: an
    assignment left for an earlier pod of the same name is not this one's."""

    pod_uid: str = Field(alias="podUid")
    group: str  # "<namespace>/<name>"
    instance: str
    env: dict[str, str]  # keys of ASSIGNMENT_ENV only (engine_settings.EngineEnv's)
    load_source: str = Field(alias="loadSource")  # LoadSource values
    fork: ForkRef | None = None
    fallback: str = engine_settings.LoadSource.SHARED_FILE_SERVICE.value
    ts: float = 0.0


class DramPlan(_Payload):
    """The models a server's host DRAM should hold (DeepServe §6.2 pre-loading: "the cluster
    manager predicts models that are likely to scale and pre-loads them into DRAM page cache
    using pre-warmed TEs"), chosen by the WarmPool controller within the server's capacity. The
    warm engines on the server load them (emulated time) and list them in their reports'
    ``dramModels``; a model no longer listed is evicted."""

    node: str
    models: list[str] = Field(default_factory=list)
    bytes: float = 0.0  # their total size
    capacity_bytes: float = Field(default=0.0, alias="capacityBytes")
    ts: float = 0.0


class ForkSource(_Payload):
    """A live, serving instance that can broadcast its weights and compiled artefacts to warm
    targets (DeepServe §6.2 NPU-fork), written by the engine while it serves."""

    key: str
    model: str
    artifacts: str
    expert_map: int | None = Field(default=None, alias="expertMap")
    group: str  # "<namespace>/<name>"
    instance: str
    pod_ip: str = Field(alias="podIP")
    port: int
    node: str
    superpod: str
    dies: int
    incarnation: str
    ts: float


# --------------------------------------------------------------------------- expert pools
class ExpertServerState(StrEnum):
    """An expert server's state, as it reports it."""

    LOADING = "Loading"  # loading the weights of the slots the map in force gives it
    SERVING = "Serving"  # every enabled slot of the map in force loaded: it computes
    DRAINING = "Draining"  # out of the map: finishing what it was sent, then to be deleted


class ExpertServerReport(PodReport):
    """An expert server while it lives (EaaS §3.1, §4.4: registration and heartbeat): who and
    where it is (``podIP``/``port``: where clients send it tokens, on loopback), how many slots
    it has per layer, the map version whose slots it has loaded (``loaded``: 0 before any), its
    state, the messages it has in flight, and the tokens it has computed per layer and expert
    since it started (cumulative; EPLB's input, xDeepServe §4.5 step 1), rewritten every health
    interval (``ts``) and at once when its state or ``loaded`` changes. Ephemeral: it is gone
    with its session (the monitor's offline event)."""

    pool: str  # <namespace>/<name>
    slots: int = Field(ge=1)  # per layer
    loaded: int = Field(default=0, ge=0)
    state: ExpertServerState
    in_flight: int = Field(default=0, alias="inFlight", ge=0)
    tokens: dict[int, dict[int, int]] = Field(default_factory=dict)  # layer -> expert -> tokens


class ExpertMapPhase(StrEnum):
    """What a map version is, in EPLB's four-phase reconfiguration (xDeepServe §4.5 step 4)
    or outside it (``Steady``: every slot enabled)."""

    STEADY = "Steady"
    PREFETCH = "Prefetch"  # servers stage the experts they will get (host DRAM); routes unchanged
    DISABLE = "Disable"  # the slots to be replaced are out of every route
    LOAD = "Load"  # servers load the new experts into the disabled slots
    ENABLE = "Enable"  # the new slots are in the routes (then Steady)


class ExpertMapPointer(_Payload):
    """The ``map`` znode: which version is in force (0: none yet), and the pool's settings in
    force that its clients follow: ``failoverMs``, the pool's
    ``spec.failoverTimeoutMilliseconds`` (None: a pointer written before it was carried; a
    client keeps its own)."""

    version: int = Field(ge=0)
    at: float = 0.0  # wall time (epoch s) it was put in force
    failover_ms: int | None = Field(default=None, alias="failoverMs", ge=1)


class ExpertMapVersion(_Payload):
    """``map/v<N>``: one version's server table (the layers name servers by their index in
    it), the model's shape and the phase. Immutable once written.

    ``rowsAt``: per server of the table, the version since which its rows (its slots, disabled
    and staged experts in every layer) are what this version gives it. A server whose last read
    version (of the same ``origin``) has the same stamp for it reads this head alone, not the
    layers: a failover, or a newcomer's load, changes no other server's rows, and 64 servers
    reading 58 layers per version was most of a failover's ZooKeeper reads. Empty (a version written
    before it was carried): a server reads the version whole.

    ``origin``: the ``at`` of the first version of this map's history, carried by every version
    after it. Stamps compare only within one history: a pool made again under its name, or its
    map written again after ZooKeeper lost it, numbers its versions from 1 again (0: none)."""

    version: int = Field(ge=1)
    layers: int = Field(ge=1)
    experts: int = Field(ge=1)
    slots: int = Field(ge=1)  # per server per layer
    servers: list[str]  # index -> server id (its pod's name)
    phase: ExpertMapPhase = ExpertMapPhase.STEADY
    reason: str = ""  # why this version: initial, failover of <server>, scale, rebalance
    at: float = 0.0
    rows_at: dict[str, int] = Field(default_factory=dict, alias="rowsAt")
    origin: float = 0.0


class ExpertMapLayer(_Payload):
    """``map/v<N>/<layer>``: one MoE layer's slots. ``slots[i]`` lists the experts server
    ``i`` of the version's table holds in this layer (at most ``slots`` of them);
    ``disabled[i]`` those of them no client may route to now (being replaced, or loading);
    ``prefetch[i]`` those it is to stage for a coming version. A client routes an expert's
    tokens over the servers that hold it enabled, rotating by token position (xDeepServe §4.5
    step 4)."""

    layer: int = Field(ge=0)
    slots: list[list[int]]
    disabled: list[list[int]] = Field(default_factory=list)
    prefetch: list[list[int]] = Field(default_factory=list)

    def routes(self, experts: int) -> list[list[int]]:
        """Per expert, the server indices that hold it enabled (in server order)."""
        out: list[list[int]] = [[] for _ in range(experts)]
        for server, held in enumerate(self.slots):
            off = set(self.disabled[server]) if server < len(self.disabled) else set()
            for expert in held:
                if 0 <= expert < experts and expert not in off:
                    out[expert].append(server)
        return out
