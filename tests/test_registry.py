import sys
import textwrap

import pytest

from pflkit.core.api import registry as reg
from pflkit.core.common.errors import PluginError, UnknownNameError


def make_dist(site, dist, version, group, name, target, module_src=None, module=None):
    """Write an installed-distribution record (dist-info with entry points) into ``site``."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")
    if module_src is not None:
        (site / f"{module}.py").write_text(textwrap.dedent(module_src))


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    reg.refresh_all()
    yield site
    reg.refresh_all()


def test_builtins_are_discovered_through_entry_points():
    assert {"digits"} <= set(reg.DATASETS.names())
    assert {"iid", "dirichlet", "pathological"} <= set(reg.PARTITIONERS.names())
    assert {"mlp", "cnn4"} <= set(reg.MODELS.names())
    entry = {e.name: e for e in reg.MODELS.entries()}["mlp"]
    assert entry.dist == "pflkit" and entry.target == "pflkit.models.mlp:mlp"


def test_unknown_name_lists_available_and_suggests():
    with pytest.raises(UnknownNameError) as err:
        reg.MODELS.get("mpl")
    msg = str(err.value)
    assert "Did you mean 'mlp'" in msg and "cnn4" in msg


def test_in_process_registration_as_decorator(registries_snapshot):
    @reg.MODELS.register("tiny_test_model")
    def tiny(input_shape, num_classes):
        """A test model."""

    assert reg.MODELS.get("tiny_test_model") is tiny
    with pytest.raises(PluginError, match="already provided"):
        reg.MODELS.register("tiny_test_model", tiny)


def test_broken_plugin_is_reported_and_others_still_load(site):
    make_dist(site, "broken-plugin", "0.3", "pflkit.models", "broken", "broken_mod:build",
              module_src="raise RuntimeError('boom at import')\n", module="broken_mod")
    make_dist(site, "good-plugin", "1.0", "pflkit.models", "good", "good_mod:build",
              module_src="def build(input_shape, num_classes):\n    'good one'\n", module="good_mod")
    failures = reg.MODELS.load_all()
    assert [(f.name, f.dist) for f in failures] == [("broken", "broken-plugin")]
    assert "RuntimeError: boom at import" in failures[0].error
    assert callable(reg.MODELS.get("good")) and callable(reg.MODELS.get("mlp"))
    with pytest.raises(PluginError, match="broken-plugin"):
        reg.MODELS.get("broken")


def test_two_distributions_claiming_one_name_is_an_error_naming_both(site):
    make_dist(site, "first-dist", "1.0", "pflkit.partitioners", "clash", "a_mod:f")
    make_dist(site, "second-dist", "2.0", "pflkit.partitioners", "clash", "b_mod:f")
    with pytest.raises(PluginError) as err:
        reg.PARTITIONERS.get("clash")
    assert "first-dist" in str(err.value) and "second-dist" in str(err.value)
    assert "clash" in reg.PARTITIONERS.names()
    assert reg.PARTITIONERS.get("iid") is not None  # the rest keeps working
