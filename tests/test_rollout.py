"""Sequential Rollout on the mini AppWorld: the scripted skill-format policy (expected skill
events and rewards of every variant) and a tiny random model through the real sampler."""

import asyncio
import random

import numpy as np
import pytest

from sage_jax.agent import AgentConfig, Retriever, ScriptedPolicy
from sage_jax.envs import appworld
from sage_jax.rl import advantages, episode, rewards, rollout
from sage_jax.rl import metrics as rl_metrics
from sage_jax.tokenizer import Tokenizer
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import WorkerKillingPolicy, broken_pool, pool_config


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


@pytest.fixture(scope="module")
def pool(mini_root, tmp_path_factory):
  outputs = str(tmp_path_factory.mktemp("rollout_outputs"))
  config = pool_config(mini_root, outputs)
  with appworld.EnvPool(config) as pool:
    yield pool


def _function_name(root, task_id):
  from sage_jax.agent import gold_solutions
  return gold_solutions.split_solution(gold_solutions.read_solution(root, task_id))[2][0]


def test_sample_chains():
  ids = [f"{s}_{n}" for s in ("aaaaaaa", "bbbbbbb") for n in (1, 2, 3)] + ["ccccccc_1"]
  rng = random.Random(0)
  chains = rollout.sample_chains(ids, 2, 6, rng)
  assert len(chains) == 6 and {c.scenario for c in chains} == {"aaaaaaa", "bbbbbbb"}
  for c in chains:
    assert len(set(c.task_ids)) == 2 and all(t.startswith(c.scenario) for t in c.task_ids)
  ordered = rollout.sample_chains(ids, 3, 2, rng, order="ordered")
  assert all(c.task_ids == tuple(f"{c.scenario}_{n}" for n in (1, 2, 3)) for c in ordered)
  with pytest.raises(ValueError, match="4 tasks"):
    rollout.sample_chains(ids, 4, 1, rng)
  assert [c.task_ids for c in rollout.scenario_chains(ids)][-1] == ("ccccccc_1",)


def test_scripted_sequential_rollout_events_and_rewards(pool, mini_root, tok):
  train = appworld.read_split(mini_root, "train")
  chains = rollout.sample_chains(train, 2, 2, random.Random(1))
  chains.append(rollout.Chain(chains[0].scenario, chains[0].task_ids[::-1] + (
      next(t for t in train if t.startswith(chains[0].scenario)
           and t not in chains[0].task_ids),)))  # a K = 3 chain
  agent = AgentConfig()
  ctx = rollout.RolloutContext(ScriptedPolicy(mini_root, tok), pool, tok, agent, Retriever(),
                               mini_root)
  config = rollout.RolloutConfig(group_size=2, experiment_prefix="scripted")
  batch = asyncio.run(rollout.run_groups(ctx, chains, config))
  assert len(batch.records) == 3 and all(len(g) == 2 for g in batch.records)
  for chain, group in zip(chains, batch.records):
    name = _function_name(mini_root, chain.task_ids[0])
    for r, records in enumerate(group):
      assert [x.task_id for x in records] == list(chain.task_ids)
      first, *later = records
      assert first.success and first.events.generated == (name,)
      assert first.events.saved == (name,) and first.events.used == ()
      assert first.visible_skills == ()
      for x in later:
        assert x.success and x.events.used == (name,) and x.events.generated == ()
        assert x.events.mentioned == x.events.used  # run-time and static agree on gold
        assert x.visible_skills == (name,)
        assert x.used_skill_sources == {name: chain.task_ids[0]}
        assert x.num_steps == 1 and x.generated_tokens < first.generated_tokens
      for x in records:
        assert x.rollout == r and x.experiment == f"scripted_g{chains.index(chain)}_r{r}"
        assert x.end_reason == "completed" and x.errors == [] and x.task_completed
        assert int(x.loss_mask.sum()) == x.generated_tokens
        assert not x.sampler_logprobs.any() and not x.model_logprobs.any()
        assert x.tokens.dtype == np.int32 and x.loss_mask.dtype == np.int8
      library = batch.libraries[chains.index(chain)][r]
      skill = library.get(chain.scenario, name)
      assert skill.source_task == chain.task_ids[0]
      assert skill.uses == len(later) and skill.successes == len(later)
  expected = {"sage": ([2.0, 2.0], [2.0, 2.0, 2.0]), "outcome": ([1.0, 1.0], [1.0, 1.0, 1.0]),
              "chain": ([2.0, 2.0], [2.0, 2.0, 2.0])}
  for variant, (k2, k3) in expected.items():
    stats = rollout.score(batch, rewards.RewardConfig(variant=variant))
    for group in batch.records:
      for records in group:
        assert [x.reward for x in records] == (k2 if len(records) == 2 else k3), variant
        assert all(x.advantage == 0.0 for x in records)
    assert stats.num_groups == 7 and stats.num_constant_groups == 7
  metrics = rl_metrics.task_metrics(batch.flat(), unit="chain")
  assert metrics["tgc"] == metrics["chain_success"] == 100.0
  assert metrics["skill_usage_rate"] == metrics["success_skill_usage_rate"] == 100.0
  # A failed second task in one rollout: only that rollout loses the bonuses.
  g0 = batch.records[0]
  g0[1][1].success = False
  stats = rollout.score(batch, rewards.RewardConfig())
  assert [x.reward for x in g0[1]] == [1.0, 0.0] and [x.reward for x in g0[0]] == [2.0, 2.0]
  assert g0[0][0].advantage > 0 > g0[1][0].advantage
  assert g0[0][1].advantage > 0 > g0[1][1].advantage
  assert stats.num_constant_groups == 5


