"""``engine.backend = "ray"``: the demo on Ray worker processes gives the simulator's results, survives a
killed worker, resumes on another number of workers, and refuses bad settings cleanly.

Every Ray instance here is started by :func:`decentdp.runtime.distributed.ray_backend.connect` with an empty
address: bound to 127.0.0.1, no dashboard, no usage statistics, HTTP probes sent to a closed loopback
port (see ``docs/distributed.md``); no test names another address.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decentdp.config import load_config
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.results.files import CHECKPOINT_FILE, PRIVACY_FILE

pytestmark = [pytest.mark.ray, pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                  reason="Ray is not installed (pip install 'decentdp[ray]')")]

DEMO = Path(__file__).resolve().parents[2] / "experiments" / "demo.toml"
QUIET = {"progress": False, "log": lambda line: None}


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for this module (runs attach to it instead of starting their own)."""
    from decentdp.runtime.distributed.ray_backend import connect

    ray, owned = connect("", workers=4)  # CPUs for 4 workers (the most a test starts)
    assert owned
    yield ray
    ray.shutdown()


def _demo(*overrides: str):
    return load_config(DEMO, overrides=list(overrides))


def _ledger_runs(folder: Path) -> list:
    """Each agent's release history from ``privacy.json``, with events spelled out (ids are per table)."""
    privacy = json.loads((folder / PRIVACY_FILE).read_text())
    ledger = privacy["ledger"]
    return [[[ledger["events"][event], count, first, last] for event, count, first, last in runs]
            for runs in ledger["agent_runs"]]


def _raylets() -> int:
    """Ray node processes running on this machine."""
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            count += entry.name.isdigit() and b"raylet" in (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
    return count


def test_a_local_instance_binds_loopback_only(local_ray) -> None:
    assert local_ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert {node["NodeManagerAddress"] for node in local_ray.nodes()} == {"127.0.0.1"}
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"


class _HeldRay:
    """A stand-in for a Ray instance a process already holds (or starts), bound where ``gcs`` and ``nodes`` say."""

    def __init__(self, gcs: str, nodes: list[str], initialized: bool = True) -> None:
        self.gcs, self.node_hosts, self.initialized, self.shut = gcs, nodes, initialized, False

    def is_initialized(self) -> bool:
        return self.initialized

    def get_runtime_context(self):  # noqa: ANN201
        return type("Context", (), {"gcs_address": self.gcs})()

    def nodes(self) -> list[dict[str, str]]:
        return [{"NodeManagerAddress": host} for host in self.node_hosts]

    def init(self, **kwargs) -> None:  # noqa: ANN003
        self.initialized = True

    def shutdown(self) -> None:
        self.shut = True


def test_a_held_instance_that_is_not_the_one_asked_for_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper's review: an empty engine.address (local, loopback only) silently ran on whatever Ray instance the
    process held, a cluster's included, and an explicit address was ignored the same way."""
    from decentdp.runtime.distributed import ray_backend

    cluster = _HeldRay("10.0.0.5:6379", ["10.0.0.5", "10.0.0.6"])
    monkeypatch.setattr(ray_backend, "import_ray", lambda local: cluster)
    with pytest.raises(ConfigError, match="already holds a Ray instance on 10.0.0.5, 10.0.0.6") as error:
        ray_backend.connect("", workers=2)
    assert error.value.field == "engine.address"
    with pytest.raises(ConfigError, match="already holds the Ray instance at 10.0.0.5:6379"):
        ray_backend._check_held_instance(cluster, "10.0.0.7:6379")  # (connect would first dial it)
    ray_backend._check_held_instance(cluster, "10.0.0.5:6379")  # the instance named: used
    ray_backend._check_held_instance(cluster, "auto")
    ray_backend._check_held_instance(_HeldRay("127.0.0.1:6379", ["127.0.0.1"]), "")  # a local one: used


def test_a_local_start_that_binds_outside_loopback_is_shut_down_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when first imported: imported earlier, a 'local' start
    bound the machine's outward address (a helper's measurement).  The run checks where it bound."""
    from decentdp.runtime.distributed import ray_backend

    outward = _HeldRay("10.9.9.9:34825", ["10.9.9.9"], initialized=False)
    monkeypatch.setattr(ray_backend, "import_ray", lambda local: outward)
    with pytest.raises(ConfigError, match="bound 10.9.9.9, not 127.0.0.1"):
        ray_backend.connect("", workers=2)
    assert outward.shut


def test_sigterm_exits_through_python_after_ray_replaced_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper's review: ray.init installs a SIGTERM handler of its own, so the library's (exit through Python's
    shutdown: Ray stopped, the results folder's lock released) was never installed, and SIGTERM aborted the run
    with a C++ stack dump (exit -6).  The library's handler replaces the one ray.init installed."""
    from decentdp.runtime.distributed import ray_backend

    class InstallsItsOwnHandler(_HeldRay):
        def init(self, **kwargs) -> None:  # noqa: ANN003
            super().init(**kwargs)
            signal.signal(signal.SIGTERM, lambda number, frame: None)  # as ray.init does

    monkeypatch.setattr(ray_backend, "import_ray", lambda local: InstallsItsOwnHandler("127.0.0.1:1", ["127.0.0.1"],
                                                                                       initialized=False))
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ray_backend.connect("", workers=2)
        assert signal.getsignal(signal.SIGTERM) is ray_backend._exit_through_shutdown
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_handler_set_before_ray_init_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """`decentdp run` stops a run on SIGTERM as on Ctrl-C (its own handler, set before the engine starts Ray):
    ray.init's replacement, kept there before, aborted such a run with a C++ stack dump instead."""
    from decentdp.runtime.distributed import ray_backend

    class InstallsItsOwnHandler(_HeldRay):
        def init(self, **kwargs) -> None:  # noqa: ANN003
            super().init(**kwargs)
            signal.signal(signal.SIGTERM, lambda number, frame: None)  # as ray.init does

    def commands_own(number: int, frame: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_backend, "import_ray", lambda local: InstallsItsOwnHandler("127.0.0.1:1", ["127.0.0.1"],
                                                                                       initialized=False))
    before = signal.signal(signal.SIGTERM, commands_own)
    try:
        ray_backend.connect("", workers=2)
        assert signal.getsignal(signal.SIGTERM) is commands_own
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_local_settings_replace_the_users_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from decentdp.runtime.distributed import ray_backend

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    ray_backend.import_ray(local=True)
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0" and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


