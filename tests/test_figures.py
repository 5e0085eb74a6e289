"""core/results/figures.py: per-client matrices become readable figures (client ids on the axes, a colour bar, a title),
and FedCAC's overlap and FedSA's similarity reach TensorBoard as such figures, not N x N-pixel arrays."""
from pathlib import Path

import numpy as np
import pytest

from pflkit.core.results.figures import matrix_figure_rgb
from pflkit.core.engine.simulation import Simulation
from pflkit.core.testing import tiny_config


def _tb_images(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={IMAGES: 0})
    acc.Reload()
    return {tag: acc.Images(tag) for tag in acc.Tags()[IMAGES]}


def test_matrix_figure_has_readable_size_and_content():
    rng = np.random.default_rng(0)
    matrix = rng.random((20, 20))
    image = matrix_figure_rgb(matrix, "overlap, round 1", labels=[f"c{i}" for i in range(20)], colorbar_label="x")
    assert image.ndim == 3 and image.shape[2] == 3 and image.shape[0] >= 400 and image.shape[1] >= 400
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert (image < 0.5).any() and (image > 0.9).any()  # text/axes drawn on a white figure, not one flat colour
    big = matrix_figure_rgb(rng.random((200, 200)), "many clients")  # labels thinned, size capped
    assert big.shape[0] <= 1000 and big.shape[1] <= 1200
    with pytest.raises(ValueError, match="labels"):
        matrix_figure_rgb(matrix, "t", labels=[1, 2])


@pytest.mark.parametrize("algorithm, tag, sets", [
    ("fedcac", "fedcac/overlap", ()),
    ("fedsa", "fedsa/similarity", ()),
])
def test_plugin_matrices_are_logged_as_figures(tmp_path, algorithm, tag, sets):
    cfg = tiny_config(algorithm, {"rounds": 1, "partition": {"num_clients": 6}}, sets)
    Simulation(cfg, run_dir=tmp_path / "run", tensorboard=True).run()
    images = _tb_images(tmp_path / "run")
    assert tag in images, sorted(images)
    first = images[tag][0]
    assert first.step == 1 and first.width >= 400 and first.height >= 400  # a figure, not 6 x 6 pixels
