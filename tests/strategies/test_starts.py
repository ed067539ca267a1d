"""FedBEns' start rules: the weighted K-medoids against brute force, and the clustered starts
of real uploads (tiny net, members from two broadcast initialisations)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.tiny import TINY, tiny_upload
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfusion.strategies import FedBEns
from fedfusion.strategies.fedbens.starts import (
    clustered_starts,
    member_weights,
    sorted_median,
    squared_distances,
    weighted_medoids,
)


def cost(distances: np.ndarray, weights: np.ndarray, medoids: list[int]) -> float:
    return float((weights * distances[:, medoids].min(axis=1)).sum())


def brute_force_best(distances: np.ndarray, weights: np.ndarray, k: int) -> float:
    return min(cost(distances, weights, list(c))
               for c in itertools.combinations(range(len(weights)), k))


def test_squared_distances_match_the_flattened_points():
    rng = np.random.default_rng(0)
    points = [{"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4)} for _ in range(5)]
    flat = np.stack([np.concatenate([p["a"].ravel(), p["b"]]) for p in points])
    expected = ((flat[:, None] - flat[None]) ** 2).sum(-1)
    np.testing.assert_allclose(squared_distances(points, ["a", "b"]), expected, atol=1e-12)
    only_b = ((flat[:, None, 6:] - flat[None, :, 6:]) ** 2).sum(-1)
    np.testing.assert_allclose(squared_distances(points, ["b"]), only_b, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 2**16), ties=st.booleans())
def test_the_sorted_median_is_numpys_to_the_bit(n, seed, ties):
    """The GPU's median starts (a sort, then the middle value or the mean of the two middle
    ones) equal ``np.median``'s, for odd and even client counts, with ties; checked here
    with the sort on the CPU."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(n)]
    if ties:
        arrays = [np.round(a) for a in arrays]
    expected = np.median(np.stack(arrays), axis=0)
    got = sorted_median(arrays, torch.device("cpu"))
    assert got.dtype == expected.dtype and np.array_equal(got, expected)


def test_separated_groups_get_one_medoid_each_at_the_weighted_centre():
    """Three far-apart groups: one medoid per group, each the brute-force weighted medoid of
    its group; a heavy point pulls its group's medoid onto itself; largest group first."""
    rng = np.random.default_rng(1)
    centres = np.array([[0.0, 0.0], [100.0, 0.0], [0.0, 100.0]])
    sizes = [3, 6, 4]
    points = np.concatenate([c + rng.normal(size=(n, 2)) for c, n in zip(centres, sizes,
                                                                         strict=True)])
    group = np.repeat(np.arange(3), sizes)
    distances = ((points[:, None] - points[None]) ** 2).sum(-1)
    weights = np.ones(len(points))
    medoids = weighted_medoids(distances, weights, 3)
    assert [int(group[m]) for m in medoids] == [1, 2, 0]  # by cluster mass
    for m in medoids:
        members = np.flatnonzero(group == group[m])
        within = distances[np.ix_(members, members)].sum(axis=0)
        assert m == members[np.argmin(within)]
    assert cost(distances, weights, medoids) == pytest.approx(
        brute_force_best(distances, weights, 3))
    heavy = int(np.flatnonzero(group == 0)[-1])
    weights[heavy] = 50.0
    assert heavy in weighted_medoids(distances, weights, 3)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 8), seed=st.integers(0, 2**16), data=st.data())
def test_no_single_exchange_improves_the_medoids(n, seed, data):
    """On any instance the result is deterministic and PAM-optimal: no exchange of one
    medoid for one other point (all tried by brute force) lowers the weighted cost."""
    k = data.draw(st.integers(1, n))
    rng = np.random.default_rng(seed)
    points = rng.normal(size=(n, 3))
    distances = ((points[:, None] - points[None]) ** 2).sum(-1)
    weights = rng.uniform(0.1, 2.0, size=n)
    medoids = weighted_medoids(distances, weights, k)
    assert len(set(medoids)) == k
    assert medoids == weighted_medoids(distances, weights, k)
    found = cost(distances, weights, medoids)
    for i, h in itertools.product(range(k), set(range(n)) - set(medoids)):
        swapped = medoids[:i] + [h] + medoids[i + 1:]
        assert cost(distances, weights, swapped) >= found - 1e-9
    if k == n - 1:  # then the optimum is known: drop the point that costs least to drop
        assert found == pytest.approx(brute_force_best(distances, weights, k))


def test_medoids_reject_an_impossible_k():
    with pytest.raises(ValueError, match="need 1 <= k <= 2"):
        weighted_medoids(np.zeros((2, 2)), np.ones(2), 3)


def test_clustered_starts_split_each_initialisation_group_and_reach_member_starts():
    """Members trained from two broadcast inits form two groups in parameter space: two
    clustered starts are one member of each group; K = N is the member starts exactly; the
    clustered runs climb like the member runs and the ensemble holds K modes."""
    uploads = [tiny_upload(c, "kron", seed=c, members=2, broadcast_inits=True)
               for c in range(3)]
    strategy = FedBEns(TINY, num_clients=3, starts="clustered", num_starts=2, steps=40,
                       lr=0.01, eval_every=10, dtype=torch.float64)
    starts = strategy.starting_points(uploads)
    members = [(c, m) for c in range(3) for m in range(2)]
    chosen = [next(i for i, (c, m) in enumerate(members)
                   if all(np.array_equal(s[k], uploads[c].weights(m)[k]) for k in s))
              for s in starts]
    assert sorted(members[i][1] for i in chosen) == [0, 1]  # one per initialisation
    parameters = sorted(TINY.param_shapes().parameters)
    points = [uploads[c].weights(m) for c, m in members]
    distances = squared_distances(points, parameters)
    group = np.array([m for _, m in members])
    assert distances[group[:, None] == group[None]].max() < distances[
        group[:, None] != group[None]].min()  # the premise: the inits separate the members
    weights = member_weights(uploads)
    assert chosen == weighted_medoids(distances, weights, 2)
    everyone = clustered_starts(uploads, parameters, 6)
    members_rule = FedBEns(TINY, num_clients=3, starts="members").starting_points(uploads)
    for a, b in zip(everyone, members_rule, strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    default_k = FedBEns(TINY, num_clients=3, starts="clustered").starting_points(uploads)
    assert len(default_k) == 4  # 2 x max_c M_c
    fused = strategy.fuse(uploads)
    assert len(fused.members) == 2
    assert strategy.report()["starts"] == "clustered"
    with pytest.raises(ValueError, match=r"num_starts must be in 0..10000"):
        FedBEns(TINY, num_clients=3, starts="clustered", num_starts=-1)
