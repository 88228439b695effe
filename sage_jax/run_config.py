"""The schema of a run: which config section builds which dataclass, and cross-field checks.

`configs/*.py` start from `defaults()` (every section at its dataclass defaults, so the
printed config states every setting) and change what their preset needs. `resolve()` turns
a ConfigDict into a `RunConfig` of built dataclasses, failing with the key's full path on an
unknown key, a wrong type or an inconsistent combination, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
import zlib
from typing import Any

import ml_collections

from sage_jax.agent.config import AgentConfig, RetrievalConfig
from sage_jax.agent.retrieval import EMBEDDING_STRATEGIES
from sage_jax.configurable import ConfigError, build
from sage_jax.envs.appworld.config import EnvPoolConfig
from sage_jax.eval import metrics as eval_metrics
from sage_jax.eval.runner import EvalConfig, check_evaluation_sections
from sage_jax.multihost import SamplerMeshConfig
from sage_jax.rl.advantages import AdvantageConfig
from sage_jax.rl.batch import BatchConfig
from sage_jax.rl.grpo import GRPOConfig
from sage_jax.rl.rewards import RewardConfig
from sage_jax.rl.rollout import RolloutConfig
from sage_jax.sampler import EngineConfig
from sage_jax.sft.expert import ExpertConfig
from sage_jax.sft.loop import SFTConfig
from sage_jax.sharding import MeshConfig
from sage_jax.train.checkpoint import CheckpointConfig
from sage_jax.train.metrics import MetricsConfig
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.rl_loop import RLLoopConfig
from sage_jax.train.step import TrainerConfig
from sage_jax.weights.loader import ModelSpec

STAGES = ("sft", "rl")
TASKS_PER_SCENARIO = 3  # AppWorld's official splits and the mini world alike


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """stages: what `sage_jax.train` runs, in order ("sft", "rl"). data: "mini" (the offline
  mini AppWorld, built on first use) or an APPWORLD_ROOT. train_split: the dataset split of
  the rollouts and, unless expert.splits names others, of the expert plays that make the SFT
  data (dev evaluation runs on eval.split). chains_per_step: chains sampled per RL step (each
  run by grpo.group_size rollouts). train_scenarios: train on the first N scenarios of the
  train split (file order), in SFT and RL (0 = all): the expert plays only those, and SFT
  keeps only their examples of a given file. expert_trajectories: an SFT JSONL file ("" = made
  by the expert's plays, `expert.source`, once per workdir). eval_before /
  eval_after: dev evaluation around training, and with eval_train also one on the training
  scenarios. export: write the final model in HF format to <workdir>/hf. plot: PNG curves.
  compilation_cache_dir: JAX's persistent compilation cache (a path or gs:// URL every host
  reaches; "" = JAX's own setting, e.g. JAX_COMPILATION_CACHE_DIR): a rerun after a
  preemption loads its compiled programs instead of compiling them again."""

  stages: tuple[str, ...] = ("sft", "rl")
  data: str = "mini"
  train_split: str = "train"
  chains_per_step: int = 4
  train_scenarios: int = 0
  expert_trajectories: str = ""
  eval_before: bool = True
  eval_after: bool = True
  eval_train: bool = False
  export: bool = True
  plot: bool = True
  compilation_cache_dir: str = ""

  def __post_init__(self):
    unknown = [s for s in self.stages if s not in STAGES]
    if (unknown or len(set(self.stages)) != len(self.stages)
        or list(self.stages) != [s for s in STAGES if s in self.stages]):
      raise ValueError(f"stages={self.stages}: each of {STAGES} at most once, in that order "
                       "(RL starts from SFT's result)")
    if self.chains_per_step < 1:
      raise ValueError(f"chains_per_step must be >= 1, got {self.chains_per_step}")
    if self.train_scenarios < 0:
      raise ValueError(f"train_scenarios must be >= 0, got {self.train_scenarios}")


# Section name -> dataclass. A section absent from a config takes the dataclass defaults.
# (The `advantage` section is built from the GRPO knobs below; a config has no such section.)
SECTIONS: dict[str, type] = {
    "pipeline": PipelineConfig,
    "model": ModelSpec,
    "mesh": MeshConfig,
    "sampler_mesh": SamplerMeshConfig,
    "pool": EnvPoolConfig,
    "engine": EngineConfig,
    "agent": AgentConfig,
    "retrieval": RetrievalConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "advantage": AdvantageConfig,
    "grpo": GRPOConfig,
    "optimizer": OptimizerConfig,
    "batch": BatchConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "rl": RLLoopConfig,
    "expert": ExpertConfig,
    "sft": SFTConfig,
    "sft_optimizer": OptimizerConfig,
    "eval": EvalConfig,
}


# The GRPO knobs, all in the config's `grpo` section so that one place says which GRPO a run
# is: its key there -> the (section, field) it builds. GRPOConfig's own keys there are the
# loss type (loss_aggregation, ratio_level, clipping) and KL (kl_coef, kl_estimator, kl_clamp).
GRPO_KNOBS: dict[str, tuple[str, str]] = {
    "group_size": ("rollout", "group_size"),  # G rollouts of each chain
    "chain_length": ("rollout", "chain_length"),  # K tasks per chain
    "single_task": ("rollout", "single_task"),  # K = 1 without a library (the baseline)
    "max_redraws": ("rollout", "max_redraws"),  # dynamic sampling: redraw no-signal chains
    "advantage_estimator": ("advantage", "estimator"),
    "advantage_std": ("advantage", "std"),
    "advantage_epsilon": ("advantage", "epsilon"),
}
# Sections whose every key is a GRPO knob: no section of their own in a config.
KNOB_SECTIONS = tuple(name for name, cls in SECTIONS.items()
                      if {f.name for f in dataclasses.fields(cls)}
                      <= {field for s, field in GRPO_KNOBS.values() if s == name})
CONFIG_SECTIONS = tuple(name for name in SECTIONS if name not in KNOB_SECTIONS)


# Keys a training run sets itself, from --workdir and pipeline.data: setting one is an error
# rather than a value silently replaced.
SET_BY_THE_RUN = {
    "pool.appworld_root": "pipeline.data",
    "expert.appworld_root": "pipeline.data",
    "expert.outputs_root": "the pool's outputs (pool.outputs_root)",
    "checkpoint.directory": "--workdir",
    "metrics.log_dir": "--workdir",
    "eval.data": "pipeline.data",
    "eval.experiment": "the evaluation's name (eval_before, eval_step<N>, eval_after)",
    "grpo.temperature": "agent.temperature (the trainer's policy is the one rollouts sample)",
}


# Sections with a `seed` of their own: left unset (None), it derives from config.seed.
SEEDED_SECTIONS = tuple(name for name, cls in SECTIONS.items()
                        if "seed" in {f.name for f in dataclasses.fields(cls)})


def component_seed(seed: int, section: str) -> int:
  """Section `section`'s seed in a run seeded `seed`: distinct per section, so that model
  initialisation, chain draws, sampling and data order do not share a random stream."""
  return zlib.crc32(f"{section}/{seed}".encode()) & 0x7FFFFFFF


def with_seeds(config: Any, run: "RunConfig") -> dict:
  """`config` as a dict with every derived section seed filled in: what a run writes beside
  its outputs, so that the file alone reproduces it."""
  out = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  out["seed"] = run.seed
  for name in SEEDED_SECTIONS:
    out[name] = {**(out.get(name) or {}), "seed": getattr(run, name).seed}
  return out


# Keys (or sections, ending in ".") a rerun into an existing workdir may change: how long it
# runs and how it is laid out, checkpointed, evaluated and reported. Any other change (the
# data, what the model sees or samples with, the objective, the seeds) would resume the run's
# checkpoints under another experiment. `pipeline.stages` may gain stages, not lose them.
RESUMABLE_KEYS = (
    "rl.total_steps", "rl.eval_every", "sft.total_steps", "sft.eval_every", "sft.save_every",
    "sft.logprob_chunk", "grpo.logprob_chunk", "checkpoint.", "metrics.", "eval.", "batch.",
    "mesh.", "sampler_mesh.tensor", "sampler_mesh.fuse_projections",
    "trainer.skip_empty_micro_batches", "engine.num_slots",
    "engine.prefill_buckets", "engine.min_attend", "engine.steps_per_call", "engine.max_top_k",
    "pool.num_workers", "pool.start_timeout_s", "pool.call_timeout_s", "pool.kill_grace_s",
    "pool.log_dir", "pool.outputs_root", "pool.keep_outputs", "pool.data_check_cache",
    "pool.use_servers", "pool.episode_retries", "expert.num_workers", "expert.outputs_root",
    "model.remat", "model.remat_layers", "model.attention_block", "model.attention_impl",
    "model.decode_attention_impl", "pipeline.compilation_cache_dir", "pipeline.eval_before",
    "pipeline.eval_after", "pipeline.eval_train", "pipeline.export", "pipeline.plot")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(value, dict):
    return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
  return {prefix[:-1]: value}


def _comparable(config: dict) -> dict[str, Any]:
  """`config` flattened to JSON values, `expert.splits` unset written as the train split: a
  workdir's SFT data is made once, and for its examples (those of the scenarios trained) the
  expert playing the train split whole or only its training scenarios is the same."""
  flat = _flat(json.loads(json.dumps(config, default=str)))
  if flat.get("expert.splits") == [] and "pipeline.train_split" in flat:
    flat["expert.splits"] = [flat["pipeline.train_split"]]
  return flat


def not_a_run(recorded: Any) -> str | None:
  """What `recorded`, a directory's config.json, looks like when it is not a training run's
  config (it has no `pipeline` section, as `run_checkpoint.run_config_at` tells them apart):
  "an HF model config (...)" for a model's directory, such as a run's HF export; None for a
  run's config."""
  if isinstance(recorded, dict) and "pipeline" in recorded:
    return None
  return (f"an HF model config (model_type {recorded['model_type']!r})"
          if isinstance(recorded, dict) and "model_type" in recorded
          else "some other file (no `pipeline` section)")


def check_recorded(recorded: Any, source: str) -> None:
  """Raises ConfigError when `recorded`, the config.json found in a --workdir (at `source`), is
  not a training run's (`not_a_run`): that directory is something else, such as a run's HF
  export, and recording a run there would overwrite its file."""
  looks = not_a_run(recorded)
  if looks is None:
    return
  raise ConfigError(
      f"{source} is not a training run's config: it looks like {looks}, so this directory "
      "is not a run's workdir (a run's HF export, <workdir>/hf, is a model). Nothing was "
      "written; pass a new --workdir, or the workdir of the run to resume")


def check_resume(recorded: dict, config: dict, source: str) -> None:
  """Raises ConfigError when `config` (as `with_seeds` gives it) changes a key of the
  experiment that `recorded` (the workdir's config.json, at `source`) started. Keys only one
  of them has (added or dropped by another version of this code) are not compared."""
  old, new = _comparable(recorded), _comparable(config)
  changed = sorted(k for k in old.keys() & new.keys()
                   if old[k] != new[k] and not k.startswith(RESUMABLE_KEYS))
  if "pipeline.stages" in changed and set(old["pipeline.stages"]) <= set(new["pipeline.stages"]):
    changed.remove("pipeline.stages")  # a stage added (e.g. RL after an SFT-only run)
  if changed:
    shown = "; ".join(f"config.{k}: {old[k]!r} -> {new[k]!r}" for k in changed[:10])
    raise ConfigError(
        f"{source} records the run this workdir holds, and this config changes "
        f"{len(changed)} of its settings ({shown}{' ...' if len(changed) > 10 else ''}); "
        "resuming would continue its checkpoints under another experiment. Use a new "
        "--workdir, or move that config.json aside to resume under the new settings")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  seed: int
  pipeline: PipelineConfig
  model: ModelSpec
  mesh: MeshConfig
  sampler_mesh: SamplerMeshConfig
  pool: EnvPoolConfig
  engine: EngineConfig
  agent: AgentConfig
  retrieval: RetrievalConfig
  rollout: RolloutConfig
  reward: RewardConfig
  advantage: AdvantageConfig
  grpo: GRPOConfig
  optimizer: OptimizerConfig
  batch: BatchConfig
  trainer: TrainerConfig
  checkpoint: CheckpointConfig
  metrics: MetricsConfig
  rl: RLLoopConfig
  expert: ExpertConfig
  sft: SFTConfig
  sft_optimizer: OptimizerConfig
  eval: EvalConfig


def _asdict(instance: Any) -> dict:
  """Field values as they are: tuples stay tuples, which ml_collections can override from the
  command line (`--config.pipeline.stages="('rl',)"`); it cannot override lists."""
  return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def _overridable(name: str, values: dict) -> dict:
  """Section `name`'s `values` with each None replaced by a typed placeholder (None until
  set): the command line can then set it (`--config.rollout.seed=1`), which it cannot do for
  a plain None."""
  out = dict(values)
  for key, value in values.items():
    if value is None:
      cls, field = (SECTIONS[GRPO_KNOBS[key][0]], GRPO_KNOBS[key][1]) if (
          name == "grpo" and key in GRPO_KNOBS) else (SECTIONS[name], key)
      hint = typing.get_type_hints(cls)[field]
      kinds = [t for t in typing.get_args(hint) if t is not type(None)] if isinstance(
          hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
      out[key] = ml_collections.config_dict.placeholder(kinds[0] if len(kinds) == 1 else object)
  return out


def defaults() -> ml_collections.ConfigDict:
  """Every section at its dataclass defaults; unset (None) fields are typed placeholders."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  sections = {}
  for name, cls in SECTIONS.items():
    kwargs = {"spec": "tiny"} if cls is ModelSpec else {}
    sections[name] = _asdict(cls(**kwargs))
  knobs = {key: sections[name].pop(field) for key, (name, field) in GRPO_KNOBS.items()}
  sections["grpo"] = {**knobs, **sections["grpo"]}
  sections["model"].update(spec="", preset="tiny")
  for name in CONFIG_SECTIONS:
    if name in SEEDED_SECTIONS:
      sections[name]["seed"] = None  # derived from config.seed
    config[name] = ml_collections.ConfigDict(_overridable(name, sections[name]),
                                             type_safe=False)
  return config


def _knobs_apart(sections: dict) -> dict:
  """`sections` with the GRPO knobs moved from `grpo` to the sections they build; a knob set
  at its old place is an error naming where it belongs."""
  sections = {name: dict(sections.get(name) or {}) for name in CONFIG_SECTIONS}
  for key, (name, field) in GRPO_KNOBS.items():
    if name in sections and field in sections[name]:
      raise ConfigError(f"config.{name}.{field}: a GRPO knob; set config.grpo.{key}")
  for name in KNOB_SECTIONS:
    sections[name] = {}
  for key, (name, field) in GRPO_KNOBS.items():
    if key in sections["grpo"]:
      sections[name][field] = sections["grpo"].pop(key)
  return sections


def _build(name: str, section: dict) -> Any:
  """`build` of one section; errors about a GRPO knob name its key in config.grpo."""
  try:
    return build(SECTIONS[name], section, f"config.{name}")
  except ConfigError as e:
    message = str(e)
    for key, (knob_section, field) in GRPO_KNOBS.items():
      if knob_section == name:
        message = message.replace(f"config.{name}.{field}", f"config.grpo.{key}")
        head = f"config.{name}: {field}"  # a dataclass's own check: "<field>=... " or " must"
        if message.startswith(head + "="):
          message = f"config.grpo.{key}: {message[len(head) + 1:]}"
        elif message.startswith(head + " "):
          message = f"config.grpo.{key}{message[len(head):]}"
    raise ConfigError(message) from e


def resolve(config: Any, num_devices: int | None = None,
            local_devices: int | None = None, trained: bool = False) -> RunConfig:
  """Builds every section and checks the combinations; errors name the offending key.
  `num_devices`: all devices of the run (the training mesh); `local_devices`: those of one
  host (the sampler's mesh). `trained`: the config of a run that has trained (its model and
  SFT data exist, as `evaluate --run` reads them), so what training must build before its
  model exists is not checked."""
  sections = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  unknown = sorted(set(sections) - set(CONFIG_SECTIONS) - {"seed"})
  if unknown:
    moved = [k for k, (name, _) in GRPO_KNOBS.items() if name == unknown[0]]
    raise ConfigError(f"config.{unknown[0]}: " + (
        f"its keys are GRPO knobs in config.grpo ({', '.join(moved)})" if moved
        else f"unknown section; known: {sorted(CONFIG_SECTIONS)}"))
  seed = sections.get("seed", 0)
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ConfigError(f"config.seed: expected int, got {seed!r}")
  sections = _knobs_apart(sections)
  for name in SEEDED_SECTIONS:
    if sections[name].get("seed") is None:
      sections[name]["seed"] = component_seed(seed, name)
  built = {name: _build(name, sections[name]) for name in SECTIONS}
  for key, source in SET_BY_THE_RUN.items():
    section, field = key.split(".")
    default = next(f.default for f in dataclasses.fields(SECTIONS[section]) if f.name == field)
    if getattr(built[section], field) != default:
      raise ConfigError(f"config.{key}: set by the run from {source}; leave it unset")
  agent = built["agent"]
  if agent.temperature <= 0 and "rl" in built["pipeline"].stages:
    raise ConfigError(f"config.agent.temperature: {agent.temperature} samples greedily; RL "
                      "needs sampled rollouts (a greedy group is one rollout repeated)")
  if agent.temperature > 0:
    built["grpo"] = dataclasses.replace(built["grpo"], temperature=agent.temperature)
  run = RunConfig(seed=seed, **built)
  _check(run, num_devices, local_devices, trained)
  return run


def _check(run: RunConfig, num_devices: int | None, local_devices: int | None,
           trained: bool) -> None:
  rollout, pipeline = run.rollout, run.pipeline
  estimator = run.advantage.estimator
  if rollout.group_size == 1 and "rl" in pipeline.stages:  # every estimator centres
    raise ConfigError("config.grpo.group_size: 1 leaves no group to normalise over; the "
                      f"{estimator!r} advantage is 0 for every episode (use >= 2)")
  if (pipeline.train_scenarios and set(run.expert.splits) - {pipeline.train_split}
      and not pipeline.expert_trajectories):
    raise ConfigError(
        f"config.expert.splits: {run.expert.splits} with pipeline.train_scenarios="
        f"{pipeline.train_scenarios}, which keeps for SFT only the first "
        f"{pipeline.train_scenarios} scenarios of pipeline.train_split "
        f"{pipeline.train_split!r}: leave expert.splits unset (the expert plays the scenarios "
        "RL trains on), name only the train split (played whole), or set train_scenarios=0 "
        "(SFT on every task of expert.splits, RL on the whole train split)")
  if run.model.vocabulary == "compact" and run.expert.source == "self" and not trained:
    raise ConfigError("config.model.vocabulary: 'compact' is cut to the SFT corpus, which "
                      "expert.source='self' samples from the model itself; use the gold "
                      "trajectories or the full vocabulary")
  if (run.model.vocabulary == "compact" and not pipeline.expert_trajectories and not trained
      and run.retrieval.strategy in EMBEDDING_STRATEGIES
      and run.retrieval.embedding_model == "policy"):
    raise ConfigError("config.retrieval.embedding_model: 'policy' embeds with the policy model, "
                      "and the expert plays that make the SFT data retrieve skills with it, "
                      "but a 'compact' vocabulary builds that model from the SFT data; use "
                      "'minilm' or 'hashing', the full vocabulary, or "
                      "pipeline.expert_trajectories")
  check_evaluation_sections(run.agent, run.engine, run.pool, run.eval)
  episode = run.agent.max_episode_tokens  # at most engine.max_len (above)
  if "rl" in pipeline.stages and run.batch.length_buckets[-1] < episode - 1:
    raise ConfigError(
        f"config.batch.length_buckets: the largest, {run.batch.length_buckets[-1]}, holds "
        f"fewer positions than an episode of agent.max_episode_tokens {episode} needs "
        f"({episode - 1}); the first update with such an episode would fail. Add a "
        "bucket that large")
  if not trained and run.eval.policy != "model":
    raise ConfigError(f"config.eval.policy: {run.eval.policy!r}; a training run evaluates its "
                      "own model ('model'): run `python -m sage_jax.evaluate` for the "
                      "scripted policy")
  if pipeline.plot and not run.metrics.jsonl:
    raise ConfigError("config.pipeline.plot: True draws the curves from metrics.jsonl, which "
                      "metrics.jsonl=False does not write; set plot=False, or keep the file")
  if not trained and run.checkpoint.read_only:
    raise ConfigError("config.checkpoint.read_only: True writes no checkpoint, which a "
                      "training run does")
  if rollout.single_task and rollout.chain_length != 1:
    raise ConfigError(f"config.grpo.chain_length: {rollout.chain_length} with "
                      "grpo.single_task=True, whose rollouts are single tasks (K = 1, the "
                      "GRPO baseline); set chain_length=1, or single_task=False for chains")
  if rollout.effective_chain_length > TASKS_PER_SCENARIO:
    raise ConfigError(f"config.grpo.chain_length: {rollout.chain_length} exceeds the "
                      f"{TASKS_PER_SCENARIO} tasks of an AppWorld scenario")
  if rollout.single_task and run.agent.use_library and "rl" in pipeline.stages:
    raise ConfigError("config.agent.use_library: True with grpo.single_task=True, whose "
                      "rollouts keep no library (the GRPO baseline): SFT and evaluation would "
                      "show the agent a library that RL never does; set use_library=False, as "
                      "configs/grpo.py does")
  _check_evaluation_split(run, trained)
  best = run.checkpoint.best_metric
  reported = best.startswith("dev/") and eval_metrics.reports(best.removeprefix("dev/"))
  if not trained and run.checkpoint.keep_best and not reported:
    raise ConfigError(
        f"config.checkpoint.best_metric: {best!r} is not a number the dev evaluation reports, "
        "so no checkpoint would be kept as the best; expected 'dev/' and one of "
        f"{', '.join(eval_metrics.reported_numbers())} (or a per-position rate, "
        "'dev/no_code_rate/pos1'), or keep_best=0")
  if num_devices is not None:
    try:
      data, fsdp, _ = run.mesh.resolve(num_devices)
    except ValueError as e:
      raise ConfigError(f"config.mesh: {e}") from e
    rollouts = pipeline.chains_per_step * rollout.group_size
    if "rl" in pipeline.stages and rollouts % data:
      raise ConfigError(f"config.pipeline.chains_per_step: {pipeline.chains_per_step} chains x "
                        f"grpo.group_size {rollout.group_size} = {rollouts} rollouts per step, "
                        f"not divisible by the mesh's data axis ({data})")
  if run.sampler_mesh.merge_lora != "auto" and not run.model.lora_rank:
    raise ConfigError(f"config.sampler_mesh.merge_lora: {run.sampler_mesh.merge_lora!r} with "
                      "model.lora_rank=0, which adds no adapters to merge: set "
                      "model.lora_rank, or leave merge_lora 'auto'")
  if run.reward.variant == "sage" and not run.agent.use_library and "rl" in pipeline.stages:
    raise ConfigError("config.reward.variant: 'sage' pays for the library skills that later "
                      "tasks of a chain use, and agent.use_library=False keeps no library: RL "
                      "would train on the outcome reward alone. Set reward.variant='outcome' "
                      "(as configs/grpo.py does), or use_library=True")
  if local_devices is not None:
    run.sampler_mesh.check_host(local_devices, run.engine.num_slots)


def _check_evaluation_split(run: RunConfig, trained: bool) -> None:
  """A training run's dev evaluation may not score a split it trains on: the expert's SFT
  data holds those tasks' gold solutions, RL their rewards."""
  pipeline = run.pipeline
  if trained or not (pipeline.eval_after or run.sft.eval_every or run.rl.eval_every):
    return
  sources = []
  if "sft" in pipeline.stages and not pipeline.expert_trajectories:
    sources.append(("expert.splits", run.expert.splits or (pipeline.train_split,)))
  if "rl" in pipeline.stages:
    sources.append(("pipeline.train_split", (pipeline.train_split,)))
  if keys := [key for key, splits in sources if run.eval.split in splits]:
    raise ConfigError(
        f"config.eval.split: {run.eval.split!r} is a split the run trains on ("
        f"{' and '.join(keys)}): its evaluations would score tasks whose gold solutions or "
        "rewards the model learned from; evaluate on another split (pipeline.eval_train=True "
        "scores the training scenarios apart)")
