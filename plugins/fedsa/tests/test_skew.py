"""Unit tests of FedSA's mathematics (pflkit_fedsa.skew) on constructed tensors."""
import pytest
import torch

from pflkit_fedsa import skew
from pflkit_fedsa.skew import (cluster_clients, cluster_weights, client_similarity, coefficient_of_variation, squared_deviation,
                               fedsa_aggregate, high_dispersion_mask, macro_categories, mic_agreement,
                               micro_classes)


def _aggregate(stacks, **kw):
    args = dict(cv_t=0.2, sim_t=0.2, num_categories=4, max_clusters=4)
    args.update(kw)
    return fedsa_aggregate(stacks.items(), **args)


# --- Eq. 2-7: dispersion split -------------------------------------------------------------------------------
def _constructed_layer():
    # 4 clients x 4 entries: cv = [0, 0.1, 1.0, 0.25]
    return torch.tensor([[1.0, 0.9, 0.0, 1.5],
                         [1.0, 1.1, 2.0, 2.5],
                         [1.0, 0.9, 0.0, 1.5],
                         [1.0, 1.1, 2.0, 2.5]], dtype=torch.float64)


def test_coefficient_of_variation_on_constructed_tensor():
    mu, cv = coefficient_of_variation(_constructed_layer())
    sq_dev = squared_deviation(_constructed_layer(), mu)
    torch.testing.assert_close(mu, torch.tensor([1.0, 1.0, 1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(sq_dev[:, 2], torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(cv, torch.tensor([0.0, 0.1, 1.0, 0.25], dtype=torch.float64))


def test_dispersion_split_minmax_threshold():
    _, cv = coefficient_of_variation(_constructed_layer())
    # normalised cv = [0, 0.1, 1, 0.25]
    assert high_dispersion_mask(cv, 0.2).tolist() == [False, False, True, True]
    assert high_dispersion_mask(cv, 0.3).tolist() == [False, False, True, False]
    assert high_dispersion_mask(cv, 1.0).tolist() == [False, False, False, False]
    # rank option: ranks [0, 1, 3, 2] / 3
    assert high_dispersion_mask(cv, 0.2, "rank").tolist() == [False, True, True, True]
    assert high_dispersion_mask(cv, 0.5, "rank").tolist() == [False, False, True, True]


def test_dispersion_split_constant_layer_is_all_low():
    same = torch.full((5, 7), 0.3)
    _, cv = coefficient_of_variation(same)
    assert not high_dispersion_mask(cv, 0.0).any()
    zeros = torch.zeros(5, 3)  # zero mean and zero spread: cv 0, not NaN
    _, cv0 = coefficient_of_variation(zeros)
    assert torch.isfinite(cv0).all() and not high_dispersion_mask(cv0, 0.0).any()


def test_near_zero_mean_dominates_minmax_but_not_rank():
    layer = _constructed_layer()
    layer = torch.cat([layer, torch.tensor([[-1e-3], [1e-3], [-1e-3], [1e-3]], dtype=torch.float64) + 1e-9], 1)
    _, cv = coefficient_of_variation(layer)
    assert high_dispersion_mask(cv, 0.2).tolist() == [False] * 4 + [True]  # the zero-mean entry squeezes the rest
    assert high_dispersion_mask(cv, 0.2, "rank").sum() == 4


def test_all_low_dispersion_equals_plain_mean():
    g = torch.Generator().manual_seed(0)
    stacks = {"a.weight": torch.randn(6, 3, 5, generator=g), "a.bias": torch.randn(6, 3, generator=g)}
    out, report = _aggregate(stacks, cv_t=1.0)  # normalised cv never exceeds 1: everything low-dispersion
    assert report.num_high == 0 and report.clustering is None
    for k, v in stacks.items():
        torch.testing.assert_close(out[k], v.mean(dim=0))
    # sample weighting option: the low-dispersion mean is then the weighted mean
    w = torch.tensor([1.0, 2, 3, 4, 5, 6])
    out_w, _ = _aggregate(stacks, cv_t=1.0, client_weights=w)
    torch.testing.assert_close(out_w["a.bias"], torch.tensordot(w / w.sum(), stacks["a.bias"], dims=1))


# --- Eq. 8-9: Micro-Classes ----------------------------------------------------------------------------------
def test_micro_class_binning_minmax():
    # one column per entry; clients along rows
    sq = torch.tensor([[0.0, 2.0], [0.25, 3.0], [0.5, 4.0], [1.0, 10.0]])
    mic = micro_classes(sq, 4, "minmax")
    # entry 0: s' = [0, .25, .5, 1] -> (c-1)/4 < s' <= c/4 -> [1 (s'=0 goes to 1), 1, 2, 4]
    # entry 1: s' = [0, .125, .25, 1] -> [1, 1, 1, 4]
    assert mic.dtype == torch.uint8
    assert mic[:, 0].tolist() == [1, 1, 2, 4]
    assert mic[:, 1].tolist() == [1, 1, 1, 4]


def test_micro_class_binning_other_norms():
    sq = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert micro_classes(sq, 4, "max")[:, 0].tolist() == [1, 2, 3, 4]         # s / max = .25 .5 .75 1
    raw = torch.tensor([[0.1], [0.3], [0.74], [2.0]])
    assert micro_classes(raw, 4, "none")[:, 0].tolist() == [1, 2, 3, 4]       # raw values, >1 clamps to C
    with pytest.raises(ValueError, match="mic_norm"):
        micro_classes(sq, 4, "zscore")


def test_micro_class_identical_deviations_fall_in_first_category():
    sq = torch.full((3, 2), 0.7)
    assert micro_classes(sq, 5, "minmax").eq(1).all()


# --- Eq. 10: similarity --------------------------------------------------------------------------------------
def test_similarity_matrix_over_layers():
    layer1 = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 1], [4, 4, 4, 4]], dtype=torch.uint8)
    layer2 = torch.tensor([[1, 1], [1, 2], [1, 1]], dtype=torch.uint8)
    sim = client_similarity([layer1, layer2], 4)
    expected = torch.tensor([[1, 4 / 6, 3 / 6], [4 / 6, 1, 1 / 6], [3 / 6, 1 / 6, 1]], dtype=torch.float64)
    torch.testing.assert_close(sim, expected)


def test_agreement_is_chunk_independent(monkeypatch):
    g = torch.Generator().manual_seed(1)
    mic = torch.randint(1, 5, (5, 1000), generator=g, dtype=torch.uint8)
    brute = (mic.unsqueeze(0) == mic.unsqueeze(1)).sum(-1).double()
    torch.testing.assert_close(mic_agreement(mic, 4), brute)
    monkeypatch.setattr(skew, "_CHUNK", 77)
    torch.testing.assert_close(mic_agreement(mic, 4), brute)


# --- Macro-Classes: clustering procedure ---------------------------------------------------------------------
def _block_similarity(groups, inside=0.9, between=0.1, n=None):
    n = n or sum(len(g) for g in groups)
    sim = torch.full((n, n), between, dtype=torch.float64)
    for g in groups:
        for a in g:
            for b in g:
                sim[a, b] = inside
    sim.fill_diagonal_(1.0)
    return sim


def test_clustering_limit_reached_and_unclustered_client():
    sim = _block_similarity([[0, 1], [2, 3], [4, 5]], n=7)
    sim[6, :6] = sim[:6, 6] = 0.15
    res = cluster_clients(sim, max_clusters=3, sim_t=0.2)
    assert sorted(res.clusters) == [[0, 1], [2, 3], [4, 5]]
    assert res.unclustered == [6]


def test_clustering_threshold_admits_client_to_best_cluster():
    sim = _block_similarity([[0, 1], [2, 3], [4, 5]], n=7)
    sim[6, :6] = sim[:6, 6] = 0.12
    sim[6, [4, 5]] = sim[[4, 5], 6] = 0.15
    res = cluster_clients(sim, max_clusters=3, sim_t=0.1)   # 0.15 > sim_t: joins the cluster it is closest to
    assert sorted(res.clusters) == [[0, 1], [2, 3], [4, 5, 6]]
    assert res.unclustered == []


def test_clustering_joins_existing_cluster_before_limit():
    sim = torch.tensor([[1.0, 0.9, 0.8, 0.1],
                        [0.9, 1.0, 0.8, 0.1],
                        [0.8, 0.8, 1.0, 0.1],
                        [0.1, 0.1, 0.1, 1.0]], dtype=torch.float64)
    res = cluster_clients(sim, max_clusters=4, sim_t=0.2)
    # Step 2: client 2 is closest to cluster {0, 1} (0.8 > best pair 0.1); client 3, alone, can only join a
    # cluster -- below the limit S the threshold does not apply (it only governs Step 3).
    assert res.clusters == [[0, 1, 2, 3]] and res.unclustered == []
    res2 = cluster_clients(sim, max_clusters=1, sim_t=0.2)
    assert res2.clusters == [[0, 1, 2]] and res2.unclustered == [3]


def test_clustering_new_pair_when_stronger_than_any_join():
    sim = _block_similarity([[0, 1, 2], [3, 4, 5]], inside=0.95, between=0.05)
    res = cluster_clients(sim, max_clusters=4, sim_t=0.2)
    assert sorted(res.clusters) == [[0, 1, 2], [3, 4, 5]]
    assert cluster_clients(torch.ones(1, 1), 4, 0.2).clusters == [[0]]


# --- Eq. 11, 14: categories and weights ----------------------------------------------------------------------
def test_macro_categories_majority_and_ties():
    mic = torch.tensor([[1, 2, 3], [1, 3, 3], [2, 2, 4], [4, 4, 4]], dtype=torch.uint8)
    mac = macro_categories(mic, [[0, 1, 2], [3]], 4)
    assert mac.tolist() == [[1, 2, 3], [4, 4, 4]]
    assert macro_categories(mic, [[0, 1]], 4).tolist() == [[1, 2, 3]]  # tie 2 vs 3 -> lowest category


def test_cluster_weights_sum_to_one_and_favour_shared_categories():
    mac = torch.tensor([[1, 1, 2, 3], [1, 2, 2, 4], [1, 2, 3, 4]])
    alpha = cluster_weights(mac, 4)
    expected = torch.tensor([[1 / 3, 0.2, 0.4, 0.2], [1 / 3, 0.4, 0.4, 0.4], [1 / 3, 0.4, 0.2, 0.4]])
    torch.testing.assert_close(alpha, expected)
    torch.testing.assert_close(alpha.sum(0), torch.ones(4))
    g = torch.Generator().manual_seed(2)
    random_mac = torch.randint(1, 6, (4, 500), generator=g)
    torch.testing.assert_close(cluster_weights(random_mac, 5).sum(0), torch.ones(500))
    printed = cluster_weights(mac, 4, "printed")
    torch.testing.assert_close(printed, torch.tensor([[3, 1, 2, 1], [3, 2, 2, 2], [3, 2, 1, 2]]) / 12.0)


# --- the whole rule ------------------------------------------------------------------------------------------
def test_skewed_toy_result_nearer_majority_than_mean():
    """4 client groups x 5 clients; on each entry one group (a different one per entry) is an outlier.

    FedSA's Macro-Classes recover the groups, and per entry the three clusters that share the low-deviation
    category outweigh the outlier cluster 3:1, so the result sits near the majority value, unlike the mean.
    """
    g = torch.Generator().manual_seed(3)
    groups, per_group, entries = 4, 5, 400
    k = groups * per_group
    majority = 1.0
    w = majority + 0.01 * torch.randn(k, entries, generator=g)
    outlier_group = torch.randint(0, groups, (entries,), generator=g)
    group_of_client = torch.arange(k) // per_group
    w = w + 3.0 * (group_of_client[:, None] == outlier_group[None, :]).float()
    out, report = _aggregate({"layer": w}, cv_t=0.0)
    assert sorted(report.clustering.clusters) == [list(range(i * 5, i * 5 + 5)) for i in range(4)]
    mean = w.mean(0)
    fedsa_err = (out["layer"] - majority).abs().mean()
    mean_err = (mean - majority).abs().mean()
    assert fedsa_err < 0.5 * mean_err   # mean: 0.75 of the way; FedSA: 0.3 (3 * 1/10) of the way
    torch.testing.assert_close(fedsa_err, torch.tensor(0.3), atol=0.02, rtol=0)