DEMO_50 = ("experiment.rounds=50", "privacy.accountant=rdp")  # (RDP: a faster calibration; any accountant works)


@pytest.fixture(scope="module")
def simulated_demo(tmp_path_factory: pytest.TempPathFactory):
    """50 rounds of the demo in the simulator, and its results folder."""
    folder = tmp_path_factory.mktemp("simulator") / "out"
    return run_experiment(_demo(*DEMO_50), folder, **QUIET), folder


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_the_demo_on_ray_matches_the_simulator(local_ray, simulated_demo, tmp_path: Path, workers: int) -> None:
    """50 rounds of the demo: the same accuracy (1e-4), epsilon and ledgers exactly, models within 1e-5."""
    simulated, folder = simulated_demo
    sharded = run_experiment(_demo(*DEMO_50, "engine.backend=ray", f"engine.workers={workers}"), tmp_path / "ray",
                             **QUIET)
    assert abs(sharded.summary["accuracy_mean"] - simulated.summary["accuracy_mean"]) <= 1e-4
    assert sharded.summary["epsilon_max"] == simulated.summary["epsilon_max"]
    assert sharded.summary["epsilon_per_agent"] == simulated.summary["epsilon_per_agent"]
    assert _ledger_runs(tmp_path / "ray") == _ledger_runs(folder)
    for key, value in simulated.state.items():
        assert float((sharded.state[key] - value).abs().max()) <= 1e-5, key


