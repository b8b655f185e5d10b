"""The API's names, defined once: group, version, every kind with its plural, label and annotation
keys, the NPU extended resource.

Everything that names a MatrixServe object (the operator's handlers and adapters, the gateway,
the node emulator, the dev-cluster tooling, tests and benchmarks) takes the name from here; the
CRDs in ``crds/`` carry the same strings (a unit test checks that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "matrixserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


@dataclass(frozen=True)
class Kind:
    """One custom resource kind: what the API server calls it."""

    kind: str
    plural: str

    @property
    def group(self) -> str:
        return GROUP

    @property
    def version(self) -> str:
        return VERSION

    @property
    def api_version(self) -> str:
        return API_VERSION

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


PDGROUP = Kind("PDGroup", "pdgroups")
DPDOMAIN = Kind("DPDomain", "dpdomains")
EXPERTPOOL = Kind("ExpertPool", "expertpools")
WARMPOOL = Kind("WarmPool", "warmpools")
KINDS: tuple[Kind, ...] = (PDGROUP, DPDOMAIN, EXPERTPOOL, WARMPOOL)

# --------------------------------------------------------------------------- labels and annotations
LABEL_PREFIX = GROUP
LABEL_GROUP = f"{LABEL_PREFIX}/group"  # the PDGroup a pod serves
LABEL_ROLE = f"{LABEL_PREFIX}/role"  # prefill | decode
LABEL_INSTANCE = f"{LABEL_PREFIX}/instance"  # the instance a pod belongs to
LABEL_SUPERPOD = f"{LABEL_PREFIX}/superpod"  # a node's SuperPod (topology)
LABEL_RACK = f"{LABEL_PREFIX}/rack"
LABEL_SERVER = f"{LABEL_PREFIX}/server"
LABEL_NPU_TYPE = f"{LABEL_PREFIX}/npu-type"
LABEL_EMULATED = f"{LABEL_PREFIX}/emulated-node"  # set by the node emulator on its nodes
# A warm pod's pool and shape; a claimed one also names the group that claimed it
# (the claim is the label, written with the pod's resourceVersion as precondition).
LABEL_WARMPOOL = f"{LABEL_PREFIX}/warmpool"
LABEL_WARM_SHAPE = f"{LABEL_PREFIX}/warm-shape"
LABEL_WARM_NPUS = f"{LABEL_PREFIX}/warm-npus"  # NPUs it holds (devicesPerPod)
LABEL_CLAIMED_BY = f"{LABEL_PREFIX}/claimed-by"  # the name of the object that claimed it
# ... and its kind (absent on a pod claimed before kinds other than PDGroup could claim: a
# PDGroup's); domain.warmclaim.Claimer reads the two
LABEL_CLAIMED_KIND = f"{LABEL_PREFIX}/claimed-kind"
ANNOTATION_CLAIM = f"{LABEL_PREFIX}/claim"  # JSON: instance, role, path, estimate, fork source, at
ANNOTATION_WARM_TEMPLATE = f"{LABEL_PREFIX}/warm-template"  # JSON: image, NPUs, type, selector
ANNOTATION_SERVICE = f"{LABEL_PREFIX}/service"
ANNOTATION_SCENARIO = f"{LABEL_PREFIX}/scenario"
# Gang placement: the scheduling gate an instance's pods are created with (lifted together once
# every pod of the instance exists), the SuperPod its servers were reserved in, and the plane
# its KV moves on (UB | RoCE), as the placement chose them.
GANG_GATE = f"{LABEL_PREFIX}/gang"
ANNOTATION_SUPERPOD = f"{LABEL_PREFIX}/superpod"
ANNOTATION_KV_PLANE = f"{LABEL_PREFIX}/kv-plane"
APP_NAME_LABEL = "app.kubernetes.io/name"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
ENGINE_APP = "matrixserve-engine"
OPERATOR_MANAGER = "matrixserve-operator"

# The kopf finalizer and the annotation prefix the operator stores its own bookkeeping under.
FINALIZER = f"{GROUP}/cleanup"

# The NPU extended resource the (emulated) Ascend device plugin advertises.
NPU_RESOURCE = "huawei.com/Ascend910"
# Faults (xDeepServe §6.2: "Kubernetes marks the node as tainted"): a server with a faulty NPU
# takes no new pods; NoSchedule, not NoExecute, so the instances still serving on it stay. The
# value lists the faulty NPUs (e.g. "npu-3.npu-5"); the faulty NPUs also leave ``allocatable``.
TAINT_NPU_FAULT = f"{LABEL_PREFIX}/npu-fault"
# The NPUs a pod was granted, as the device plugin records them on the pod (``Ascend910-0,...``).
ANNOTATION_NPU_GRANT = NPU_RESOURCE

# --------------------------------------------------------------------------- node emulator
# The annotation on each Node the emulator registers, naming the emulator process that serves it
# (for whoever reads a Node's history).
ANNOTATION_NODE_EMULATOR = f"{LABEL_PREFIX}/node-emulator"
