"""aggregator.weighting: samples (default, Algorithm 1) or uniform (1 per reply), serially and on the distributed
fast path (distributed.exact false, where each rank sums weight x upload before the all-reduce)."""

import pytest
import torch

from pflkit.core import Simulation, WeightedMean
from pflkit.core.testing import DistributedBackend, one_process_group, run_capturing_replies, tiny_config
from pflkit_fedavg import FedAvgAggregator, reply_weight


def test_reply_weight_is_the_sample_count_or_one():
    assert reply_weight({"num_samples": 37}, "samples") == 37.0
    assert reply_weight({"num_samples": 37}, "uniform") == 1.0
    assert FedAvgAggregator.params["weighting"].default == "samples"


def test_uniform_weighting_is_the_plain_mean_and_samples_is_unchanged(tmp_path):
    means = {}
    for weighting in ("samples", "uniform"):
        sim = Simulation(tiny_config("fedavg", {"rounds": 1, "aggregator": {"weighting": weighting}}),
                         run_dir=tmp_path / weighting, tensorboard=False)
        seen = run_capturing_replies(sim)[1]
        means[weighting] = sim.server.global_state
    default = Simulation(tiny_config("fedavg", {"rounds": 1}), run_dir=tmp_path / "default", tensorboard=False)
    default.run()
    for key, value in means["uniform"].items():
        assert torch.allclose(value, sum(seen[c]["params"][key] for c in seen) / len(seen), atol=1e-6)
        assert torch.equal(means["samples"][key], default.server.global_state[key])  # the default, bit for bit
    assert any(not torch.allclose(means["samples"][k], means["uniform"][k]) for k in means["uniform"])


def test_bad_weighting_is_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner

    from pflkit.core.testing import cli

    res = CliRunner().invoke(cli, ["run", "--plugin", "fedavg", "--set", "aggregator.weighting=median",
                                   "--set", f"output_dir={tmp_path}"])
    assert res.exit_code == 2 and "aggregator.weighting" in res.output and "uniform" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # a failed start leaves nothing behind


@pytest.fixture
def one_rank_group():
    with one_process_group():
        yield


def test_uniform_weighting_holds_on_the_distributed_fast_path(tmp_path, one_rank_group):
    over = {"rounds": 1, "aggregator": {"weighting": "uniform"}, "distributed": {"exact": False}}
    fast = Simulation(tiny_config("fedavg", over), run_dir=tmp_path / "fast", tensorboard=False,
                      backend=DistributedBackend())
    replies = run_capturing_replies(fast)[1]
    assert all(isinstance(r["params"], WeightedMean) for r in replies.values())  # the all-reduced mean was used
    assert next(iter(replies.values()))["params"].weight == len(replies)  # weight 1 per reply, not n_k
    serial = Simulation(tiny_config("fedavg", {**over, "distributed": {"exact": True}}), run_dir=tmp_path / "serial",
                        tensorboard=False)
    serial.run()
    for key, value in serial.server.global_state.items():
        assert torch.allclose(fast.server.global_state[key], value, atol=1e-6), key
