"""The RL loop: rollout -> rewards + advantages -> GRPO update -> metrics -> checkpoint.

The loop composes callables, so the same code runs SAGE on AppWorld and the synthetic task of
the learning test:

  rollout(step, seed) -> episodes | (episodes, metrics)
      samples the step's chains and runs them with the current policy. `seed` is a pure
      function of (loop seed, step): a resumed run samples the same data with the same RNG.
      A rollout that samples more than it returns (dynamic sampling) puts the `compute/`
      counts and `rl.metrics.sample_metrics` of everything it sampled in its metrics;
      otherwise the loop takes them of `episodes`.
  score(episodes) -> metrics | None
      rewards and advantages; sets `episode.advantage` (and usually `.reward`) in place.
  evaluate(step) -> metrics
      dev evaluation every `eval_every` steps; reported as "dev/<name>", ranks checkpoints.
  sync_params(params)
      hands the freshly updated nnx.State to the sampler (e.g. `Engine.update_params`): the
      arrays stay on device, no host copy. Called after every update and after a restore.

Episodes are duck-typed: the batch fields of `rl.batch` plus, for metrics
(`rl.metrics.sample_metrics`), whichever of `reward`, `chain_position`, `success`,
`num_steps`, `generated_tokens` they carry (`rl.episode.EpisodeRecord` carries all).

Strictly on-policy by default: one optimiser update per rollout batch; with
`GRPOConfig.num_mini_batches > 1` the batch is split and each part is one update, all
against the same pi_old (the rollout's logprobs, or recomputed before the first update).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sage_jax import multihost
from sage_jax import sharding as shd
from sage_jax.model.qwen2 import Qwen2
from sage_jax.rl import batch as batch_lib
from sage_jax.rl import grpo
from sage_jax.rl import metrics as metrics_lib
from sage_jax.rl.episode import has_loss_tokens, trained_on
from sage_jax.train.checkpoint import Checkpointer
from sage_jax.train.loop import Evaluate, LoopResult, SyncParams, run_steps, step_seed
from sage_jax.train.metrics import MetricsConfig, scalars
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.state import merge_trainable, split_trainable
from sage_jax.train.step import Trainer, TrainerConfig

Rollout = Callable[[int, int], Any]
Score = Callable[[Sequence[Any]], Mapping[str, float] | None]


@dataclasses.dataclass(frozen=True)
class RLLoopConfig:
  """total_steps: loop steps (rollout + update) of the run. eval_every: dev evaluation every
  this many steps (0 = never). seed: the loop's seed; step s uses `step_seed(seed, s)` for
  its rollout and mini-batch shuffling."""

  total_steps: int = 100
  eval_every: int = 0
  seed: int = 0

  def __post_init__(self):
    if self.total_steps < 0 or self.eval_every < 0:
      raise ValueError(f"{self}: total_steps and eval_every must be >= 0")


def grpo_trainer(model: Qwen2, grpo_config: grpo.GRPOConfig = grpo.GRPOConfig(),
                 optimizer: OptimizerConfig = OptimizerConfig(),
                 config: TrainerConfig = TrainerConfig(), *, mesh: Mesh | None = None,
                 rules: shd.ShardingRules = shd.ShardingRules()) -> Trainer:
  """A Trainer whose loss is the GRPO loss of `grpo_config`."""
  return Trainer(model, grpo.make_loss_fn(grpo_config), optimizer, config, mesh=mesh,
                 rules=rules, logprob_chunk=grpo_config.logprob_chunk,
                 logprob_temperature=grpo_config.temperature,
                 gradient_mask=grpo.gradient_mask(grpo_config))


def frozen_copy(params: nnx.State) -> nnx.State:
  """`params` as they are now, safe from later updates: the KL reference. A step donates (and
  so deletes) the arrays it updates, the trainable ones (`split_trainable`): those are copied.
  A frozen LoRA base is only read by the step, never changed nor donated, so the reference
  shares it with the trainer (the same variables, which a restored checkpoint refills with
  the same values) instead of holding a second copy (61 GiB for Qwen2.5-32B in bfloat16).
  Without adapters everything is trainable and copied."""
  trainable, frozen = split_trainable(params)
  return merge_trainable(jax.tree.map(jnp.copy, trainable), frozen)


def gather_episodes(episodes: Sequence[Any]) -> list[Any]:
  """Every process's episodes, for metrics (per-token arrays left behind: they are large and
  metrics read `generated_tokens` instead); the episodes themselves with one process."""
  if jax.process_count() == 1:
    return list(episodes)
  empty = np.zeros(0, np.float32)
  light = [dataclasses.replace(e, tokens=empty, loss_mask=empty, sampler_logprobs=empty,
                               model_logprobs=empty, turns=[])
           if dataclasses.is_dataclass(e) and metrics_lib.field(e, "generated_tokens") is not None
           else e for e in episodes]
  return [e for part in multihost.allgather_objects(light) for e in part]


def compute_counts(episodes: Sequence[Any]) -> dict[str, float]:
  """`rl.metrics.compute_counts` of every process's `episodes` (this process's given)."""
  counts = metrics_lib.compute_counts(episodes)
  totals = multihost.allgather(np.asarray(list(counts.values()), np.float64)).sum(0)
  return dict(zip(counts, map(float, totals)))


# --- Update ---------------------------------------------------------------------------------

# Counts of an update, which the step reports as totals over its updates.
UPDATE_TOTALS = frozenset({"loss_tokens", "nonfinite_skipped", "batch/positions",
                           "batch/real_positions"})


def update_reduction(name: str) -> Callable[[Sequence[float]], Any]:
  """How a step combines the metric `name` of its updates: an extreme (`train.step` names
  them "<stat>_max" / "<stat>_min") as the step's extreme, a count (`UPDATE_TOTALS`) as its
  total, anything else as the mean over the updates; a mean of maxima would be no maximum."""
  if name.endswith("_max"):
    return np.max
  if name.endswith("_min"):
    return np.min
  return np.sum if name in UPDATE_TOTALS else np.mean


def reduce_updates(per_update: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """One step's metrics from those of its updates (`update_reduction`)."""
  return {k: float(update_reduction(k)([m[k] for m in per_update])) for k in per_update[0]}


