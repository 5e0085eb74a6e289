"""digits_clusters: k clusters of clients with their own label maps (or image rotation), the true cluster of every
group in meta, client_clusters' rule for when a run's clients have a known true cluster, and bad options."""
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from sklearn.datasets import load_digits

from pflkit.core.cli.main import cli
from pflkit.core.common.errors import DataError
from pflkit.core.testing import assert_run_refused
from pflkit.datasets.clustered import client_clusters, label_maps, load_digits_clusters


def _original():
    d = load_digits()
    x = (torch.as_tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.3) / 0.4
    return x, torch.as_tensor(d.target)


def test_label_rotation_moves_every_label_of_cluster_c_by_c_and_groups_line_up_with_clusters():
    b = load_digits_clusters(num_clusters=3, clients_per_cluster=2)
    x0, y0 = _original()
    cluster = b.groups // 2
    assert torch.equal(b.x, x0) and torch.equal(b.y, (y0 + cluster) % 10)  # same images, relabelled
    assert b.meta["true_cluster"] == [0, 0, 1, 1, 2, 2] and len(b.group_names) == 6
    assert b.group_names[2] == "cluster1-1"
    sizes = torch.bincount(b.groups)
    assert len(sizes) == 6 and int(sizes.min()) >= 290  # 1,797 digits dealt evenly, stratified
    for g in range(6):  # every group holds every class (stratified deal)
        assert len(torch.unique(b.y[b.groups == g])) == 10


def test_label_permutation_and_image_rotation():
    maps = label_maps("label_permutation", 4, seed=3)
    assert maps[0] == list(range(10)) and all(sorted(m) == list(range(10)) for m in maps)
    assert len({tuple(m) for m in maps}) == 4 and maps == label_maps("label_permutation", 4, seed=3)
    assert maps != label_maps("label_permutation", 4, seed=4)
    b = load_digits_clusters(num_clusters=4, clients_per_cluster=1, structure="label_permutation", seed=3)
    x0, y0 = _original()
    perm = torch.as_tensor(maps)[b.groups]
    assert torch.equal(b.y, perm.gather(1, y0.unsqueeze(1)).squeeze(1)) and b.meta["label_maps"] == maps
    r = load_digits_clusters(num_clusters=2, clients_per_cluster=1, structure="image_rotation")
    one = r.groups == 1
    assert torch.equal(r.y, y0) and torch.equal(r.x[~one], x0[~one])
    assert torch.equal(r.x[one], torch.rot90(x0[one], k=1, dims=(2, 3)))


def test_seeded_by_dataset_seed_alone():
    a, b = load_digits_clusters(seed=1), load_digits_clusters(seed=1)
    assert torch.equal(a.groups, b.groups) and torch.equal(a.y, b.y)
    assert not torch.equal(a.groups, load_digits_clusters(seed=2).groups)


def test_client_clusters_known_only_when_client_k_is_group_k():
    meta = {"true_cluster": [0, 0, 1, 1]}
    assert client_clusters(meta, {"partition": {"name": "by_group"}}, 4) == ([0, 0, 1, 1], None)
    for part in ({"name": "dirichlet"}, {"name": "by_group", "shuffle": True}, {"name": "by_group", "assign": "split"}):
        truth, why = client_clusters(meta, {"partition": part}, 4)
        assert truth is None and "by_group" in why
    assert client_clusters(meta, {"partition": {"name": "by_group"}}, 3)[0] is None
    assert client_clusters({}, {"partition": {"name": "by_group"}}, 4)[0] is None


def test_bad_options_are_refused():
    with pytest.raises(DataError, match="image_rotation has 4"):
        load_digits_clusters(num_clusters=5, structure="image_rotation")
    with pytest.raises(DataError, match="cannot be cut"):
        load_digits_clusters(num_clusters=30, clients_per_cluster=40)


@pytest.mark.parametrize("sets, message", [
    (("dataset.structure=swap",), "dataset.structure"),
    (("dataset.num_clusters=0",), "dataset.num_clusters: 0 is invalid"),
    (("dataset.structure=image_rotation", "dataset.num_clusters=5", "partition.name=by_group",
      "partition.num_clients=25"), "image_rotation has 4"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("fedavg", ("dataset.name=digits_clusters",) + sets, message, tmp_path)


def test_fl_show_documents_it():
    out = CliRunner().invoke(cli, ["show", "digits_clusters"]).output
    assert "label_rotation" in out and "dataset.clients_per_cluster = 5" in out


def test_a_federated_run_on_it_has_one_client_per_group(tmp_path):
    from pflkit.core.testing import tiny_run

    sim, summary = tiny_run("fedavg", tmp_path / "r", {
        "dataset": {"name": "digits_clusters", "num_clusters": 2, "clients_per_cluster": 2},
        "partition": {"name": "by_group", "num_clients": 4}, "rounds": 1})
    assert summary["rounds_completed"] == 1
    assert sim.server_ctx.data_info["meta"]["true_cluster"] == [0, 0, 1, 1]
    groups = np.bincount(np.asarray(load_digits_clusters(num_clusters=2, clients_per_cluster=2).groups))
    for cid, ctx in sim.contexts.items():  # client k holds group k's samples (train + test)
        assert len(ctx.train) + len(ctx.test) == groups[cid]
