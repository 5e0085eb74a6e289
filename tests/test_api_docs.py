"""The public API is documented where a third-party author looks (issue 36): every public name has a docstring,
so has every public method of the classes a plugin subclasses, ``pflkit.core.testing`` declares ``__all__``, and
docs/api.md in the repository lists every public name (not only the built site)."""
from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pflkit.core
import pflkit.core.testing
from pflkit.core import (ClientTrainer, GlobalModelAggregator, LocalSGDTrainer, ServerAggregator, Task,
                         feature_keys, head_keys)

REPO = Path(__file__).resolve().parents[1]


def _api_index():
    spec = importlib.util.spec_from_file_location("api_index", REPO / "docs" / "hooks" / "api_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _public(module):
    return [(name, getattr(module, name)) for name in module.__all__]


def test_every_public_class_and_function_has_a_docstring():
    missing = [f"{m.__name__}.{name}" for m in (pflkit.core, pflkit.core.testing) for name, value in _public(m)
               if (inspect.isclass(value) or inspect.isfunction(value)) and not inspect.getdoc(value)]
    assert not missing, f"no docstring: {missing}"


def test_every_public_method_of_a_public_class_has_a_docstring():
    missing = []
    for module in (pflkit.core, pflkit.core.testing):
        for name, cls in _public(module):
            if not inspect.isclass(cls):
                continue
            for attr, raw in vars(cls).items():
                if attr.startswith("_") or not (callable(raw) or isinstance(raw, (classmethod, staticmethod, property))):
                    continue
                if not inspect.getdoc(getattr(cls, attr)):
                    missing.append(f"{name}.{attr}")
    assert not missing, f"no docstring: {missing}"


def test_the_extension_points_a_plugin_overrides_are_documented():
    # the ones a third-party author named as undocumented, each with a docstring of its own (not only inherited)
    own = [LocalSGDTrainer.local_update, LocalSGDTrainer.loss, LocalSGDTrainer.personal_forward,
           LocalSGDTrainer.receive, LocalSGDTrainer.upload, LocalSGDTrainer.on_fit, LocalSGDTrainer.on_evaluate,
           ServerAggregator.configure_fit, ServerAggregator.aggregate_fit, ServerAggregator.configure_evaluate,
           ServerAggregator.run_round, ServerAggregator.setup_steps, GlobalModelAggregator.combine, Task.loss,
           feature_keys, head_keys, ClientTrainer.handle]
    assert [f.__qualname__ for f in own if not f.__doc__] == []


def test_setup_steps_is_a_method_of_server_aggregator_and_defaults_to_setup():
    calls = []

    class Strategy(ServerAggregator):
        def setup(self, comm):
            calls.append(comm)

    steps = list(Strategy.__new__(Strategy).setup_steps("channel"))
    assert steps == [] and calls == ["channel"]


def test_testing_declares_its_public_names():
    names = pflkit.core.testing.__all__
    assert len(set(names)) == len(names) and all(hasattr(pflkit.core.testing, n) for n in names)
    assert "tiny_run" in names and "os" not in names and "Dict" not in names


def test_docs_api_md_lists_every_public_name():
    text = (REPO / "docs" / "api.md").read_text()
    index = _api_index()
    assert index.current_block(text) == index.index_markdown(), \
        "docs/api.md's index is stale: python docs/hooks/api_index.py --write"
    for module in (pflkit.core, pflkit.core.testing):
        for name in module.__all__:
            assert f"| `{name}` |" in text, name
