"""One role type (``matrixserve.api.roles``) for a P/D group's instances: its ZooKeeper letter,
its pod label value and its spec key, the same role wherever the operator names it."""

from __future__ import annotations

import pytest

from matrixserve.api import kinds
from matrixserve.api import zk_layout as zl
from matrixserve.api.resources import PDGroupSpec
from matrixserve.api.roles import Role
from matrixserve.domain.enginepod import EngineSettings
from matrixserve.domain.pdgroup import pods
from matrixserve.domain.pdgroup.validation import ROLES

SPEC = PDGroupSpec.model_validate(
    {
        "service": "chat",
        "scenario": "general",
        "model": {"name": "llama3-8b"},
        "prefill": {"replicas": 1, "batchSize": 4},
        "decode": {"replicas": 2, "batchSize": 32},
    }
)


@pytest.mark.parametrize(
    ("role", "letter", "label"), [(Role.PREFILL, "P", "prefill"), (Role.DECODE, "D", "decode")]
)
def test_one_role_type_spells_each_role_everywhere(role: Role, letter: str, label: str) -> None:
    assert zl.Role is Role
    assert (role.value, role.letter, role.label, role.spec_key) == (letter, letter, label, label)
    assert Role.from_label(label) is role
    assert Role.from_spec_key(label) is role
    assert SPEC.role_spec(role) is getattr(SPEC, label)
    manifest = pods.pod_manifest("ns", "g", "uid", "g-x-0", role, SPEC, EngineSettings("zk"))
    assert manifest["metadata"]["labels"][kinds.LABEL_ROLE] == label
    assert label in ROLES


def test_what_is_not_a_role_is_not_read_as_one() -> None:
    assert Role.from_label(None) is None
    assert Role.from_label("colocated") is None
    with pytest.raises(ValueError, match="not a role"):
        Role.from_spec_key("P")
    assert ROLES == ("prefill", "decode")
