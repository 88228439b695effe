"""Resume: 6 RL steps straight vs 3 steps + a signal + resume + 3 steps give identical params,
metrics and logs (same data order and RNG); a damaged newest step falls back to the newest
intact one, with the same result."""

import logging
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from sage_jax import stopping
from sage_jax.model import get_preset, init_model
from sage_jax.rl import batch as B
from sage_jax.rl import grpo
from sage_jax.sampler import Engine, EngineConfig
from sage_jax.train import checkpoint as ckpt
from sage_jax.train import loop
from sage_jax.train import rl_loop
from sage_jax.train.metrics import MetricsConfig, read_jsonl
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.synthetic import SyntheticTask, SyntheticTaskConfig

VOCAB = 16
TASK = SyntheticTaskConfig(vocab_size=VOCAB, task="fixed", num_prompts=2, group_size=4,
                           max_new_tokens=4)
GRPO = grpo.GRPOConfig(num_mini_batches=2)  # exercises the seeded mini-batch shuffle too
BATCH = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(8, 16))
OPTIM = OptimizerConfig(learning_rate=3e-3, warmup_steps=2, schedule="cosine", decay_steps=6)


def _run(directory, total_steps=6, init_seed=0, on_step=None, save_every=100):
  model = init_model(get_preset("tiny").replace(vocab_size=VOCAB), seed=init_seed)
  engine = Engine(model, EngineConfig(num_slots=8, max_len=16, prefill_buckets=(4,),
                                      min_attend=16, steps_per_call=4, max_top_k=4),
                  eos_ids=[VOCAB - 1])
  task = SyntheticTask(engine, TASK)
  trainer = rl_loop.grpo_trainer(model, GRPO, OPTIM)
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory),
                                                 save_every=save_every),
                            run_config={"task": TASK, "grpo": GRPO})
  result = rl_loop.run_rl(
      trainer, rollout=task.rollout, score=task.score, sync_params=engine.update_params,
      config=rl_loop.RLLoopConfig(total_steps=total_steps, seed=3), grpo_config=GRPO,
      batch_config=BATCH, checkpointer=saver, on_step=on_step,
      metrics=MetricsConfig(log_dir=str(directory), tensorboard=False, progress=False))
  saver.close()
  return result, trainer


def _comparable(history):
  return [{k: v for k, v in h.items()
           if not k.startswith(("time/", "memory/")) and "per_s" not in k} for h in history]


def test_interrupted_and_resumed_run_equals_straight_run(tmp_path):
  straight, trainer_a = _run(tmp_path / "straight")
  assert straight.end_step == 6 and not straight.preempted and straight.stop_signal is None

  def interrupt_after_3(step, _):  # Ctrl-C: stops the loop like SIGTERM, and says which it was
    if step == 3:
      os.kill(os.getpid(), signal.SIGINT)

  first, _ = _run(tmp_path / "resumed", on_step=interrupt_after_3)
  assert first.preempted and first.end_step == 3 and first.stop_signal == signal.SIGINT
  assert ckpt.Checkpointer(ckpt.CheckpointConfig(
      directory=str(tmp_path / "resumed"))).all_steps() == [3]
  # A fresh process would start from another random init: the checkpoint must win.
  second, trainer_b = _run(tmp_path / "resumed", init_seed=99)
  assert (second.start_step, second.end_step, second.preempted) == (3, 6, False)

  for a, b in zip(jax.tree.leaves(trainer_a.state), jax.tree.leaves(trainer_b.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(trainer_b.state.step) == 6 * GRPO.num_mini_batches
  assert _comparable(first.history + second.history) == _comparable(straight.history)
  logged = read_jsonl(str(tmp_path / "resumed"))
  assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
  peaks = [r["memory/host_peak_gib"] for r in logged]  # this process's peak resident set
  assert 0 < peaks[0] and peaks == sorted(peaks)
  assert "memory/device_peak_gib" not in logged[0]  # CPUs do not report theirs
  assert [r["reward/mean"] for r in logged] == pytest.approx(
      [r["reward/mean"] for r in read_jsonl(str(tmp_path / "straight"))], abs=0)


def test_a_signal_during_the_last_save_lets_it_land_and_stops_the_run(tmp_path, monkeypatch):
  """Ctrl-C while the last step's checkpoint is being finalised: the save lands whole, and the
  loop reports a stop (what follows it, such as the pipeline's next stage, does not start)."""
  wait, signalled = ckpt.Checkpointer.wait, []

  def wait_signalled_once(self):
    if not signalled:
      signalled.append(True)
      os.kill(os.getpid(), signal.SIGINT)
    wait(self)

  monkeypatch.setattr(ckpt.Checkpointer, "wait", wait_signalled_once)
  stopped, _ = _run(tmp_path, total_steps=2)
  assert signalled
  assert (stopped.end_step, stopped.preempted, stopped.stop_signal) == (2, True, signal.SIGINT)
  assert ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(tmp_path))).all_steps() == [2]
  resumed, _ = _run(tmp_path, total_steps=2)  # restores the landed step: nothing left to do
  assert (resumed.start_step, resumed.end_step, resumed.preempted) == (2, 2, False)


