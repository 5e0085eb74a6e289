import torch

from pflkit.core import Simulation
from pflkit.core.testing import run_capturing_replies, tiny_config


def test_global_model_is_the_sample_weighted_mean_of_uploads(tmp_path):
    sim = Simulation(tiny_config("fedavg", {"rounds": 1}), run_dir=tmp_path / "r", tensorboard=False)
    seen = run_capturing_replies(sim)[1]
    n = {c: r["num_samples"] for c, r in seen.items()}
    assert len(set(n.values())) > 1  # unequal clients, so weighting matters
    for key, value in sim.server.global_state.items():
        expected = sum(n[c] * seen[c]["params"][key] for c in seen) / sum(n.values())
        assert torch.allclose(value, expected, atol=1e-6)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedavg", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
