"""A training run read back from its workdir: its config, its checkpoint steps and the model
of one step (what `sage_jax.evaluate --run` evaluates and `sage_jax.export` exports).

A run's workdir holds config.json (the resolved config with its derived seeds), the orbax
train states under checkpoints/ (RL) and sft/checkpoints/ (SFT), and, for a model with
`model.vocabulary="compact"`, its own tokenizer under tokenizer/. The workdir may be remote
(gs://...; `sage_jax.storage`).
"""

from __future__ import annotations

import os

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from sage_jax import compact_tokenizer, multihost, run_config, storage
from sage_jax import sharding as shd
from sage_jax.tokenizer import Tokenizer
from sage_jax.train.checkpoint import CheckpointConfig, Checkpointer
from sage_jax.weights import loader

STAGE_DIRS = {"rl": "checkpoints", "sft": "sft/checkpoints"}
# Keys that runs of earlier versions recorded and this one no longer has (-> what took their
# place): dropped from a recorded config, so that those runs still export and evaluate.
RETIRED_KEYS = {"expert.use_library": "agent.use_library"}


def run_config_at(path: str) -> ml_collections.ConfigDict | None:
  """The config of the training run whose workdir `path` is; None when it is not one (e.g. a
  model's directory, whose config.json has no pipeline section). One of the run's checkpoint
  directories holds a copy of it too (`checkpoints_of` tells them apart)."""
  directory = storage.path(path)
  config = storage.read_json(directory / "config.json") if directory.is_dir() else None
  if run_config.not_a_run(config) is not None:
    return None
  return _without_retired_keys(config)


def checkpoints_of(path: str) -> tuple[str, str] | None:
  """(workdir, stage) when `path` is the `stage` checkpoint directory (`STAGE_DIRS`) of the
  training run in `workdir`: its copy of the run's config.json makes it look like a workdir.
  None for anything else."""
  directory = storage.path(path)
  for stage, stage_dir in STAGE_DIRS.items():
    workdir = directory
    for _ in stage_dir.split("/"):
      workdir = workdir.parent
    if workdir / stage_dir == directory and run_config_at(os.fspath(workdir)) is not None:
      return os.fspath(workdir), stage
  return None


def read_config(run_dir: str) -> ml_collections.ConfigDict:
  """The run's config.json, less its `RETIRED_KEYS`. What is not a training run's workdir fails
  naming what it is: a directory without config.json, a model's (a run's HF export,
  <workdir>/hf), one of a run's checkpoint directories."""
  directory = storage.path(run_dir)
  config = storage.read_json(directory / "config.json")
  if config is None:
    raise FileNotFoundError(f"{run_dir}: not a training run's workdir (no config.json)")
  looks = run_config.not_a_run(config)
  if looks is not None:
    run = os.fspath(directory.parent)
    model = isinstance(config, dict) and "model_type" in config
    raise FileNotFoundError(
        f"{run_dir}{' is a model export,' if model else ':'} not a training run's workdir "
        f"(its config.json looks like {looks}): pass the workdir of the run"
        + (f", {run}" if run_config_at(run) is not None
           else " it was exported from" if model else ""))
  check_not_checkpoints(run_dir)
  return _without_retired_keys(config)


def check_not_checkpoints(path: str) -> None:
  """Fails when `path`, given as a run's workdir, is one of the run's checkpoint directories
  (`checkpoints_of`), naming the workdir to give instead."""
  if (found := checkpoints_of(path)) is not None:
    workdir, stage = found
    raise FileNotFoundError(
        f"{path} is the {stage} checkpoint directory of the run in {workdir}, not a "
        f"training run's workdir: pass the run's workdir, {workdir}"
        + (" (with --stage=sft)" if stage == "sft" else ""))


def _without_retired_keys(config: dict) -> ml_collections.ConfigDict:
  for key in RETIRED_KEYS:
    section, field = key.split(".")
    (config.get(section) or {}).pop(field, None)
  return ml_collections.ConfigDict(config)


