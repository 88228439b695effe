"""A small GRPO job that tests run as one or several JAX processes (launch/local.py).

  python tests/multihost_job.py --out=DIR [--steps=N] [--step_sleep_s=S] [--ckpt=DIR]
      [--save_every=N] [--slow_move_s=S] [--late_start_s=S] [--lagging_listing=I]
      [--eval_turns=N --eval_turn_s=S]

A tiny Qwen2 (vocabulary 256) on a global (fsdp) mesh over every process's devices; each step
draws a fixed global batch of synthetic episodes from (seed, step), every process packs its
own share (at step 1 process 0 holds all of it), and the GRPO update runs on the global batch; then the weights are synced into
each process's sampling copy. Process 0 writes DIR/result.json (the loop's steps, every
process's start step, the loss per step) and DIR/params.npz (the final parameters, gathered);
every process writes DIR/copy_<i>.json, the fingerprint of its sampling copy after each step.
With --eval_turns, every step is evaluated: each process plays turns of S seconds, checking
before each whether a stop was asked (as the agent does), after writing DIR/eval_<i>_<step>.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sage_jax import multihost  # noqa: E402
from tests.lagging_storage import lagging_listing  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_STEPS = flags.DEFINE_integer("steps", 1, "Loop steps.")
_SLEEP = flags.DEFINE_float("step_sleep_s", 0.0, "Seconds each step sleeps (a slow rollout).")
_CKPT = flags.DEFINE_string("ckpt", "", "Checkpoint directory (resumes from it).")
_SAVE_EVERY = flags.DEFINE_integer("save_every", 1000, "Checkpoint every this many steps (and "
                                   "at the last).")
_SLOW_MOVE = flags.DEFINE_float("slow_move_s", 0.0,
                                "Seconds process 0 takes to move a damaged checkpoint step "
                                "aside (as a copy on an object store does).")
_LATE = flags.DEFINE_float("late_start_s", 0.0,
                           "Seconds the last process waits before building its model (a host "
                           "whose setup is slower than the others').")
_LAGGING = flags.DEFINE_integer("lagging_listing", -1,
                                "This process lists no step in the checkpoint directory (storage "
                                "whose listing lags behind on its host); -1: none.")
_EVAL_TURNS = flags.DEFINE_integer("eval_turns", 0, "Turns of each process's share of an "
                                   "evaluation after every step; 0: no evaluation.")
_EVAL_TURN_S = flags.DEFINE_float("eval_turn_s", 0.5, "Seconds each evaluation turn takes.")
_SEQUENCES = 12


def episodes(step: int):
  """The step's global batch: sequences of different lengths, masks and advantages."""
  import numpy as np  # noqa: PLC0415

  rng = np.random.default_rng([7, step])
  out = []
  for i in range(_SEQUENCES):
    n = int(rng.integers(20, 90))
    mask = (rng.random(n) < 0.6).astype(np.int8)
    mask[0] = 0
    lp = np.where(mask, -rng.random(n) * 3, 0).astype(np.float32)
    out.append({"tokens": rng.integers(0, 256, n), "loss_mask": mask, "sampler_logprobs": lp,
                "model_logprobs": lp, "advantage": float(rng.normal()) if i % 5 else 0.0})
  return out


def slow_move_aside(seconds: float) -> None:
  """Renames into a checkpoint directory's damaged/ take `seconds` longer."""
  from etils import epath  # noqa: PLC0415

  from sage_jax.train import checkpoint  # noqa: PLC0415

  local = type(epath.Path("/"))
  rename = local.rename

  def slow_rename(self, target):
    if f"/{checkpoint.DAMAGED_DIR}/" in os.fspath(target):
      time.sleep(seconds)
    return rename(self, target)

  local.rename = slow_rename


