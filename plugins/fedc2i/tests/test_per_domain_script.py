"""scripts/per_domain_table.py finds the runs of several ``fl compare`` calls into one folder (the README's
commands), whose results.json holds only the last call's rows."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "per_domain_table.py"


def _script():
    spec = importlib.util.spec_from_file_location("per_domain_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out: Path, name: str, rounds_completed: int = 20, interrupted: bool = False) -> Path:
    run = out / "runs" / name
    run.mkdir(parents=True)
    run.joinpath("summary.json").write_text(json.dumps(
        {"rounds": 20, "rounds_completed": rounds_completed, "interrupted": interrupted}))
    return run


def test_runs_are_found_in_the_folder_not_in_results_json(tmp_path):
    first = [_run(tmp_path, f"local-seed{s}") for s in (1, 0)]
    both = [_run(tmp_path, f"fedc2i+trainer.gamma=0.5-seed{s}") for s in (0, 1)]
    _run(tmp_path, "fedavg-seed0", rounds_completed=7)  # unfinished: left out
    _run(tmp_path, "fedavg-seed1", interrupted=True)
    (tmp_path / "runs" / "notes").mkdir()  # not a run folder
    # what the second fl compare call leaves: its own rows only
    (tmp_path / "results.json").write_text(json.dumps({"algorithms": ["fedc2i+trainer.gamma=0.5"], "results": {}}))
    found = _script().finished_runs(tmp_path)
    assert found == {"local": [(0, first[1]), (1, first[0])], "fedc2i+trainer.gamma=0.5": [(0, both[0]), (1, both[1])]}


def test_a_label_without_finished_runs_is_one_line_naming_what_exists(tmp_path, monkeypatch, capsys):
    _run(tmp_path, "local-seed0")
    monkeypatch.setattr("sys.argv", ["per_domain_table.py", str(tmp_path), "-p", "local,fedprox"])
    with pytest.raises(SystemExit) as exc:
        _script().main()
    assert str(exc.value) == f"no finished runs of fedprox under {tmp_path / 'runs'}; found: local"
