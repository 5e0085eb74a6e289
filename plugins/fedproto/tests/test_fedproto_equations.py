"""FedProto's equations on hand-computed examples (pflkit_fedproto.equations)."""
import pytest
import torch

from pflkit_fedproto.equations import (aggregate_prototypes, dense_prototypes, local_prototypes, prototype_loss,
                                       prototype_scores)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_local_prototypes_are_class_means():
    z = t([1.0, 0.0], [3.0, 2.0], [0.0, 4.0])
    protos, counts = local_prototypes(z, torch.tensor([0, 0, 2]), 3)
    assert protos.tolist() == [[2.0, 1.0], [0.0, 0.0], [0.0, 4.0]]
    assert counts.tolist() == [2, 0, 1]


def _two_clients():
    # client A: class 0 at (1, 1) from 1 sample, class 1 at (2, 0) from 3; client B: class 0 at (4, 1) from 3,
    # class 2 at (0, 2) from 1
    a = (t([1.0, 1.0], [2.0, 0.0], [0.0, 0.0]), torch.tensor([1, 3, 0]))
    b = (t([4.0, 1.0], [0.0, 0.0], [0.0, 2.0]), torch.tensor([3, 0, 1]))
    return [a[0], b[0]], [a[1], b[1]]


def test_aggregation_weighted_by_class_counts():
    protos, counts = _two_clients()
    glob, present = aggregate_prototypes(protos, counts, "samples")
    # class 0: (1 * (1, 1) + 3 * (4, 1)) / 4 = (13/4, 1); classes 1 and 2 have one holder each
    assert torch.allclose(glob, t([13 / 4, 1.0], [2.0, 0.0], [0.0, 2.0]))
    assert present.tolist() == [True, True, True]


def test_aggregation_uniform_over_holders():
    protos, counts = _two_clients()
    glob, _ = aggregate_prototypes(protos, counts, "uniform")
    assert torch.allclose(glob, t([2.5, 1.0], [2.0, 0.0], [0.0, 2.0]))  # a non-holder's zero row never counts


def test_aggregation_marks_classes_nobody_holds():
    glob, present = aggregate_prototypes([t([1.0], [0.0])], [torch.tensor([2, 0])], "samples")
    assert present.tolist() == [True, False] and glob.tolist() == [[1.0], [0.0]]
    with pytest.raises(ValueError, match="weighting"):
        aggregate_prototypes([t([1.0])], [torch.tensor([1])], "median")


def test_prototype_loss_hand_computed():
    z = t([1.0, 2.0], [3.0, 3.0], [0.0, 1.0])
    glob = t([0.0, 0.0], [9.0, 9.0], [0.0, 0.0])
    present = torch.tensor([True, False, True])
    y = torch.tensor([0, 1, 2])
    # squared distances 5, (no prototype for class 1 -> 0), 1; mean over the batch of 3
    assert prototype_loss(z, y, glob, present, "sum").item() == pytest.approx(6.0 / 3)
    assert prototype_loss(z, y, glob, present, "mean").item() == pytest.approx(6.0 / 3 / 2)  # / d = 2


def test_prototype_loss_gradient_pulls_towards_the_prototype():
    z = t([1.0, 2.0]).requires_grad_(True)
    prototype_loss(z, torch.tensor([0]), t([0.0, 0.0]), torch.tensor([True]), "sum").backward()
    assert z.grad.tolist() == [[2.0, 4.0]]  # d/dz ||z - c||^2 = 2 (z - c)


def test_nearest_prototype_scores():
    glob = t([0.0, 0.0], [4.0, 0.0], [100.0, 100.0])
    z = t([1.0, 0.0], [3.5, 0.0], [60.0, 60.0])
    scores = prototype_scores(z, glob, torch.tensor([True, True, True]), "sum")
    assert torch.allclose(scores[0], -t(1.0, 9.0, 99.0 ** 2 + 100.0 ** 2))
    assert scores.argmax(1).tolist() == [0, 1, 2]
    # class 2 undefined: never predicted, scores stay finite (1 below the lowest defined score)
    part = prototype_scores(z, glob, torch.tensor([True, True, False]), "sum")
    assert torch.isfinite(part).all() and part.argmax(1).tolist() == [0, 1, 1]
    assert part[0, 2].item() == pytest.approx(-10.0)
    assert torch.allclose(prototype_scores(z, glob, torch.tensor([True] * 3), "mean"), scores / 2)


def test_wire_format_round_trip_and_checks():
    dense, counts = dense_prototypes(torch.tensor([2, 0]), t([5.0, 5.0], [1.0, 2.0]), 3, torch.tensor([4, 1]))
    assert dense.tolist() == [[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]] and counts.tolist() == [1, 0, 4]
    with pytest.raises(ValueError, match="0..2"):
        dense_prototypes(torch.tensor([3]), t([1.0, 1.0]), 3)
    with pytest.raises(ValueError, match="repeat"):
        dense_prototypes(torch.tensor([1, 1]), t([1.0, 1.0], [1.0, 1.0]), 3)
    with pytest.raises(ValueError, match="rows"):
        dense_prototypes(torch.tensor([1]), t([1.0, 1.0], [1.0, 1.0]), 3)
