"""FedCAC's equations on hand-computed examples (pflkit_fedcac.equations)."""
import pytest
import torch

from pflkit_fedcac.equations import (critical_masks, customized_models, global_model, masked_init,
                                     num_critical, overlap_matrix, sensitivity, threshold,
                                     time_varying_collaborators, top_k_collaborators, top_tau_mask)


def t(*v):
    return torch.tensor(v, dtype=torch.float32)


# -- Eq. (5) -------------------------------------------------------------------------------------------------
def test_sensitivity_is_abs_change_times_end_value():
    start = {"w": t(1.0, 2.0, -1.0, 0.5)}
    end = {"w": t(1.5, 1.0, -3.0, 0.5)}
    s = sensitivity(start, end)["w"]
    assert torch.allclose(s, t(0.75, 1.0, 6.0, 0.0))


# -- Eq. (6) -------------------------------------------------------------------------------------------------
def test_top_tau_mask_known_scores():
    assert top_tau_mask(t(0.1, 0.5, 0.3, 0.9), 0.5).tolist() == [False, True, False, True]
    assert top_tau_mask(t(0.1, 0.5, 0.3, 0.9), 0.25).tolist() == [False, False, False, True]
    assert top_tau_mask(t(0.1, 0.5, 0.3, 0.9), 1.0).tolist() == [True] * 4
    assert not top_tau_mask(t(0.1, 0.5, 0.3, 0.9), 0.0).any()


def test_top_tau_mask_includes_ties_at_the_cut():
    # k = floor(0.4 * 5) = 2; the 2nd largest is 2.0, held by three entries: all three are critical
    mask = top_tau_mask(t(1.0, 2.0, 2.0, 2.0, 0.5), 0.4)
    assert mask.tolist() == [False, True, True, True, False]
    # all equal: all critical
    assert top_tau_mask(t(3.0, 3.0, 3.0, 3.0), 0.5).all()


def test_top_tau_mask_zero_scores_are_never_critical():
    assert top_tau_mask(t(0.0, 0.0, 0.0, 1.0), 0.75).tolist() == [False, False, False, True]
    assert not top_tau_mask(torch.zeros(6), 0.5).any()


def test_num_critical_floors_without_float_error():
    assert num_critical(100, 0.29) == 29
    assert num_critical(10, 0.5) == 5 and num_critical(1, 0.5) == 0


def test_masks_are_chosen_per_tensor_not_globally():
    # tensor 'a' has far larger scores; a global top-50% would take only 'a'. Per tensor each keeps half.
    scores = {"a": t(100.0, 400.0, 200.0, 300.0).reshape(2, 2), "b": t(0.4, 0.1, 0.2, 0.3)}
    masks = critical_masks(scores, 0.5)
    assert masks["a"].shape == (2, 2)
    assert masks["a"].tolist() == [[False, True], [False, True]]
    assert masks["b"].tolist() == [True, False, False, True]


def test_reverse_and_random_selection():
    scores = {"w": torch.arange(1.0, 11.0)}  # 1..10
    rev = critical_masks(scores, 0.3, "reverse")["w"]
    assert rev.tolist() == [True] * 3 + [False] * 7  # the three least sensitive
    g = torch.Generator().manual_seed(0)
    rnd1 = critical_masks({"w": torch.zeros(1000)}, 0.3, "random", generator=g)["w"]
    rnd2 = critical_masks({"w": torch.zeros(1000)}, 0.3, "random", generator=g)["w"]
    assert int(rnd1.sum()) == 300 and int(rnd2.sum()) == 300
    assert not torch.equal(rnd1, rnd2)
    with pytest.raises(ValueError):
        critical_masks(scores, 0.3, "nope")


# -- overlap (Section 3.4) -----------------------------------------------------------------------------------
MASKS = torch.tensor([[1, 1, 0, 0, 0, 0],
                      [1, 0, 1, 0, 0, 0],
                      [1, 1, 1, 0, 0, 0]], dtype=torch.bool)


def test_overlap_similarity_on_hand_made_masks():
    o = overlap_matrix(MASKS)
    # |M0-M1|_1 = 2, c0 = 2 -> 1 - 2/4; |M0-M2|_1 = 1 -> 1 - 1/4; normalised by c_i, so O_20 = 1 - 1/6
    expected = torch.tensor([[1.0, 0.5, 0.75],
                             [0.5, 1.0, 0.75],
                             [1 - 1 / 6, 1 - 1 / 6, 1.0]], dtype=torch.float64)
    assert torch.allclose(o, expected)
    assert o[0, 2] != o[2, 0]  # asymmetric, as in the authors' code