@pytest.mark.slow
def test_killed_process_resumes_to_the_same_params(tmp_path):
  """A real process killed with SIGTERM after step 3 saves and exits; a new process resumes
  and finishes; its final params equal an uninterrupted run's, bit for bit."""
  import json
  import subprocess
  import sys
  import time

  from sage_jax.train import synthetic

  workdir = tmp_path / "killed"
  command = [sys.executable, "-m", "sage_jax.train.synthetic", f"--workdir={workdir}",
             "--steps=6", "--save_every=100"]
  child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  log = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and child.poll() is None:
    if log.exists() and any(json.loads(line)["step"] >= 3 for line in log.read_text().splitlines()
                            if line.strip().endswith("}")):
      child.send_signal(signal.SIGTERM)
      break
    time.sleep(0.05)
  out, err = child.communicate(timeout=300)
  assert child.returncode == 0, err[-3000:]
  first = json.loads(out.strip().splitlines()[-1])
  assert first["preempted"] and 3 <= first["end_step"] < 6, first
  done = subprocess.run(command, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  second = json.loads(done.stdout.strip().splitlines()[-1])
  assert (second["start_step"], second["end_step"]) == (first["end_step"], 6)

  _, straight = synthetic.run_demo(str(tmp_path / "straight"), steps=6, save_every=100,
                                   progress=False)
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(workdir / "checkpoints")))
  resumed, meta = saver.restore(straight.abstract_state())
  saver.close()
  assert meta["step"] == 6
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [r["step"] for r in read_jsonl(str(workdir))] == [1, 2, 3, 4, 5, 6]


def _truncate_largest_data_file(step_dir):
  files = sorted((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
                 key=lambda p: p.stat().st_size)
  os.truncate(files[-1], files[-1].stat().st_size // 2)
  return files[-1]


def _remove_manifest(step_dir):
  manifest = step_dir / "state" / "manifest.ocdbt"
  manifest.unlink()
  return manifest


def _remove_manifest_and_record(step_dir):
  (step_dir / ckpt.FILES_RECORD).unlink()  # as a step written before records existed
  return _remove_manifest(step_dir)


@pytest.fixture(scope="module")
def straight_with_steps(tmp_path_factory):
  """An uninterrupted 6-step run that kept steps 2, 4 and 6."""
  directory = tmp_path_factory.mktemp("straight_saved")
  result, trainer = _run(directory, save_every=2)
  return directory, result, trainer


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", [_truncate_largest_data_file, _remove_manifest,
                                    _remove_manifest_and_record])