def grpo_update(trainer: Trainer, episodes: Sequence[Any], grpo_config: grpo.GRPOConfig,
                batch_config: batch_lib.BatchConfig, *, seed: int = 0,
                reference_params: nnx.State | None = None) -> dict[str, float]:
  """`grpo_config.num_mini_batches` optimiser updates on `episodes` (with advantages set),
  fewer when the processes together hold fewer episodes (a mini-batch no process has an
  episode for is skipped); returns the update metrics and batch layout statistics, combined
  over the mini-batches by `update_reduction`.
  Episodes that `rl.episode.trained_on` rejects (the environment failed under them or under
  the later task their reward hangs on) are left out of the loss, and so are those with no
  token to train: a first prompt (system, skills, task) that alone filled the episode's token
  budget ended it before any turn, and it may be longer than any row. When no process has any
  other episode, there is no update."""
  untrainable = sum(trained_on(e) and not has_loss_tokens(e) for e in episodes)
  if untrainable:
    logging.warning("%d episode(s) had no turn to train (the first prompt filled the episode's "
                    "token budget: agent.max_episode_tokens); left out of the update",
                    untrainable)
  episodes = [e for e in episodes if trained_on(e) and has_loss_tokens(e)]
  trainable = np.asarray(multihost.allgather(np.asarray([len(episodes)], np.int64))).sum()
  if trainable == 0:
    return {"updates": 0.0, "batch/positions": 0.0, "batch/real_positions": 0.0}
  parts = batch_lib.split_mini_batches(
      episodes, grpo_config.num_mini_batches,
      np.random.default_rng(seed) if grpo_config.shuffle_mini_batches else None)
  batches = []
  for part in parts:
    batch, info = batch_lib.make_batch(part, batch_config,
                                       aggregation=grpo_config.aggregation,
                                       norm_constant=grpo_config.norm_constant,
                                       allgather=multihost.allgather)
    if info.num_sequences:  # else no process had an episode for it (the counts are global)
      # On device once, for pi_old, the KL reference and the update alike.
      batches.append((trainer.place_batch(batch), info))
  if grpo_config.recomputes_old_logprobs:  # pi_old of every mini-batch before any update
    batches = [(b.replace(old_logprobs=trainer.logprobs(b)), i) for b, i in batches]
  if grpo_config.use_kl:
    if reference_params is None:
      raise ValueError("GRPOConfig.kl_coef > 0 needs reference_params (see frozen_copy)")
    batches = [(b.replace(ref_logprobs=trainer.logprobs(b, reference_params)), i)
               for b, i in batches]
  per_update = []
  for batch, info in batches:
    m = scalars(jax.device_get(trainer.step(batch)))
    m["batch/padding_fraction"] = info.padding_fraction
    m["batch/positions"] = float(info.total_positions)
    m["batch/real_positions"] = float(info.real_positions)
    m["batch/micro_batches"] = float(batch.shape[0])
    m["batch/row_len"] = float(batch.shape[2])
    per_update.append(m)
  out = reduce_updates(per_update)
  out["updates"] = float(len(per_update))
  return out


