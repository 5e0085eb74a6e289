"""The embedded feature-shift dataset digits_domains: deterministic, one group per domain, renderings as
documented, several clients per domain, clear errors, described by `fl show`."""
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pflkit.core import ConfigError, DataError
from pflkit.core.cli.main import cli
from pflkit.core.engine.config import resolve
from pflkit.core.data.data import build_federated_data
from pflkit.datasets.feature_shift import DOMAINS, FAMILIES, group_names, load_digits_domains


@pytest.fixture(scope="module")
def bundle():
    return load_digits_domains()


def test_six_domains_disjoint_digits_balanced_classes(bundle):
    assert bundle.group_names == list(DOMAINS) and bundle.input_shape == (3, 16, 16)
    assert bundle.x.dtype == torch.uint8 and len(bundle.y) == 1797  # every digit once, in one domain
    groups, labels = bundle.groups.numpy(), bundle.y.numpy()
    assert sorted(np.unique(groups).tolist()) == list(range(6))
    for g in range(6):
        counts = np.bincount(labels[groups == g], minlength=10)
        assert counts.min() >= 28 and counts.max() - counts.min() <= 3  # ~30 per class in every domain
    assert sorted(sum(FAMILIES.values(), ())) == sorted(DOMAINS)


def test_deterministic_and_seeded_by_the_dataset_seed(bundle):
    again = load_digits_domains()
    assert torch.equal(again.x, bundle.x) and torch.equal(again.y, bundle.y) and torch.equal(again.groups, bundle.groups)
    other = load_digits_domains(seed=1)
    assert not torch.equal(other.groups, bundle.groups) or not torch.equal(other.x, bundle.x)


def test_renderings_are_what_the_docs_say():
    b = load_digits_domains(domains=["original", "inverted", "rotated", "thick", "textured", "inverted_colour"],
                            shared_digits=True)
    n = 1797
    orig, inv, rot, thick, tex, col = (b.x[k * n:(k + 1) * n].int() for k in range(6))
    assert torch.equal(b.y[:n], b.y[n:2 * n])  # shared_digits: the same digits in every domain, same order
    assert (orig + inv - 255).abs().max() <= 1                       # black on white = 255 - white on black
    assert torch.equal(rot, torch.rot90(orig, 1, dims=(2, 3)))        # a quarter turn
    assert (thick >= orig).all() and thick.float().mean() > orig.float().mean() + 10  # dilated strokes
    assert torch.equal(orig[:, 0], orig[:, 1])                        # grey
    assert not torch.equal(tex[:, 0], tex[:, 1]) and not torch.equal(col[:, 0], col[:, 2])  # coloured
    # polarity: bright-stroke domains are dark on average, dark-stroke domains light
    assert orig.float().mean() < 100 < inv.float().mean() and col.float().mean() > 100


def test_clients_per_domain_gives_one_group_per_client():
    b = load_digits_domains(domains=["original", "inverted"], clients_per_domain=3)
    assert b.group_names == ["original-1", "original-2", "original-3", "inverted-1", "inverted-2", "inverted-3"]
    assert b.group_names == group_names(["original", "inverted"], 3)
    cfg = resolve([{"dataset": {"name": "digits_domains", "domains": ["original", "inverted"],
                                "clients_per_domain": 3},
                    "partition": {"name": "by_group", "num_clients": 6}}])
    data = build_federated_data(cfg, bundle=b)
    groups = b.groups.numpy()
    for cid, split in enumerate(data.splits):
        idx = np.concatenate([split.train, split.test])
        assert set(groups[idx].tolist()) == {cid}  # client k = group k
        assert len(np.unique(b.y.numpy()[idx])) == 10


def test_bad_options_are_clear_errors():
    with pytest.raises(ConfigError, match="dataset.domains"):
        resolve([{"dataset": {"name": "digits_domains", "domains": ["mnist"]}}])
    with pytest.raises(ConfigError, match="dataset.image_size"):
        resolve([{"dataset": {"name": "digits_domains", "image_size": 4}}])
    with pytest.raises(DataError, match="listed twice"):
        load_digits_domains(domains=["original", "original"])
    with pytest.raises(DataError, match="clients_per_domain"):
        load_digits_domains(domains=["original"], clients_per_domain=5000)
    with pytest.raises(DataError, match="by_group"):  # 6 domains, 4 clients: the partitioner says what to set
        build_federated_data(resolve([{"dataset": {"name": "digits_domains"},
                                       "partition": {"name": "by_group", "num_clients": 4}}]))


def test_fl_show_describes_it():
    res = CliRunner().invoke(cli, ["show", "digits_domains"])
    assert res.exit_code == 0
    assert "feature-shift" in res.output and "dataset.clients_per_domain" in res.output
    assert "inverted_colour" in res.output
