"""A pool of AppWorld worker processes serving many episodes at once.

The workers are forks of one template process that starts AppWorld once (worker.py). Each
worker slot has one host thread that takes the next queued episode, runs its calls in order
on its worker, and replaces the worker (a new fork) when it faults. Calls return futures, so
the trainer's main thread (JAX) never blocks on AppWorld; `AsyncEpisode` wraps them for
asyncio:

  with EnvPool(config) as pool:
    async with pool.episode(task_id, experiment, library_code=code) as ep:
      output = await ep.execute("print(apis.supervisor.show_profile())")
      evaluation = await ep.evaluate()
    ep.result  # the episode's one EpisodeResult; pool.results holds them all

Multi-host: every host runs its own pool over its own share of episodes; nothing is shared
between pools but the data root, which no pool writes to: outputs go to
`config.outputs_root`, or to a temporary directory of the pool's own that it removes when
it closes.
"""

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import os
import queue
import shutil
import tempfile
import threading
from typing import Any

from sage_jax.envs.appworld import config as config_lib
from sage_jax.envs.appworld import data_root
from sage_jax.envs.appworld import process
from sage_jax.envs.appworld.results import EpisodeResult
from sage_jax.envs.appworld.results import EpisodeStart
from sage_jax.envs.appworld.results import Evaluation


def fault_observation(error: str) -> str:
  """What the agent reads when the environment itself failed under its code."""
  return (f"Execution failed. Traceback:\nEnvironmentError: {error}\n"
          "The environment was restarted and this episode has ended.")


def _check_no_memory(what: str, path: str) -> None:
  """AppWorld's evaluator takes any DB path containing "memory" for an in-memory DB."""
  if "memory" in path:
    raise ValueError(f"The {what} contains 'memory', which AppWorld reads as an in-memory "
                     f"database when it evaluates the saved world: {path}")


class EpisodeError(RuntimeError):
  """AppWorld refused a request (e.g. an unknown task id); the worker is fine."""


@dataclasses.dataclass
class _Command:
  op: str  # execute | evaluate | close
  payload: dict[str, Any]
  future: concurrent.futures.Future


@dataclasses.dataclass
class _StartJob:
  task_id: str
  experiment: str
  library_code: str | None
  future: concurrent.futures.Future


class Episode:
  """One task in one world. Methods return futures; calls run in submission order."""

  def __init__(self, pool: "EnvPool", task_id: str, experiment: str):
    self.task_id = task_id
    self.experiment = experiment
    self.start: EpisodeStart | None = None
    self.num_steps = 0
    self.task_completed = False
    self.error: str | None = None  # set once an environment fault has ended the episode
    # The worker's call records of the last executed block (`calltrace`); None when the
    # environment failed under it.
    self.last_trace: dict | None = None
    self.evaluation: Evaluation | None = None
    self.result: EpisodeResult | None = None
    self._pool = pool
    self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
    self._closing = False

  def _submit(self, op: str, **payload) -> concurrent.futures.Future:
    if self._closing:
      raise RuntimeError(f"Episode {self.task_id} ({self.experiment}) is closed.")
    future = concurrent.futures.Future()
    self._commands.put(_Command(op, payload, future))
    return future

  def execute(self, code: str) -> concurrent.futures.Future:
    """Runs agent code; resolves to AppWorld's output text (cut to max_output_chars)."""
    return self._submit("execute", code=code)

  def evaluate(self) -> concurrent.futures.Future:
    """Resolves to the Evaluation of the world as it is now."""
    return self._submit("evaluate")

  def close(self, evaluate: bool = True) -> concurrent.futures.Future:
    """Ends the episode (evaluating first unless done or told not to); resolves to its
    EpisodeResult, also appended to pool.results."""
    future = self._submit("close", evaluate=evaluate)
    self._closing = True
    return future


class AsyncEpisode:
  """asyncio face of an Episode: the same calls, awaited."""

  def __init__(self, episode: Episode):
    self.episode = episode

  def __getattr__(self, name: str) -> Any:  # start, error, result, num_steps, ...
    return getattr(self.episode, name)

  async def execute(self, code: str) -> str:
    return await asyncio.wrap_future(self.episode.execute(code))

  async def evaluate(self) -> Evaluation:
    return await asyncio.wrap_future(self.episode.evaluate())

  async def close(self, evaluate: bool = True) -> EpisodeResult:
    return await asyncio.wrap_future(self.episode.close(evaluate))


