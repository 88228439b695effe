"""The step loop shared by RL and SFT: resume, steps, metrics, evaluation, checkpoints, signals.

`run_steps` calls `one_step(step, seed)` for step = start .. total_steps - 1, where `start` is
the latest checkpoint's step (0 for a fresh run) and `seed = step_seed(loop seed, step)`: data
order and randomness are pure functions of the step, so a resumed run repeats exactly what the
straight run would have done. After each step it logs metrics at `step + 1` (completed
steps; with the peak memory so far, `memory/*`), evaluates every `eval_every` steps
("dev/<name>"), saves when due (every `save_every`, at evaluations, at the end), and on
SIGTERM / SIGINT saves, waits for the save to land, and returns. With several processes, a
signal to any one of them stops all of them after the same step, with one checkpoint. A signal
that comes while the last step is being saved lets that save land and still counts as a stop,
so that what follows the loop does not start. A signal during an evaluation, to any process,
ends it at each episode's next turn on every process (`sage_jax.stopping`,
`multihost.asked_anywhere`): the step is saved without it and the loop stops, rather than
outlasting a scheduler's grace period. An evaluation that fails saves its step before the
error ends the loop: a rerun resumes after it. A run resumed at a step whose
evaluation was due and is not in its checkpoint (a signal stopped that step or its
evaluation, or its evaluation failed) makes it first, on the restored weights, and logs it at
that step: no point of the dev curve goes missing. A save that fails raises
`CheckpointSaveError` at the next save, or for the last one (at the end or at a stop) before
the loop returns: a run whose checkpoint did not land is never reported done or stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from typing import Callable, Mapping

import numpy as np
from flax import nnx

from sage_jax import multihost, stopping

from sage_jax.train.checkpoint import Checkpointer, PreemptionGuard
from sage_jax.train.metrics import MetricsConfig, MetricsWriter, memory_metrics
from sage_jax.train.step import Trainer

Evaluate = Callable[[int], Mapping[str, float]]
SyncParams = Callable[[nnx.State], None]


@dataclasses.dataclass
class LoopResult:
  """start_step: where this run began (after a resume); end_step: completed steps;
  preempted: stopped by a signal (a checkpoint was saved; end_step is total_steps when the
  signal came during the last save); history: metrics per step (first the restored step's
  evaluation, when this run made the one it was owed);
  stop_signal: the signal this process caught (None when another process's signal or a
  preemption notice stopped it), so that its command can exit as that signal asks."""

  start_step: int
  end_step: int
  preempted: bool
  history: list[dict[str, float]]
  stop_signal: int | None = None


def step_seed(seed: int, step: int) -> int:
  """A 32-bit seed for loop step `step`, independent across steps and seeds."""
  return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def restore_latest(trainer: Trainer, checkpointer: Checkpointer | None) -> int:
  """Loads the newest intact checkpoint into `trainer` (if there is one; damaged newer steps
  are moved aside); returns the step to continue from. With resuming off, checkpoints already
  in the directory are an error: the new run's steps would mix with them. Whether there is a
  checkpoint is process 0's word (`Checkpointer.latest_step`): a process that listed none on
  storage that lists differently from host to host would start afresh beside the others."""
  meta = _restore_newest(trainer, checkpointer)
  return 0 if meta is None else int(meta["step"])


def _restore_newest(trainer: Trainer, checkpointer: Checkpointer | None) -> dict | None:
  """`restore_latest`, returning the restored step's meta (None when there was none)."""
  latest = None if checkpointer is None else checkpointer.latest_step()
  if latest is None:
    return None
  if not checkpointer.config.resume:
    raise ValueError(f"{checkpointer.directory} holds checkpoints (latest step {latest}) and "
                     "resuming is off: a new run there would mix its steps with them. Use "
                     "another directory, or remove them to start over")
  trainer.state, meta = checkpointer.restore_newest_intact(trainer.release_state())
  logging.info("resumed from %s at step %d", checkpointer.directory, meta["step"])
  return meta


