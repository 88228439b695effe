"""Orbax checkpoints of the train state: async, keep last N + best on dev, atomic, resumable.

Layout under `CheckpointConfig.directory`:

  config.json              the run's config (written atomically at each start)
  <step>/state/            the TrainState (params, optimiser state, step, RNG), sharded arrays
  <step>/meta/             JSON: the loop's position (next step), seeds, dev metrics

`<step>` is the number of completed loop steps, so a run resumed from it continues at loop
step `<step>`. Orbax writes each checkpoint into a temporary directory and renames it when
every array is on disk (the atomic finalisation); a run killed mid-save leaves only a
temporary directory, which restore ignores and the next start removes.

Each finished step also gets `<step>/files.json`, the size of every file orbax wrote,
recorded once the step is finalised. A restore checks a step against it first, so that a
truncated or missing file is named (`CheckpointError`) before orbax reads anything; a
step that fails to read anyway is reported the same way. `restore_newest_intact` moves a
damaged step aside to `damaged/<step>` (never deletes it) and falls back to the newest step
that reads.

With several processes each reads its own part of a step, so a damaged file may fail one
process's read and not another's: the processes agree after each read (a failure on any is a
failure on all), take process 0's listing of the steps and its word on whether a step was
written whole, and list the steps again only once process 0 has moved the damaged ones aside.
Shared or eventually consistent storage (NFS, an object store) may also list the steps
differently from host to host: every listing that a decision rests on (whether to resume and
from where, whether a step is saved already, `all_steps`) is process 0's, shared, and orbax
deletes the steps that keep_last / keep_best let go on process 0 alone. Every process thus
resumes from the same step, and saves (or skips) the same steps.

A failed save (orbax writes in the background) raises `CheckpointSaveError`, naming the step,
at the next save or `wait` (the loops wait after their last save): a run whose last checkpoint
did not land fails, and nothing marks it finished.

The directory may be local or remote (`gs://...`: orbax writes the arrays through
tensorstore, the JSON files here go through `sage_jax.storage`). There a finished step is
marked by orbax's commit file instead of a rename, and a damaged step is moved aside by copy.

`PreemptionGuard` turns SIGTERM (and SIGINT) into a flag the loops poll after each step:
they save a checkpoint, wait for it, and return.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import warnings
from typing import Any, Callable, Literal, Mapping

import jax
from etils import epath
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from sage_jax import multihost, storage
from sage_jax.train.state import TrainState

CONFIG_FILE = "config.json"
FILES_RECORD = "files.json"  # inside each step: relative path -> size in bytes
DAMAGED_DIR = "damaged"  # damaged steps are moved here, not deleted


class CheckpointError(RuntimeError):
  """A checkpoint step cannot be read; the message names the step and the file."""

  def __init__(self, step: int, path: str, problem: str):
    super().__init__(f"checkpoint step {step} cannot be read: {path}: {problem}")
    self.step, self.path, self.problem = step, path, problem


class CheckpointSaveError(RuntimeError):
  """A checkpoint step was not saved; the message names the step, the file and the problem."""

  def __init__(self, step: int | None, path: str, problem: str):
    super().__init__(f"checkpoint step {step} was not saved: {path}: {problem}")
    self.step, self.path, self.problem = step, path, problem


# What the array store appends to its errors, which says nothing of what went wrong: its spec
# of the array, or orbax's "See full TensorStore details: <bound method ...>".
_STORE_DETAILS = re.compile(r"\s*(?:\[tensorstore_spec=|See full TensorStore details:).*", re.S)


def _problem(error: BaseException, directory: epath.Path) -> tuple[str | None, str]:
  """(the file under `directory` it names, what went wrong) for an error of orbax or
  tensorstore. Orbax raises its own error from tensorstore's ("Encountered error while reading
  array index ... See full TensorStore details: <bound method ...>" from 'OUT_OF_RANGE: Error
  reading "<array>" in OCDBT database at local file "<dir>": ...'): the first line of the
  innermost error of the chain that says something says what failed, and where."""
  chain = [error]
  while chain[-1].__cause__ is not None:
    chain.append(chain[-1].__cause__)
  for cause in reversed(chain):
    text = _STORE_DETAILS.sub("", str(cause).strip()).split("\n")[0].strip()
    if text:
      break
  else:
    text = type(error).__name__
  named = re.findall(re.escape(os.fspath(directory)) + r"[^\s\"':]*", text)
  return (named[-1] if named else None), text[:500]


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
  return not str(record.msg).startswith("Given directory is read only")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """directory: where checkpoints go ("" = no checkpoints). save_every: save after every
  this many loop steps (and after the last step, at eval steps, and on preemption).
  keep_last: most recent checkpoints kept. keep_best: checkpoints kept by the dev metric
  `best_metric` (higher is better for best_mode "max"), on top of the last ones.
  async_save: write in the background while training goes on. resume: continue from the
  latest checkpoint in `directory` when there is one. read_only: only read what is there
  (export, evaluation of a run that may still be training): no save, no deletion, no
  cleanup of an unfinished save's temporary directory, nothing written into the run; a
  `directory` that does not exist (as process 0 sees it) holds no steps."""

  directory: str = ""
  save_every: int = 100
  keep_last: int = 3
  keep_best: int = 1
  best_metric: str = "dev/tgc"
  best_mode: Literal["max", "min"] = "max"
  async_save: bool = True
  resume: bool = True
  read_only: bool = False

  def __post_init__(self):
    if self.save_every < 1 or self.keep_last < 1 or self.keep_best < 0:
      raise ValueError(f"{self}: save_every and keep_last must be >= 1, keep_best >= 0")
    if self.best_mode not in ("max", "min"):
      raise ValueError(f"best_mode={self.best_mode!r}; expected max or min")


def to_jsonable(value: Any) -> Any:
  """Dataclasses, ConfigDicts, tuples, numpy scalars -> plain JSON values."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if hasattr(value, "to_dict"):
    return to_jsonable(value.to_dict())
  if isinstance(value, Mapping):
    return {str(k): to_jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_jsonable(v) for v in value]
  if hasattr(value, "item") and callable(value.item):
    return value.item()
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return repr(value)