class _EpisodeContext:
  """`with` / `async with` around an episode: starts it, and always closes it."""

  def __init__(self, pool: "EnvPool", task_id: str, experiment: str, library_code: str | None):
    self._begin = lambda: pool.begin(task_id, experiment, library_code)
    self._episode: Episode | None = None

  def __enter__(self) -> Episode:
    self._episode = self._begin().result()
    return self._episode

  def __exit__(self, *exc_info) -> None:
    if not self._episode._closing:
      self._episode.close().result()

  async def __aenter__(self) -> AsyncEpisode:
    future = self._begin()
    try:
      self._episode = await asyncio.wrap_future(future)
    except asyncio.CancelledError:
      # Cancelled (a stop, a failed sibling) before the episode started: a start still
      # queued is dropped; one a worker has begun is closed once started, and waited for,
      # so that the episode is not live when the caller goes on (it may start it again).
      if not future.cancel():
        closed = concurrent.futures.Future()
        future.add_done_callback(lambda f: _close_started(f, closed))
        await asyncio.wrap_future(closed)
      raise
    return AsyncEpisode(self._episode)

  async def __aexit__(self, *exc_info) -> None:
    if not self._episode._closing:
      await asyncio.wrap_future(self._episode.close())


def _close_started(start: concurrent.futures.Future, closed: concurrent.futures.Future) -> None:
  """Closes the episode `start` resolved to (if it started), then resolves `closed`."""
  if start.cancelled() or start.exception() is not None:
    closed.set_result(None)
  else:
    start.result().close().add_done_callback(lambda _: closed.set_result(None))


