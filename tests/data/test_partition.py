"""Properties of fededge.data.partition: coverage, determinism and the skew each scheme
promises."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits

from fededge.data import PARTITIONS, PartitionError, label_distribution, label_skew, partition

DIGITS_Y = load_digits().target  # 1,797 labels, 10 classes of 174..183


def assert_exact_cover(parts: list[np.ndarray], n: int, k: int) -> None:
    assert len(parts) == k
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "each partition is sorted and has no repeats"
    allidx = np.concatenate(parts)
    # Disjoint and covering: every index appears exactly once.
    assert np.array_equal(np.sort(allidx), np.arange(n))


def _kwargs(scheme: str) -> dict:
    return {"dirichlet": {"min_partition_size": 0}, "shards": {}, "iid": {}}[scheme]


@pytest.mark.parametrize("scheme", PARTITIONS)
@pytest.mark.parametrize("n,k", [(1797, 10), (1797, 7), (100, 3), (53, 53), (10, 1)])
def test_partitions_are_disjoint_and_cover_every_index(scheme, n, k):
    labels = DIGITS_Y[:n]
    spp = 1 if scheme == "shards" and 2 * k > n else 2
    parts = partition(labels, k, scheme=scheme, shards_per_partition=spp, seed=3,
                      **_kwargs(scheme))
    assert_exact_cover(parts, n, k)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 300),
    num_classes=st.integers(1, 12),
    scheme=st.sampled_from(PARTITIONS),
    seed=st.integers(0, 2**32 - 1),
)
def test_exact_cover_property(data, n, num_classes, scheme, seed):
    labels = np.random.default_rng(seed).integers(0, num_classes, size=n)
    k = data.draw(st.integers(1, n), label="num_partitions")
    spp = data.draw(st.integers(1, max(1, n // k)), label="shards_per_partition")
    alpha = data.draw(st.floats(0.05, 50.0), label="alpha")
    parts = partition(labels, k, scheme=scheme, alpha=alpha, shards_per_partition=spp,
                      seed=seed, min_partition_size=0)
    assert_exact_cover(parts, n, k)


@pytest.mark.parametrize("scheme", PARTITIONS)
def test_same_seed_same_partition_different_seed_different(scheme):
    a = partition(DIGITS_Y, 10, scheme=scheme, seed=5)
    b = partition(DIGITS_Y, 10, scheme=scheme, seed=5)
    c = partition(DIGITS_Y, 10, scheme=scheme, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_partition_leaves_global_rng_alone():
    np.random.seed(123)
    before = np.random.random()
    np.random.seed(123)
    partition(DIGITS_Y, 10, scheme="dirichlet", seed=0)
    assert np.random.random() == before


@pytest.mark.parametrize("n,k", [(1797, 10), (1797, 7), (11, 3), (5, 5)])
def test_iid_sizes_differ_by_at_most_one(n, k):
    sizes = [len(p) for p in partition(DIGITS_Y[:n], k, scheme="iid", seed=1)]
    assert max(sizes) - min(sizes) <= 1


def test_iid_is_not_the_identity_split():
    parts = partition(DIGITS_Y, 4, scheme="iid", seed=0)
    assert not np.array_equal(parts[0], np.arange(len(parts[0])))


def _mean_skew(scheme: str, seeds=range(5), **kw) -> float:
    return float(np.mean([label_skew(DIGITS_Y, partition(DIGITS_Y, 10, scheme=scheme,
                                                         seed=s, **kw), 10)
                          for s in seeds]))


def test_dirichlet_skew_grows_as_alpha_shrinks():
    iid = _mean_skew("iid")
    s100 = _mean_skew("dirichlet", alpha=100.0)
    s1 = _mean_skew("dirichlet", alpha=1.0)
    s01 = _mean_skew("dirichlet", alpha=0.1)
    assert s01 > s1 > s100
    # Observed: 0.67 > 0.33 > 0.04; leave margins wide enough for any seed set.
    assert s01 > s1 + 0.15 and s1 > s100 + 0.15
    # alpha=100 is near-IID. (It is even a little below IID's 0.08: the Dirichlet
    # scheme splits each class on its own, which stratifies away sampling noise.)
    assert s100 < 0.1 and abs(s100 - iid) < 0.06


def test_dirichlet_respects_min_partition_size():
    for seed in range(5):
        parts = partition(DIGITS_Y, 20, scheme="dirichlet", alpha=0.3, seed=seed,
                          min_partition_size=30)
        assert min(len(p) for p in parts) >= 30
        assert_exact_cover(parts, len(DIGITS_Y), 20)


def test_dirichlet_small_alpha_gives_uneven_sizes():
    sizes = [len(p) for p in partition(DIGITS_Y, 10, scheme="dirichlet", alpha=0.1,
                                       seed=0)]
    assert max(sizes) > 2 * min(sizes)


@pytest.mark.parametrize(
    "k,kw",
    [
        (1000, {}),  # needs 10,000 samples for 1,797: impossible outright
        (100, {"alpha": 0.05}),  # possible in principle, never drawn
    ],
)
def test_impossible_dirichlet_request_says_what_to_change(k, kw):
    with pytest.raises(ValueError) as err:
        partition(DIGITS_Y, k, scheme="dirichlet", min_partition_size=10,
                  max_retries=20, **kw)
    msg = str(err.value)
    for needle in ("alpha", "num-clients", "min_partition_size=10",
                   f"num_partitions={k}"):
        assert needle in msg


@pytest.mark.parametrize(
    "k,kw,needed,draws",
    [
        (1000, {"scheme": "dirichlet"}, 10_000, None),  # k * min_partition_size > n
        (100, {"scheme": "dirichlet", "alpha": 0.05}, None, 20),  # every seeded draw fails
        (1000, {"scheme": "shards", "shards_per_partition": 2}, 2000, None),
        (1798, {"scheme": "iid"}, 1798, None),  # more partitions than samples
    ],
)
def test_impossible_requests_raise_partition_error_with_the_facts(k, kw, needed, draws):
    with pytest.raises(PartitionError) as err:
        partition(DIGITS_Y, k, min_partition_size=10, max_retries=20, **kw)
    e = err.value
    assert isinstance(e, ValueError)  # callers catching ValueError keep working
    assert (e.scheme, e.num_partitions, e.num_samples) == (kw["scheme"], k, len(DIGITS_Y))
    assert (e.needed, e.draws) == (needed, draws)
    assert (e.smallest is not None) == (draws is not None)
    if draws is not None:
        assert 0 <= e.smallest < 10


def test_a_failed_dirichlet_request_fails_the_same_way_every_time():
    """What lets a server run the clients' partition once and know their outcome."""
    msgs = set()
    for _ in range(3):
        with pytest.raises(PartitionError) as err:
            partition(DIGITS_Y, 100, scheme="dirichlet", alpha=0.05, seed=4, max_retries=20)
        msgs.add((str(err.value), err.value.smallest))
    assert len(msgs) == 1