class _OrbaxLeftovers(logging.Filter):
  """Drops asyncio's reports of orbax's abandoned reads: "... exception was never retrieved"
  (tasks name orbax's coroutines; bare futures carry the read's tensorstore error, and only
  orbax reads through tensorstore here) and callbacks into its closed event loop."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    error = record.exc_info[1] if record.exc_info else None
    closed_loop = "Event loop is closed" in message or (
        isinstance(error, RuntimeError) and str(error) == "Event loop is closed")
    return not (closed_loop or ("was never retrieved" in message and (
        "orbax" in message or "tensorstore_spec" in message or _raised_in_orbax(error))))


def _raised_in_orbax(error: BaseException | None) -> bool:
  tb = error.__traceback__ if error is not None else None
  while tb is not None:
    if "orbax" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _quiet_orbax_leftovers() -> None:
  """A failed read or save leaves orbax's other reads or writes behind, and they report
  themselves as they finish or are collected, during and long after it: dozens of tracebacks
  that bury the CheckpointError (unretrieved task exceptions, unawaited coroutines, callbacks
  into its closed event loop: "Event loop is closed"). Those, and only those, are dropped from
  the first Checkpointer on."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_orbax_leftovers", False):
    return
  logging.getLogger("asyncio").addFilter(_OrbaxLeftovers())
  warnings.filterwarnings("ignore", message=r"coroutine '_read_array\w*' was never awaited")

  def hook(unraisable):
    error, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
    closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    if not (closed_loop or (code is not None and "orbax" in code.co_filename)):
      previous(unraisable)

  hook.drops_orbax_leftovers = True
  sys.unraisablehook = hook


def _read_item(handler: ocp.CheckpointHandler, directory: epath.Path,
               args: ocp.args.CheckpointArgs) -> Any:
  """One item of a step, read by this process alone. Not through orbax's Checkpointer, whose
  restore ends in a barrier of every process: a process whose read failed would never reach
  it, and the others would wait there, or pass it with a later read of another step."""
  try:
    return handler.restore(directory, args=args)
  finally:
    handler.close()