def test_single_task_mode_is_the_baseline(pool, mini_root, tok):
  train = appworld.read_split(mini_root, "train")
  chains = rollout.sample_chains(train, 2, 1, random.Random(2))
  ctx = rollout.RolloutContext(ScriptedPolicy(mini_root, tok), pool, tok,
                               AgentConfig(use_library=False), Retriever(), mini_root)
  config = rollout.RolloutConfig(group_size=2, single_task=True, experiment_prefix="single")
  batch = rollout.collect(ctx, chains, config, rewards.RewardConfig())
  assert batch.libraries == [[None, None]]
  for records in batch.records[0]:
    (x,) = records
    assert x.task_id == chains[0].task_ids[0] and x.success and x.reward == 1.0
    assert x.visible_skills == () and "# Skills" not in tok.decode(x.tokens)


def test_a_task_the_environment_failed_under_is_played_again(pool, mini_root, tok):
  """A worker killed under a task's episode: the task is played again from its start, with
  the same skills, and only the last attempt counts; after `episode_retries` more attempts
  that all fail, the record is an environment failure, left out of training."""
  first, second = appworld.group_by_scenario(appworld.read_split(mini_root, "train")).popitem(
      )[1][:2]
  policy = WorkerKillingPolicy(ScriptedPolicy(mini_root, tok), pool, {first: 1, second: 3})
  ctx = rollout.RolloutContext(policy, pool, tok, AgentConfig(), Retriever(), mini_root)
  library = rollout.SkillLibrary()
  chain = rollout.Chain(appworld.scenario_id(first), (first, second))
  done, failed = asyncio.run(rollout.run_chain(ctx, chain, group=0, rollout=0,
                                               experiment="retried", library=library))
  assert policy.killed == 4
  # The retry is a whole episode of its own: no trace of the killed one in its conversation.
  assert done.success and not done.env_failed and done.errors == []
  assert len(done.retried_errors) == 1 and "worker" in done.retried_errors[0]
  assert "EnvironmentError" not in tok.decode(done.tokens) and done.num_steps == 1
  assert [s.source_task for s in library.skills(chain.scenario)] == [first]
  assert pool.config.episode_retries == 2
  assert failed.env_failed and len(failed.retried_errors) == 2 and not failed.success
  assert all("died" in e for e in failed.retried_errors + failed.errors)
  assert failed.end_reason == "env_error" and not episode.trained_on(failed)
  assert failed.visible_skills == done.events.saved  # each attempt saw the library's skill
  assert rl_metrics.task_metrics([done, failed])["env_retry_rate"] == 100.0
  # The retried attempts' tokens are compute spent: counted beside the kept attempts'.
  assert done.retried_tokens > done.retried_generated_tokens > 0
  assert failed.retried_tokens > done.retried_tokens
  counts = rl_metrics.compute_counts([done, failed])
  assert counts["compute/episodes"] == 5.0
  assert counts["compute/generated_tokens"] == (
      done.generated_tokens + failed.generated_tokens + done.retried_generated_tokens
      + failed.retried_generated_tokens)
  assert counts["compute/prompt_tokens"] + counts["compute/generated_tokens"] == (
      len(done.tokens) + len(failed.tokens) + done.retried_tokens + failed.retried_tokens)
  rollout.check_environment([done, failed], "a chain")  # one episode got through: no error
  with pytest.raises(rollout.EnvironmentDown,
                     match=rf"all 1 episodes of a chain, each after 3 attempt.*{second}"):
    rollout.check_environment([failed], "a chain")


