"""The scale-out path choice (issue 18, ``domain/scaleout.py``): each new instance by the
fastest feasible path, a warm pod promised once, a fork source within its fan-out, no fork
without a live source of the same model, artefacts and expert map."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixserve.domain import scaleout as so
from matrixserve.domain.scaleout import Path, Phase

pytestmark = pytest.mark.unit

# Llama3-8B on 2 NPUs, in the order the engine's load model gives them (fork UB < RoCE < DRAM <
# SSD < shared file service), with a cold pod's extra phases.
EST = so.Estimates(
    scaler_pre_cold=2.0,
    scaler_pre_warm=0.3,
    te_pre_load=20.0,
    te_post_load=1.0,
    scaler_post=0.5,
    load={
        "NPUForkUB": 0.05,
        "NPUForkRoCE": 0.65,
        "HostDRAM": 1.3,
        "SSD": 2.6,
        "SharedFileService": 7.7,
    },
)


def want(name: str = "g-p-4", model: str = "llama3-8b", npus: int = 2) -> so.Want:
    return so.Want(name, model, "a1", npus)


def pod(
    name: str = "w-0", superpod: str = "sp0", npus: int = 2, **extra: frozenset[str]
) -> so.WarmPod:
    return so.WarmPod(name, f"{name}-node", superpod, npus, **extra)


def source(superpod: str = "sp0", busy: int = 0, **extra: object) -> so.ForkSource:
    fields: dict[str, object] = {"model": "llama3-8b", "artifacts": "a1", "expert_map": None}
    fields |= extra
    return so.ForkSource("g-p-0", superpod, busy=busy, **fields)  # type: ignore[arg-type]


def test_without_a_warm_pod_every_instance_is_a_cold_start_through_all_five_phases() -> None:
    (choice,) = so.choose([want()], [], [source()], EST)
    assert choice.path is Path.COLD
    assert choice.warm_pod is None
    assert choice.fork_source is None
    assert choice.phases == {
        Phase.SCALER_PRE: 2.0,
        Phase.TE_PRE_LOAD: 20.0,
        Phase.TE_LOAD: 7.7,
        Phase.TE_POST_LOAD: 1.0,
        Phase.SCALER_POST: 0.5,
    }
    assert choice.total == pytest.approx(31.2)


@pytest.mark.parametrize(
    ("pods", "sources", "path", "seconds"),
    [
        ([pod()], [], Path.WARM_SHARED, 0.3 + 7.7 + 1.5),  # no pre-load, still the slow fetch
        ([pod(ssd_models=frozenset({"llama3-8b"}))], [], Path.WARM_SSD, 0.3 + 2.6 + 1.5),
        ([pod(dram_models=frozenset({"llama3-8b"}))], [], Path.WARM_DRAM, 0.3 + 1.3 + 1.5),
        ([pod(dram_models=frozenset({"qwen2-72b"}))], [], Path.WARM_SHARED, 9.5),  # not this one
        ([pod()], [source("sp1")], Path.WARM_FORK_ROCE, 0.3 + 0.65 + 1.5),  # another SuperPod
        ([pod()], [source("sp0")], Path.WARM_FORK_UB, 0.3 + 0.05 + 1.5),  # over UB
        ([pod()], [source(artifacts="a0")], Path.WARM_SHARED, 9.5),  # other compiled graphs
        ([pod()], [source(expert_map=3)], Path.WARM_SHARED, 9.5),  # another expert map
        ([pod()], [source(model="qwen2-72b")], Path.WARM_SHARED, 9.5),
        ([pod(npus=4)], [source()], Path.COLD, 31.2),  # a warm pod of another shape
    ],
)
def test_the_fastest_feasible_path_is_taken(
    pods: list[so.WarmPod], sources: list[so.ForkSource], path: Path, seconds: float
) -> None:
    (choice,) = so.choose([want()], pods, sources, EST)
    assert choice.path is path
    assert choice.total == pytest.approx(seconds)
    assert choice.considered[Path.COLD] == pytest.approx(31.2)  # the cold start always priced
    assert choice.considered[path] == pytest.approx(seconds)


def test_a_warm_pod_is_promised_once_and_the_rest_start_cold() -> None:
    dram = frozenset({"llama3-8b"})
    choices = so.choose(
        [want("g-p-4"), want("g-p-5"), want("g-p-6")],
        [pod("w-0", dram_models=dram), pod("w-1")],
        [],
        EST,
    )
    assert [(c.path, c.warm_pod) for c in choices] == [
        (Path.WARM_DRAM, "w-0"),
        (Path.WARM_SHARED, "w-1"),
        (Path.COLD, None),
    ]


def test_a_fork_source_broadcasts_to_no_more_than_32_targets() -> None:
    pods = [pod(f"w-{i}") for i in range(3)]
    choices = so.choose([want(f"g-p-{i}") for i in range(3)], pods, [source(busy=30)], EST)
    assert [c.path for c in choices] == [Path.WARM_FORK_UB, Path.WARM_FORK_UB, Path.WARM_SHARED]
    assert {c.fork_source for c in choices[:2]} == {"g-p-0"}


@settings(max_examples=150, deadline=None)
@given(
    n_wants=st.integers(0, 6),
    pod_specs=st.lists(
        st.tuples(st.sampled_from(["sp0", "sp1"]), st.sampled_from([2, 4]), st.booleans()),
        max_size=6,
    ),
    source_specs=st.lists(
        st.tuples(st.sampled_from(["sp0", "sp1"]), st.integers(0, 32), st.booleans()),
        max_size=3,
    ),
)
def test_every_choice_is_feasible_and_no_slower_than_a_cold_start(
    n_wants: int,
    pod_specs: list[tuple[str, int, bool]],
    source_specs: list[tuple[str, int, bool]],
) -> None:
    pods = [
        pod(f"w-{i}", sp, npus, dram_models=frozenset({"llama3-8b"}) if dram else frozenset())
        for i, (sp, npus, dram) in enumerate(pod_specs)
    ]
    sources = [
        so.ForkSource(f"s-{i}", sp, "llama3-8b", "a1" if same else "a0", busy=busy)
        for i, (sp, busy, same) in enumerate(source_specs)
    ]
    choices = so.choose([want(f"g-p-{i}") for i in range(n_wants)], pods, sources, EST)
    assert [c.instance for c in choices] == [f"g-p-{i}" for i in range(n_wants)]
    claimed = [c.warm_pod for c in choices if c.warm_pod is not None]
    assert len(claimed) == len(set(claimed)), "a warm pod promised twice"
    by_name = {p.name: p for p in pods}
    for c in choices:
        assert c.total <= c.considered[Path.COLD] + 1e-9
        assert c.total == pytest.approx(min(c.considered.values()))
        assert (c.path is Path.COLD) == (c.warm_pod is None)
        if c.warm_pod is not None:
            assert by_name[c.warm_pod].npus == 2
        if c.path in (Path.WARM_FORK_UB, Path.WARM_FORK_ROCE):
            src = next(s for s in sources if s.instance == c.fork_source)
            assert src.artifacts == "a1"
            assert c.warm_pod is not None
            assert (c.path is Path.WARM_FORK_UB) == (src.superpod == by_name[c.warm_pod].superpod)
        else:
            assert c.fork_source is None
    for src in sources:
        forks = sum(c.fork_source == src.instance for c in choices)
        assert forks == 0 or src.busy + forks <= so.FORK_FANOUT