def run_steps(trainer: Trainer, one_step: Callable[[int, int], dict[str, float]], *,
              total_steps: int, seed: int = 0, eval_every: int = 0,
              evaluate: Evaluate | None = None, sync_params: SyncParams | None = None,
              checkpointer: Checkpointer | None = None,
              metrics: MetricsConfig = MetricsConfig(), description: str = "train",
              meta: Mapping[str, object] | None = None,
              on_step: Callable[[int, dict], None] | None = None) -> LoopResult:
  """Runs `one_step` until `total_steps` steps are done (see the module doc)."""
  restored = _restore_newest(trainer, checkpointer)
  start = 0 if restored is None else int(restored["step"])
  # A signal or a failed evaluation saved the restored step without the evaluation it was due.
  owed = (restored is not None and evaluate is not None and eval_every
          and start % eval_every == 0 and not restored.get("metrics"))
  if sync_params is not None:
    sync_params(trainer.params)
  writer = MetricsWriter(metrics, total_steps=total_steps, start_step=start,
                         description=description)
  history: list[dict[str, float]] = []
  step, preempted = start, False
  extra_meta = dict(meta or {})

  def evaluation(at: int) -> tuple[dict[str, float], float] | None:
    """The dev numbers of step `at` and the seconds they took, or None when a signal (on any
    process) ended the evaluation. Rates with an empty denominator are None, breakdowns nest.
    A failure is every process's (all_succeed)."""
    t = time.perf_counter()
    try:
      with stopping.stop_when(multihost.asked_anywhere(lambda: guard.requested)):
        dev = multihost.all_succeed(lambda: evaluate(at))
    except Exception:  # every process's: they agree on whether a signal caused it
      if not multihost.any_process(guard.requested):
        raise
      logging.warning("A signal ended the evaluation of step %d: the step is saved without "
                      "it, and a rerun makes it first", at)
      return None
    return ({f"dev/{k}": float(v) for k, v in dev.items() if isinstance(v, numbers.Real)},
            time.perf_counter() - t)

  with PreemptionGuard() as guard:
    try:
      if owed:  # a failure leaves the step as it is: the next rerun tries again
        done = evaluation(start)
        if done is not None:
          dev, seconds = done
          history.append(writer.write(start, {**dev, "time/eval_s": seconds}))
        preempted = done is None or multihost.any_process(guard.requested)
      while step < total_steps and not preempted:
        t0 = time.perf_counter()
        values = dict(one_step(step, step_seed(seed, step)))
        if sync_params is not None:
          t_sync = time.perf_counter()
          sync_params(trainer.params)
          values["time/sync_s"] = time.perf_counter() - t_sync
        step += 1
        if values.get("nonfinite_skipped"):
          logging.warning("step %d: a non-finite loss or gradient; that update was skipped "
                          "(parameters and optimiser state unchanged)", step)
        values["time/step_s"] = time.perf_counter() - t0
        values.update(memory_metrics())
        # Every process stops at the same step, whichever one was signalled; a stopped run
        # saves before anything else (a scheduler's grace period may not cover an evaluation).
        preempted = multihost.any_process(guard.requested)
        dev = {}
        if evaluate is not None and eval_every and step % eval_every == 0 and not preempted:
          try:
            done = evaluation(step)
          except Exception:  # every process's, and so is this save
            # The step's update is kept: a rerun evaluates it again and goes on after it,
            # instead of training it anew.
            if checkpointer is not None:
              checkpointer.save(step, trainer.state,
                                meta={**extra_meta, "step": step, "seed": seed})
            raise
          if done is None:  # saved below without its evaluation, which a rerun makes
            preempted = True
          else:
            dev, values["time/eval_s"] = done
            values.update(dev)
        values = writer.write(step, values)
        writer.progress(step, values)
        history.append(values)
        if on_step is not None:
          on_step(step, values)
        preempted = preempted or multihost.any_process(guard.requested)
        if checkpointer is not None and (checkpointer.should_save(step) or dev or preempted
                                         or step == total_steps):
          checkpointer.save(step, trainer.state,
                            meta={**extra_meta, "step": step, "seed": seed}, metrics=dev)
        if preempted:
          break
    finally:
      try:
        if checkpointer is not None:  # within the guard: a signal cannot cut the last save short
          checkpointer.wait()  # a failed last save raises here: the run has not finished
      finally:
        writer.close()
    if not preempted:  # a signal during the last step's save stops the run once it has landed
      preempted = multihost.any_process(guard.requested)
  return LoopResult(start_step=start, end_step=step, preempted=preempted, history=history,
                    stop_signal=guard.signal if preempted else None)