def test_damaged_newest_step_falls_back_to_newest_intact(tmp_path, straight_with_steps, damage,
                                                         caplog):
  source, straight, trainer_a = straight_with_steps
  directory = tmp_path / "run"
  shutil.copytree(source, directory)
  damaged_file = damage(directory / "6")
  with pytest.raises(ckpt.CheckpointError) as error:
    saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory)))
    try:
      saver.restore(trainer_a.abstract_state(), 6)
    finally:
      saver.close()
  assert error.value.step == 6 and "checkpoint step 6" in str(error.value)
  # Named to the file where the record tells which one; to the step otherwise.
  assert str(damaged_file if damage is not _remove_manifest_and_record
             else directory / "6") in str(error.value)

  with caplog.at_level(logging.INFO):
    resumed, trainer_b = _run(directory, init_seed=99, save_every=2)
  assert (resumed.start_step, resumed.end_step) == (4, 6)
  fallback = [r.getMessage() for r in caplog.records if "instead" in r.getMessage()]
  assert len(fallback) == 1 and "resuming from step 4 instead" in fallback[0]
  assert "\n" not in fallback[0] and str(error.value) in fallback[0]
  assert not any("never retrieved" in r.getMessage() or "Event loop is closed" in r.getMessage()
                 for r in caplog.records)
  assert (directory / ckpt.DAMAGED_DIR / "6").is_dir()  # moved aside, not deleted
  for a, b in zip(jax.tree.leaves(trainer_a.state), jax.tree.leaves(trainer_b.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_signal_during_a_step_saves_before_the_evaluation_due(tmp_path):
  """A scheduler's grace period may not cover a dev evaluation: the step that sees the
  signal saves its checkpoint and stops, its evaluation left out."""
  evaluated = []
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), save_every=100,
                                 async_save=False)

  def one_step(step, _):
    if step == 1:  # during the second step, whose end an evaluation is due at
      signal.raise_signal(signal.SIGTERM)
    return {"loss": 1.0}

  trainer = rl_loop.grpo_trainer(init_model(get_preset("tiny").replace(vocab_size=VOCAB)),
                                 GRPO, OPTIM)
  result = loop.run_steps(trainer, one_step, total_steps=4, eval_every=2,
                          evaluate=lambda step: evaluated.append(step) or {"tgc": 1.0},
                          checkpointer=ckpt.Checkpointer(config),
                          metrics=MetricsConfig(log_dir="", progress=False))
  assert (result.end_step, result.preempted, result.stop_signal) == (2, True, signal.SIGTERM)
  assert evaluated == [] and ckpt.Checkpointer(config).all_steps() == [2]


def test_a_signal_during_an_evaluation_ends_it_saves_the_step_and_a_rerun_makes_it(tmp_path):
  """An evaluation checks for a stop before each turn (`stopping.check`, which the agent
  calls): a signal during it ends it there, the step is saved without it and the loop stops;
  the rerun makes that evaluation first, then goes on. A step's own work is not ended early:
  its checks do nothing, and the loop stops after the step."""
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), save_every=100,
                                 async_save=False)
  turns = []

  def one_step(step, _):
    stopping.check()  # a training step's rollouts run on
    return {"loss": 1.0}

  def signalled_after_a_turn(step):
    for turn in range(100):
      stopping.check()
      turns.append((step, turn))
      if step == 4:
        signal.raise_signal(signal.SIGTERM)
    return {"tgc": step / 10}

  def run(evaluate):
    trainer = rl_loop.grpo_trainer(init_model(get_preset("tiny").replace(vocab_size=VOCAB)),
                                   GRPO, OPTIM)
    return loop.run_steps(trainer, one_step, total_steps=6, eval_every=2, evaluate=evaluate,
                          checkpointer=ckpt.Checkpointer(config),
                          metrics=MetricsConfig(log_dir=str(tmp_path), tensorboard=False,
                                                progress=False))

  stopped = run(signalled_after_a_turn)
  assert (stopped.end_step, stopped.preempted, stopped.stop_signal) == (4, True, signal.SIGTERM)
  assert [t for t in turns if t[0] == 4] == [(4, 0)]  # ended at its second turn
  assert ckpt.Checkpointer(config).all_steps() == [2, 4]
  assert [h.get("dev/tgc") for h in stopped.history] == [None, 0.2, None, None]
  turns.clear()
  resumed = run(lambda step: turns.append(step) or {"tgc": step / 10})
  assert (resumed.start_step, resumed.end_step, resumed.preempted) == (4, 6, False)
  assert turns == [4, 6]
  assert [(r["step"], r.get("dev/tgc")) for r in read_jsonl(str(tmp_path)) if "dev/tgc" in r] == [
      (2, 0.2), (4, 0.4), (6, 0.6)]


