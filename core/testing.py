"""Helpers for plugin tests: a tiny, fast, fully seeded run on the embedded dataset, and the checks every
algorithm's tests repeat (pooled = one trainer per client, resume = full run, bad input = one line and exit 2,
``--workers N`` = serial)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .cli.main import cli
from .distributed.backend import DistributedBackend
from .engine.backend import SerialBackend
from .engine.compose import composition
from .engine.config import deep_merge, load_file, parse_sets, resolve, to_plain
from .engine.simulation import Simulation, make_model_factory
from .results.tables import check_table, installed_table

# Besides its own helpers, this module is where a plugin's tests find the core's pieces they drive directly: the fl
# command (``cli``), configuration (``resolve``, ``parse_sets``, ``load_file``, ``composition``), the backends,
# ``make_model_factory`` and a plugin's paper tables (``installed_table``: a parsed ``pflkit.tables`` entry with
# ``cell_config``; ``check_table``: what ``fl reproduce --check`` runs); with ``pflkit.core`` that is all a plugin
# imports (tests/test_public_api.py).

__all__: List[str] = sorted([
    # this module's own helpers
    "TINY", "WORKER_ENV", "OneTrainerPerClient", "assert_batched_matches_sequential", "assert_one_line_error",
    "assert_pooled_matches_one_trainer_per_client",
    "assert_resume_matches_full_run", "assert_run_refused", "assert_streaming_matches_all_replies",
    "assert_workers_match_serial", "fold_tolerance", "metrics_records", "one_process_group", "quick_run",
    "run_capturing_replies", "run_in_own_session", "run_with_workers", "tiny_config", "tiny_run", "tiny_simulation",
    # the core's pieces a plugin's tests drive directly (see above)
    "cli", "check_table", "composition", "deep_merge", "installed_table", "load_file", "make_model_factory",
    "parse_sets", "resolve", "to_plain", "DistributedBackend", "SerialBackend", "Simulation",
])

TINY: Dict[str, Any] = {
    "rounds": 2, "device": "cpu",
    "partition": {"num_clients": 4},
    "model": {"name": "mlp", "hidden": [32]},
    "train": {"batch_size": 32, "local_epochs": 1},
    "checkpoint": {"every": 0},
}


def tiny_config(algorithm: str, overrides: Optional[Dict[str, Any]] = None, sets: tuple = ()):
    """A resolved config for ``algorithm`` sized for unit tests (4 clients, 2 rounds, small MLP)."""
    overrides = dict(overrides or {})
    base = dict(TINY)
    if overrides.get("model", {}).get("name", "mlp") != "mlp":
        base.pop("model")  # the tiny MLP's keys do not apply to another model
    layer = deep_merge(base, overrides)
    return resolve([layer, parse_sets(sets)], algorithm=algorithm)


def tiny_simulation(algorithm: str, run_dir: Path, overrides: Optional[Dict[str, Any]] = None, sets: tuple = (),
                    **sim_kwargs) -> Simulation:
    """A :class:`Simulation` of ``tiny_config(algorithm, overrides, sets)`` writing to ``run_dir`` (no TensorBoard);
    ``sim_kwargs`` go to the Simulation (e.g. ``backend=``)."""
    return Simulation(tiny_config(algorithm, overrides, sets), run_dir=Path(run_dir), tensorboard=False, **sim_kwargs)


def tiny_run(algorithm: str, run_dir: Path, overrides: Optional[Dict[str, Any]] = None, sets: tuple = (),
             **sim_kwargs) -> Tuple[Simulation, Dict[str, Any]]:
    """Run :func:`tiny_simulation` to the end; return the simulation (its server, trainers) and the run summary."""
    sim = tiny_simulation(algorithm, run_dir, overrides, sets, **sim_kwargs)
    return sim, sim.run()


def quick_run(algorithm: str, tmp_path: Path, overrides: Optional[Dict[str, Any]] = None, sets: tuple = (),
              **sim_kwargs) -> Dict[str, Any]:
    """Run ``algorithm`` on a tiny config in ``tmp_path/run`` and return the run summary."""
    return tiny_run(algorithm, Path(tmp_path) / "run", overrides, sets, **sim_kwargs)[1]


def run_capturing_replies(sim: Simulation) -> Dict[int, Dict[int, Dict[str, Any]]]:
    """Run ``sim`` and return what its aggregator received: round -> client -> fit reply (uploads, counts). A field
    the aggregator streams (``mean_fields``, core/api/fold.py) reached it as one shared ``WeightedMean``; here it is the
    client's own upload, kept aside for the test (a serial run; on a distributed backend it stays the mean)."""
    from .api.state import WeightedMean

    captured: Dict[int, Dict[int, Dict[str, Any]]] = {}
    raw: Dict[int, Dict[str, Any]] = {}
    original = sim.server.aggregate_fit
    original_each = sim.backend.execute_each

    def each(calls, snapshot=False):
        for res in original_each(calls, snapshot):
            if res.error is None and isinstance(res.reply, dict):
                raw[res.cid] = res.reply  # the whole reply, before any fold
            yield res

    def spy(rnd, replies):
        captured[rnd] = {cid: {k: raw[cid][k] if isinstance(v, WeightedMean) and cid in raw else v
                               for k, v in reply.items()} for cid, reply in replies.items()}
        raw.clear()
        return original(rnd, replies)

    sim.server.aggregate_fit = spy
    sim.backend.execute_each = each
    try:
        sim.run()
    finally:
        sim.server.aggregate_fit = original
        sim.backend.execute_each = original_each
    return captured


