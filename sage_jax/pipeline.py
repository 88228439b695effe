"""A whole run: SFT on expert trajectories, then SAGE (or the GRPO baseline), with dev
evaluations before and after, HF export, plots and a before/after table.

Every stage reads its settings from the run config (`sage_jax.run_config`); each writes
under the workdir:

  <workdir>/config.json              the resolved config
  <workdir>/expert_trajectories.jsonl  SFT data made from the gold solutions of the training
                                     scenarios (or of expert.splits), or sampled from the
                                     starting policy (expert.source "self"), if not given
  <workdir>/sft/                     SFT checkpoints and metrics
  <workdir>/checkpoints/             RL checkpoints (orbax), config beside them
  <workdir>/metrics.jsonl            RL metrics per step (+ TensorBoard events)
  <workdir>/tokenizer/               the compact tokenizer (model.vocabulary "compact")
  <workdir>/eval_before/ eval_after/ dev evaluations (JSON + markdown), with eval_train also
                                     of the training scenarios (and eval_after_sft/)
  <workdir>/hf/                      the final model in HF format (LoRA merged in)
  <workdir>/hf/lora_adapter/         a LoRA run's adapters in PEFT's format
  <workdir>/plots/training.png       curves (RL; sft.png: SFT's)
  <workdir>/summary.json             the before/after table, and the checkpoint it is of
  <workdir>/workdir.lock             held by the run while it runs (`storage.WorkdirLock`)

DIR is a local path or a URL that etils.epath handles, e.g. gs://bucket/run (`sage_jax.storage`;
AppWorld's working files then stay on each host).

A run that is interrupted resumes where it stopped: finished stages are skipped and the
loops continue from their latest checkpoint. A SIGTERM (a preemption) stops the run after the
step in progress, with a checkpoint of it (during a dev evaluation, at each episode's next
turn, the evaluation left for the rerun to make): no later stage, evaluation or export runs,
and the command exits with status 143 (what an unhandled SIGTERM gives) so that a scheduler
or retry loop runs it again. An evaluation done before is redone when the weights it scored
or its settings have changed since (a rerun with more steps evaluates the new last step). A
rerun may change how long and how the run goes (steps, layout, evaluation;
`run_config.RESUMABLE_KEYS`), not the experiment its checkpoints belong to: that fails,
naming the keys changed; a workdir whose run stopped before it saved or evaluated anything
(`Pipeline.progress`) takes any config. More SFT steps
continue a finished SFT stage, until RL has trained from its result. Once RL has saved, a
resumed run reads SFT's last checkpoint only as KL's reference (grpo.kl_coef > 0) or for an
evaluation or export of SFT's result not made yet: without KL, SFT's checkpoints may be
removed to free disk. A workdir that holds a
run refuses `checkpoint.resume=False` (a new run there would mix with the old one's files).

  python -m sage_jax.pipeline --config=configs/sage.py:<preset> --workdir=DIR

(`python -m sage_jax.train` is the same command.) Config overrides go as
`--config.<section>.<key>=<value>`; the resolved config is printed and written to
DIR/config.json, and an invalid config fails before anything compiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any

from absl import app, flags
from absl import logging as absl_logging

import jax
import ml_collections
from flax import nnx

from sage_jax import (compact_tokenizer, config_file, export, multihost, plot, run_checkpoint,
                      run_config, storage)
from sage_jax import sharding as shd
from sage_jax.agent.retrieval import Retriever, make_embedder
from sage_jax.envs import appworld
from sage_jax.envs.appworld import data_root
from sage_jax.eval import runner
from sage_jax.rl import rollout
from sage_jax.sampler import AsyncEngine, Engine
from sage_jax.sft import data as sft_data
from sage_jax.sft import expert as sft_expert
from sage_jax.sft import loop as sft_loop
from sage_jax.tokenizer import Tokenizer
from sage_jax.tools import memory_plan
from sage_jax.train import rl_loop
from sage_jax.train.checkpoint import CheckpointConfig, Checkpointer
from sage_jax.train.loop import LoopResult
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.state import abstract_like
from sage_jax.weights import hf, loader

# The sections of a run's config that decide what an evaluation measures: a report made under
# others is made again.
EVALUATION_SECTIONS = ("eval", "agent", "retrieval")
# Written into <workdir>/hf after the export there is complete: the checkpoint it is of and a
# digest of its text files (config, model card). A new export replaces the directory, record
# and all.
EXPORT_RECORD = "sage_jax_run_export.json"
# The given SFT file (pipeline.expert_trajectories) as the run read it: its path and digest.
EXPERT_FILE_RECORD = "sft/expert_file.json"
SUMMARY_KEYS = ("tgc", "sgc", "avg_steps", "avg_generated_tokens", "skill_usage_rate",
                "later_skill_usage_rate")


def reusable(report: dict | None, config: dict, weights_from: dict | None) -> bool:
  """Whether an evaluation report stands for evaluating the weights of checkpoint
  `weights_from` (None: the starting weights) under `config`: the same checkpoint of the
  run, wherever the run is now, under the same `EVALUATION_SECTIONS`. A report whose scores
  AppWorld's evaluation contradicted (`appworld_disagrees`: the evaluation failed after
  writing it) stands for none: a rerun evaluates again."""
  if report is None or report.get("appworld_disagrees"):
    return False
  stage_step = lambda c: c and (c["stage"], c["step"])
  settings = lambda c: json.loads(json.dumps({k: c.get(k) for k in EVALUATION_SECTIONS},
                                             default=str))
  return (stage_step(report.get("checkpoint")) == stage_step(weights_from)
          and settings(report.get("config") or {}) == settings(config))


def check_evaluation_reports(run: run_config.RunConfig) -> None:
  """Fails a run whose dev evaluation and evaluation of the training scenarios would write
  one report: both keep theirs in <workdir>/eval_before/ (eval_after/) as
  eval_<split>.json, and with one split the second would replace the first."""
  p = run.pipeline
  if p.eval_train and (p.eval_before or p.eval_after) and run.eval.split == p.train_split:
    name = "eval_before" if p.eval_before else "eval_after"
    raise run_config.ConfigError(
        f"config.pipeline.eval_train: True with eval.split == pipeline.train_split "
        f"({p.train_split!r}): the dev evaluation scores that split already, and the "
        f"evaluation of the training scenarios would replace its report "
        f"({name}/eval_{p.train_split}.json); set eval_train=False, or evaluate on another "
        "split")


def preempted_exit_code(stop_signal: int | None) -> int:
  """A stopped run's exit status: 128 + the signal this process caught, as if that signal had
  ended it (130 after Ctrl-C); 143 (SIGTERM's) on a process that another one's signal or a
  preemption notice stopped. Either way a scheduler or retry loop sees an unfinished run."""
  return 128 + (stop_signal or signal.SIGTERM)


def stage_optimizer(config: OptimizerConfig, total_updates: int, section: str,
                    stage: str) -> OptimizerConfig:
  """`config` (the run's `section`) for the `total_updates` of `stage`, with a warning when
  the stage ends before its warmup does."""
  if reason := config.never_peaks(total_updates):
    logging.warning("config.%s: the %s stage never reaches its peak learning rate: %s",
                    section, stage, reason)
  return config.for_updates(total_updates)


def _write_json(path, value: Any) -> None:
  """Writes whole, from process 0 only."""
  if multihost.is_lead():
    storage.write_json(path, value, default=str)


def _read_json_on_lead(path) -> Any:
  """`storage.read_json(path)` as process 0 reads it, on every process (a collective). What
  the stages decide from the workdir's files, every process decides alike: storage may show
  a file to some hosts before others (NFS attribute caches, eventually consistent buckets),
  and a process that decided on its own read could skip a stage the others run, and leave
  them waiting in its collectives."""
  return multihost.from_lead(lambda: storage.read_json(path))


class Pipeline:
  """Holds what the stages share: config, mesh, tokenizer, model, sampler, env pool."""

  def __init__(self, config: Any, workdir: str):
    self.config = config
    self.run = run_config.resolve(config, jax.device_count(), jax.local_device_count())
    # Before config.json records the run (the weights first: the plan reads their shapes):
    loader.check_weights(self.run.model)
    memory_plan.check_fits(self.run, jax.local_devices()[0])
    loader.check_tokenizer(self.run.model)
    check_evaluation_reports(self.run)
    self.workdir = storage.open_workdir(workdir, flag="--workdir")
    recorded = _read_json_on_lead(self.workdir / "config.json")
    if recorded is not None:  # a model's directory gets no lock file either
      run_config.check_recorded(recorded, f"{workdir}/config.json")
    # Held until `close`: a second run on this workdir stops here, before it writes anything.
    self._workdir_lock = multihost.all_succeed(lambda: storage.WorkdirLock(
        self.workdir, "--workdir", hold=multihost.is_lead()))
    try:
      self._start(config, workdir, recorded)
    except BaseException:
      self._workdir_lock.release()
      raise

  def _start(self, config: Any, workdir: str, recorded: dict | None) -> None:
    """The rest of `__init__`, with the workdir held: checks it against the run it holds
    (`recorded`, its config.json), records this one, and builds the mesh, AppWorld pool,
    model and sampler."""
    self.config_dict = run_config.with_seeds(config, self.run)
    if recorded is not None and not (progress := self.progress()):
      logging.warning("%s/config.json records a run that stopped before it saved or evaluated "
                      "anything: this config replaces it", workdir)
      recorded = None
    if recorded is not None and not self.run.checkpoint.resume:
      raise run_config.ConfigError(
          f"--workdir {workdir} holds a run ({workdir}/config.json; {', '.join(progress)}), "
          "and checkpoint.resume=False starts a new one: its checkpoints, metrics and "
          "evaluations would mix with the new run's. Use a new --workdir, or remove that one")
    if recorded is not None:
      run_config.check_resume(recorded, self.config_dict, f"{workdir}/config.json")
    if self.run.pipeline.export:
      self._check_export_dir()
    self.sft_pending = self._check_saved_stages(workdir)
    self.root = self._check_data()
    expert_file = self._check_expert_file()
    _write_json(self.workdir / "config.json", self.config_dict)
    if expert_file is not None:
      _write_json(self.workdir / EXPERT_FILE_RECORD, expert_file)
    self.mesh = shd.make_mesh(self.run.mesh)
    multihost.connect(self.mesh)
    self.batch_config = self.run.batch
    if jax.process_count() > 1:  # each process must own whole rows of every train batch
      multihost.check_batch_split(self.mesh, ("data", "fsdp"))
      self.batch_config = dataclasses.replace(self.batch_config, row_multiple=math.lcm(
          self.batch_config.row_multiple, self.mesh.shape["data"] * self.mesh.shape["fsdp"]))
    self._pool = appworld.EnvPool(multihost.pool_config(self.run.pool, self.root, self.workdir))
    if self._plays_episodes():
      # AppWorld starts while the model is built and SFT runs; the first episode waits for
      # it (and raises what kept it from starting, inside the stage's multi-process checks).
      self._pool.start_in_background()
    try:
      self.tokenizer = Tokenizer()
      compact = self.run.model.vocabulary == "compact"
      if compact:
        self.tokenizer = Tokenizer(self.compact_tokenizer_dir())
      self.model = loader.build_model(self.run.model, mesh=self.mesh,
                                      vocab_size=self.tokenizer.vocab_size if compact else None)
      # Each process samples from its own copy of the weights on its own devices.
      self.weight_sync = multihost.WeightSync(self.model, self.run.sampler_mesh)
      self.engine = Engine(self.weight_sync.sampling_model(self.model), self.run.engine,
                           eos_ids=[self.tokenizer.eos_id, self.tokenizer.endoftext],
                           detokenize=self.tokenizer.decode, mesh=self.weight_sync.mesh)
    except BaseException:
      self._pool.close()
      raise
    self.driver = AsyncEngine(self.engine)
    self.policy = rollout.SamplerPolicy(self.driver, self.run.agent)
    self.eval_policy = rollout.SamplerPolicy(self.driver, self.run.eval.agent(self.run.agent))
    # The checkpoint (stage, step) whose weights the model holds; None: the starting weights.
    self.weights_from: dict | None = None
    # Whether those are SFT's adopted params, not read yet (`read_sft_result`).
    self.sft_result_unread = False

  def progress(self) -> list[str]:
    """What the workdir holds that a rerun takes up as its run's: checkpoints, a finished SFT
    stage, evaluation reports, and the SFT data and compact tokenizer made once per workdir.
    None: the run its config.json records stopped before it made any (a bad input, a crash),
    and nothing of it ties the workdir to that config."""
    found = [f"{run_checkpoint.STAGE_DIRS[stage]} {steps}" for stage in ("sft", "rl")
             if (steps := self.saved_steps(stage))]

    def files() -> list[str]:
      w = self.workdir
      made = [self.sft_marker, w / "expert_trajectories.jsonl",
              compact_tokenizer.run_tokenizer_dir(w, "compact") / "tokenizer.json"]
      return ([os.fspath(path.relative_to(w)) for path in made if path.exists()]
              + sorted(os.fspath(path.relative_to(w)) for path in w.glob("eval_*/eval_*.json")))

    return found + multihost.from_lead(files)

  def _check_export_dir(self) -> None:
    """Fails unless the export the run ends with may replace <workdir>/hf: a file or a
    directory that is not an export there (a model put in its place) would otherwise stop the
    run at its end, after every stage has trained and evaluated."""
    out = self.workdir / "hf"
    try:
      export.check_target(os.fspath(out), remedy=(
          "the run exports its model there when it ends (config.pipeline.export): move it "
          "away, or set --config.pipeline.export=false"))
    except hf.ExportError as e:
      raise storage.WorkdirError(str(e)) from None

  def _check_data(self) -> str:
    """The AppWorld root of `pipeline.data`, checked with the splits the run reads there and
    a given SFT file before config.json records the run: a wrong path fails naming its key,
    with nothing written."""
    p, run = self.run.pipeline, self.run
    try:
      root = appworld.resolve_root(p.data)
    except appworld.AppWorldDataError as e:
      raise run_config.ConfigError(f"config.pipeline.data: {e}") from e
    datasets = os.path.join(root, "data", "datasets")
    if not os.path.isdir(datasets):
      raise run_config.ConfigError(
          f"config.pipeline.data: {p.data!r} holds no AppWorld data ({datasets} is not a "
          f"directory). {data_root.HOW_TO_GET_DATA}")
    splits = {}  # split -> the key that names it
    if p.eval_before or p.eval_after or run.rl.eval_every or run.sft.eval_every:
      splits[run.eval.split] = "eval.split"
    # The expert plays for the SFT data (a compact vocabulary is cut to it).
    plays = not p.expert_trajectories and ("sft" in p.stages or run.model.vocabulary == "compact")
    if plays:
      splits.update((split, "expert.splits") for split in run.expert.splits)
    if "rl" in p.stages or p.eval_train or p.train_scenarios or plays and not run.expert.splits:
      splits[p.train_split] = "pipeline.train_split"
    for split, key in splits.items():
      try:
        task_ids = appworld.read_split(root, split)
      except (OSError, ValueError) as e:
        raise run_config.ConfigError(f"config.{key}: {e}") from e
      scenarios = len(appworld.group_by_scenario(task_ids))
      if split == p.train_split and p.train_scenarios > scenarios:
        raise run_config.ConfigError(
            f"config.pipeline.train_scenarios: {p.train_scenarios}, but the {split!r} split of "
            f"{root} has {scenarios} scenarios; set at most {scenarios} (0: all of them)")
    if p.expert_trajectories and not storage.path(p.expert_trajectories).exists():
      raise run_config.ConfigError(
          f"config.pipeline.expert_trajectories: {p.expert_trajectories}: no such file")
    return root

  def _check_expert_file(self) -> dict | None:
    """A given SFT file that the pending SFT stage reads, validated, cut to the training
    scenarios as SFT cuts it and its lengths checked (with Qwen2.5's tokenizer: a compact
    vocabulary cut from it tokenises alike), before config.json records the run: a file SFT
    would fail on, after the evaluations before training, fails now naming its key, which
    a rerun could no longer change. So does a file whose contents changed since the run
    first read it (its record, `EXPERT_FILE_RECORD`), once SFT has saved a step or a compact
    vocabulary was cut from it: SFT would go on with other data. Returns the record to keep."""
    path = self.run.pipeline.expert_trajectories
    if not (path and self.sft_pending):
      return None
    try:
      digest = hashlib.sha256(storage.path(path).read_bytes()).hexdigest()
      trajectories = self._of_training_scenarios(sft_data.read_jsonl(path))
      tokenizer = Tokenizer()
      long = sft_data.longer_than((sft_data.tokenize(t, tokenizer) for t in trajectories),
                                  self.run.engine.max_len)
    except (OSError, ValueError) as e:  # unreadable, not the format, ids of no AppWorld task
      raise run_config.ConfigError(f"config.pipeline.expert_trajectories: {e}") from e
    if not trajectories:
      raise run_config.ConfigError(
          f"config.pipeline.expert_trajectories: {path} holds no trajectory of the scenarios "
          f"the run trains on (pipeline.train_split {self.run.pipeline.train_split!r}, "
          f"train_scenarios {self.run.pipeline.train_scenarios})")
    if long:
      raise run_config.ConfigError(
          f"config.pipeline.expert_trajectories: {path} holds {len(long)} trajectories longer "
          f"than config.engine.max_len={self.run.engine.max_len} tokens (e.g. {long[0][0]}, "
          f"{long[0][1]} tokens), and SFT trains on whole trajectories: raise engine.max_len, "
          "or leave them out of the file")
    recorded = _read_json_on_lead(self.workdir / EXPERT_FILE_RECORD) or {}
    sft_steps = self.saved_steps("sft")
    cut = multihost.from_lead(lambda: compact_tokenizer.is_complete(
        compact_tokenizer.run_tokenizer_dir(self.workdir, "compact")))
    made = ([f"SFT saved steps {sft_steps}"] if sft_steps else []) + (
        ["the run's compact vocabulary was cut from it"] if cut else [])
    if recorded.get("sha256", digest) != digest and made:
      raise run_config.ConfigError(
          f"config.pipeline.expert_trajectories: {path} changed since this run first read it "
          f"(sha256 {recorded['sha256'][:12]}... then, {digest[:12]}... now), and "
          f"{' and '.join(made)}: SFT would go on with other data. Put the file back as it was, "
          "or use a new --workdir")
    return {"path": path, "sha256": digest}

  def _plays_episodes(self) -> bool:
    """Whether the configured stages play AppWorld episodes: RL, evaluations, and SFT whose
    data is not read from a file or which evaluates as it trains. A run that plays none (SFT
    on a file, say) starts no AppWorld, unless something asks for `pool` after all."""
    p = self.run.pipeline
    return bool(p.eval_before or p.eval_after or "rl" in p.stages or self.sft_pending and (
        not p.expert_trajectories or self.run.sft.eval_every))

  @property
  def pool(self) -> appworld.EnvPool:
    """The run's AppWorld pool, started (in the background) on first use if not at startup."""
    return self._pool.start_in_background()

  def close(self) -> None:
    """Stops the sampler and AppWorld, and lets another run take the workdir."""
    try:
      self.driver.close()
      self._pool.close()
    finally:
      self._workdir_lock.release()

  def saved_steps(self, stage: str) -> list[int]:
    """The checkpoint steps of `stage` in the workdir (read without cleaning anything up;
    none before the stage has saved)."""
    directory = self.workdir / run_checkpoint.STAGE_DIRS[stage]
    reader = Checkpointer(CheckpointConfig(directory=os.fspath(directory), read_only=True))
    try:
      return reader.all_steps()
    finally:
      reader.close()

  def _check_saved_stages(self, workdir: str) -> bool:
    """Whether the SFT stage has steps to run: it has not finished, or it finished short of
    an `sft.total_steps` raised since (an epoch-counted SFT, total_steps 0, has its own end).
    Refuses a rerun whose SFT stage would change the model that RL already trained from (SFT
    added to a run whose RL started without it, or total_steps changed since), and one whose
    RL went past an `rl.total_steps` lowered since (its checkpoints, metrics and export would
    describe steps the config says were never run)."""
    rl = self.saved_steps("rl")
    if rl and rl[-1] > self.run.rl.total_steps and "rl" in self.run.pipeline.stages:
      raise run_config.ConfigError(
          f"--workdir {workdir}: its RL stage is at step {rl[-1]}, past "
          f"config.rl.total_steps={self.run.rl.total_steps}; keep it (or raise it to train "
          "on), or use a new --workdir")
    if "sft" not in self.run.pipeline.stages:
      return False
    finished = self.sft_result_step()
    if rl and finished is None:
      raise run_config.ConfigError(
          f"--workdir {workdir} holds RL checkpoints (steps {rl}) of a run that did not start "
          f"from SFT: the SFT stage cannot come before them now; use a new --workdir")
    total, keep = self.run.sft.total_steps, "; keep it, or use a new --workdir"
    if finished is None or not total or finished == total:
      return finished is None
    if finished > total:
      raise run_config.ConfigError(
          f"--workdir {workdir}: its SFT stage finished at step {finished}, past "
          f"config.sft.total_steps={total}{keep}")
    if rl:
      raise run_config.ConfigError(
          f"--workdir {workdir}: RL trained (steps {rl}) from the SFT result of step "
          f"{finished}, and config.sft.total_steps={total} would change that model{keep}")
    return True

  @property
  def sft_marker(self):
    """Written when the SFT stage has finished, with the step it finished at."""
    return self.workdir / "sft" / "done.json"

  def sft_result_step(self) -> int | None:
    """The step the finished SFT stage ended at (None while it has not finished): as its
    marker records it, since its checkpoints may have been removed to free disk once RL had
    saved; its last checkpoint for a marker that does not record it."""
    marker = _read_json_on_lead(self.sft_marker)
    if marker is None:
      return None
    if "step" in marker:
      return marker["step"]
    sft = self.saved_steps("sft")
    if not sft:
      raise FileNotFoundError(
          f"{self.sft_marker} records that SFT finished, not at which step, and its "
          f"checkpoints ({self.workdir / run_checkpoint.STAGE_DIRS['sft']}) are gone: put "
          "them back, or use a new --workdir")
    return sft[-1]

  # --- Stages -------------------------------------------------------------------------------

  def evaluate(self, name: str, training_scenarios: bool = False) -> dict:
    """Dev evaluation of the current params, or with `training_scenarios` one on the
    scenarios RL trains on; kept in <workdir>/<name>/ and reused while the params are the
    checkpoint it evaluated under the same evaluation settings (a rerun may change them). One
    that a signal stopped resumes with the scenarios it finished, if the rerun evaluates the
    same weights the same way."""
    out = self.workdir / name
    split, scenarios = ((self.run.pipeline.train_split, self.run.pipeline.train_scenarios)
                        if training_scenarios else (self.run.eval.split,
                                                    self.run.eval.max_scenarios))
    # The run's config with its derived seeds, as config.json holds it.
    config = {**self.config_dict,
              "eval": {**self.config_dict["eval"], "data": self.root, "experiment": name,
                       "split": split, "max_scenarios": scenarios}}

    # Whether the report there stands is process 0's word, as in `_read_json_on_lead`; its
    # metrics travel, not its records.
    def reused_metrics() -> dict | None:
      report = storage.read_json(out / f"eval_{split}.json")
      return report["metrics"] if reusable(report, config, self.weights_from) else None

    metrics = multihost.from_lead(reused_metrics)
    if metrics is None:
      self.read_sft_result(f"the model that {name} evaluates")
      metrics = runner.evaluate(config, out, pool=self.pool, policy=self.eval_policy,
                                engine=self.engine, tokenizer=self.tokenizer,
                                checkpoint=self.weights_from, resume=True,
                                replace_other=True, hold_workdir=False)["metrics"]
    return metrics["overall"]

  def compact_tokenizer_dir(self) -> str:
    """Qwen2.5's tokenizer cut to the tokens of the SFT corpus (made once, kept in the run;
    made again when a write of it was cut short)."""
    out = compact_tokenizer.run_tokenizer_dir(self.workdir, "compact")
    corpus = self.expert_trajectories()  # every process: it may gather
    if multihost.is_lead() and not compact_tokenizer.is_complete(out):
      examples = self._load_examples(corpus)  # each turn encoded apart
      compact_tokenizer.write_compact_tokenizer(out, ids=(t for e in examples for t in e.tokens))
    multihost.sync_barrier("compact_tokenizer")
    return os.fspath(out)

  def retriever(self) -> Retriever:
    """The run's skill retrieval, for RL's rollouts and the expert plays. A "policy" embedding
    embeds with the sampler's current weights; no sampler exists yet while a compact
    vocabulary is cut to the SFT data, a combination run_config refuses."""
    return Retriever(self.run.retrieval, make_embedder(
        self.run.retrieval, engine=getattr(self, "engine", None), tokenizer=self.tokenizer))

  def expert_trajectories(self) -> str:
    """The SFT data file: the configured one, or made on first use from the gold solutions
    (or the starting policy) of `expert_task_ids`, played as the run's agent with its skill
    retrieval. Made once per workdir: the keys that pick its tasks are not resumable."""
    path = self.run.pipeline.expert_trajectories
    if not path:
      path = os.fspath(self.workdir / "expert_trajectories.jsonl")
      if not multihost.from_lead(storage.path(path).exists):  # every process plays, or none
        expert_cfg = dataclasses.replace(self.run.expert, appworld_root=self.root,
                                         outputs_root=self.pool.outputs_root)
        # Played as the run's agent, its skills retrieved as RL retrieves them: SFT trains on
        # the prompts RL shows.
        retriever, task_ids = self.retriever(), self.expert_task_ids()
        if expert_cfg.source == "self":  # self-distillation from the starting policy
          trajectories, stats = sft_expert.self_distilled_trajectories(
              lambda agent: rollout.SamplerPolicy(self.driver, agent), task_ids, expert_cfg,
              self.tokenizer, pool=self.pool, agent=self.run.agent, retriever=retriever)
        else:
          trajectories, stats = sft_expert.gold_trajectories(
              task_ids, expert_cfg, self.tokenizer, pool=self.pool, agent=self.run.agent,
              retriever=retriever)
        logging.info("expert trajectories: %d kept of %d tasks", stats.kept, stats.tasks)
        for extra, failed in (("rewrites", stats.rewrites_failed),
                              ("firsts", stats.firsts_failed)):
          if failed:
            logging.warning("expert %s: %d later tasks' extra plays failed and were left out: "
                            "%s", extra, len(failed), failed[:10])
        trajectories = self._fitting(trajectories)
        if multihost.is_lead():
          sft_data.write_jsonl(path, trajectories)
      multihost.sync_barrier("expert_trajectories")
    return path

  def _fitting(self, trajectories: list) -> list:
    """The expert's trajectories that fit the run's `engine.max_len`, which bounds what SFT
    trains on: a scripted play has longer budgets (`gold_solutions.SCRIPTED_BUDGET_FLOORS`),
    and a file holding a longer one would stop this run and every rerun of it. Replies longer
    than the run's turns (`agent.max_turn_tokens`, which cuts a rollout's) are named."""
    max_len, turn = self.run.engine.max_len, self.run.agent.max_turn_tokens
    examples = [sft_data.tokenize(t, self.tokenizer) for t in trajectories]
    long = sft_data.longer_than(examples, max_len)
    if long:
      logging.warning("expert trajectories: %d longer than config.engine.max_len=%d tokens left "
                      "out: %s", len(long), max_len,
                      ", ".join(f"{i} ({n} tokens)" for i, n in long[:10]))
    dropped = {i for i, _ in long}
    if cut := [(e.id, n) for e in examples if e.id not in dropped
               and (n := sft_data.longest_reply(e)) > turn]:
      logging.warning("expert trajectories: %d hold a reply longer than "
                      "config.agent.max_turn_tokens=%d, which the run's rollouts would cut (SFT "
                      "trains on it whole): %s", len(cut), turn,
                      ", ".join(f"{i} ({n} tokens)" for i, n in cut[:10]))
    return [t for t in trajectories if t.id not in dropped]

  def train_task_ids(self) -> list[str]:
    """The train split's tasks, cut to its first `train_scenarios` scenarios."""
    return appworld.first_scenarios(appworld.read_split(self.root, self.run.pipeline.train_split),
                                    self.run.pipeline.train_scenarios)

  def expert_task_ids(self) -> list[str]:
    """The tasks the expert plays for the SFT data: those RL trains on, unless `expert.splits`
    names splits, played whole (with `train_scenarios`, run_config allows only the train
    split there)."""
    if not self.run.expert.splits:
      return self.train_task_ids()
    return [t for split in self.run.expert.splits for t in appworld.read_split(self.root, split)]

  def _of_training_scenarios(self, examples: list) -> list:
    """The SFT examples (or trajectories) of the scenarios the run trains on: a given file,
    or the plays of a split named in `expert.splits`, may hold others."""
    if not self.run.pipeline.train_scenarios:
      return examples
    keep = {appworld.scenario_id(t) for t in self.train_task_ids()}
    return [e for e in examples if appworld.scenario_id(sft_expert.task_of_id(e.id)) in keep]

  def _load_examples(self, path: str, **kwargs) -> list:
    """`sft_data.load_examples` of the SFT data file `path`; a given file
    (`pipeline.expert_trajectories`) that cannot be read or parsed is the config's error."""
    try:
      return sft_data.load_examples(path, self.tokenizer, **kwargs)
    except (OSError, sft_data.FormatError) as e:
      if not self.run.pipeline.expert_trajectories:
        raise
      raise run_config.ConfigError(f"config.pipeline.expert_trajectories: {e}") from e

  def expert_examples(self) -> list:
    """The SFT data's examples of the scenarios the run trains on (`_of_training_scenarios`).
    Every process reads them, and every process must read the same: each packs its share of
    the same steps' examples, and an epoch-counted SFT takes its length from them."""
    path = self.expert_trajectories()
    examples = self._of_training_scenarios(
        self._load_examples(path, max_len=self.run.engine.max_len))
    multihost.check_same(sft_data.fingerprint(examples), f"the SFT data read from {path}")
    return examples

  def sft(self) -> LoopResult:
    run = self.run
    examples = self.expert_examples()
    longest = max(examples, key=lambda e: len(e.tokens), default=None)
    if longest is not None and len(longest.tokens) - 1 > self.batch_config.length_buckets[-1]:
      raise run_config.ConfigError(
          f"config.batch.length_buckets: the largest, {self.batch_config.length_buckets[-1]}, "
          f"holds fewer positions than the SFT example {longest.id} needs "
          f"({len(longest.tokens) - 1}); SFT would fail at the first batch holding it. Add a "
          "bucket that large")
    optimizer = stage_optimizer(run.sft_optimizer, run.sft.steps_for(len(examples)),
                                "sft_optimizer", "SFT")
    trainer = sft_loop.sft_trainer(self.model, run.sft, optimizer, run.trainer, mesh=self.mesh)
    directory = self.workdir / "sft"
    checkpointer = self._sft_checkpointer(run_config=self.config_dict)

    def dev(step: int) -> dict:  # the sampler takes SFT's params only when it evaluates them
      self.sync_sampler(trainer.params)
      self._trained("sft", step)
      return self.evaluate(f"eval_sft_step{step}")

    try:
      result = sft_loop.run_sft(
          trainer, examples, config=run.sft, batch_config=self.batch_config,
          evaluate=dev if run.sft.eval_every else None, checkpointer=checkpointer,
          metrics=dataclasses.replace(run.metrics, log_dir=os.fspath(directory)))
    finally:
      checkpointer.close()
    self.sync_sampler(trainer.params)
    self._trained("sft", result.end_step)
    return result

  def adopt_sft_result(self) -> None:
    """Takes the finished SFT stage's result as the model (a run resumed after SFT), its
    params read when first used (`read_sft_result`): a resumed RL stage restores its own
    checkpoint over them, so it reads none (minutes for a large model) unless KL's reference
    is SFT's result, and runs on when SFT's checkpoints were removed to free disk."""
    self._trained("sft", self.sft_result_step())
    self.sft_result_unread = True

  def read_sft_result(self, use: str) -> None:
    """Reads the adopted SFT params into the model and the sampler, unless they are there;
    `use` names what needs them, for the error when they are gone. Only the params are read:
    SFT's optimiser state, twice the params under Adam, stays on disk."""
    if not self.sft_result_unread:
      return
    step = self.weights_from["step"]
    directory = self.workdir / run_checkpoint.STAGE_DIRS["sft"]
    if step not in self.saved_steps("sft"):
      raise FileNotFoundError(
          f"{directory}: this run needs SFT's result (step {step}) as {use}, and that "
          "checkpoint is gone (RL's checkpoints hold only the params RL trains). Put it back, "
          "or use a new --workdir")
    reader = Checkpointer(CheckpointConfig(directory=os.fspath(directory), read_only=True))
    try:
      params = reader.restore_params(abstract_like(nnx.state(self.model)), step)
    finally:
      reader.close()
    nnx.update(self.model, params)
    self.sync_sampler(params)
    self.sft_result_unread = False

  def _trained(self, stage: str, step: int) -> None:
    """Records that the model holds `stage`'s checkpoint `step` (step 0: nothing trained)."""
    if step:
      self.weights_from = {"run": os.fspath(self.workdir), "stage": stage, "step": step}
      self.sft_result_unread = False

  def _sft_checkpointer(self, run_config: Any) -> Checkpointer:
    """SFT's checkpoints, <workdir>/sft/checkpoints (the last ones: no dev metric ranks them),
    every `sft.save_every` steps."""
    directory = self.workdir / run_checkpoint.STAGE_DIRS["sft"]
    return Checkpointer(dataclasses.replace(
        self.run.checkpoint, directory=os.fspath(directory), keep_best=0,
        save_every=self.run.sft.save_every or self.run.checkpoint.save_every),
        run_config=run_config)

  def rl(self) -> LoopResult:
    run = self.run
    # KL's reference is the model RL starts from (the SFT result, also on a resumed run). A
    # resumed RL stage without KL needs nothing of it: its own checkpoint is restored over
    # the trainer's params.
    if run.grpo.use_kl:
      self.read_sft_result("KL's reference (grpo.kl_coef > 0)")
    elif not self.saved_steps("rl"):
      self.read_sft_result("the model RL starts from")
    optimizer = stage_optimizer(run.optimizer, run.rl.total_steps * run.grpo.num_mini_batches,
                                "optimizer", "RL")
    trainer = rl_loop.grpo_trainer(self.model, run.grpo, optimizer, run.trainer, mesh=self.mesh)
    task_ids = self.train_task_ids()
    k = run.rollout.effective_chain_length
    if short := [s for s, ids in appworld.group_by_scenario(task_ids).items() if len(ids) < k]:
      logging.warning("%d training scenario(s) have fewer than the %d tasks of a chain and are "
                      "never drawn: %s", len(short), k, ", ".join(short[:10]))
    ctx = rollout.RolloutContext(self.policy, self.pool, self.tokenizer, run.agent,
                                 self.retriever(), self.root)
    collect = rl_loop.appworld_rollout(ctx, task_ids, run.rollout, run.reward, run.advantage,
                                       num_chains=run.pipeline.chains_per_step)

    def dev(step: int) -> dict:
      self._trained("rl", step)
      return self.evaluate(f"eval_step{step}")

    checkpointer = self._rl_checkpointer()
    # KL's reference, frozen and sharded like the parameters; nothing is kept when KL is off.
    reference = rl_loop.frozen_copy(trainer.params) if run.grpo.use_kl else None
    try:
      result = rl_loop.run_rl(
          trainer, rollout=collect, config=run.rl, grpo_config=run.grpo,
          batch_config=self.batch_config, evaluate=dev if run.rl.eval_every else None,
          sync_params=self.sync_sampler, checkpointer=checkpointer,
          metrics=dataclasses.replace(run.metrics, log_dir=os.fspath(self.workdir)),
          reference_params=reference)
    finally:
      checkpointer.close()
    self.sync_sampler(trainer.params)
    self._trained("rl", result.end_step)
    return result

  def _rl_checkpointer(self) -> Checkpointer:
    """RL's checkpoints: without dev evaluations (rl.eval_every 0) no metric ranks them, and
    none is kept as the best, unless an earlier run of this workdir kept one: orbax would
    delete that one at the next save."""
    directory = os.fspath(self.workdir / run_checkpoint.STAGE_DIRS["rl"])
    checkpoint = dataclasses.replace(self.run.checkpoint, directory=directory)
    if not self.run.rl.eval_every:
      reader = Checkpointer(CheckpointConfig(
          directory=directory, read_only=True, best_metric=checkpoint.best_metric,
          best_mode=checkpoint.best_mode))
      try:
        if reader.best_step() is None:
          checkpoint = dataclasses.replace(checkpoint, keep_best=0)
      finally:
        reader.close()
    return Checkpointer(checkpoint, run_config=self.config_dict)

  def sync_sampler(self, params: nnx.State) -> None:
    """Every process's sampler samples from `params` (a collective: all processes call it)."""
    copy = self.weight_sync(params, replacing=self.engine.weights[1])
    self.weight_sync.check_copies_agree(copy)
    self.engine.update_params(copy)

  def export(self, summary: dict) -> str:
    """Writes the model as trained to workdir/hf, with what `sage_jax.export` writes beside a
    checkpoint's: the run's config and a model card (`summary`'s evaluations in its table). The
    weights are in the dtype of the HF checkpoint the run started from, else in param_dtype
    (`export.write_model`). An export there of the same checkpoint with the same files,
    as its record says (`EXPORT_RECORD`, written last), is kept: a rerun of a finished run
    exports nothing (for a large model, minutes and the model's size in writes)."""
    out = self.workdir / "hf"
    held = self.weights_from or {"stage": None, "step": 0}
    files = export.run_files(ml_collections.ConfigDict(self.config_dict), held["stage"],
                             held["step"], {"table": summary_table(summary), "weights": held}
                             if {"before", "after"} & summary.keys() else {})
    record = {"stage": held["stage"], "step": held["step"], "files_sha256": hashlib.sha256(
        json.dumps(files, sort_keys=True).encode()).hexdigest()}
    if _read_json_on_lead(out / EXPORT_RECORD) == record:
      return os.fspath(out)
    self.read_sft_result("the model exported")
    # <workdir>/hf is the run's own: it replaces the export of the run's earlier weights.
    export.write_model(self.model, os.fspath(out), compact_tokenizer.run_tokenizer_dir(
        self.workdir, self.run.model.vocabulary), base_model=self.run.model.spec,
        text_files=files, of=export.export_of(self.workdir, held["stage"], held["step"]),
        overwrite=True)
    _write_json(out / EXPORT_RECORD, record)
    return os.fspath(out)


def summary_table(summary: dict) -> str:
  """Before/after columns of the dev evaluation, and of the training scenarios' when run."""
  titles = {"train_before": "train before", "train_after_sft": "train after SFT",
            "train_after": "train after"}
  columns = [(k, title) for k, title in titles.items() if k in summary] + [
      ("before", "dev before"), ("after", "dev after")]
  if len(columns) == 2:
    columns = [("before", "before"), ("after", "after")]
  rows = ["| metric | " + " | ".join(title for _, title in columns) + " |",
          "|---" * (len(columns) + 1) + "|"]
  for key in SUMMARY_KEYS:
    cell = lambda m: "-" if m is None or m.get(key) is None else _number(m[key])
    rows.append(f"| {key} | " + " | ".join(cell(summary.get(c)) for c, _ in columns) + " |")
  return "\n".join(rows)


def _number(x: float) -> str:
  """Three significant digits, but whole numbers from 100 on (tokens, not 1.48e+03)."""
  return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def run(config: Any, workdir: str) -> dict:
  """Runs the configured stages; returns the summary (also written to summary.json, with the
  checkpoint its results are of), or, when a signal stopped a stage (its checkpoint saved),
  what was done with `preempted` naming the stage and `stop_signal` the signal this process
  caught (None: another's). A rerun moves the summary of the run before it to
  summary.previous.json as it starts: it describes weights the rerun may change."""
  started = time.time()
  pipe = Pipeline(config, workdir)
  p = pipe.run.pipeline
  if multihost.is_lead() and (pipe.workdir / "summary.json").exists():
    (pipe.workdir / "summary.json").replace(pipe.workdir / "summary.previous.json")
  summary: dict[str, Any] = {"workdir": os.fspath(pipe.workdir)}
  try:
    if p.eval_before:
      summary["before"] = pipe.evaluate("eval_before")
      if p.eval_train:
        summary["train_before"] = pipe.evaluate("eval_before", training_scenarios=True)
    # SFT runs when it has not finished, or to continue to more steps than it finished at.
    if pipe.sft_pending:
      result = pipe.sft()
      if result.preempted:
        return {**summary, "preempted": "sft", "stop_signal": result.stop_signal}
      _write_json(pipe.sft_marker, {"finished": time.time(), "step": result.end_step})
    elif "sft" in p.stages:  # resumed after SFT: its result is the starting point
      pipe.adopt_sft_result()
    if p.eval_train and "sft" in p.stages and "rl" in p.stages:  # what RL starts from
      summary["train_after_sft"] = pipe.evaluate("eval_after_sft", training_scenarios=True)
    if "rl" in p.stages:
      result = pipe.rl()
      if result.preempted:
        return {**summary, "preempted": "rl", "stop_signal": result.stop_signal}
    if p.eval_after:
      summary["after"] = pipe.evaluate("eval_after")
      if p.eval_train:
        summary["train_after"] = pipe.evaluate("eval_after", training_scenarios=True)
    if p.export and jax.process_index() == 0:
      summary["export"] = pipe.export(summary)
    elif p.export:
      pipe.export(summary)  # every process joins the gathers
    if p.plot and multihost.is_lead():
      summary["plots"] = plot.plot_stages(os.fspath(pipe.workdir))
    summary["weights"] = pipe.weights_from or {"stage": None, "step": 0}
    summary["elapsed_s"] = round(time.time() - started, 1)
    summary["table"] = summary_table(summary)
    _write_json(pipe.workdir / "summary.json", summary)
  finally:
    pipe.close()  # after the last write: the workdir is held until then
  return summary


# XLA:CPU's default schedule starts independent work early, which keeps every layer's
# recomputed activations alive at once and undoes remat (the 0.5B on 4k tokens: 31 GB of
# temporaries instead of 4.8). The memory-optimised schedule keeps remat's savings; other
# backends ignore the flag. It must be set before JAX starts its backend.
CPU_REMAT_FLAG = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"


def main(argv) -> None:
  del argv
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  if "eval" in config and "pipeline" not in config:
    raise app.UsageError("--config is an evaluation config (configs/eval.py); run it with "
                         "`python -m sage_jax.evaluate`")
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if config.model.remat != "none" and "xla_cpu_scheduler_type" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} {CPU_REMAT_FLAG}".strip()
  if not flags.FLAGS["verbosity"].present:  # orbax logs every file at INFO
    absl_logging.set_verbosity(absl_logging.WARNING)
  cache_dir = config.pipeline.compilation_cache_dir
  if cache_dir:  # checked like the workdir, and set before anything compiles
    storage.open_workdir(cache_dir, flag="--config.pipeline.compilation_cache_dir")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
  multihost.initialize()
  logging.getLogger("httpx").setLevel(logging.WARNING)
  lead = multihost.is_lead()
  if lead:
    print(config, flush=True)
  summary = run(config, workdir)
  multihost.finish()  # every process stops at the same step, preempted or not
  if "preempted" in summary:
    logging.warning("Stopped by a signal during the %s stage, its checkpoint saved; run the "
                    "same command again to resume.", summary["preempted"])
    sys.exit(preempted_exit_code(summary["stop_signal"]))
  if lead:
    print(summary["table"])
    print(f"workdir: {summary['workdir']}  ({summary['elapsed_s']} s)")


def define_flags() -> None:
  """The entry point's flags (defined only when run, so importing this module defines none)."""
  config_file.define_flag("config", "configs/<file>.py:<preset>")
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, exports): a local "
                      "path or a URL such as gs://bucket/run.")
  flags.mark_flags_as_required(["config", "workdir"])


if __name__ == "__main__":
  define_flags()
  config_file.run(main)