def test_a_resumed_run_first_makes_the_evaluation_a_signal_skipped(tmp_path):
  """The step a signal stopped was due an evaluation: the resumed run makes it before its
  first step, on the weights that step saved, and logs it at that step: else the dev curve
  would miss that point."""
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), save_every=100,
                                 async_save=False)
  calls = []

  def run(one_step, init_seed):
    trainer = rl_loop.grpo_trainer(
        init_model(get_preset("tiny").replace(vocab_size=VOCAB), seed=init_seed), GRPO, OPTIM)

    def evaluate(step):
      calls.append(("evaluate", step))
      seen.append(jax.tree.map(np.asarray, trainer.params))
      return {"tgc": step / 10}

    seen = []
    result = loop.run_steps(trainer, one_step, total_steps=4, eval_every=2, evaluate=evaluate,
                            checkpointer=ckpt.Checkpointer(config),
                            metrics=MetricsConfig(log_dir=str(tmp_path), tensorboard=False,
                                                  progress=False))
    return result, trainer, seen

  def stopped_in_the_second_step(step, _):
    if step == 1:
      signal.raise_signal(signal.SIGTERM)
    return {"loss": 1.0}

  first, stopped_trainer, _ = run(stopped_in_the_second_step, init_seed=0)
  assert (first.end_step, first.preempted, calls) == (2, True, [])
  saved = jax.tree.map(np.asarray, stopped_trainer.params)
  resumed, _, seen = run(lambda step, _: calls.append(("step", step)) or {"loss": 1.0},
                         init_seed=99)  # a fresh init: the evaluation must see the checkpoint's
  assert (resumed.start_step, resumed.end_step, resumed.preempted) == (2, 4, False)
  assert calls == [("evaluate", 2), ("step", 2), ("step", 3), ("evaluate", 4)]
  for a, b in zip(jax.tree.leaves(seen[0]), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)
  assert resumed.history[0]["dev/tgc"] == 0.2
  rows = read_jsonl(str(tmp_path))  # the evaluation joins step 2's line
  assert [(r["step"], r.get("dev/tgc"), "loss" in r) for r in rows] == [
      (1, None, True), (2, 0.2, True), (3, None, True), (4, 0.4, True)]


def test_a_failed_evaluation_keeps_its_step_and_a_rerun_makes_it_then_goes_on(tmp_path):
  """The evaluation due after step 2 fails (AppWorld's scoring disagreed, say): the step's
  update is saved before the error ends the loop, so a rerun resumes after it rather than
  training step 2 again into the same evaluation. The rerun first tries that evaluation again
  (once; if it fails again, so does the rerun, the checkpoint unchanged): a failure is most
  often the environment's, fixed by the time of the rerun, and a dev curve with a hole at
  step 2 is not what the run was asked for."""
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), save_every=100,
                                 async_save=False)

  def failing(step):
    raise RuntimeError(f"the evaluation at step {step} failed")

  def run(evaluate):
    trainer = rl_loop.grpo_trainer(init_model(get_preset("tiny").replace(vocab_size=VOCAB)),
                                   GRPO, OPTIM)
    return loop.run_steps(trainer, lambda step, _: {"loss": 1.0}, total_steps=4,
                          eval_every=2, evaluate=evaluate,
                          checkpointer=ckpt.Checkpointer(config),
                          metrics=MetricsConfig(log_dir="", progress=False))

  with pytest.raises(RuntimeError, match="the evaluation at step 2 failed"):
    run(failing)
  assert ckpt.Checkpointer(config).all_steps() == [2]
  evaluated = []
  resumed = run(lambda step: evaluated.append(step) or {"tgc": 1.0})
  assert (resumed.start_step, resumed.end_step, evaluated) == (2, 4, [2, 4])
