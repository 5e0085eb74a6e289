"""The projection-head model option (``model.projection_dim``, MOON's architecture) on every built-in builder: off
by default and then the model is exactly the one built before the option existed; on, it extends ``features``."""
import pytest
import torch
from torch import nn

from pflkit.core import MODELS

BUILDERS = [("mlp", (1, 8, 8), {}), ("cnn4", (1, 8, 8), {}), ("lenet", (3, 32, 32), {"channels": [4, 4]}),
            ("resnet8", (3, 8, 8), {"width": 4}), ("resnet10", (3, 8, 8), {"width": 4}),
            ("fasttext", (6,), {"vocab_size": 20}), ("fasttext", (6,), {"vocab_size": 20, "hidden": 0})]


def build(name, shape, kw, **extra):
    torch.manual_seed(0)
    return MODELS.get(name)(input_shape=shape, num_classes=10, **kw, **extra)


def same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_off_by_default_and_cnn4_is_the_model_written_out_by_hand():
    # cnn4 for 8x8 digits as it was built before the option: conv(2-padded)-pool-conv-pool-FC(512) | FC(10)
    torch.manual_seed(0)
    conv = [nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten()]
    old_features = nn.Sequential(*conv, nn.Linear(64 * 2 * 2, 512), nn.ReLU())
    old_head = nn.Linear(512, 10)
    model = build("cnn4", (1, 8, 8), {})
    assert same(model.features, old_features) and same(model.head, old_head)
    assert same(model, build("cnn4", (1, 8, 8), {}, projection_dim=0))


@pytest.mark.parametrize("name, shape, kw", BUILDERS)
def test_projection_extends_features_and_leaves_the_body_as_it_was(name, shape, kw):
    plain = build(name, shape, kw)
    assert same(plain, build(name, shape, kw, projection_dim=0))  # 0 = the option off, bit for bit
    proj = build(name, shape, kw, projection_dim=6)
    body = plain.features.state_dict()
    # the body's keys and initial weights are unchanged (created first), then Linear(d, d), ReLU, Linear(d, 6)
    assert all(torch.equal(proj.state_dict()["features." + k], v) for k, v in body.items())
    new = [k for k in proj.state_dict() if k.startswith("features.") and k[len("features."):] not in body]
    n = len(proj.features)
    assert new == [f"features.{n - 3}.weight", f"features.{n - 3}.bias", f"features.{n - 1}.weight",
                   f"features.{n - 1}.bias"]
    d = plain.feature_dim
    assert isinstance(proj.features[n - 2], nn.ReLU)
    assert proj.features[n - 3].weight.shape == (d, d) and proj.features[n - 1].weight.shape == (6, d)
    assert proj.head.weight.shape == (10, 6) and proj.feature_dim == 6
    x = torch.randint(0, 20, (2, *shape)) if name == "fasttext" else torch.randn(2, *shape)
    proj.eval()
    assert proj(x).shape == (2, 10) and proj.features(x).shape == (2, 6)
    assert torch.equal(proj(x), proj.head(proj.features(x)))