def test_a_step_whose_every_episode_the_environment_failed_under_stops_the_run(
    mini_root, tok, tmp_path):  # noqa: F811
  """A pool whose data went away after it started, and whose template process then died:
  no worker can be started, so no episode even opens its world. Each is retried, the
  step has nothing to train on, and it stops the run with an error naming the step and the
  fault, rather than step on."""
  from sage_jax.train import rl_loop

  train = appworld.read_split(mini_root, "train")
  with broken_pool(mini_root, tmp_path) as pool:
    ctx = rollout.RolloutContext(ScriptedPolicy(mini_root, tok), pool, tok, AgentConfig(),
                                 Retriever(), mini_root)
    run = rl_loop.appworld_rollout(ctx, train, rollout.RolloutConfig(
        chain_length=1, group_size=2, experiment_prefix="broken"), rewards.RewardConfig(),
        num_chains=1)
    with pytest.raises(rollout.EnvironmentDown, match=r"all 2 episodes of step 4's rollouts"
                                                      r".*3 attempt.*no environment worker"):
      run(4, 0)
    assert len(pool.results) == 2 * 3 and all(r.error for r in pool.results)


class RecordingPolicy:
  """Wraps a policy and keeps every turn it produced, per task."""

  def __init__(self, inner):
    self.inner, self.turns = inner, {}

  def session(self, context):
    inner, turns = self.inner.session(context), self.turns.setdefault(
        (context.task_id, context.seed), [])

    class Session:
      async def generate(self, request):
        turn = await inner.generate(request)
        turns.append(turn)
        return turn

      async def close(self):
        await inner.close()

    return Session()


@pytest.mark.slow
def test_tiny_random_model_group_through_sampler_and_pool(pool, mini_root, tok):
  from sage_jax.model import get_preset, init_model
  sampler = pytest.importorskip("sage_jax.sampler")
  Engine, EngineConfig = sampler.Engine, sampler.EngineConfig

  model = init_model(get_preset("tiny"), seed=0)
  engine = Engine(model, EngineConfig(num_slots=4, max_len=1024, prefill_buckets=(32, 128, 512),
                                      min_attend=256, steps_per_call=8),
                  eos_ids=[tok.eos_id], detokenize=tok.decode)
  driver = sampler.AsyncEngine(engine)
  agent = AgentConfig(max_steps=3, max_turn_tokens=16, max_episode_tokens=1024)
  policy = RecordingPolicy(rollout.SamplerPolicy(driver, agent))
  ctx = rollout.RolloutContext(policy, pool, tok, agent, Retriever(), mini_root)
  chain = rollout.sample_chains(appworld.read_split(mini_root, "train"), 2, 1,
                                random.Random(3))
  try:
    batch = rollout.collect(ctx, chain, rollout.RolloutConfig(group_size=3,
                                                              experiment_prefix="tiny"),
                            rewards.RewardConfig(), advantages.AdvantageConfig())
  finally:
    driver.close()
  records = batch.flat()
  assert len(records) == 6
  for x in records:
    assert 1 <= x.num_steps <= 3 and x.errors == [] and len(x.tokens) <= 1024
    turns = policy.turns[(x.task_id, (x.group * 1009 + x.rollout) * 1000 + x.chain_position)]
    generated = np.concatenate([np.asarray(t.tokens, np.int32) for t in turns])
    # The mask covers exactly the sampled tokens, and the logprobs sit exactly on them.
    assert np.array_equal(x.tokens[x.loss_mask == 1], generated)
    assert int(x.loss_mask.sum()) == x.generated_tokens == len(generated)
    assert np.array_equal(x.sampler_logprobs[x.loss_mask == 1],
                          np.concatenate([t.sample_logprobs for t in turns]))
    assert np.array_equal(x.model_logprobs[x.loss_mask == 1],
                          np.concatenate([t.model_logprobs for t in turns]))
    assert not x.sampler_logprobs[x.loss_mask == 0].any()
    assert np.all(x.sampler_logprobs[x.loss_mask == 1] < 0)
    roles = [t[0] for t in x.turns]
    assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
    for role, start, end in x.turns:
      assert x.loss_mask[start:end].any() == (role == "assistant")
    assert x.reward in (-1.0, 0.0)  # random text: no code (or no success)
  assert batch.advantage_stats.num_groups == 2
  assert engine.stats.generated_tokens == sum(x.generated_tokens for x in records)
