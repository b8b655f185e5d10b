"""The two roles of a P/D group's instances (P/D-Serve §3: prefill and decode), one type for
every place that names them.

A role has three spellings, each some contract's: its ZooKeeper letter (the RoCE map's ``P`` and
``D`` lists, a report's and a health's ``role``: :mod:`.zk_layout`), its pod label value
(``matrixserve.io/role``: ``prefill``, ``decode``) and its key in a PDGroup's spec and status
(``spec.prefill``, ``status.decode``). They are kept here together, so that no module translates
one into another by hand. The enum's value is the ZooKeeper letter: what the payloads carry.

An engine's own role setting (``ENGINE_ROLE``) is a wider set (``colocated``, ``auto``, ...):
the engine's, not this type.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "P"
    DECODE = "D"

    @property
    def letter(self) -> str:
        """In ZooKeeper (:mod:`.zk_layout`): the RoCE map's keys, reports' and healths' role."""
        return self.value

    @property
    def label(self) -> str:
        """The value of an instance pod's role label (``kinds.LABEL_ROLE``)."""
        return "prefill" if self is Role.PREFILL else "decode"

    @property
    def spec_key(self) -> str:
        """The key of this role's part of a PDGroup's spec and status."""
        return "prefill" if self is Role.PREFILL else "decode"

    @classmethod
    def from_label(cls, label: str | None) -> Role | None:
        """The role a pod label value names; None for none or another value."""
        return next((role for role in cls if role.label == label), None)

    @classmethod
    def from_spec_key(cls, key: str) -> Role:
        """The role of a spec key; ValueError for anything but ``prefill`` and ``decode``."""
        for role in cls:
            if role.spec_key == key:
                return role
        raise ValueError(f"{key!r} is not a role's spec key (prefill or decode)")