class EnvPool:
  """N AppWorld worker processes; each serves one episode at a time."""

  def __init__(self, config: config_lib.EnvPoolConfig):
    self.config = config
    self.results: list[EpisodeResult] = []
    self.worker_restarts = 0
    self._jobs: queue.SimpleQueue[_StartJob | None] = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._live: dict[tuple[str, str], Episode | None] = {}  # None until started
    self._threads: list[threading.Thread] = []
    self._closed = False
    # This pool's own directory, removed at its close: its evaluations' scratch (a worker
    # killed mid-evaluation leaves its copy there), and its outputs unless configured.
    self._scratch: str | None = None
    self._template: process.WorkerTemplate | None = None  # what the workers are forked from
    self._template_lock = threading.Lock()
    self._start_thread: threading.Thread | None = None
    self._started: concurrent.futures.Future = concurrent.futures.Future()  # to self

  # --- lifecycle --------------------------------------------------------------------------

  def start(self) -> "EnvPool":
    """Checks every task's files, starts the workers' template and forks the workers from
    it; raises AppWorldDataError for a bad data root, SandboxError where agent code cannot
    be confined."""
    self.start_in_background()
    try:
      return self.wait_started()
    except BaseException:  # a Ctrl-C too: nothing of the pool may stay behind
      self.close()
      raise

  def start_in_background(self) -> "EnvPool":
    """`start`, returning once the task files are checked (AppWorldDataError now): the
    template and the workers start in a thread, so that the caller builds its model
    meanwhile (AppWorld takes seconds to start). `begin` waits for them; so does
    `wait_started`, which raises what failed. A pool already started is returned as it is."""
    if self._start_thread is not None:  # a failed start raises at `begin`, not here
      return self
    if self._closed:
      raise RuntimeError("The pool is closed.")
    cache = self.config.data_check_cache
    data_root.check_tasks(self.config.data_root(), cache and os.path.expanduser(cache))
    self._scratch = tempfile.mkdtemp(prefix="sage_jax_appworld_")
    atexit.register(self._remove_scratch)
    if self.config.outputs_root is None:
      self.config = dataclasses.replace(self.config, outputs_root=self._scratch)
    try:
      _check_no_memory("outputs_root", os.path.abspath(self.config.outputs_root))
      _check_no_memory("system's temporary directory", self._scratch)
    except BaseException:
      self.close()
      raise
    self._start_thread = threading.Thread(target=self._start_workers, daemon=True,
                                          name="appworld-start")
    self._start_thread.start()
    return self

  def wait_started(self) -> "EnvPool":
    """Waits for `start_in_background`'s workers; raises what kept them from starting (the
    pool is closed then)."""
    if self._start_thread is None:
      raise RuntimeError("The pool is not running: use `with EnvPool(config) as pool`.")
    return self._started.result()

  def _start_workers(self) -> None:
    try:
      self._template = process.WorkerTemplate(self.config, self._scratch)
      ready = [concurrent.futures.Future() for _ in range(self.config.num_workers)]
      for slot, future in enumerate(ready):
        thread = threading.Thread(target=self._serve, args=(slot, future), daemon=True,
                                  name=f"appworld-slot-{slot}")
        thread.start()
        self._threads.append(thread)
      errors = [f.exception() for f in ready]
      if any(errors):
        raise next(e for e in errors if e)
    except BaseException as e:  # noqa: BLE001 - raised where the pool is waited for
      self.close()
      self._started.set_exception(e)
      return
    protections = self._template.protections
    logging.info("AppWorld agent code runs confined: %s.", "; ".join(protections)
                 if protections else "NOT AT ALL (sandbox='off'; it can read the answers)")
    self._started.set_result(self)

  def close(self) -> None:
    """Stops taking episodes, lets live ones finish their queued calls, stops workers."""
    if self._closed:
      return
    self._closed = True
    if self._start_thread not in (None, threading.current_thread()):
      self._start_thread.join()  # its workers are then all in self._threads
    with self._lock:
      unclosed = [e for e in self._live.values() if e is not None and not e._closing]
    for episode in unclosed:  # their slots wait for a close; results still get recorded
      episode.close()
    for _ in self._threads:
      self._jobs.put(None)
    for thread in self._threads:
      thread.join()
    if self._template is not None:
      self._template.close()
    self._remove_scratch()

  @property
  def outputs_root(self) -> str | None:
    """Where AppWorld writes this pool's experiments (<outputs_root>/experiments)."""
    return self.config.outputs_root

  def _remove_scratch(self) -> None:
    if self._scratch is not None:
      shutil.rmtree(self._scratch, ignore_errors=True)
      atexit.unregister(self._remove_scratch)
      self._scratch = None

  def __enter__(self) -> "EnvPool":
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.close()

  # --- episodes ---------------------------------------------------------------------------

  def begin(self, task_id: str, experiment: str,
            library_code: str | None = None) -> concurrent.futures.Future:
    """Queues an episode; resolves to its started Episode once a worker is free.

    `library_code` (a skill library) runs in the world before the agent's first turn; its
    output is in Episode.start.library_output and a failure there does not end the
    episode. Two live episodes may not share (experiment, task_id): AppWorld would write
    both to the same output directory.
    """
    self.wait_started()  # raises what kept the workers from starting
    if self._closed:
      raise RuntimeError("The pool is closed.")
    _check_no_memory(f"experiment name {experiment!r}", experiment)
    key = (experiment, task_id)
    with self._lock:
      if key in self._live:
        raise ValueError(f"Episode {task_id} of experiment {experiment!r} is already live; "
                         "use a distinct experiment name per concurrent rollout.")
      self._live[key] = None
    future = concurrent.futures.Future()
    future.add_done_callback(lambda f: f.cancelled() and self._forget(key))
    self._jobs.put(_StartJob(task_id, experiment, library_code, future))
    return future

  def episode(self, task_id: str, experiment: str,
              library_code: str | None = None) -> _EpisodeContext:
    """`with pool.episode(...) as ep` (futures) or `async with` (awaitables)."""
    return _EpisodeContext(self, task_id, experiment, library_code)

  def _forget(self, key: tuple[str, str]) -> None:
    with self._lock:
      self._live.pop(key, None)

  # --- the slot threads -------------------------------------------------------------------

  def _fork(self, name: str) -> process.WorkerProcess:
    """A new worker, from a new template if the last one died (its workers died with it)."""
    with self._template_lock:
      if not self._template.alive:
        logging.warning("The AppWorld workers' template process died; starting a new one.")
        self._template.close()
        self._template = process.WorkerTemplate(self.config, self._scratch)
      template = self._template
    return process.WorkerProcess(template, self.config, name)

  def _spawn(self, slot: int) -> process.WorkerProcess | None:
    name = f"slot{slot}-{self.worker_restarts}"
    try:
      return self._fork(name)
    except Exception:  # noqa: BLE001 - the slot must keep serving (its episodes fail)
      logging.exception("Could not start AppWorld worker %s; its next episode fails.", name)
      return None

  def _serve(self, slot: int, ready: concurrent.futures.Future) -> None:
    try:
      worker = self._fork(f"slot{slot}")
    except Exception as e:  # noqa: BLE001 - reported to start()
      ready.set_exception(e)
      return
    ready.set_result(None)
    try:
      while (job := self._jobs.get()) is not None:
        if not job.future.set_running_or_notify_cancel():
          continue
        if worker is None or not worker.alive:
          worker = self._spawn(slot)
        try:
          self._run_episode(worker, job)
        except Exception as e:  # noqa: BLE001 - a slot thread must outlive any episode
          if not job.future.done():
            job.future.set_exception(e)
        finally:
          self._forget((job.experiment, job.task_id))
        if worker is not None and not worker.alive:
          with self._lock:
            self.worker_restarts += 1
          worker = self._spawn(slot)
    finally:
      if worker is not None:
        worker.kill()

  def _call(self, worker: process.WorkerProcess | None, episode: Episode, request: dict):
    """One worker call; on a fault, ends the episode and returns None."""
    if worker is None:
      episode.error = "no environment worker could be started"
      return None
    try:
      return worker.call(request, self.config.call_timeout_s)
    except process.WorkerFault as e:
      episode.error = str(e)
      return None

  def _run_episode(self, worker: process.WorkerProcess | None, job: _StartJob) -> None:
    episode = Episode(self, job.task_id, job.experiment)
    answer = self._call(worker, episode, {"op": "start", "task_id": job.task_id,
                                          "experiment": job.experiment,
                                          "library_code": job.library_code})
    if answer is not None and not answer["ok"]:
      job.future.set_exception(EpisodeError(f"Cannot start {job.task_id}: {answer['error']}"))
      return
    if answer is not None:
      answer.pop("ok")
      episode.start = EpisodeStart(**answer)
    with self._lock:
      self._live[(job.experiment, job.task_id)] = episode
    job.future.set_result(episode)
    while True:
      command = episode._commands.get()
      try:
        value = self._run_command(worker, episode, command)
      except Exception as e:  # noqa: BLE001 - delivered to the caller's future
        command.future.set_exception(e)
      else:
        command.future.set_result(value)
      if command.op == "close":
        return

  def _run_command(self, worker, episode: Episode, command: _Command):
    if command.op == "execute":
      episode.last_trace = None
      if episode.error is None:
        answer = self._call(worker, episode, {"op": "execute", **command.payload})
        # One way to count steps (see EpisodeResult.num_steps): whatever ran or faulted.
        episode.num_steps += answer is None or answer.get("executed", True)
        if answer is not None:
          if not answer["ok"]:
            raise EpisodeError(answer["error"])
          episode.task_completed = answer["task_completed"]
          episode.last_trace = answer["trace"]
          return answer["output"]
      return fault_observation(episode.error)
    if command.op == "evaluate":
      return self._evaluate(worker, episode)
    # close: always records the episode's one result
    if command.payload["evaluate"] and episode.evaluation is None and episode.error is None:
      try:
        self._evaluate(worker, episode)
      except EpisodeError as e:
        episode.error = f"evaluation failed: {e}"
    if worker is not None and worker.alive:
      answer = self._call(worker, episode, {"op": "close"})
      if answer is not None and not answer["ok"]:
        episode.error = episode.error or answer["error"]
      if answer is not None and answer.get("recycle"):
        worker.kill()  # bloated (e.g. by a memory bomb): the slot spawns a fresh one
    result = EpisodeResult(
      task_id=episode.task_id, experiment=episode.experiment,
      evaluation=episode.evaluation if episode.error is None else None,
      num_steps=episode.num_steps, task_completed=episode.task_completed,
      error=episode.error)
    episode.result = result
    with self._lock:
      self.results.append(result)
      # Before the caller learns of the close, so it may start the same task again at once.
      self._live.pop((episode.experiment, episode.task_id), None)
    return result

  def _evaluate(self, worker, episode: Episode) -> Evaluation:
    if episode.error is None:
      answer = self._call(worker, episode, {"op": "evaluate"})
      if answer is not None:
        if not answer["ok"]:
          raise EpisodeError(answer["error"])
        answer.pop("ok")
        episode.evaluation = Evaluation(
          failed_requirements=tuple(answer.pop("failed_requirements")), **answer)
        return episode.evaluation
    return Evaluation(success=False, num_passed=0, num_failed=0, error=episode.error)
