"""The disaggregated decode iteration (enginestub.disaggregated): xDeepServe §7.1's ≈ 92.9 ms
predicted from the roofline and the cited constants (the error printed, at most 10%), the
pipeline's overlap, the combine barrier, popularity and rotation over replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginestub import calibration as cal
from enginestub import disaggregated as dis
from matrixserve.api.catalog import DEEPSEEK_V3


def test_paper_iteration_predicted_within_ten_percent() -> None:
    p = dis.paper_prediction()
    print(
        f"\nattention layer x microbatch {p.attention_layer * 1e3:.3f} ms (paper ~0.7), "
        f"MoE {p.moe * 1e3:.3f} ms (paper 0.12), iteration {p.iteration * 1e3:.1f} ms "
        f"(paper {cal.DISAGGREGATED_ITERATION_SECONDS * 1e3:.1f}): error {p.error:+.1%}"
    )
    assert abs(p.error) <= 0.10
    assert 0.5e-3 < p.attention_layer < 0.9e-3  # the term that dominates, predicted not taken


def test_pipeline_hides_all_hops_but_the_last() -> None:
    attention = [[0.7e-3, 0.7e-3]] * 61
    hops = [[0.48e-3, 0.48e-3]] * 61
    seconds = dis.iteration_seconds(attention, hops, mtp=True)
    expected = 2e-3 + 5e-3 + 0.7e-3 * 2 * 61 + 0.48e-3  # §7.1's decomposition
    assert seconds == pytest.approx(expected, rel=1e-9)
    # a hop longer than the other microbatch's attention is no longer hidden
    slow = dis.iteration_seconds(attention, [[2e-3, 2e-3]] * 61, mtp=False)
    assert slow > 2e-3 + 0.7e-3 * 2 * 61 + 2e-3


def test_layer_ends_at_its_slowest_server() -> None:
    even = dis.expert_layer_seconds(DEEPSEEK_V3, [480], dies=1)
    hot = dis.expert_layer_seconds(DEEPSEEK_V3, [480 * 30], dies=1)
    assert hot > 20 * even  # compute-bound: a hot expert's server holds the layer
    assert dis.expert_layer_seconds(DEEPSEEK_V3, [0, 0], dies=1) == 0.0


def test_zipf_hottest_is_thirty_times_the_mean() -> None:
    pop = dis.Popularity.parse("zipf", 256, 58)
    counts = pop.counts(0, 1000, 8)
    mean = sum(counts) / 256
    assert sum(counts) == 8000
    assert max(counts) / mean == pytest.approx(cal.HOTTEST_EXPERT_OVER_MEAN, rel=0.02)
    assert counts.index(max(counts)) != pop.counts(1, 1000, 8).index(max(counts))  # per layer


def test_uniform_small_batches_reach_different_experts_as_positions_move() -> None:
    pop = dis.Popularity.parse("uniform", 16, 3)
    first, later = pop.counts(0, 2, 4, offset=0), pop.counts(0, 2, 4, offset=8)
    assert sum(first) == sum(later) == 8
    assert first != later


def test_trace_popularity_and_its_errors(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"0": [3, 1, 0, 0]}))
    pop = dis.Popularity.parse(str(trace), 4, 2)
    assert pop.counts(0, 4, 1) == [3, 1, 0, 0]
    assert pop.counts(1, 4, 1) == [1, 1, 1, 1]  # a layer the trace omits: uniform
    trace.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="4 finite weights"):
        dis.Popularity.parse(str(trace), 4, 2)
    with pytest.raises(ValueError, match="uniform, zipf or the path"):
        dis.Popularity.parse("hot", 4, 2)


@pytest.mark.parametrize(("count", "replicas"), [(7, [0, 1, 2]), (1, [4, 5]), (6, [3])])
def test_rotation_spreads_an_experts_tokens_evenly(count: int, replicas: list[int]) -> None:
    shares = dict(dis.rotate(5, count, replicas))
    assert sum(shares.values()) == count
    assert max(shares.values()) - min(shares.values()) <= 1 or len(shares) < len(replicas)
    assert set(shares) <= set(replicas)