# --- Loop -----------------------------------------------------------------------------------


def appworld_rollout(ctx: Any, task_ids: Sequence[str], rollout_config: Any, reward_config: Any,
                     advantage_config: Any = None, *, num_chains: int) -> Rollout:
  """The RL loop's `rollout` for AppWorld: step s draws `num_chains` chains of the task ids
  (a `random.Random` of the step's seed, the same on every process), runs this process's
  share of them (a chain's G rollouts stay on one host, with their rewards and advantages)
  through the Sequential Rollout (`rl.rollout`) with the context's policy, sampling seeds
  `step_seed(rollout_config.seed, s)`.

  With `rollout_config.max_redraws` > 0 (dynamic sampling, as in DAPO) a chain whose every
  reward set is constant (zero advantages: no gradient) is dropped, and up to `max_redraws`
  more draws follow, each of as many chains as are still missing, until `num_chains` chains
  with a learning signal are kept. The step then trains on those; a step where no draw has
  any trains on nothing.

  Returns this process's episodes to train on, and metrics of every episode that every
  process sampled: `rl.metrics.task_metrics` under "rollout/", `rl.metrics.sample_metrics`
  (rewards of the episodes whose reward is known), its mean reward also as "rollout/reward"
  (and "rollout/reward/pos<k>"), the compute counts, the episodes left out of training
  (num_env_failures, num_rewards_unknown), the draws and the kept chains."""
  import random

  from sage_jax.rl import advantages as advantages_lib
  from sage_jax.rl import rollout as rollout_lib

  advantage_config = advantage_config or advantages_lib.AdvantageConfig()
  filtering = rollout_config.max_redraws > 0

  def run(step: int, seed: int):
    config = dataclasses.replace(rollout_config, seed=step_seed(rollout_config.seed, step),
                                 experiment_prefix=f"{rollout_config.experiment_prefix}_s{step}")
    sampled, kept, draws, missing = [], [], 0, num_chains
    constant_sets = env_failures = rewards_unknown = 0
    while draws <= rollout_config.max_redraws:
      rng = random.Random(seed if draws == 0 else step_seed(seed, draws))
      chains = rollout_lib.sample_chains(task_ids, rollout_config.effective_chain_length,
                                         missing, rng, order=rollout_config.chain_order)
      share = multihost.share(len(chains))

      def collect() -> rollout_lib.RolloutBatch:
        batch = rollout_lib.collect(ctx, chains[share], config, reward_config, advantage_config,
                                    first_group=draws * num_chains + share.start)
        rollout_lib.check_environment(batch.flat(), f"step {step}'s rollouts on this process")
        return batch

      batch = multihost.all_succeed(collect)
      draws += 1
      sampled.extend(batch.flat())
      constant_sets += batch.advantage_stats.num_constant_groups
      env_failures += batch.advantage_stats.num_env_failures
      rewards_unknown += batch.advantage_stats.num_rewards_unknown
      kept.extend([r for rollout in group for r in rollout] for group in batch.records
                  if not filtering or any(r.advantage != 0 for rollout in group
                                          for r in rollout))
      if not filtering:
        break
      counts = multihost.allgather(np.asarray([len(kept)], np.int64))[:, 0]
      missing = num_chains - int(counts.sum())
      if missing <= 0:
        break
    episodes = [r for group in kept for r in group]
    if failed := [r for r in sampled if r.env_failed]:  # the errors are in no metric
      logging.warning("step %d: the environment failed under %d of this process's %d episodes "
                      "(left out of training); the first, %s: %s", step, len(failed),
                      len(sampled), failed[0].task_id, "; ".join(failed[0].errors)[:2000])
    everyone = gather_episodes(sampled)
    values = {f"rollout/{k}": float(v) for k, v in metrics_lib.task_metrics(
        everyone, unit="chain").items() if v is not None}
    values.update(compute_counts(sampled))
    sampled_metrics = metrics_lib.sample_metrics(everyone)
    values.update(sampled_metrics)
    # The reward curve's names (plots, benchmarks): sample_metrics' mean rewards.
    values.update({f"rollout/{k.removesuffix('/mean')}": v for k, v in sampled_metrics.items()
                   if k.startswith("reward/") and k.endswith("/mean")})
    for key, count in (("constant_groups", constant_sets), ("num_env_failures", env_failures),
                       ("num_rewards_unknown", rewards_unknown)):
      values[key] = float(sum(multihost.allgather_objects(count)))
    values["sampling/draws"] = float(draws)
    values["sampling/kept_chains"] = float(sum(multihost.allgather_objects(len(kept))))
    return episodes, values

  return run


