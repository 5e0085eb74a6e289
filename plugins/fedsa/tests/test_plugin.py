"""The FedSA aggregator inside pflkit: configuration, state handling, logging and end-to-end runs."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from easydict import EasyDict
from torch import nn

from pflkit.core import ConfigError, MODELS, ServerContext, TRAINERS, weighted_average
from pflkit.core.testing import quick_run, resolve, tiny_config
from pflkit_fedsa import FedSAAggregator


def _hp(**kw):
    hp = {name: p.default for name, p in FedSAAggregator.params.items()}
    hp.update(kw)
    return EasyDict(hp)


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


def _aggregator(**kw):
    ctx = ServerContext(hp=_hp(**kw), cfg=None, task=None, num_clients=5, build_model=_bn_model, shared_keys=None,
                        device=torch.device("cpu"), seed=0, logger=None, rng=np.random.default_rng(0))
    return FedSAAggregator(ctx)


def _client_states(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = _bn_model().state_dict()
    states = []
    for i in range(n):
        s = {}
        for k, v in base.items():
            s[k] = v + torch.randn(v.shape, generator=g) * 0.5 if v.is_floating_point() else v + i
        states.append(s)
    return states


def test_combine_all_low_dispersion_is_plain_mean():
    agg = _aggregator(cv_t=1.0)
    states = _client_states()
    out = agg.combine(states, [1.0] * 5, list(range(5)))
    plain = weighted_average(states, [1.0] * 5)
    for k in plain:
        torch.testing.assert_close(out[k], plain[k])
    assert agg.last_report.num_high == 0


def test_combine_buffers_follow_fedavg_and_parameters_fedsa():
    agg = _aggregator()
    states = _client_states()
    weights = [10.0, 20.0, 30.0, 40.0, 50.0]
    out = agg.combine(states, weights, list(range(5)))
    fedavg = weighted_average(states, weights)
    torch.testing.assert_close(out["1.running_mean"], fedavg["1.running_mean"])
    torch.testing.assert_close(out["1.running_var"], fedavg["1.running_var"])
    assert out["1.num_batches_tracked"].dtype == states[0]["1.num_batches_tracked"].dtype
    assert agg.last_report.num_high > 0
    assert set(agg.last_report.high_share) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"}
    assert not torch.allclose(out["0.weight"], fedavg["0.weight"])  # high-dispersion entries changed
    for k, v in out.items():
        assert v.shape == states[0][k].shape and v.dtype == states[0][k].dtype
    # "all": buffers go through FedSA too
    agg_all = _aggregator(apply_to="all")
    agg_all.combine(states, weights, list(range(5)))
    assert "1.running_mean" in agg_all.last_report.high_share


def test_config_validation_names_key():
    with pytest.raises(ConfigError, match="aggregator.cv_t"):
        tiny_config("fedsa", sets=("aggregator.cv_t=1.5",))
    with pytest.raises(ConfigError, match="aggregator.mic_norm"):
        tiny_config("fedsa", sets=("aggregator.mic_norm=zscore",))
    with pytest.raises(ConfigError, match="aggregator.mic_categories"):
        tiny_config("fedsa", sets=("aggregator.mic_categories=1",))


def test_algorithm_defaults_follow_paper():
    cfg = resolve([], algorithm="fedsa")
    assert cfg.trainer.name == "fedavg" and cfg.aggregator.name == "fedsa"
    assert cfg.aggregator.cv_t == 0.2 and cfg.aggregator.sim_t == 0.2
    assert cfg.aggregator.mic_categories == 4 and cfg.aggregator.max_clusters == 4
    assert cfg.partition.num_clients == 20 and cfg.participation.join_ratio == 1.0
    assert cfg.train.local_epochs == 1 and cfg.eval.final_k == 10


def _logged(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_end_to_end_quick_run(tmp_path):
    summary = quick_run("fedsa", tmp_path)
    assert summary["aggregator"] == "fedsa" and summary["trainer"] == "fedavg"
    assert summary["rounds_completed"] == 2
    assert 0.0 <= summary["final"]["uniform"] <= 1.0
    records = [r for r in _logged(summary["run_dir"]) if r.get("round", 0) >= 1]
    assert len(records) == 2
    for r in records:
        assert "fedsa/high_share" in r and "fedsa/macro_classes" in r and "fedsa/unclustered" in r
        assert any(k.startswith("fedsa/high_share/") for k in r)
        assert r["fedsa/macro_classes"] + r["fedsa/unclustered"] >= 1


def test_other_trainer_configuration_bn_stats_local(tmp_path):
    """FedAvg's trainer keeping BN statistics local: the uploads lack the BN buffers, FedSA combines the rest."""
    model = {"name": "resnet8", "width": 4} if "resnet8" in MODELS.names() else {"name": "mlp", "hidden": [16]}
    overrides = {"trainer": {"name": "fedavg", "bn_stats": "local"}, "model": model}
    summary = quick_run("fedsa", tmp_path, overrides=overrides)
    assert summary["trainer"] == "fedavg" and summary["aggregator"] == "fedsa"
    assert summary["rounds_completed"] == 2 and 0.0 <= summary["final"]["uniform"] <= 1.0


def test_fedprox_trainer_by_configuration(tmp_path):
    if "fedprox" not in TRAINERS.names():
        pytest.skip("pflkit-fedprox is not installed")
    summary = quick_run("fedsa", tmp_path, sets=("trainer.name=fedprox",))
    assert summary["trainer"] == "fedprox" and summary["aggregator"] == "fedsa"
    assert summary["rounds_completed"] == 2 and 0.0 <= summary["final"]["uniform"] <= 1.0


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedsa", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
