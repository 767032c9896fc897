"""Shared test helpers: the example GPT on sys.path, a tiny model factory, TensorBoard readers."""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import sys
from typing import Any

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per test worker: the workers share the machine's cores (``-n 2`` on 2 cores)
    import torch

    torch.set_num_threads(1)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in a fresh folder of its own: what a run given no ``default_root_dir`` writes into the working
    directory (``alerts.jsonl``, ``lightning_logs/``, checkpoints) stays out of the checkout and out of other tests."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


_LINK_FOLDERS: list[str] = []


@atexit.register
def _remove_link_folders() -> None:
    for folder in _LINK_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


def tb_event_accumulator(logdir: str) -> Any:
    """An EventAccumulator over the (single) run in ``logdir``, loaded with every scalar and tensor."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)
    assert files, f"no TensorBoard event file under {logdir}"
    folder = os.path.dirname(files[0])
    ea = EventAccumulator(_in_written_order(folder), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    ea.Reload()
    return ea


def _in_written_order(folder: str) -> str:
    """``folder``, or where it holds several event files, a folder of links to them named in the order they were written
    (TensorBoard reads a folder's files in the order of their names: within one second, one process's writer 10 came
    before its writer 9, and a Trainer's second fit, which opens a writer of its own, was read as the first)."""
    import tempfile

    names = [n for n in os.listdir(folder) if n.startswith("events.out.tfevents.")]
    if len(names) < 2:
        return folder

    def written(name: str) -> tuple[int, int, str]:
        parts = name.split(".")
        return (int(parts[3]) if parts[3].isdigit() else 0, int(parts[-1]) if parts[-1].isdigit() else 0, name)

    links = tempfile.mkdtemp(prefix="tb-ordered-")
    _LINK_FOLDERS.append(links)  # removed when the test process ends
    for i, name in enumerate(sorted(names, key=written)):
        os.symlink(os.path.join(folder, name), os.path.join(links, f"events.out.tfevents.{i:06d}.ordered"))
    return links


def tb_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value), ...]`` read back from the TensorBoard event files in ``logdir``."""
    ea = tb_event_accumulator(logdir)
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def tb_texts(logdir: str) -> dict[str, list[tuple[int, str]]]:
    """``tag -> [(step, markdown), ...]`` of the Text tab."""
    ea = tb_event_accumulator(logdir)
    out: dict[str, list[tuple[int, str]]] = {}
    for tag in ea.Tags()["tensors"]:
        events = ea.Tensors(tag)
        out[tag] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events if e.tensor_proto.string_val]
    return out


def digits_subset(n: int = 1200) -> tuple[Any, Any]:
    """scikit-learn's digits as float inputs in [0, 1] and labels, ``n`` of them in a fixed random order (the guard's
    digits runs)."""
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(123))[:n]
    return x[perm], y[perm]


@pytest.fixture
def tiny_gpt():
    """Factory of a tiny example GPT LightningModule and its loader (fast on CPU)."""
    from gpt import GPTModule, make_loader

    def make(batch_size: int = 8, n_samples: int = 2048, **kwargs: Any):
        config = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32, **kwargs.pop("config", {})}
        module = GPTModule(config, **kwargs)
        loader = make_loader("prose", block_size=config["block_size"], batch_size=batch_size, n_samples=n_samples)
        return module, loader

    return make


def fit_ddp_spawn(trainer: Any, *args: Any, **kwargs: Any) -> None:
    """``trainer.fit`` under ``ddp_spawn``, with the gloo group destroyed before each rank's interpreter exits.

    On our 2-core test machine a spawned gloo rank occasionally died with SIGABRT ("terminate called without
    an active exception") in interpreter shutdown, after ``fit`` and ``on_train_end`` had completed: in the
    GradES DDP test, and in the noise-scale DDP test while it used a DDP communication hook (a plain DDP
    model without our callbacks did not abort in 15 runs). Not reproduced since: 0 aborts in 40+ spawned
    2-rank runs with the whole suite, GradES freezing, and the noise scale's communication hook attached
    (the cause is not found). The DDP tests judge the results every rank writes in
    ``on_train_end`` and fail if a rank did not get that far; any failure other than a SIGABRT is re-raised.

    Since the gloo group is destroyed while the interpreter is alive (:class:`_DestroyGlooGroupAtExit`), no
    abort was seen in 64 more spawned runs, so an abort now fails the test like any other error. One was seen
    since, in a run of the slow tests beside other heavy work on the same 2 cores (rank 1 of
    ``test_per_example_noise_scale_under_manual_optimization_ddp``; it passed when run again). With
    ``LIGHTNING_MONITOR_TOLERATE_DDP_EXIT_ABORT=1`` a SIGABRT at exit is tolerated instead: counted in
    ``fit_ddp_spawn.aborts`` and reported as a warning *and* on stderr, so it shows in any log.
    """
    import warnings

    from torch.multiprocessing.spawn import ProcessExitedException

    if not any(isinstance(c, _DestroyGlooGroupAtExit) for c in trainer.callbacks):
        trainer.callbacks.append(_DestroyGlooGroupAtExit())
    try:
        trainer.fit(*args, **kwargs)
    except ProcessExitedException as err:
        if err.signal_name != "SIGABRT" or os.environ.get("LIGHTNING_MONITOR_TOLERATE_DDP_EXIT_ABORT") != "1":
            raise
        fit_ddp_spawn.aborts.append(f"rank {err.error_index} (pid {err.pid}): {err}")
        message = (
            f"SPAWNED DDP RANK ABORTED AT PROCESS EXIT after training (abort #{len(fit_ddp_spawn.aborts)} in this "
            f"session): {err}"
        )
        print(message, file=sys.stderr, flush=True)
        warnings.warn(message)


fit_ddp_spawn.aborts = []  # type: ignore[attr-defined]


from lightning.pytorch.callbacks import Callback as _Callback  # noqa: E402


class _DestroyGlooGroupAtExit(_Callback):
    """In each spawned rank: destroy the process group at interpreter exit, while the interpreter is alive.

    Lightning registers ``destroy_process_group`` at exit for NCCL only, so a gloo group is torn down during
    interpreter finalization, and Gloo's worker threads may still hold work objects (the communication
    hook's futures and their Python callbacks, tensors) whose destruction then takes the GIL of a dying
    interpreter: SIGABRT (the suspected cause of the exit aborts, see pytorch/pytorch PR #179291). A
    mitigation: the abort was not reproduced here, so it is not proven to be the cause.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        import atexit

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            atexit.register(_destroy_process_group_if_initialized)


def _destroy_process_group_if_initialized() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the slow set
# Tests that start other processes: the demo and the CLI as subprocesses, the sharded (FSDP2) jobs, the SIGKILL
# resume, every DDP spawn (2 gloo ranks), the compiled model and every order of the five callbacks. The
# README's test command runs the rest (`-m "not slow" -n 2`, about 2 minutes on 2 cores); CI (`.ci/run`) runs both.
_SLOW_FILES = ("test_demo.py", "test_sharded.py", "test_resume_alerts.py", "test_compile.py", "test_permutations.py",
               "test_noise_scale_ddp_accumulation.py")
_SLOW_TESTS = ("test_cli.py::test_example_yaml_trains_with_a_short_name_added",
               "test_cli.py::test_short_names_resolve_when_lightning_is_imported_after_the_package")


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    for item in items:
        path = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        name = item.nodeid.rsplit("/", 1)[-1]
        if path in _SLOW_FILES or name.split("[")[0] in _SLOW_TESTS or "ddp" in item.name.lower():
            item.add_marker(pytest.mark.slow)