def _unpack_rollout(result: Any) -> tuple[list, dict]:
  if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
    return list(result[0]), dict(result[1])
  return list(result), {}


def run_rl(trainer: Trainer, *, rollout: Rollout, config: RLLoopConfig = RLLoopConfig(),
           grpo_config: grpo.GRPOConfig = grpo.GRPOConfig(),
           batch_config: batch_lib.BatchConfig = batch_lib.BatchConfig(),
           score: Score | None = None, evaluate: Evaluate | None = None,
           sync_params: SyncParams | None = None, checkpointer: Checkpointer | None = None,
           metrics: MetricsConfig = MetricsConfig(),
           reference_params: nnx.State | None = None,
           on_step: Callable[[int, dict], None] | None = None) -> LoopResult:
  """Runs loop steps until `config.total_steps` are done (resuming from the latest checkpoint
  when there is one) or a SIGTERM / SIGINT arrives (then saves and returns).

  `trainer` must carry the GRPO loss of `grpo_config` (see `grpo_trainer`). Step s (0-based)
  is: rollout(s, step_seed(seed, s)) -> score -> update -> sync_params; then metrics at
  s + 1, evaluation and checkpoint when due (`train.loop.run_steps`).
  """

  def one_step(step: int, seed: int) -> dict[str, float]:
    t0 = time.perf_counter()
    episodes, values = _unpack_rollout(rollout(step, seed))
    t1 = time.perf_counter()
    if not any(k.startswith("compute/") for k in values):
      values.update(compute_counts(episodes))
    if score is not None:
      values.update(score(episodes) or {})
    everyone = gather_episodes(episodes)
    if "episodes" not in values:
      values.update(metrics_lib.sample_metrics(everyone))
    values.update(metrics_lib.advantage_metrics(everyone))
    t2 = time.perf_counter()
    values.update(grpo_update(trainer, episodes, grpo_config, batch_config, seed=seed,
                              reference_params=reference_params))
    t3 = time.perf_counter()
    values.update({
        "time/rollout_s": t1 - t0, "time/score_s": t2 - t1, "time/update_s": t3 - t2,
        "tokens_per_s": values["batch/real_positions"] / max(t3 - t2, 1e-9),
        "rollout_tokens_per_s": values["compute/generated_tokens"] / max(t1 - t0, 1e-9),
    })
    return values

  return run_steps(trainer, one_step, total_steps=config.total_steps, seed=config.seed,
                   eval_every=config.eval_every, evaluate=evaluate, sync_params=sync_params,
                   checkpointer=checkpointer, metrics=metrics, description="rl",
                   meta={"loop": "rl"}, on_step=on_step)