def tokenizer_dir(run_dir: str, run: run_config.RunConfig) -> str:
  return os.fspath(compact_tokenizer.run_tokenizer_dir(run_dir, run.model.vocabulary))


def _reader(run_dir: str, stage: str) -> Checkpointer:
  """The run's `stage` checkpoints, read-only: the run may still be training, with a save
  under way that a cleanup of temporary directories would delete."""
  return Checkpointer(CheckpointConfig(
      directory=os.fspath(storage.path(run_dir) / STAGE_DIRS[stage]), keep_best=0,
      async_save=False, read_only=True))


def _stage_steps(run_dir: str, stage: str) -> list[int]:
  """The finished checkpoint steps of the run's `stage` (process 0's listing)."""
  checkpointer = _reader(run_dir, stage)
  try:
    return list(checkpointer.all_steps())
  finally:
    checkpointer.close()


def checkpoint_step(run_dir: str, stage: str = "rl", step: int | None = None) -> int:
  """`step` (default: the latest) of the run's `stage` checkpoints, checked to be there
  (`restore_model`'s error where not), without reading it."""
  checkpointer = _reader(run_dir, stage)
  try:
    return _checked_step(checkpointer, run_dir, stage, step)
  finally:
    checkpointer.close()


def _checked_step(checkpointer: Checkpointer, run_dir: str, stage: str,
                  step: int | None) -> int:
  steps = checkpointer.all_steps()  # process 0's: every process fails, or none
  ckpt_dir = os.fspath(checkpointer.directory)
  if not steps:
    others = [s for s in STAGE_DIRS if s != stage and _stage_steps(run_dir, s)]
    raise FileNotFoundError(
        f"{run_dir}: no {stage} checkpoints ({ckpt_dir} does not exist or holds no finished "
        "step)" + (f"; it has {others[0]} checkpoints: pass --stage={others[0]}"
                   if others else ""))
  step = steps[-1] if step is None else step
  if step not in steps:
    raise FileNotFoundError(f"{ckpt_dir}: no checkpoint step {step}; available steps: "
                            f"{steps}")
  return step


def restore_model(run_dir: str, run: run_config.RunConfig, step: int | None = None,
                  stage: str = "rl") -> tuple[nnx.Module, int]:
  """(model, step) of checkpoint `step` (default: the latest) of the run's `stage`, its
  weights sharded over every device of this job (however many processes it has, whatever
  mesh trained it). Only the params are read: the optimizer state, twice the params under
  Adam, stays on disk. A missing step is an error that lists the steps there are."""
  checkpointer = _reader(run_dir, stage)
  try:
    step = _checked_step(checkpointer, run_dir, stage, step)
    vocab_size = (Tokenizer(tokenizer_dir(run_dir, run)).vocab_size
                  if run.model.vocabulary == "compact" else None)
    model = loader.abstract_model(run.model, vocab_size=vocab_size)  # reads no weights
    params = nnx.state(model)
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=-1, tensor=1))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, shd.state_shardings(params, mesh))
    params = checkpointer.restore_params(target, step)
  finally:
    checkpointer.close()
  return nnx.merge(nnx.graphdef(model), params), step


def restore_sampling_model(run_dir: str, run: run_config.RunConfig, step: int | None = None,
                           stage: str = "rl") -> tuple[nnx.Module, Mesh, int]:
  """(model, mesh, step): checkpoint `step` of the run's `stage` as the run's sampler holds it,
  this process's copy of the weights (in the sampler's dtype and layout) on the run's sampler
  mesh, LoRA adapters merged where that is a copy (`multihost.WeightSync.sampling_model`)."""
  model, step = restore_model(run_dir, run, step, stage)
  sync = multihost.WeightSync(model, run.sampler_mesh)
  return sync.sampling_model(model), sync.mesh, step
