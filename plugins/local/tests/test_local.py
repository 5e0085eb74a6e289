import torch

from pflkit.core import Simulation
from pflkit.core.testing import tiny_config


def test_no_parameters_travel_and_models_stay_personal(tmp_path):
    sim = Simulation(tiny_config("local", {"rounds": 2}), run_dir=tmp_path / "r", tensorboard=False)
    result = sim.run()
    # replies carry two scalars per client and round: 16 bytes up, nothing down
    assert result["bytes_up_total"] == 2 * 4 * 16 and result["bytes_down_total"] == 0
    first = [next(iter(sim.backend.get_state(c)["model"].values())) for c in sim.client_ids]
    assert not torch.equal(first[0], first[1])
    assert result["final"]["uniform"] > 0.3


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("local", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
