"""A WarmPool's rules beyond the schema's types and ranges (pure).

The API server checks what the CRD states (types, ranges, the shapes' name pattern, the
``refillPolicy`` rule in CEL); the controller checks it all again, since an object may have been
stored before its CRD had a rule (a CRD not upgraded with the chart, a server without CEL), and
adds what the schema cannot say: the pool's name and its NPU types become label values, its
shapes' names parts of pod names, and a model to pre-load must be one whose size the platform
knows (the DRAM plan fits models by size, DeepServe §6.2). On a violation the controller sets
``Ready=False``, reason ``InvalidSpec``, and touches nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from matrixserve.api.resources import RefillPolicy, WarmPoolSpec, field_errors
from matrixserve.domain.warmpool.dram import model_bytes
from matrixserve.domain.warmpool.view import shape_name

LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def parse(body: Mapping[str, Any]) -> tuple[WarmPoolSpec | None, list[str]]:
    """A WarmPool object's spec parsed and checked: the spec (None if it does not parse) and
    every violation of the schema's and the cross-field rules, each naming its field."""
    try:
        spec = WarmPoolSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        return None, field_errors(exc)
    return spec, problems(str(body["metadata"]["name"]), spec)


def problems(name: str, spec: WarmPoolSpec) -> list[str]:
    """What the schema cannot say about a WarmPool: its name and NPU types become label values,
    its shapes' names parts of pod names, and a model to pre-load must be one the platform
    knows the size of."""
    out = []
    if len(name) > 63:
        out.append(
            f"metadata.name: {len(name)} characters; a WarmPool's name is a label value (at most 63)"
        )
    shapes = [shape_name(s, i) for i, s in enumerate(spec.shapes)]
    if len(set(shapes)) != len(shapes):
        out.append(f"spec.shapes: names must differ (they are {', '.join(shapes)})")
    for i, (shape, s) in enumerate(zip(shapes, spec.shapes, strict=True)):
        if not DNS_LABEL.fullmatch(shape) or len(shape) > 40:
            out.append(f"spec.shapes[{i}]: its name {shape!r} is no DNS label: give it a name")
        if len(s.npu_type) > 63 or not LABEL_VALUE.fullmatch(s.npu_type):
            out.append(f"spec.shapes[{i}].npuType: {s.npu_type!r} is no label value")
    if spec.refill_policy is RefillPolicy.SCHEDULED:  # the CRD's rule, for objects stored before it
        out.append(
            "spec.refillPolicy: Scheduled is not implemented (there is no schedule to refill "
            "by): use Immediate (refill at once) or Manual (refill on a new generation)"
        )
    for i, entry in enumerate(spec.dram_preload):
        if model_bytes(entry.model) is None:
            out.append(
                f"spec.dramPreload[{i}].model: {entry.model!r} is not a model the platform knows "
                "the size of"
            )
    return out