@pytest.mark.parametrize("read_at_once", [False, True])
def test_a_killed_worker_restarts_from_the_last_checkpoint(local_ray, read_at_once: bool) -> None:
    """SIGKILL one worker after round 6 (last checkpoint: round 4): the run replays rounds 5-6 on fresh
    workers and ends as an uninterrupted run, every release counted once; the loss is announced in one line
    of ours.  ``read_at_once``: the state and the ledger are read right after the kill, before the next round
    (a helper's review: reads went straight to the dead worker and ended the run)."""
    from decentdp.runtime.distributed.ray_backend import distribute

    config = _demo("experiment.rounds=10", "experiment.eval_every=4", "engine.backend=ray", "engine.workers=2",
                   "privacy.accountant=rdp")
    reference = build_experiment(config)
    expected = reference.simulator.run(reference.simulator.setup(reference.initial_state()), 0, 10,
                                       lambda done, state: True)
    experiment = build_experiment(config)
    lines: list[str] = []
    engine = distribute(experiment.simulator, config.engine, config.experiment.checkpoint_interval, lines.append)
    killed: list[int] = []

    def after_round(done: int, state) -> bool:
        if done == 6:
            killed.append(engine.worker_pids()[1])
            os.kill(killed[0], signal.SIGKILL)
            if read_at_once:
                assert state["params"].shape[0] == 10 and experiment.ledger.releases().tolist() == [6] * 10
        return True

    state = engine.run(engine.setup(experiment.initial_state()), 0, 10, after_round)
    assert killed and engine.restarts == 1
    assert lines == ["Ray worker(s) 1 lost after round 6; replaying from the round-4 checkpoint on new workers "
                     "(restart 1 of at most 3)"]
    for key, value in expected.items():
        assert float((state[key] - value).abs().max()) <= 1e-5, key
    ledger = experiment.ledger
    assert ledger.releases().tolist() == reference.ledger.releases().tolist() == [10] * 10
    assert [ledger.history(i) for i in range(10)] == [reference.ledger.history(i) for i in range(10)]


def test_an_error_in_one_workers_code_ends_the_run_at_once(local_ray) -> None:
    """A helper's review: when one shard's algorithm code raised, its peer waited in a receive, failed the
    liveness call, counted as lost, and the run replayed the same error four times over five minutes before
    giving up with "workers were lost".  The error is raised at once, as the simulator raises it (its type and
    message, a note naming the round), the workers stopped, and no loss announced."""
    from decentdp.runtime.distributed.ray_backend import distribute

    config = _demo("experiment.rounds=4", "engine.backend=ray", "engine.workers=2", "privacy.accountant=rdp")
    experiment = build_experiment(config)
    algorithm = experiment.simulator.algorithm

    class FailingInTheSecondShard(type(algorithm)):  # (defined here: Ray sends the class by value)
        def round(self, state, ctx):  # noqa: ANN001, ANN202
            if ctx.round_index == 2 and 9 in ctx.network.agent_ids.tolist():
                raise FloatingPointError("agent 9's update overflowed")
            return super().round(state, ctx)

    algorithm.__class__ = FailingInTheSecondShard
    lines: list[str] = []
    engine = distribute(experiment.simulator, config.engine, config.experiment.checkpoint_interval, lines.append)
    with pytest.raises(FloatingPointError) as error:
        engine.run(engine.setup(experiment.initial_state()), 0, 4, lambda done, state: True)
    assert str(error.value) == "agent 9's update overflowed"
    assert error.value.__notes__[0].startswith("(raised by a Ray worker in round 2; the workers were stopped")
    assert 'raise FloatingPointError("agent 9' in error.value.__notes__[0]  # the worker's traceback
    assert lines == [] and engine.restarts == 0 and engine.workers == []


def _placement(workers: int) -> tuple[str, ...]:
    """Overrides that run on ``workers`` Ray workers (0: the simulator)."""
    return ("engine.backend=ray", f"engine.workers={workers}") if workers else ()


@pytest.mark.parametrize(("before", "after", "algorithm"), [(2, 1, "dp-dsgt"), (2, 0, "dp-dsgt"), (0, 2, "dp-dsgt"),
                                                        (2, 3, "top-dp")])
def test_a_run_resumes_on_another_number_of_workers(local_ray, tmp_path: Path, before: int, after: int,
                                                    algorithm: str) -> None:
    """Stopped after round 6 on ``before`` workers (0: the simulator), resumed on ``after``: the uninterrupted
    simulator's result, every release counted once (TOP-DP: its per-agent message state re-split too)."""
    common = ("experiment.rounds=12", "experiment.eval_every=3", "privacy.accountant=rdp",
              f"algorithm.name={algorithm}")
    whole = run_experiment(_demo(*common), tmp_path / "whole", **QUIET)
    run_experiment(_demo(*common, *_placement(before)), tmp_path / "split", stop_after=6, **QUIET)
    saved = torch.load(tmp_path / "split" / CHECKPOINT_FILE, weights_only=True)
    assert ("shards" in saved) == (before > 0) and ("state" in saved) == (before == 0)  # workers wrote the rows
    resumed = run_experiment(_demo(*common, *_placement(after)), tmp_path / "split", resume=True, **QUIET)
    assert (tmp_path / "split" / "shards").exists() == (after > 0)  # (a simulator's checkpoint names no shard files)
    assert resumed.summary["accuracy_mean"] == pytest.approx(whole.summary["accuracy_mean"], abs=1e-4)
    assert resumed.summary["epsilon_per_agent"] == whole.summary["epsilon_per_agent"]
    assert _ledger_runs(tmp_path / "split") == _ledger_runs(tmp_path / "whole")
    torch.testing.assert_close(resumed.state["params"], whole.state["params"], rtol=0, atol=1e-5)