def main(argv):
  del argv
  multihost.initialize()
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.experimental import multihost_utils  # noqa: PLC0415

  from sage_jax import sharding as shd  # noqa: PLC0415
  from sage_jax import stopping  # noqa: PLC0415
  from sage_jax.weights.loader import init_model  # noqa: PLC0415
  from sage_jax.model.config import get_preset  # noqa: PLC0415
  from sage_jax.rl import batch as batch_lib  # noqa: PLC0415
  from sage_jax.rl import grpo  # noqa: PLC0415
  from sage_jax.train import checkpoint, rl_loop  # noqa: PLC0415
  from sage_jax.train.loop import run_steps  # noqa: PLC0415
  from sage_jax.train.metrics import MetricsConfig  # noqa: PLC0415
  from sage_jax.train.optimizer import OptimizerConfig  # noqa: PLC0415

  os.makedirs(_OUT.value, exist_ok=True)
  if _SLOW_MOVE.value and multihost.is_lead():
    slow_move_aside(_SLOW_MOVE.value)
  if _LAGGING.value == jax.process_index():
    lagging_listing(_CKPT.value)
  mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=-1, tensor=1))
  multihost.connect(mesh)
  if jax.process_index() == jax.process_count() - 1:
    time.sleep(_LATE.value)
  cfg = get_preset("tiny", vocab_size=256)
  model = shd.create_sharded(lambda: init_model(cfg, seed=0), mesh)
  trainer = rl_loop.grpo_trainer(model, grpo.GRPOConfig(), OptimizerConfig(learning_rate=1e-2),
                                 mesh=mesh)
  sync = multihost.WeightSync(model)
  batch_config = batch_lib.BatchConfig(micro_batch_tokens=256, num_micro_batches=2,
                                       length_buckets=(32, 64, 128),
                                       row_multiple=mesh.shape["fsdp"])
  fingerprints, held = [], []

  def sync_params(params):  # as the pipeline's sampler does: each copy replaces the last
    copy = sync(params, replacing=held.pop() if held else None)
    sync.check_copies_agree(copy)
    fingerprints.append([float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(copy)])
    held.append(copy)

  def one_step(step, seed):
    del seed
    time.sleep(_SLEEP.value)
    # Step 1 gives process 0 the whole batch: a host left with nothing to train on (dynamic
    # sampling, environment failures) still takes part in the update.
    share = multihost.share(_SEQUENCES) if step != 1 else slice(
        0, _SEQUENCES if multihost.is_lead() else 0)
    mine = episodes(step)[share]
    return rl_loop.grpo_update(trainer, mine, grpo.GRPOConfig(), batch_config)

  def evaluate(step):
    open(os.path.join(_OUT.value, f"eval_{jax.process_index()}_{step}"), "w").close()
    for _ in range(_EVAL_TURNS.value):
      stopping.check()
      time.sleep(_EVAL_TURN_S.value)
    return {"score": float(step)}

  checkpointer = (checkpoint.Checkpointer(checkpoint.CheckpointConfig(
      directory=_CKPT.value, save_every=_SAVE_EVERY.value, keep_last=5, keep_best=0,
      async_save=False))
      if _CKPT.value else None)
  result = run_steps(trainer, one_step, total_steps=_STEPS.value, sync_params=sync_params,
                     checkpointer=checkpointer, eval_every=int(_EVAL_TURNS.value > 0),
                     evaluate=evaluate if _EVAL_TURNS.value else None,
                     metrics=MetricsConfig(log_dir=_OUT.value, progress=False,
                                           tensorboard=False))
  if checkpointer is not None:
    checkpointer.close()
  start_steps = multihost.allgather_objects(result.start_step)
  with open(os.path.join(_OUT.value, f"copy_{jax.process_index()}.json"), "w") as f:
    json.dump(fingerprints, f)
  flat = {"/".join(str(k) for k in path): np.asarray(
      multihost_utils.process_allgather(x, tiled=True))
          for path, x in jax.tree_util.tree_leaves_with_path(trainer.params)}
  if multihost.is_lead():
    np.savez(os.path.join(_OUT.value, "params.npz"), **flat)
    with open(os.path.join(_OUT.value, "result.json"), "w") as f:
      json.dump({"start_step": result.start_step, "start_steps": start_steps,
                 "end_step": result.end_step,
                 "preempted": result.preempted,
                 "loss": [h.get("loss") for h in result.history],
                 "dev_score": [h.get("dev/score") for h in result.history],
                 "processes": jax.process_count(), "devices": jax.device_count()}, f)
  multihost.finish()


if __name__ == "__main__":
  app.run(main)