def test_invalid_arguments_are_not_partition_errors():
    with pytest.raises(ValueError) as err:
        partition(DIGITS_Y, 10, alpha=0.0)
    assert not isinstance(err.value, PartitionError)


def test_shards_give_each_client_about_two_classes():
    # Ten equal classes, 20 shards of 50: every shard is one class, so every client
    # sees at most shards_per_partition = 2 classes.
    sorted_labels = np.repeat(np.arange(10), 100)
    parts = partition(sorted_labels, 10, scheme="shards", shards_per_partition=2,
                      seed=0)
    classes = [len(np.unique(sorted_labels[p])) for p in parts]
    assert max(classes) <= 2
    assert all(len(p) == 100 for p in parts)
    # Digits classes are uneven (174..183), so a shard of ~90 can straddle two classes:
    # at most 4 classes per client, and on average no more than 3.
    for seed in range(5):
        parts = partition(DIGITS_Y, 10, scheme="shards", shards_per_partition=2,
                          seed=seed)
        classes = [len(np.unique(DIGITS_Y[p])) for p in parts]
        assert max(classes) <= 4 and np.mean(classes) <= 3


def test_shards_assign_leftover_samples():
    labels = np.repeat(np.arange(3), [7, 8, 8])  # 23 samples: 6 shards of 4,4,4,4,4,3
    for seed in range(5):
        parts = partition(labels, 3, scheme="shards", shards_per_partition=2, seed=seed)
        assert_exact_cover(parts, 23, 3)
        assert sorted(len(p) for p in parts) == [7, 8, 8]


