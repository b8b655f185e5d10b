"""The sub-links of a P-D pair (``matrixserve.api.kvmapping``): CloudMatrix-Infer §4.3.3's
deterministic group connection mapping for different sizes (the worked examples of notes 001
§2.6, its invariant, its preconditions), device k <-> device k for the same size, and the RoCE
map, links and sub-links built on it (``zk_layout``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixserve.api import kvmapping
from matrixserve.api import zk_layout as zl
from matrixserve.api.kvmapping import Precondition, Side


def test_the_papers_first_example_prefill_tp8_decode_tp1_dp32() -> None:
    """ratio 8, group_size 4: dp ranks 0-3 pull from prefill rank 0, 4-7 from 1, ..., 28-31
    from 7; each prefill rank serves 4."""
    sources = kvmapping.source_dies(Side(8, 8), Side(32, 1))
    assert sources == [dp // 4 for dp in range(32)]
    assert kvmapping.connections(Side(8, 8), Side(32, 1)) == [4] * 8


def test_the_papers_second_example_prefill_tp4_decode_tp2_dp8() -> None:
    """ratio 2, group_size 4: dp 0-3 with tp 0/1 pull from prefill 0/1, dp 4-7 from 2/3."""
    sources = kvmapping.source_dies(Side(4, 4), Side(16, 2))
    by_rank = {(j // 2, j % 2): i for j, i in enumerate(sources)}  # (dp, tp) -> prefill rank
    for dp in range(8):
        for tp in range(2):
            assert by_rank[(dp, tp)] == (0 if dp < 4 else 2) + tp
    assert kvmapping.connections(Side(4, 4), Side(16, 2)) == [4] * 4


@pytest.mark.parametrize(("dies", "p_tp", "d_tp"), [(4, 4, 4), (4, 4, 1), (8, 2, 8), (16, 1, 2)])
def test_the_same_size_pairs_device_k_with_device_k_whatever_the_tp(
    dies: int, p_tp: int, d_tp: int
) -> None:
    assert kvmapping.source_dies(Side(dies, p_tp), Side(dies, d_tp)) == list(range(dies))
    assert kvmapping.broken(Side(dies, p_tp), Side(dies, d_tp)) == []


@st.composite
def pairing_shapes(draw: st.DrawFn) -> tuple[Side, Side]:
    """A prefill (one TP group) and a decode of another size that the mapping pairs."""
    decode_tp = draw(st.sampled_from([1, 2, 4, 8]))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    prefill_tp = decode_tp * ratio
    decode_dp = ratio * draw(st.integers(1, 16))
    return Side(prefill_tp, prefill_tp), Side(decode_dp * decode_tp, decode_tp)


@settings(max_examples=200, deadline=None)
@given(pairing_shapes())
def test_every_prefill_rank_gets_decode_dp_x_decode_tp_over_prefill_tp_connections(
    shapes: tuple[Side, Side],
) -> None:
    prefill, decode = shapes
    sources = kvmapping.source_dies(prefill, decode)
    assert len(sources) == decode.dies == kvmapping.sub_links_per_pair(prefill, decode)
    assert all(0 <= i < prefill.dies for i in sources)
    expected = decode.dp * decode.tp // prefill.tp
    assert kvmapping.connections(prefill, decode) == [expected] * prefill.dies
    # the TP ranks of one decode DP group pull from distinct prefill dies (kv_pull_links)
    for dp in range(decode.dp):
        group = sources[dp * decode.tp : (dp + 1) * decode.tp]
        assert len(set(group)) == decode.tp


@pytest.mark.parametrize(
    ("prefill", "decode", "broken"),
    [
        (Side(4, 4), Side(8, 8), [Precondition.TP_DIVIDES]),  # ratio 1/2
        (Side(8, 8), Side(4, 1), [Precondition.DP_DIVIDES]),  # dp 4, ratio 8
        (Side(4, 4), Side(6, 2), [Precondition.DP_DIVIDES]),  # dp 3, ratio 2
        (Side(8, 4), Side(16, 1), [Precondition.PREFILL_ONE_TP_GROUP]),
        (Side(8, 2), Side(4, 4), [Precondition.PREFILL_ONE_TP_GROUP, Precondition.TP_DIVIDES]),
    ],
)
def test_a_broken_precondition_is_refused_naming_it(
    prefill: Side, decode: Side, broken: list[Precondition]
) -> None:
    assert kvmapping.broken(prefill, decode) == broken
    with pytest.raises(ValueError, match="do not pair") as refused:
        kvmapping.source_dies(prefill, decode)
    for each in broken:
        assert str(each) in str(refused.value)


def test_a_tp_that_does_not_divide_the_dies_is_no_side() -> None:
    with pytest.raises(ValueError, match="tp 3 does not divide the instance's 4 dies"):
        Side(4, 3)
    assert Side.of(4, None) == Side(4, 4)  # the engine's default: TP over all its dies


# --------------------------------------------------------------------------- on the RoCE map
def entry(name: str, dies: int, tp: int | None, incarnation: str = "i1") -> zl.MapEntry:
    return zl.MapEntry(
        instance=name,
        podIP="10.0.0.1",
        port=8000,
        roceIps=[f"{name}.{k}" for k in range(dies)],
        incarnation=incarnation,
        tp=tp,
    )


def link(p: zl.MapEntry, d: zl.MapEntry) -> zl.Link:
    return zl.Link(
        prefill=p.instance,
        decode=d.instance,
        subLinks=zl.verify_sub_links(p, d),
        verifiedAt=0.0,
        initiator=d.instance,
        prefillIncarnation=p.incarnation,
        decodeIncarnation=d.incarnation,
    )


def test_unequal_sizes_link_one_sub_link_per_decode_die_by_the_mapping() -> None:
    p, d = entry("p", 4, None), entry("d", 8, 2)  # prefill tp 4 (its dies), decode tp 2 dp 4
    subs = zl.verify_sub_links(p, d)
    assert [(s.device, s.prefill_device) for s in subs] == [
        (0, 0), (1, 1), (2, 0), (3, 1), (4, 2), (5, 3), (6, 2), (7, 3)
    ]  # fmt: skip
    assert [(s.prefill_ip, s.decode_ip) for s in subs] == [
        (f"p.{s.prefill_device}", f"d.{s.device}") for s in subs
    ]
    assert link(p, d).joins(p, d)
    # the same link does not join a decode whose TP changed (its pairing did), nor a new
    # incarnation
    assert not link(p, d).joins(p, entry("d", 8, 1))
    assert not link(p, d).joins(p, entry("d", 8, 2, incarnation="i2"))
    roce_map = zl.RoceMap(version=1, P=[p, entry("q", 4, None)], D=[d, entry("e", 4, None)])
    assert roce_map.expected_links() == 2 * (8 + 4)  # per pair: the decode's dies


def test_the_same_size_links_device_k_with_device_k_as_before() -> None:
    p, d = entry("p", 4, 4), entry("d", 4, 1)
    subs = zl.verify_sub_links(p, d)
    assert [(s.device, s.prefill_ip, s.decode_ip) for s in subs] == [
        (k, f"p.{k}", f"d.{k}") for k in range(4)
    ]
    assert zl.RoceMap(version=1, P=[p, p], D=[d]).expected_links() == 2 * 1 * 4


def test_a_pair_the_mapping_refuses_raises_naming_both_and_joins_nothing() -> None:
    p, d = entry("p", 4, None), entry("d", 8, None)  # decode tp 8 does not divide prefill tp 4
    with pytest.raises(ValueError, match=r"^p and d: .*prefill_tp % decode_tp == 0"):
        zl.verify_sub_links(p, d)
    forged = zl.Link(
        prefill="p",
        decode="d",
        subLinks=[
            zl.SubLink(device=k, prefillIp=f"p.{k % 4}", decodeIp=f"d.{k}") for k in range(8)
        ],
        verifiedAt=0.0,
        initiator="d",
        prefillIncarnation="i1",
        decodeIncarnation="i1",
    )
    assert not forged.joins(p, d)


def test_old_payloads_without_tp_parse_and_the_map_carries_the_reports_tp() -> None:
    old = b'{"instance":"p","podIP":"10.0.0.1","port":8000,"roceIps":["a","b"],"incarnation":"i"}'
    assert zl.MapEntry.parse(old).tp is None
    assert zl.MapEntry.parse(old).side() == Side(2, 2)
    old_sub = b'{"device":0,"prefillIp":"a","decodeIp":"b"}'
    assert zl.SubLink.parse(old_sub).prefill_device is None
    report = zl.Report(
        instance="g-d-0",
        role=zl.Role.DECODE,
        podIP="10.0.0.2",
        port=8000,
        node="n",
        superpod="sp",
        dies=[0, 1, 2, 3],
        roceIps=["w", "x", "y", "z"],
        ts=0.0,
        tp=2,
    )
    (decode,) = zl.build_roce_map([report], {}, version=1).decode
    assert decode.tp == 2
    assert zl.Report.parse(report.dump()).tp == 2