class OneTrainerPerClient(SerialBackend):
    """One live trainer per client whatever the trainer declares (the legacy path): the reference a pooled run,
    which keeps only each client's declared state, must equal bit for bit. Pass it as ``backend=``."""

    def start(self, build_trainer, client_ids, state_options=None):
        super().start(lambda cid: build_trainer(cid), client_ids)  # no state options: never pooled


def metrics_records(run_dir: Path, drop: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` without wall-clock timings (keys containing "seconds") and without
    the keys containing any of ``drop``: what two runs that should agree are compared on."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if "seconds" not in k and not any(d in k for d in drop)}
            for line in lines]


def assert_pooled_matches_one_trainer_per_client(algorithm: str, overrides: Optional[Dict[str, Any]],
                                                  tmp_path: Path, sets: tuple = ()) -> Tuple[Simulation, Simulation]:
    """A tiny run pooled (only each client's declared state kept) gives the metrics records and final scores of the
    same run with one live trainer per client (in ``tmp_path/pooled``, ``/legacy``). Returns both simulations, for the
    plugin's own checks of the state its clients keep."""
    tmp_path = Path(tmp_path)
    pooled, a = tiny_run(algorithm, tmp_path / "pooled", overrides, sets)
    legacy, b = tiny_run(algorithm, tmp_path / "legacy", overrides, sets, backend=OneTrainerPerClient())
    assert pooled.backend.pool is not None and legacy.backend.pool is None
    assert metrics_records(tmp_path / "pooled") == metrics_records(tmp_path / "legacy") and a["final"] == b["final"]
    return pooled, legacy


def _assert_close(a: Any, b: Any, rtol: float, where: str) -> None:
    """Float tensors (nested in dicts/lists) within ``rtol`` of the larger magnitude; anything else equal."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, f"{where}: shapes {tuple(a.shape)} and " \
                                                                   f"{tuple(getattr(b, 'shape', ()))}"
        if not a.is_floating_point():
            assert torch.equal(a, b), f"{where}: differs"
            return
        scale = float(a.abs().max()) if a.numel() else 0.0
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        assert diff <= rtol * max(scale, 1e-12), f"{where}: batched and sequential differ by {diff:.3g} " \
                                                 f"(scale {scale:.3g}, rtol {rtol:g})"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} and {sorted(b)}"
        for k in a:
            _assert_close(a[k], b[k], rtol, f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} and {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, rtol, f"{where}[{i}]")
    elif isinstance(a, float):
        assert abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12), f"{where}: {a!r} and {b!r} (rtol {rtol:g})"


def assert_batched_matches_sequential(algorithm: str, overrides: Optional[Dict[str, Any]], tmp_path: Path,
                                      sets: tuple = (), rounds: int = 3, rtol: float = 1e-4,
                                      rounds_rtol: float = 0.01) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``clients.batched=on`` computes what one client at a time computes, for a plugin's tests.

    One round from the same start: every client's fit reply (uploads, counts, losses) within ``rtol`` of the
    larger magnitude (float rounding of a vectorised pass). ``rounds`` rounds: the final uniform and sample-weighted
    scores within ``rounds_rtol`` of each other (rounding can move a few test predictions). Fails when the plugin
    does not batch at all -- a batched check of a run that went sequential would prove nothing -- naming the reason
    ``fl show`` gives. Returns the two ``rounds``-round summaries (sequential, batched)."""
    tmp_path = Path(tmp_path)
    one = {**dict(overrides or {}), "rounds": 1}
    sims, replies = {}, {}
    for mode in ("off", "on"):
        sims[mode] = tiny_simulation(algorithm, tmp_path / f"one-{mode}", one, tuple(sets) + (f"clients.batched={mode}",))
        replies[mode] = run_capturing_replies(sims[mode])
    runner = sims["on"].backend.batched
    plan = sims["on"].batched_plan
    assert plan.batched and runner is not None and runner.groups_run > 0, \
        f"{algorithm} did not batch ({plan.reason}): nothing to compare"
    assert replies["off"].keys() == replies["on"].keys(), "batched and sequential rounds differ"
    for rnd, by_client in replies["off"].items():
        assert by_client.keys() == replies["on"][rnd].keys(), f"round {rnd}: other clients replied"
        for cid, reply in by_client.items():
            _assert_close(reply, replies["on"][rnd][cid], rtol, f"{algorithm} round {rnd} client {cid}")
    many = {**dict(overrides or {}), "rounds": rounds}
    _, seq = tiny_run(algorithm, tmp_path / "many-off", many, tuple(sets) + ("clients.batched=off",))
    _, bat = tiny_run(algorithm, tmp_path / "many-on", many, tuple(sets) + ("clients.batched=on",))
    assert bat["clients_batched"]["path"] == "batched", bat["clients_batched"]
    for key in ("uniform", "weighted"):
        a, b = seq["final"][key], bat["final"][key]
        assert abs(a - b) <= rounds_rtol * max(abs(a), abs(b), 1e-12), \
            f"{algorithm} after {rounds} rounds: final {key} {a:.6g} sequential, {b:.6g} batched (rtol {rounds_rtol:g})"
    return seq, bat


def assert_resume_matches_full_run(algorithm: str, overrides: Optional[Dict[str, Any]], tmp_path: Path,
                                   sets: tuple = (), stop_after: Optional[int] = None) -> None:
    """A tiny run stopped after ``stop_after`` rounds (default: one before the end) and resumed from its checkpoint
    reaches the summary and the metrics records of the same run made in one go (in ``tmp_path/full``, ``/part``)."""
    tmp_path = Path(tmp_path)
    _, full = tiny_run(algorithm, tmp_path / "full", overrides, sets)
    part = tiny_simulation(algorithm, tmp_path / "part", overrides, sets)
    rounds = int(part.cfg.rounds)
    part.run(stop_after=rounds - 1 if stop_after is None else stop_after)
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["rounds_completed"] == rounds and resumed["final"] == full["final"]
    assert metrics_records(tmp_path / "part") == metrics_records(tmp_path / "full")


def assert_one_line_error(args: Sequence[str], fragment: str, out_dir: Path, strict: bool = False) -> str:
    """``fl ARGS`` (in-process) is refused the way bad input must be: exit status 2, exactly one ``Error`` line, which
    contains ``fragment``, no traceback, and no run directory left in ``out_dir``. ``strict`` also requires that line
    to be all the output and ``out_dir`` to stay empty, files included. Returns the output."""
    from click.testing import CliRunner

    res = CliRunner().invoke(cli, list(args))
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1 and fragment in errors[0] and "Traceback" not in res.output, res.output
    assert not [p for p in Path(out_dir).iterdir() if p.is_dir()]  # a failed start leaves no run folder behind
    if strict:
        assert [ln for ln in res.output.splitlines() if ln.strip()] == errors, res.output
        assert not any(Path(out_dir).iterdir())
    return res.output


def assert_run_refused(algorithm: str, sets: Sequence[str], fragment: str, out_dir: Path,
                       strict: bool = False) -> str:
    """``fl run --plugin ALGORITHM --set output_dir=OUT_DIR --set rounds=1 --set S...`` is refused as
    :func:`assert_one_line_error` says."""
    args = ["run", "--plugin", algorithm, "--no-progress", "--set", f"output_dir={out_dir}", "--set", "rounds=1"]
    for s in sets:
        args += ["--set", s]
    return assert_one_line_error(args, fragment, out_dir, strict)


def run_in_own_session(cmd: Sequence[str], env: Optional[Dict[str, str]] = None,
                       timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a process group of its own; if it outlives ``timeout`` seconds the whole group (the workers it
    started too) is killed, so a test never leaves a process behind."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


# one thread, and rendezvous and collectives bounded in time, for multi-process test runs on 127.0.0.1
WORKER_ENV = {"OMP_NUM_THREADS": "1", "PFLKIT_RENDEZVOUS_TIMEOUT": "60", "PFLKIT_DIST_TIMEOUT": "120"}


def run_with_workers(cfg, workers: int, out_dir: Path, run_name: str, timeout: float = 300) -> Path:
    """Run the resolved config ``cfg`` with ``fl run --workers N`` (gloo on 127.0.0.1) in a subprocess, as
    :func:`run_in_own_session` does, with :data:`WORKER_ENV`; assert it succeeded and return its run directory,
    ``out_dir/run_name``."""
    out_dir = Path(out_dir)
    config = out_dir / f"{run_name}.config.json"
    config.write_text(json.dumps(to_plain(cfg)))
    cmd = [sys.executable, "-m", "pflkit.core.cli", "run", "--workers", str(workers), "--no-progress", "--config",
           str(config), "--set", f"output_dir={out_dir}", "--set", f"run_name={run_name}"]
    res = run_in_own_session(cmd, {**os.environ, **WORKER_ENV}, timeout)
    assert res.returncode == 0, res.stderr
    return out_dir / run_name


def assert_workers_match_serial(algorithm: str, overrides: Optional[Dict[str, Any]], tmp_path: Path,
                                sets: tuple = (), workers: int = 2) -> None:
    """A tiny run with ``--workers N`` gives the metrics records of the same run made serially."""
    tmp_path = Path(tmp_path)
    parallel = run_with_workers(tiny_config(algorithm, overrides, sets), workers, tmp_path, f"w{workers}")
    tiny_run(algorithm, tmp_path / "serial", overrides, sets)
    assert metrics_records(parallel) == metrics_records(tmp_path / "serial")


def fold_tolerance(states: Sequence[Dict[str, Any]]) -> float:
    """The bound within which streaming aggregation (core.api.fold: ``sum w_i x_i`` accumulated in float32, then
    divided) and the all-replies ``weighted_average`` (float32 accumulation of ``(w_i / W) x_i``) agree on K float32
    states, and within which either is the exact mean: each of K accumulation steps rounds once, so
    ``|a - b| <= (K + 1) * 2**-23 * max_i |x_i|`` elementwise (the ``+ 1``: the final rounding)."""
    import torch

    biggest = max((float(v.detach().abs().max()) for s in states for v in s.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()), default=0.0)
    return (len(states) + 1) * 2.0 ** -23 * biggest


def assert_streaming_matches_all_replies(algorithm: str, overrides: Optional[Dict[str, Any]], tmp_path: Path,
                                         sets: tuple = (), rounds: int = 1) -> None:
    """``algorithm``'s aggregator streams (it declares ``mean_fields``), and ``rounds`` tiny rounds folded as replies
    arrive leave the server state that the same rounds leave when the aggregator gets every upload at once, within
    :func:`fold_tolerance` of the uploads (in ``tmp_path/stream`` and ``/all``). Past one round the two runs may
    drift apart by more than one rounding, so keep ``rounds`` to what the strategy needs for one aggregation."""
    layer = deep_merge(dict(overrides or {}), {"rounds": rounds})
    streamed = tiny_simulation(algorithm, Path(tmp_path) / "stream", layer, sets)
    fields = streamed.comm.mean_fields
    assert fields, f"{algorithm}'s aggregator declares no mean_fields: it does not stream"
    whole = tiny_simulation(algorithm, Path(tmp_path) / "all", layer, sets)
    whole.comm.mean_fields = ()  # the all-replies path: the aggregator combines the uploads itself
    uploads: List[Dict[str, Any]] = []
    original_each = whole.backend.execute_each

    def each(calls, snapshot=False):
        for res in original_each(calls, snapshot):
            if res.error is None and isinstance(res.reply, dict):
                uploads.extend(res.reply[f] for f in fields if isinstance(res.reply.get(f), dict))
            yield res

    whole.backend.execute_each = each
    whole.run()
    streamed.run()
    assert uploads, f"{algorithm} uploaded no {', '.join(fields)} in {rounds} round(s): nothing was compared"
    tol = fold_tolerance(uploads)
    a, b = _flat_tensors(streamed.server.state_dict()), _flat_tensors(whole.server.state_dict())
    assert a.keys() == b.keys() and a, "the two servers hold different state"
    for key in a:
        diff = float((a[key].double() - b[key].double()).abs().max()) if a[key].numel() else 0.0
        assert diff <= tol, f"{algorithm}: server state {key} differs by {diff:.3g} > {tol:.3g}"


def _flat_tensors(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """Every floating tensor in a nested state (dicts, lists), by path."""
    import torch

    out: Dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out[prefix] = obj.detach()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat_tensors(v, f"{prefix}/{i}"))
    return out


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A one-process gloo group on 127.0.0.1 in this process, so the distributed backend's paths run in a test
    without spawning workers; destroyed on exit."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
