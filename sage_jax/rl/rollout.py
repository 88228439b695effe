"""Sequential Rollout: chains of K tasks of one scenario, G rollouts per chain, each rollout
walking its chain in order with its own skill library.

Many groups run at once: every rollout is an asyncio task; AppWorld episodes queue on the
env pool's workers and turns on the sampler's slots. A task episode yields an
`EpisodeRecord` with the conversation's exact ids, the loss mask, the sampler's logprobs,
skill events and AppWorld's evaluation; `rewards` and `advantages` then fill `reward` and
`advantage`.

Single-task mode (`RolloutConfig.single_task`): K = 1 and no library, the GRPO baseline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sage_jax.agent import agent as agent_lib
from sage_jax.agent.config import AgentConfig
from sage_jax.agent.library import SkillLibrary, install_code
from sage_jax.agent.policy import Policy, PolicyTurn, TaskContext, TurnRequest
from sage_jax.agent.retrieval import Retriever
from sage_jax.envs.appworld import dataset
from sage_jax.rl import advantages as advantages_lib
from sage_jax.rl import rewards as rewards_lib
from sage_jax.rl.episode import EpisodeRecord
from sage_jax.tokenizer import Tokenizer

if TYPE_CHECKING:
  from sage_jax.sampler import AsyncEngine

CHAIN_ORDERS = ("random", "ordered")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """chain_length: K tasks per chain (drawn from one scenario's tasks). group_size: G
  rollouts of the same chain. single_task: K = 1 without a library (the GRPO baseline).
  chain_order: "random" (K distinct tasks of the scenario in random order) or "ordered"
  (K consecutive tasks by task number, starting at a random one). experiment_prefix: AppWorld
  experiment names are `<prefix>_g<group>_r<rollout>`. seed: the sampler's per-rollout seeds
  (the RL loop gives step s `step_seed(seed, s)`; the chains come from the loop's own seed).
  max_redraws: dynamic sampling (DAPO): chains whose G rollouts all got the same rewards
  (no gradient) are dropped and as many new chains drawn, at most this many more times per
  step (`train.rl_loop.appworld_rollout`); 0 = off, every drawn chain is trained on (the
  paper)."""

  chain_length: int = 2
  group_size: int = 8
  single_task: bool = False
  chain_order: str = "random"
  experiment_prefix: str = "rollout"
  seed: int = 0
  max_redraws: int = 0

  def __post_init__(self):
    if self.max_redraws < 0:
      raise ValueError(f"max_redraws must be >= 0, got {self.max_redraws}")
    for name in ("chain_length", "group_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.chain_order not in CHAIN_ORDERS:
      raise ValueError(f"chain_order={self.chain_order!r}; expected one of {CHAIN_ORDERS}")

  @property
  def effective_chain_length(self) -> int:
    return 1 if self.single_task else self.chain_length


@dataclasses.dataclass(frozen=True)
class Chain:
  scenario: str
  task_ids: tuple[str, ...]


def sample_chains(task_ids: Sequence[str], chain_length: int, num_chains: int,
                  rng: random.Random, order: str = "random") -> list[Chain]:
  """`num_chains` chains of `chain_length` tasks, each from one scenario with enough tasks;
  scenarios are drawn uniformly (with replacement once all were used)."""
  scenarios = {s: ids for s, ids in dataset.group_by_scenario(list(task_ids)).items()
               if len(ids) >= chain_length}
  if not scenarios:
    raise ValueError(f"no scenario has {chain_length} tasks to chain")
  names = sorted(scenarios)
  chains, pool = [], []
  for _ in range(num_chains):
    if not pool:
      pool = names[:]
      rng.shuffle(pool)
    scenario = pool.pop()
    ids = scenarios[scenario]
    if order == "ordered":
      start = rng.randrange(len(ids) - chain_length + 1)
      picked = ids[start:start + chain_length]
    else:
      picked = rng.sample(ids, chain_length)
    chains.append(Chain(scenario, tuple(picked)))
  return chains


def scenario_chains(task_ids: Sequence[str]) -> list[Chain]:
  """Every scenario's tasks in order, one chain per scenario (what evaluation walks)."""
  return [Chain(s, tuple(ids)) for s, ids in dataset.group_by_scenario(list(task_ids)).items()]


def read_task_specs(appworld_root: str, task_id: str) -> dict:
  with open(os.path.join(appworld_root, "data", "tasks", task_id, "specs.json")) as f:
    return json.load(f)


def read_difficulty(appworld_root: str, task_id: str) -> int | None:
  path = os.path.join(appworld_root, "data", "tasks", task_id, "ground_truth", "metadata.json")
  try:
    with open(path) as f:
      return json.load(f).get("difficulty")
  except (OSError, ValueError):
    return None


@dataclasses.dataclass
class RolloutContext:
  """What every rollout of a batch shares."""

  policy: Policy
  pool: Any  # sage_jax.envs.appworld.EnvPool (started)
  tokenizer: Tokenizer
  agent: AgentConfig
  retriever: Retriever
  appworld_root: str


async def run_chain(ctx: RolloutContext, chain: Chain, *, group: int, rollout: int,
                    experiment: str, library: SkillLibrary | None, seed: int = 0,
                    on_record: Callable[[EpisodeRecord], None] | None = None
                    ) -> list[EpisodeRecord]:
  """Walks `chain` in order: retrieve skills, install them, run the agent, evaluate, save the
  task's skills into `library` (None: no library, the baseline). Returns one record per task.

  A task the environment failed under is played again from its start (same skills, same
  seed, same AppWorld experiment), up to the pool's `episode_retries` times; only the last
  attempt counts, and the library learns nothing from the others (the record keeps their
  errors and token counts)."""
  records = []
  retries = ctx.pool.config.episode_retries
  for position, task_id in enumerate(chain.task_ids):
    skills, code = None, None
    if library is not None and ctx.agent.use_library:
      instruction = read_task_specs(ctx.appworld_root, task_id)["instruction"]
      skills = ctx.retriever.retrieve(library, scenario=chain.scenario, instruction=instruction)
      code = install_code(skills)
    difficulty, failed = read_difficulty(ctx.appworld_root, task_id), []  # earlier attempts
    while True:
      async with ctx.pool.episode(task_id, experiment, library_code=code) as episode:
        trace = await agent_lib.run_task(
            policy=ctx.policy, episode=episode, tokenizer=ctx.tokenizer, config=ctx.agent,
            skills=skills, scenario=chain.scenario, seed=seed * 1000 + position)
      by_name = {s.name: s for s in trace.visible_skills}
      used = [by_name[n] for n in trace.events.used if n in by_name]
      record = EpisodeRecord.from_trace(
          trace, episode.result, chain_position=position, group=group, rollout=rollout,
          experiment=experiment, used_skill_sources={s.name: s.source_task for s in used},
          difficulty=difficulty)
      if not record.env_failed or len(failed) == retries:
        break
      logging.warning("The environment failed under task %s of experiment %s (attempt %d of "
                      "%d), playing it again: %s", task_id, experiment, len(failed) + 1,
                      retries + 1, "; ".join(record.errors)[:2000])
      failed.append(record)
    record.retried_errors = ["; ".join(f.errors) for f in failed]
    record.retried_tokens = sum(len(f.tokens) for f in failed)
    record.retried_generated_tokens = sum(f.generated_tokens for f in failed)
    if library is not None and ctx.agent.use_library:
      library.record_use(used, record.success)
      library.save(trace.saved, scenario=chain.scenario, task_id=task_id,
                   instruction=trace.instruction)
    records.append(record)
    if on_record is not None:
      on_record(record)
  return records


class EnvironmentDown(RuntimeError):
  """The environment failed under every episode of a batch, each after its retries."""


def check_environment(records: Sequence[EpisodeRecord], what: str) -> None:
  """Raises EnvironmentDown when the environment failed under every one of `records` (`what`
  they are): a broken pool, not a policy, and a run would otherwise go on training on no
  episode, or score its evaluations as if every task had failed."""
  if records and all(r.env_failed for r in records):
    first = records[0]
    raise EnvironmentDown(
        f"The environment failed under all {len(records)} episodes of {what}, each after "
        f"{len(first.retried_errors) + 1} attempt(s); the last error, under task "
        f"{first.task_id}: {'; '.join(first.errors)[:2000]}")


@dataclasses.dataclass
class RolloutBatch:
  """A batch of groups: records[group][rollout][chain position]."""

  chains: list[Chain]
  records: list[list[list[EpisodeRecord]]]
  libraries: list[list[SkillLibrary | None]]
  advantage_stats: advantages_lib.AdvantageStats | None = None

  def flat(self) -> list[EpisodeRecord]:
    return [r for group in self.records for chain in group for r in chain]


async def run_groups(ctx: RolloutContext, chains: Sequence[Chain], config: RolloutConfig,
                     *, initial_library: SkillLibrary | None = None,
                     first_group: int = 0) -> RolloutBatch:
  """G rollouts of every chain, all concurrently; each rollout gets its own library (a copy
  of `initial_library`, empty by default; none in single-task mode). Chain i is group
  `first_group + i`: its records, experiment names and seeds (so that the processes of a
  multi-host run, each given its own share of a step's chains, never collide)."""
  libraries = [[None if config.single_task else
                (initial_library.copy() if initial_library is not None else SkillLibrary())
                for _ in range(config.group_size)] for _ in chains]
  jobs = []
  for g, chain in enumerate(chains, start=first_group):
    if config.single_task:
      chain = Chain(chain.scenario, chain.task_ids[:1])
    for r in range(config.group_size):
      jobs.append(run_chain(ctx, chain, group=g, rollout=r,
                            experiment=f"{config.experiment_prefix}_g{g}_r{r}",
                            library=libraries[g - first_group][r],
                            seed=config.seed * 1_000_003 + g * 1009 + r))
  results = await asyncio.gather(*jobs)
  it = iter(results)
  records = [[next(it) for _ in range(config.group_size)] for _ in chains]
  return RolloutBatch(list(chains), records, libraries)


def score(batch: RolloutBatch, reward: rewards_lib.RewardConfig,
          advantage: advantages_lib.AdvantageConfig = advantages_lib.AdvantageConfig()
          ) -> advantages_lib.AdvantageStats:
  """Fills `reward` (per rollout chain) and `advantage` (per group and chain position)."""
  for group in batch.records:
    rewards_lib.assign_rewards(group, reward)
  batch.advantage_stats = advantages_lib.assign_advantages(batch.flat(), advantage)
  return batch.advantage_stats


def collect(ctx: RolloutContext, chains: Sequence[Chain], config: RolloutConfig,
            reward: rewards_lib.RewardConfig,
            advantage: advantages_lib.AdvantageConfig = advantages_lib.AdvantageConfig(),
            *, first_group: int = 0) -> RolloutBatch:
  """Synchronous entry for the trainer: runs the groups, then rewards and advantages."""
  batch = asyncio.run(run_groups(ctx, chains, config, first_group=first_group))
  score(batch, reward, advantage)
  return batch


# --- The sampler as a policy ------------------------------------------------------------------


class _SamplerSession:

  def __init__(self, engine: AsyncEngine, context: TaskContext, sampling: Callable[..., Any],
               max_len: int):
    self._engine = engine
    self._context = context
    self._sampling = sampling
    self._max_len = max_len
    self._seq_id: int | None = None

  async def generate(self, request: TurnRequest) -> PolicyTurn:
    sampling = self._sampling(max_new_tokens=request.max_new_tokens,
                              max_context=max(2, min(request.max_context, self._max_len)))
    if self._seq_id is None:
      result = await self._engine.start(request.prompt_ids, sampling, self._context.seed)
      self._seq_id = result.seq_id
    else:
      result = await self._engine.append(self._seq_id, request.new_ids, sampling)
    return PolicyTurn(tokens=list(result.tokens),
                      sample_logprobs=np.asarray(result.sample_logprobs, np.float32),
                      model_logprobs=np.asarray(result.model_logprobs, np.float32),
                      finish_reason=result.finish_reason)

  async def close(self) -> None:
    if self._seq_id is not None:
      await self._engine.free(self._seq_id)
      self._seq_id = None


class SamplerPolicy:
  """The sampler engine as the agent's policy: one engine sequence per task episode, each
  turn appended to the live sequence (only new ids are prefilled)."""

  def __init__(self, engine: AsyncEngine, agent: AgentConfig):
    from sage_jax.sampler import SamplingParams

    self.engine = engine
    self._max_len = engine.engine.config.max_len
    self._sampling = functools.partial(
        SamplingParams, temperature=agent.temperature, top_p=agent.top_p, top_k=agent.top_k,
        stop_strings=agent.stop_strings)

  def session(self, context: TaskContext) -> _SamplerSession:
    return _SamplerSession(self.engine, context, self._sampling, self._max_len)