def test_a_replicated_table_with_a_row_per_agent_survives_resumes(local_ray, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper's review: a resume told per-agent state entries by shape (one row per agent), so a replicated
    public table with 10 rows, in a run of 10 agents, was split over the workers on a Ray resume.  The
    checkpoints record the entries the shards found per-agent, and a resume splits by them: Ray -> Ray, then
    Ray -> simulator (whose checkpoint carries the record on) -> Ray."""
    from decentdp.experiment import loop

    def build(config, data_dir=None):  # noqa: ANN001, ANN202
        experiment = build_experiment(config, data_dir)
        algorithm = experiment.simulator.algorithm

        class WithAPublicTable(type(algorithm)):  # (defined here: Ray sends the class by value)
            def setup(self, state, ctx):  # noqa: ANN001, ANN202
                return {**super().setup(state, ctx), "table": torch.arange(10, dtype=torch.float32)}

            def round(self, state, ctx):  # noqa: ANN001, ANN202
                table = state["table"]
                assert table.shape == (10,), f"the replicated table has {table.shape[0]} rows in round " \
                                             f"{ctx.round_index}"
                return {**super().round({k: v for k, v in state.items() if k != "table"}, ctx), "table": table}

        algorithm.__class__ = WithAPublicTable
        return experiment

    monkeypatch.setattr(loop, "build_experiment", build)
    common = ("experiment.rounds=4", "experiment.eval_every=1", "privacy.accountant=rdp")
    folder = tmp_path / "out"
    run_experiment(_demo(*common, *_placement(2)), folder, stop_after=1, **QUIET)
    run_experiment(_demo(*common, *_placement(2)), folder, resume=True, stop_after=2, **QUIET)
    run_experiment(_demo(*common), folder, resume=True, stop_after=3, **QUIET)
    recorded = torch.load(folder / CHECKPOINT_FILE, weights_only=True)["per_agent"]  # the simulator's checkpoint
    assert "params" in recorded and "table" not in recorded
    resumed = run_experiment(_demo(*common, *_placement(2)), folder, resume=True, **QUIET)
    assert torch.equal(resumed.state["table"], torch.arange(10, dtype=torch.float32))


@pytest.mark.parametrize(("kill_after", "stop_after"), [(6, 8), (7, 7)])
def test_the_workers_checkpoint_survives_a_kill_and_resumes_on_four(local_ray, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   kill_after: int, stop_after: int) -> None:
    """With a results folder the workers write the checkpoints and ``checkpoint.pt`` only names their files.
    SIGKILL a worker after round ``kill_after`` (6: before the next round; 7: before the checkpoint of the
    round the run stops at): the fresh workers read round 4 back from the files and replay; stopped after
    ``stop_after`` and resumed on 4 workers, the run ends as the uninterrupted simulator's, every release
    counted once (``privacy.json``'s ledger)."""
    from decentdp.runtime.distributed import ray_backend

    engines: list = []

    class Recorded(ray_backend.RaySimulator):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(ray_backend, "RaySimulator", Recorded)
    common = ("experiment.rounds=12", "experiment.eval_every=1", "experiment.checkpoint_every=4",
              "privacy.accountant=rdp")
    whole = run_experiment(_demo(*common), tmp_path / "whole", **QUIET)
    killed: list[int] = []

    def kill(line: str) -> None:  # the runner logs each evaluation (every round here) before it checkpoints
        if line.startswith(f"round {kill_after:>5}/") and not killed:
            killed.append(engines[0].worker_pids()[1])
            os.kill(killed[0], signal.SIGKILL)

    folder = tmp_path / "ray"
    run_experiment(_demo(*common, *_placement(2)), folder, stop_after=stop_after, progress=False, log=kill)
    assert killed and engines[0].restarts == 1
    saved = torch.load(folder / CHECKPOINT_FILE, weights_only=True)
    assert saved["round"] == stop_after and "state" not in saved and "ledger" not in saved
    shards = saved["shards"]
    assert [entry["agents"] for entry in shards["files"]] == [[0, 5], [5, 10]]
    assert all((folder / shards["directory"] / entry["file"]).stat().st_size == entry["bytes"]
               for entry in shards["files"])
    kept = sorted(path.name for path in (folder / "shards").iterdir())
    assert len(kept) <= 2 and Path(shards["directory"]).name in kept  # older checkpoints' files removed
    assert not list((folder / "shards").rglob(".*.tmp"))

    resumed = run_experiment(_demo(*common, *_placement(4)), folder, resume=True, **QUIET)
    assert len(engines) == 2 and engines[1].restarts == 0
    assert _ledger_runs(folder) == _ledger_runs(tmp_path / "whole")
    assert resumed.summary["epsilon_per_agent"] == whole.summary["epsilon_per_agent"]
    torch.testing.assert_close(resumed.state["params"], whole.state["params"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("failed_round", "blocked_at"), [(0, 0), (4, 3)])
def test_a_shard_file_that_cannot_be_written_ends_the_run_with_one_message(local_ray, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          failed_round: int, blocked_at: int) -> None:
    """A review: a full disk while the workers wrote their shard files ended the run with a RuntimeError and the
    worker's traceback.  Worker 1 cannot write its file of round ``failed_round``'s checkpoint (a folder stands
    where its temporary file goes, made when round ``blocked_at`` is logged, after the checkpoint before it, which
    removes older folders): round 0's is written when the driver
    checkpoints (``write_shards``), round 4's as the workers' snapshot within the rounds.  The run ends with the
    checkpoint's one message naming the shard folder, which is removed (worker 0's file with it), and the run goes
    on: started again by the same command, or resumed from the round-2 checkpoint."""
    from types import SimpleNamespace

    from decentdp.runtime.distributed import ray_backend

    monkeypatch.setattr(ray_backend, "secrets", SimpleNamespace(token_hex=lambda size: "0badc0de"))
    folder = tmp_path / "run"
    shards = folder / "shards" / f"round-{failed_round:06d}-0badc0de"

    def block(line: str) -> None:  # the runner logs each evaluation before the round's shard files are written
        if line.startswith(f"round {blocked_at:>5}/"):
            (shards / ".shard-0001-of-0002.pt.tmp").mkdir(parents=True)

    config = _demo("experiment.rounds=6", "experiment.eval_every=1", "experiment.checkpoint_every=2",
                   "engine.backend=ray", "engine.workers=2", "privacy.accountant=rdp")
    with pytest.raises(ConfigError) as error:
        run_experiment(config, folder, progress=False, log=block)
    kept = "the previous checkpoint is kept: free space and continue with --resume" if failed_round else \
        "no checkpoint was written: free space and start again"
    assert str(error.value) == f"--out: cannot write the checkpoint of round {failed_round} in {shards} (Is a " \
                               f"directory); {kept}"
    assert not getattr(error.value, "__notes__", None) and not shards.exists()
    resumed = run_experiment(config, folder, resume=bool(failed_round), **QUIET)
    assert resumed.summary["finished"] and resumed.summary["rounds"] == 6


def test_an_unreachable_address_is_a_config_error(local_ray, tmp_path: Path) -> None:
    config = _demo("engine.backend=ray", "engine.address=127.0.0.1:1", "experiment.rounds=2",
                   "privacy.accountant=rdp")  # port 1 of this machine: nothing listens there
    with pytest.raises(ConfigError, match="engine.address: cannot reach a Ray cluster at '127.0.0.1:1'"):
        run_experiment(config, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decentdp.cli", "run", str(DEMO), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_the_cli_starts_and_stops_its_own_ray(local_ray, tmp_path: Path) -> None:
    """The interface line, on 2 rounds: its own local Ray instance, gone when the command ends; a bad
    worker count fails with one line naming the setting, and writes nothing."""
    before = _raylets()
    done = _cli("--set", "engine.backend=ray", "--set", "engine.workers=2", "--set", "experiment.rounds=2",
                "--set", "privacy.accountant=rdp", "--json", "--out", str(tmp_path / "ok"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["rounds"] == 2
    assert _raylets() == before
    refused = _cli("--set", "engine.backend=ray", "--set", "engine.workers=11", "--set", "privacy.accountant=rdp",
                   "--out", str(tmp_path / "bad"))
    assert refused.returncode != 0 and "engine.workers: 11 workers for 10 agent(s)" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "bad").exists()
    assert _raylets() == before