@dataclasses.dataclass(kw_only=True)
class _BestByMetric(cm.BestN):
  """BestN over the steps whose metrics hold `metric`. A step saved under another best_metric
  (checkpoint.* may change on resume) has none to rank it by: it ranks below all of them,
  never kept as the best, instead of failing every save with its missing key."""

  metric: str

  def should_preserve(self, checkpoints, *, context):
    ranked = [c if self.metric in (c.metrics or {}) else dataclasses.replace(c, metrics=None)
              for c in checkpoints]
    return super().should_preserve(ranked, context=context)


class Checkpointer:
  """Saves and restores TrainStates with orbax's CheckpointManager (see the module doc)."""

  def __init__(self, config: CheckpointConfig, run_config: Any = None):
    if not config.directory:
      raise ValueError("CheckpointConfig.directory is empty")
    _quiet_orbax_leftovers()
    self.config = config
    self.directory = storage.path(config.directory)
    self._unrecorded: set[int] = set()  # steps saved here whose files.json is not written
    self._saving: int | None = None  # the step of the save started last
    if config.read_only:
      if run_config is not None:
        raise ValueError("a read-only Checkpointer writes no run config")
      # Orbax's read-only manager (create=False) neither creates a missing directory nor
      # raises: each process checks that it exists and lists no step there.
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                             cleanup_tmp_directories=False)
      # Orbax warns that the directory "is read only" whenever a reader opens it: the run
      # opens one at each stage's start, and the warning reads as a storage problem.
      absl_logger = logging.getLogger("absl")
      absl_logger.addFilter(_drop_read_only_notice)
      try:
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))
      finally:
        absl_logger.removeFilter(_drop_read_only_notice)
      return
    if run_config is not None and jax.process_index() == 0:
      storage.write_json(self.directory / CONFIG_FILE, to_jsonable(run_config), sort_keys=True)
    policies = [cm.LatestN(n=config.keep_last)]
    metric = lambda m: m[config.best_metric]
    if config.keep_best:
      policies.append(_BestByMetric(metric=config.best_metric, get_metric_fn=metric,
                                    n=config.keep_best, reverse=config.best_mode == "min",
                                    keep_checkpoints_without_metrics=False))
    # With best_fn orbax also stores each step's metrics beside it, which it reads back when
    # the run restarts: without them the best step had none then, and BestN let it go.
    best = {"best_fn": metric, "best_mode": config.best_mode} if config.keep_best else {}
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=config.async_save,
        preservation_policy=cm.AnyPreservationPolicy(policies),
        cleanup_tmp_directories=True, create=True, **best)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))

  # --- Queries ----------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """The finished steps as process 0 lists them, on every process (a collective: every
    process calls it, in the same order; see the module doc); none in a directory that does
    not exist."""
    return multihost.from_lead(lambda: sorted(self._manager.all_steps()))

  def latest_step(self) -> int | None:
    """The newest of `all_steps` (None if there is none); a collective too."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The kept checkpoint with the best dev metric (None if none has one)."""
    best = None
    for step in self.all_steps():
      value = (self.read_meta(step).get("metrics") or {}).get(self.config.best_metric)
      if value is None:
        continue
      better = best is None or (value > best[1] if self.config.best_mode == "max"
                                else value < best[1])
      if better:
        best = (step, value)
    return None if best is None else best[0]

  def step_directory(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def _record_files(self) -> None:
    """Writes files.json into every finalised step this Checkpointer saved (process 0 only):
    a step found without one was written elsewhere, and what its files are now may not be
    what was written."""
    if jax.process_index() != 0 or self.config.read_only:
      return
    for step in sorted(self._unrecorded & set(self._manager.all_steps())):
      root = self.step_directory(step)
      if root.is_dir():
        storage.write_json(root / FILES_RECORD, storage.file_sizes(root), sort_keys=True)
      self._unrecorded.discard(step)

  def check_step(self, step: int) -> None:
    """Raises CheckpointError naming the first file of `step` that is missing or whose size
    differs from the record (a step written before records existed is not checked)."""
    root = self.step_directory(step)
    try:
      sizes = json.loads((root / FILES_RECORD).read_text())
    except FileNotFoundError:
      return
    except (OSError, ValueError) as e:
      raise CheckpointError(step, str(root / FILES_RECORD), f"unreadable ({e})") from e
    for relative, size in sorted(sizes.items()):
      path = root / relative
      if not path.exists():
        raise CheckpointError(step, str(path), "missing")
      actual = path.stat().length
      if actual != size:
        raise CheckpointError(step, str(path), f"{actual} bytes, {size} when it was written"
                              + (" (truncated)" if actual < size else ""))

  def should_save(self, step: int) -> bool:
    return step % self.config.save_every == 0

  # --- Save / restore ---------------------------------------------------------------------

  def save(self, step: int, state: TrainState, meta: Mapping[str, Any] | None = None,
           metrics: Mapping[str, float] | None = None) -> bool:
    """Starts saving `state` as checkpoint `step` (async unless configured otherwise).

    `metrics`: dev metrics of this step (they rank the best-N policy); they are also stored
    in the meta JSON. Returns False if the step already exists.
    """
    if self.config.read_only:
      raise ValueError(f"{self.directory}: opened read-only, so step {step} cannot be saved")
    if self._saved_already(step):
      return False
    # The previous save is long done by now (save_every steps ago): its failure is raised
    # here, or its files recorded.
    self.wait()
    meta = dict(to_jsonable(meta or {}))
    metrics = {k: float(v) for k, v in (metrics or {}).items()}
    meta["metrics"] = metrics
    ranked = metrics if self.config.best_metric in metrics else None
    self._saving = step
    try:
      self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       meta=ocp.args.JsonSave(meta)),
                         metrics=ranked, force=True)
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
      raise self._save_error(e) from e
    self._unrecorded.add(step)
    return True

  def _saved_already(self, step: int) -> bool:
    """Whether `step` is saved, in process 0's listing. Orbax's save refuses a step that this
    process's own listing holds, once the others have begun saving it (they would wait for
    this one): a process that lists a step that process 0 does not lists again, and if one
    still does, every process raises CheckpointSaveError."""
    listed = multihost.allgather_objects(step in self._manager.all_steps())
    if listed[0] or not any(listed):
      return listed[0]
    if listed[jax.process_index()]:
      self._manager.reload()
    still = [i for i, seen in enumerate(multihost.allgather_objects(
        step in self._manager.all_steps())) if seen]
    if still:
      raise CheckpointSaveError(step, str(self.step_directory(step)), (
          f"process(es) {still} list it there and process 0 does not (the hosts see "
          "different steps): saving it would replace it on some and not on others"))
    return False

  def _save_error(self, error: Exception) -> CheckpointSaveError:
    path, problem = _problem(error, self.directory)
    return CheckpointSaveError(self._saving, path or str(self.directory), problem)

  def read_meta(self, step: int) -> dict:
    restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(restored.meta)

  def restore(self, abstract_state: TrainState, step: int | None = None
              ) -> tuple[TrainState, dict]:
    """Restores checkpoint `step` (default the latest) into the shapes, dtypes and shardings
    of `abstract_state` (e.g. `Trainer.abstract_state()`); returns (state, meta)."""
    step = self._known_step(step)
    return self._read(step, lambda root: (
        _read_item(ocp.StandardCheckpointHandler(), root / "state",
                   ocp.args.StandardRestore(abstract_state)),
        dict(_read_item(ocp.JsonCheckpointHandler(), root / "meta", ocp.args.JsonRestore()))))

  def restore_params(self, abstract_params: Any, step: int | None = None) -> Any:
    """Only the parameters of checkpoint `step` (default the latest), in the shapes, dtypes
    and shardings of `abstract_params`: the optimiser state is not read (a finished stage's
    model taken up by the next one)."""
    step = self._known_step(step)
    item = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(item))
    return self._read(step, lambda root: _read_item(ocp.PyTreeCheckpointHandler(),
                                                    root / "state", args))["params"]

  def _known_step(self, step: int | None) -> int:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    return step

  def _read(self, step: int, read: Callable[[epath.Path], Any]) -> Any:
    """`read(step directory)` after `check_step`, by every process; then the processes agree:
    a problem on any one is raised on all (CheckpointError), so that they fall back to another
    step, or fail, together."""
    root, value, error = self.step_directory(step), None, None
    try:
      self.check_step(step)
      value = read(root)
    except CheckpointError as e:
      error = e
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
      path, problem = _problem(e, self.directory)
      error = CheckpointError(step, path or str(root), problem)
      error.__cause__ = e
    problems = multihost.allgather_objects(None if error is None else (error.path, error.problem))
    if error is not None:
      raise error
    for process, problem in enumerate(problems):
      if problem is not None:
        path, text = problem
        raise CheckpointError(step, path, f"{text} (read by process {process})")
    return value

  def restore_newest_intact(self, abstract_state: TrainState) -> tuple[TrainState, dict] | None:
    """Restores the newest step that reads; the damaged newer ones are then moved to
    damaged/<step> and the fallback is logged in one line. A step whose files are all there
    as they were written (its files.json says so) is not damaged: its read error (a storage
    outage, a config that no longer fits) is raised, with nothing moved. None when there is
    no checkpoint; CheckpointError, with nothing moved, when no step reads. Every process
    takes the same decisions (see the module doc)."""
    damaged: list[CheckpointError] = []
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(abstract_state, step)
      except CheckpointError as e:
        if multihost.from_lead(lambda: self._recorded_intact(step)):
          older = [s for s in self.all_steps() if s < step]
          if not older:
            raise
          raise CheckpointError(e.step, e.path, (
              f"{e.problem}. Its files are all there at their sizes, so it is not taken for "
              f"damaged; if their contents are (a read error such as a failed decompression), "
              f"move {self.step_directory(step)} aside to resume from step {older[-1]}")) from e
        damaged.append(e)
        continue
      if damaged:
        moved = self._move_aside([e.step for e in damaged])
        logging.warning("%s; resuming from step %d instead.", "; ".join(
            f"{e}; moved to {aside}" for e, aside in zip(damaged, moved)), step)
      return state, meta
    if damaged:
      raise CheckpointError(damaged[-1].step, str(self.directory),
                            "no step reads: " + "; ".join(map(str, damaged)))
    return None

  def _recorded_intact(self, step: int) -> bool:
    """Whether `step` has a files.json and every file it lists is there at its size."""
    if not (self.step_directory(step) / FILES_RECORD).exists():
      return False
    try:
      self.check_step(step)
    except CheckpointError:
      return False
    return True

  def _move_aside(self, steps: list[int]) -> list[str]:
    """Moves `steps` to damaged/<step> (process 0), then every process lists the steps
    again: not before the moves are done (`from_lead` waits for them), or a process would
    still see a moved step, skip saving that step anew, and leave the others waiting in the
    save. Returns where each step went."""
    moved = multihost.from_lead(lambda: [str(self._move_step_aside(step)) for step in steps])
    self._manager.reload()
    return moved

  def _move_step_aside(self, step: int) -> epath.Path:
    aside = base = self.directory / DAMAGED_DIR / str(step)
    n = 1
    while aside.exists():  # that step was damaged before
      aside, n = base.with_name(f"{step}.{n}"), n + 1
    source = self.step_directory(step)
    if storage.is_remote(aside):  # an object store has no directories to rename
      storage.copy_tree(source, aside)
      source.rmtree()
    else:
      aside.parent.mkdir(parents=True, exist_ok=True)
      source.rename(aside)
    return aside

  def wait(self) -> None:
    """Blocks until every started save is finalised; raises CheckpointSaveError if the last
    one failed (once: orbax reports a failure to the first wait only)."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
      raise self._save_error(e) from e
    self._record_files()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()


class PreemptionGuard:
  """Within the `with` block, SIGTERM / SIGINT set `requested` instead of killing the process.

  A second signal of the same kind restores the default behaviour (a stuck save can still be
  interrupted). Outside the main thread, signals cannot be caught and the guard is inert.
  """

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    self._signals = signals
    self._previous: dict[int, Any] = {}
    self.requested = False
    self.signal: int | None = None

  def _handle(self, signum, frame):
    del frame
    if self.requested:  # second signal: give up on a graceful exit
      signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
      os.kill(os.getpid(), signum)
      return
    logging.warning("signal %d: saving a checkpoint and stopping after this step", signum)
    self.requested, self.signal = True, signum

  def __enter__(self) -> "PreemptionGuard":
    if threading.current_thread() is threading.main_thread():
      for s in self._signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()