def test_overlap_distance_option_and_chunking():
    o = overlap_matrix(MASKS, "distance")
    # 1 - |Mi-Mj|_1 / (2n), n = 6: symmetric
    assert torch.allclose(o[0, 1], torch.tensor(1 - 2 / 12, dtype=torch.float64))
    assert torch.allclose(o, o.T)
    # a list of per-tensor masks equals the concatenated mask
    chunks = [MASKS[:, :2], MASKS[:, 2:].reshape(3, 2, 2)]
    assert torch.allclose(overlap_matrix(chunks), overlap_matrix(MASKS))
    empty = torch.zeros(2, 4, dtype=torch.bool)
    assert torch.equal(overlap_matrix(empty), torch.ones(2, 2, dtype=torch.float64))


# -- Eq. (7)-(8) --------------------------------------------------------------------------------------------
O4 = torch.tensor([[1.0, 0.9, 0.5, 0.4],
                   [0.8, 1.0, 0.6, 0.5],
                   [0.5, 0.6, 1.0, 0.7],
                   [0.4, 0.5, 0.7, 1.0]], dtype=torch.float64)


def test_threshold_schedule_values():
    avg = (0.9 + 0.5 + 0.4 + 0.8 + 0.6 + 0.5 + 0.5 + 0.6 + 0.7 + 0.4 + 0.5 + 0.7) / 12
    assert threshold(O4, 1, 10) == pytest.approx(avg + 0.1 * (0.9 - avg))
    assert threshold(O4, 5, 10) == pytest.approx(avg + 0.5 * (0.9 - avg))
    assert threshold(O4, 10, 10) == pytest.approx(0.9)
    assert threshold(O4[:1, :1], 1, 10) is None


def test_collaborators_shrink_and_end_after_beta():
    beta = 4
    sizes = [int(time_varying_collaborators(O4, r, beta).sum()) for r in range(1, 7)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[beta - 1]
    c1 = time_varying_collaborators(O4, 1, beta)
    thr = threshold(O4, 1, beta)
    assert torch.equal(c1, (O4 >= thr) & ~torch.eye(4, dtype=torch.bool))
    # at t = beta only the pair(s) at O_max remain; for t > beta nobody collaborates
    at_beta = time_varying_collaborators(O4, beta, beta)
    assert at_beta.nonzero().tolist() == [[0, 1]]
    assert not time_varying_collaborators(O4, beta + 1, beta).any()
    # equal overlaps (O_max = O_avg): everyone collaborates until beta, nobody after
    flat = torch.full((3, 3), 0.5, dtype=torch.float64)
    assert int(time_varying_collaborators(flat, beta, beta).sum()) == 6
    assert not time_varying_collaborators(flat, beta + 1, beta).any()


def test_top_k_collaborators():
    c = top_k_collaborators(O4, 1)
    assert c.nonzero().tolist() == [[0, 1], [1, 0], [2, 3], [3, 2]]
    assert int(top_k_collaborators(O4, 10).sum()) == 12  # k capped at K - 1
    assert not top_k_collaborators(O4, 2).diagonal().any()


# -- Eq. (9)-(11) --------------------------------------------------------------------------------------------
def test_global_customized_and_masked_init():
    w = torch.tensor([[1.0, 10.0], [3.0, 20.0], [5.0, 60.0]])  # 3 clients, 2 parameters
    assert torch.allclose(global_model(w), t(3.0, 30.0))
    assert torch.allclose(global_model(w, torch.tensor([1.0, 1.0, 2.0])), t(3.5, 37.5))
    collab = torch.tensor([[False, True, False],
                           [False, False, False],
                           [True, True, False]])
    u = customized_models(w, collab)  # Eq. (10): mean over C_i plus i
    assert torch.allclose(u, torch.tensor([[2.0, 15.0], [3.0, 20.0], [3.0, 30.0]]))
    mask = torch.tensor([[True, False], [False, True], [True, True]])
    nxt = masked_init(u, global_model(w), mask)  # Eq. (11)
    assert torch.allclose(nxt, torch.tensor([[2.0, 30.0], [3.0, 20.0], [3.0, 30.0]]))
    # same as u * M + w_bar * (1 - M)
    m = mask.float()
    assert torch.allclose(nxt, u * m + global_model(w) * (1 - m))