def test_more_shards_per_client_means_less_skew():
    few = _mean_skew("shards", shards_per_partition=1)
    many = _mean_skew("shards", shards_per_partition=20)
    assert few > many + 0.3


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"num_partitions": 0}, "num_partitions must be >= 1"),
        ({"num_partitions": 1798}, "num_partitions must be <= len(labels)"),
        ({"num_partitions": 2.0}, "num_partitions must be an int"),
        ({"alpha": 0.0}, "alpha must be a finite float > 0"),
        ({"alpha": -1.0}, "alpha must be a finite float > 0"),
        ({"alpha": float("nan")}, "alpha must be a finite float > 0"),
        ({"shards_per_partition": 0}, "shards_per_partition must be >= 1"),
        ({"scheme": "pathological"}, "'iid', 'dirichlet', 'shards'"),
        ({"min_partition_size": -1}, "min_partition_size must be >= 0"),
        ({"max_retries": 0}, "max_retries must be >= 1"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"scheme": "shards", "num_partitions": 1000}, "lower shards_per_partition"),
    ],
)
def test_invalid_arguments_raise_value_error(kw, needle):
    args = {"num_partitions": 10, **kw}
    k = args.pop("num_partitions")
    with pytest.raises(ValueError) as err:
        partition(DIGITS_Y, k, **args)
    assert needle in str(err.value)


def test_labels_must_be_one_dimensional():
    with pytest.raises(ValueError, match="1-D"):
        partition(DIGITS_Y.reshape(-1, 1), 2)


def test_label_distribution_counts_match_bincount():
    parts = partition(DIGITS_Y, 6, scheme="dirichlet", alpha=0.5, seed=2)
    dist = label_distribution(DIGITS_Y, parts, 10)
    assert dist.shape == (6, 10) and dist.dtype == np.int64
    assert np.array_equal(dist.sum(axis=0), np.bincount(DIGITS_Y, minlength=10))
    assert np.array_equal(dist.sum(axis=1), [len(p) for p in parts])


def test_label_skew_extremes_match_total_variation():
    y = np.repeat(np.arange(10), 20)
    one_class_each = [np.flatnonzero(y == c) for c in range(10)]
    assert label_skew(y, one_class_each, 10) == pytest.approx(0.9)
    perfectly_mixed = [np.arange(c, 200, 10) for c in range(10)]
    assert label_skew(y, perfectly_mixed, 10) == pytest.approx(0.0)
    # A small hand-computed case: global (0.5, 0.5); client (1, 0) and (1/3, 2/3).
    y2 = np.array([0, 0, 1, 0, 1, 1])
    skew = label_skew(y2, [np.array([0, 1, 3]), np.array([2, 4, 5])], 2)
    assert skew == pytest.approx(0.5)
    skew = label_skew(y2, [np.array([0, 1]), np.array([2, 3, 4, 5])], 2)
    assert skew == pytest.approx((0.5 + (0.5 - 1 / 4)) / 2)


def test_label_skew_skips_empty_partitions_and_validates_labels():
    y = np.array([0, 1, 0, 1])
    assert label_skew(y, [np.array([0, 1, 2, 3]), np.array([], dtype=np.int64)], 2) == 0
    with pytest.raises(ValueError, match="num_classes=2"):
        label_skew(np.array([0, 2]), [np.array([0, 1])], 2)


def test_data_package_never_imports_flower():
    pkg = Path(__file__).resolve().parents[2] / "fededge" / "data"
    for path in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            assert not any(n.split(".")[0] in {"flwr", "flwr_datasets", "datasets"}
                           for n in names), f"{path.name} imports {names}"


def test_an_alpha_numpys_sampler_cannot_draw_is_refused_by_name():
    """alpha near float64's max: numpy's Dirichlet draws were all zeros, every sample went
    to the last client, and the message said "raise alpha"."""
    from fededge.config import ConfigError, RunConfig

    y = np.arange(500) % 5
    with pytest.raises(PartitionError, match="too large for numpy's Dirichlet sampler"):
        partition(y, 5, scheme="dirichlet", alpha=1e308, seed=0)
    assert sorted(len(p) for p in partition(y, 5, scheme="dirichlet", alpha=1e100, seed=0))[0] >= 95
    with pytest.raises(ConfigError, match="'alpha' must be <= 1e100"):
        RunConfig.from_mapping({"alpha": 1e308})
