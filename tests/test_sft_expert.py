"""The expert-trajectory command: mini-world gold solutions in the skill format, executed by
the real AppWorld engine, successes kept; trajectories from elsewhere replayed the same way.
The plays show the prompts of the run's agent and retrieval, as its RL rollouts do, and cover
the scenarios it trains on."""

import asyncio
import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from sage_jax.agent import prompts
from sage_jax.agent.config import AgentConfig, RetrievalConfig
from sage_jax.agent.gold_solutions import expert_turns_for_task
from sage_jax.agent.retrieval import Retriever
from sage_jax.configurable import ConfigError
from sage_jax.envs import appworld
from sage_jax.rl import rollout
from sage_jax.sft import data as sft_data
from sage_jax.sft import expert
from sage_jax.tokenizer import Tokenizer
from tests import appworld_fixtures
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


@pytest.fixture(scope="module")
def pool(mini_root, tmp_path_factory):
  # Observations as long as the pipeline's (the trajectories hold them).
  config = appworld_fixtures.pool_config(
      mini_root, str(tmp_path_factory.mktemp("expert_outputs")),
      max_output_chars=appworld.EnvPoolConfig.max_output_chars)
  with appworld.EnvPool(config) as pool:
    yield pool


@pytest.fixture(scope="module")
def gold(mini_root, tok, pool):
  config = expert.ExpertConfig(appworld_root=mini_root)
  return expert.gold_trajectories(appworld.read_split(mini_root, "dev"), config, tok, pool)


def test_gold_solutions_become_skill_format_trajectories(gold, mini_root, tok):
  trajectories, stats = gold
  dev = appworld.read_split(mini_root, "dev")
  assert stats.tasks == len(dev) and stats.kept == stats.succeeded == len(dev)
  assert not stats.failed and not stats.untokenisable
  by_scenario = appworld.group_by_scenario(dev)
  assert [t.id for t in trajectories] == [i for s in sorted(by_scenario) for i in by_scenario[s]]
  for t in trajectories:
    roles = [m["role"] for m in t.messages]
    assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
    assert "```python" in t.messages[-1]["content"]
    skills = t.metadata["skills"]
    if t.metadata["chain_position"] == 0:  # the first task writes the scenario's skill
      assert skills["generated"] and not skills["used"]
      assert "def " in t.messages[-1]["content"] and '"""' in t.messages[-1]["content"]
    else:  # later tasks call it from the library
      assert skills["used"] and not skills["generated"]
      assert t.metadata["visible_skills"] == skills["used"]
    example = sft_data.tokenize(t, tok)
    trained = tok.decode(example.tokens[example.loss_mask == 1].tolist())
    assert trained == "".join(m["content"] + "<|im_end|>" for m in t.messages
                              if m["role"] == "assistant")


def _rl_messages(policy, task_ids, agent, retriever, mini_root, tok, pool, prefix):
  """Each task's conversation in an RL rollout of its scenario's chain (of `task_ids`) by
  `policy`, as the run's `agent` with its `retriever`."""
  chains = rollout.scenario_chains(sorted(task_ids))
  ctx = rollout.RolloutContext(policy, pool, tok, agent, retriever, mini_root)
  config = rollout.RolloutConfig(group_size=1, chain_length=max(len(c.task_ids) for c in chains),
                                 experiment_prefix=prefix)
  batch = asyncio.run(rollout.run_groups(ctx, chains, config))
  return {r.task_id: tuple(sft_data.messages_from_ids(r.tokens.tolist(), r.turns, tok))
          for r in batch.flat()}


def test_gold_plays_show_the_runs_prompt_with_room_for_the_gold_turns(gold, mini_root, tok,
                                                                        pool):
  """Gold plays show the prompts the run's RL rollouts show: its agent's, with the skills its
  retrieval picks (none here, so every task writes its skill); its short turns (48 tokens) and
  episodes (700), fewer than a first task's gold turn and conversation, leave them whole."""
  agent = AgentConfig(max_turn_tokens=48, max_episode_tokens=700)
  retriever = Retriever(RetrievalConfig(strategy="none"))
  config = expert.ExpertConfig(appworld_root=mini_root, experiment_prefix="run_agent")
  trajectories, stats = expert.gold_trajectories(appworld.read_split(mini_root, "dev"), config,
                                                 tok, pool, agent=agent, retriever=retriever)
  assert [t.id for t in trajectories] == [t.id for t in gold[0]] and not stats.failed
  for t in trajectories:
    assert t.metadata["visible_skills"] == [] and t.metadata["skills"]["generated"]
  assert max(len(tok.encode(t.messages[2]["content"])) for t in trajectories) > 48
  assert max(len(sft_data.tokenize(t, tok).tokens) for t in trajectories) > 700
  rl = _rl_messages(expert.ScriptedPolicy(mini_root, tok), [t.id for t in trajectories], agent,
                    retriever, mini_root, tok, pool, "rl_run_agent")
  for t in trajectories:
    assert t.messages[:2] == rl[t.id][:2]


def _extra_trajectories(gold, mini_root, tok, pool, suffix, **option):
  """The gold trajectories with one extra-play option on: each extra trajectory beside the
  plain one of its task; checks that the extra ones are one per later task, added after the
  plain ones under unique ids."""
  config = expert.ExpertConfig(appworld_root=mini_root, **option)
  trajectories, stats = expert.gold_trajectories(appworld.read_split(mini_root, "dev"), config,
                                                 tok, pool)
  plain = {t.id: t for t in gold[0]}
  extra = [t for t in trajectories if t.id.endswith(suffix)]
  assert [t for t in trajectories if t not in extra] == gold[0]
  later = [i for i, t in plain.items() if t.metadata["chain_position"] > 0]
  assert sorted(expert.task_id_of(t) for t in extra) == sorted(later)
  assert stats.kept == len(trajectories) == len(gold[0]) + len(later)
  assert stats.rewrites_failed == [] and stats.firsts_failed == []
  # The file the pipeline writes reads back (ids are unique).
  assert len({t.id for t in trajectories}) == len(trajectories)
  for t in extra:
    sft_data.tokenize(t, tok)
  return [(t, plain[expert.task_id_of(t)]) for t in extra]


def test_rewrites_add_a_second_trajectory_that_writes_the_skill_the_library_has(
    gold, mini_root, tok, pool):
  for t, reused in _extra_trajectories(gold, mini_root, tok, pool, expert.REWRITE_SUFFIX,
                                      rewrites=True):
    # The same conversation up to the reply: the library shown is the one the reuse saw.
    assert t.messages[:-1] == reused.messages[:-1]
    assert t.metadata["visible_skills"] == reused.metadata["visible_skills"] != []
    # Redefined under the library's name: an update, not a use of the library's skill.
    assert not t.metadata["skills"]["used"]
    assert t.metadata["skills"]["updated"] == reused.metadata["skills"]["used"]
    assert "def " in t.messages[-1]["content"] and "def " not in reused.messages[-1]["content"]


def test_firsts_add_every_later_task_writing_its_skill_with_an_empty_library(
    gold, mini_root, tok, pool):
  for t, reused in _extra_trajectories(gold, mini_root, tok, pool, expert.FIRST_SUFFIX,
                                      firsts=True):
    assert t.metadata["chain_position"] == 0 and t.metadata["visible_skills"] == []
    # Written (a generation, with its docstring) where the chain's reuse only called it.
    assert t.metadata["skills"]["generated"] == reused.metadata["skills"]["used"] != []
    assert "def " in t.messages[-1]["content"] and '"""' in t.messages[-1]["content"]
    assert t.messages[:2] != reused.messages[:2]  # the prompt shows no library


def test_a_failed_rewrite_is_reported_and_left_out(gold, mini_root, tok, pool, monkeypatch):
  broken = next(t.id for t in gold[0] if t.metadata["chain_position"] > 0)

  class BrokenRewrite(expert.ScriptedPolicy):
    def session(self, context):
      if self._rewrite and context.task_id == broken:
        return expert.TextTurnsSession(["```python\nraise ValueError('broken')\n```"], tok)
      return super().session(context)

  monkeypatch.setattr(expert, "ScriptedPolicy", BrokenRewrite)
  config = expert.ExpertConfig(appworld_root=mini_root, rewrites=True)
  trajectories, stats = expert.gold_trajectories(appworld.read_split(mini_root, "dev"), config,
                                                 tok, pool)
  assert stats.rewrites_failed == [broken]
  ids = {t.id for t in trajectories}
  assert broken in ids and broken + expert.REWRITE_SUFFIX not in ids


def test_trajectories_from_elsewhere_are_replayed_and_failures_dropped(gold, mini_root, tok,
                                                                       pool, tmp_path):
  trajectories, _ = gold
  # Take a later task of a chain (it needs the skill its chain's first task writes) and
  # a first task whose answer is broken: the broken one fails and is dropped.
  first = [t for t in trajectories if t.metadata["chain_position"] == 0]
  broken_src = first[1]
  broken = sft_data.Trajectory(
      id=broken_src.id, metadata={"task_id": broken_src.id, "source": "weak model"},
      messages=broken_src.messages[:2] + (
          {"role": "assistant", "content": "```python\nprint('no idea')\n```"},
          {"role": "tool", "content": "no idea"},
          {"role": "assistant",
           "content": "```python\napis.supervisor.complete_task(answer='wrong')\n```"}))
  chain = [t for t in trajectories if t.metadata["scenario"] == first[0].metadata["scenario"]]
  given = chain + [broken]
  kept, stats = expert.replayed_trajectories(given, expert.ExpertConfig(appworld_root=mini_root),
                                             tok, source="strong.jsonl", pool=pool)
  assert stats.failed == [broken.id]
  assert [t.id for t in kept] == [t.id for t in chain]
  for a, b in zip(kept, chain):  # replaying the gold turns reproduces the gold conversation
    assert a.messages == b.messages and a.metadata["source"] == "strong.jsonl"


def test_two_trajectories_of_one_task_are_refused_before_any_play(tok):
  """A replay plays one trajectory per task: a file the expert wrote with rewrites holds a
  task's rewrite beside it (same task_id), and the error names both."""
  messages = ({"role": "user", "content": "task"},
              {"role": "assistant", "content": "```python\napis.supervisor.complete_task()\n```"})
  given = [sft_data.Trajectory(id=i, messages=messages, metadata={"task_id": "a1b2c3d_2"})
           for i in ("a1b2c3d_2", "a1b2c3d_2" + expert.REWRITE_SUFFIX)]
  with pytest.raises(sft_data.FormatError, match=rf"two input trajectories for task 'a1b2c3d_2' "
                     rf"\('a1b2c3d_2' and 'a1b2c3d_2{expert.REWRITE_SUFFIX}'\); .*keep one"):
    expert.replayed_trajectories(given, expert.ExpertConfig(appworld_root="/nonexistent"), tok)


def test_selection_keeps_scenarios_whose_first_two_tasks_succeeded(gold, mini_root, tok, pool):
  trajectories, _ = gold
  scenario = trajectories[0].metadata["scenario"]
  chain = [t for t in trajectories if t.metadata["scenario"] == scenario]
  assert len(chain) == 3
  wrong = {"role": "assistant",
           "content": "```python\napis.supervisor.complete_task(answer='wrong')\n```"}
  second = dataclasses.replace(chain[1], messages=chain[1].messages[:2] + (wrong,))
  given = [chain[0], second, chain[2]]
  for selection, kept_ids in (("scenario", []), ("task", [chain[0].id, chain[2].id])):
    config = expert.ExpertConfig(appworld_root=mini_root, selection=selection,
                                 experiment_prefix=f"select_{selection}")
    kept, stats = expert.replayed_trajectories(given, config, tok, pool=pool)
    assert [t.id for t in kept] == kept_ids and stats.failed == [second.id]
    assert stats.not_selected == ([chain[0].id, chain[2].id] if selection == "scenario" else [])
  with pytest.raises(ValueError, match="selection"):
    expert.ExpertConfig(selection="chain")


def _wrong_answer(tok):
  """A play that submits a wrong answer at once: the task fails."""
  return expert.TextTurnsSession(["```python\napis.supervisor.complete_task(answer='?')\n```"], tok)


def test_self_distillation_rejection_samples_over_temperatures(mini_root, tok, pool):
  """A policy that fails one scenario's second task at the first temperature: the other
  scenarios are kept from the first temperature, that one from the second."""
  from sage_jax.agent import ScriptedPolicy

  dev = appworld.read_split(mini_root, "dev")
  broken_task = next(t for t in dev if t.endswith("_2"))
  scripted = ScriptedPolicy(mini_root, tok)

  class Sampled:
    def __init__(self, agent):
      self.temperature = agent.temperature

    def session(self, context):
      if self.temperature < 0.5 and context.task_id == broken_task:
        return _wrong_answer(tok)
      return scripted.session(context)

  config = expert.ExpertConfig(appworld_root=mini_root, source="self", temperatures=(0.3, 0.7),
                               experiment_prefix="self")
  kept, stats = expert.self_distilled_trajectories(Sampled, dev, config, tok, pool=pool)
  broken = appworld.scenario_id(broken_task)
  assert sorted(t.id for t in kept) == sorted(dev)
  assert {t.metadata["source"] for t in kept if t.id.startswith(broken)} == {"self@0.7"}
  assert {t.metadata["source"] for t in kept if not t.id.startswith(broken)} == {"self@0.3"}
  assert stats.tasks == len(dev) + 3 and stats.failed == [broken_task]
  with pytest.raises(ValueError, match="temperatures"):
    expert.ExpertConfig(source="self", temperatures=())


def test_a_repeated_temperature_is_a_new_try(mini_root, tok, pool):
  """Each temperature's plays draw their own sampling seeds, and the run's seed moves them:
  a temperature listed twice samples again rather than replaying the first try."""
  from sage_jax.agent import ScriptedPolicy

  dev = appworld.read_split(mini_root, "dev")
  scripted = ScriptedPolicy(mini_root, tok)
  seeds = {}  # task id -> the sampling seed of each of its plays

  class FailsFirstPlays:
    def __init__(self, agent):
      del agent

    def session(self, context):
      seeds.setdefault(context.task_id, []).append(context.seed)
      if len(seeds[context.task_id]) == 1:
        return _wrong_answer(tok)
      return scripted.session(context)

  config = expert.ExpertConfig(appworld_root=mini_root, source="self", temperatures=(0.7, 0.7),
                               experiment_prefix="again")
  kept, _ = expert.self_distilled_trajectories(FailsFirstPlays, dev, config, tok, pool=pool)
  assert sorted(t.id for t in kept) == sorted(dev)  # every scenario, at its second try
  assert sorted(seeds) == sorted(dev)
  assert all(len(s) == 2 and s[0] != s[1] for s in seeds.values()), seeds
  first = {task: s[1] for task, s in seeds.items()}
  seeds.clear()
  seeds.update({task: [None] for task in first})  # every play now succeeds
  expert.self_distilled_trajectories(FailsFirstPlays, dev, dataclasses.replace(config, seed=1),
                                     tok, pool=pool)
  assert all(seeds[task][1] != first[task] for task in first)


PRINT_LONG = "```python\nprint('x' * 200)\n```"


def test_self_distillation_samples_as_the_runs_agent(mini_root, tok, pool):
  """The starting policy plays as the run's agent at each try's temperature: with its sampling
  settings, its step, turn and episode budgets (a scenario that takes a third turn fails under
  max_steps=2), and its execution outputs cut as its RL rollouts cut them."""
  agent = AgentConfig(max_steps=2, max_turn_tokens=320, max_episode_tokens=4000,
                      max_observation_chars=40, stop_strings=("<stop>",), top_p=0.9, top_k=5)
  dev = appworld.read_split(mini_root, "dev")
  slow = appworld.scenario_id(dev[0])
  agents, requests = [], []

  class Recorded(expert.TextTurnsSession):
    async def generate(self, request):
      requests.append(request)
      return await super().generate(request)

  class PrintsFirst:
    """Prints a long output, then plays the gold turns (after a second print in `slow`)."""

    def __init__(self, agent):
      agents.append(agent)

    def session(self, context):
      turns = expert_turns_for_task(mini_root, context.task_id,
                                    {s.name: s.code for s in context.skills})
      return Recorded([PRINT_LONG] * (2 if context.scenario == slow else 1) + turns, tok)

  config = expert.ExpertConfig(appworld_root=mini_root, source="self", temperatures=(0.3,),
                               experiment_prefix="self_agent")
  kept, stats = expert.self_distilled_trajectories(PrintsFirst, dev, config, tok, pool,
                                                   agent=agent)
  sampled = dataclasses.replace(agent, temperature=0.3)
  assert agents == [sampled]
  assert {r.max_context for r in requests} == {agent.max_episode_tokens}
  assert max(r.max_new_tokens for r in requests) <= agent.max_turn_tokens
  assert max(r.turn_index for r in requests) == agent.max_steps - 1
  assert sorted(stats.failed) == sorted(t for t in dev if appworld.scenario_id(t) == slow)
  assert sorted(t.id for t in kept) == sorted(t for t in dev if appworld.scenario_id(t) != slow)
  rl = _rl_messages(PrintsFirst(sampled), [t.id for t in kept], sampled, Retriever(), mini_root,
                    tok, pool, "rl_self_agent")
  for t in kept:
    assert t.messages == rl[t.id]
    assert t.messages[3]["role"] == "tool" and "more characters cut" in t.messages[3]["content"]


def _demo_run(**pipeline_keys):
  """The demo's config, sized for the session's 8 simulated devices, with `pipeline_keys`; its
  expert plays the scenarios the run trains on (the demo names the whole train split)."""
  from configs import sage as sage_configs  # noqa: PLC0415

  c = sage_configs.get_config("demo")
  c.pipeline.update(**pipeline_keys)
  c.expert.splits = ()
  c.eval.split = "test"  # most of these runs train on dev
  c.pool.num_workers = 2
  c.engine.num_slots = 8  # slots split over the session's 8 simulated devices
  return c


def _token_strings(examples, tokenizer):
  return [[tokenizer.id_to_token(i) for i in e.tokens] for e in examples]


def test_a_run_plays_only_the_scenarios_it_trains_on(mini_root, tok, tmp_path, monkeypatch):
  """The SFT data a run makes comes from the split RL trains on (pipeline.train_split), cut to
  its `train_scenarios`: the other scenarios are not played at all (self-distillation would
  sample them with the model itself). The compact vocabulary is cut to that data and
  tokenizes it as Qwen2.5 does. A rerun may not train on other scenarios than the data's."""
  from sage_jax import pipeline  # noqa: PLC0415

  play, played = expert.play, []  # the tasks of every chain played (gold, then rewrites)

  def counted_play(policy, chains, *args, **kwargs):
    played.extend(t for chain in chains for t in chain.task_ids)
    return play(policy, chains, *args, **kwargs)

  monkeypatch.setattr(expert, "play", counted_play)
  workdir = tmp_path / "run"
  pipe = pipeline.Pipeline(_demo_run(train_split="dev", train_scenarios=1), str(workdir))
  try:
    trained = appworld.first_scenarios(appworld.read_split(mini_root, "dev"), 1)
    assert pipe.train_task_ids() == trained and len(trained) == 3
    assert sorted(played) == sorted(trained * 2)  # the gold plays, then the rewrites'
    ids = [t.id for t in sft_data.read_jsonl(workdir / "expert_trajectories.jsonl")]
    assert sorted(map(expert.task_of_id, ids)) == sorted(trained + trained[1:])
    examples = pipe.expert_examples()  # tokenized with the run's compact vocabulary
    assert [e.id for e in examples] == ids and pipe.tokenizer.vocab_size < tok.vocab_size
    full = sft_data.load_examples(workdir / "expert_trajectories.jsonl", tok)
    assert _token_strings(examples, pipe.tokenizer) == _token_strings(full, tok)
  finally:
    pipe.close()
  # The data is made once per workdir: a rerun that trains on more scenarios, which the file
  # lacks, is refused before it reads anything.
  made = (workdir / "expert_trajectories.jsonl").read_text()
  with pytest.raises(ConfigError, match=r"config.pipeline.train_scenarios: 1 -> 2"):
    pipeline.Pipeline(_demo_run(train_split="dev", train_scenarios=2), str(workdir))
  assert (workdir / "expert_trajectories.jsonl").read_text() == made


def test_expert_trajectories_longer_than_the_engine_are_left_out(mini_root, tmp_path, caplog):
  """A scripted play's budgets exceed a run's (`SCRIPTED_BUDGET_FLOORS`), and SFT trains on
  trajectories of at most `engine.max_len` tokens: the longer ones are left out of the SFT data
  a run makes, named in a warning, so that the run (and every rerun, which reads that file)
  trains on the rest. The demo's dev scenario plays to 611-847 tokens. Replies a rollout would
  cut (agent.max_turn_tokens) are named. An SFT example the
  largest length bucket cannot hold stops SFT before it trains, naming the key."""
  from sage_jax import pipeline  # noqa: PLC0415

  c = _demo_run(train_split="dev", train_scenarios=1, stages=("sft",))
  c.engine.update(max_len=800, prefill_buckets=(64, 256, 512))
  c.agent.update(max_episode_tokens=800, max_turn_tokens=32)
  c.batch.length_buckets = (256, 512)
  workdir = tmp_path / "run"
  with caplog.at_level("WARNING"):
    pipe = pipeline.Pipeline(c, str(workdir))
  try:
    kept = {e.id: len(e.tokens) for e in pipe.expert_examples()}
    with pytest.raises(ConfigError, match=r"config.batch.length_buckets: the largest, 512, "
                                          r"holds fewer positions than the SFT example"):
      pipe.sft()
  finally:
    pipe.close()
  warned = [r.getMessage() for r in caplog.records if "longer than config.engine.max_len=800"
            in r.getMessage()]
  assert len(warned) == 1, [r.getMessage() for r in caplog.records]
  dropped = re.findall(r"(\S+) \((\d+) tokens\)", warned[0])
  assert dropped and kept and all(n <= 800 for n in kept.values())
  assert all(int(n) > 800 for _, n in dropped)
  trained = appworld.first_scenarios(appworld.read_split(mini_root, "dev"), 1)
  assert sorted(map(expert.task_of_id, [*kept, *(i for i, _ in dropped)])) == sorted(
      trained + trained[1:])  # the gold plays and the later tasks' rewrites
  # Their replies (41 and 42 tokens, calling the skill) are longer than this run's turns.
  cut = [r.getMessage() for r in caplog.records
         if "reply longer than config.agent.max_turn_tokens=32" in r.getMessage()]
  assert len(cut) == 1 and {i for i, _ in re.findall(r"(\S+) \((\d+) tokens\)", cut[0])
                            } == set(kept), cut


def test_a_given_files_other_scenarios_are_left_out_of_sft(gold, mini_root, tok, tmp_path):
  """A given SFT data file may hold scenarios the run does not train on: SFT leaves them out;
  the compact vocabulary is cut to the whole file."""
  from sage_jax import compact_tokenizer, pipeline  # noqa: PLC0415

  given = tmp_path / "given.jsonl"
  sft_data.write_jsonl(given, gold[0])  # the whole dev split
  trained = appworld.first_scenarios(appworld.read_split(mini_root, "dev"), 1)
  pipe = pipeline.Pipeline(_demo_run(train_split="dev", train_scenarios=1,
                                     expert_trajectories=str(given)), str(tmp_path / "run"))
  try:
    examples = pipe.expert_examples()
    assert sorted(e.id for e in examples) == sorted(trained)
    full = [e for e in sft_data.load_examples(given, tok) if e.id in trained]
    assert _token_strings(examples, pipe.tokenizer) == _token_strings(full, tok)
    cut = lambda name, corpus: Tokenizer(compact_tokenizer.write_compact_tokenizer(
        tmp_path / name, ids=(t for e in corpus for t in e.tokens))).vocab_size
    assert pipe.tokenizer.vocab_size == cut("whole", sft_data.load_examples(given, tok))
  finally:
    pipe.close()


def test_a_runs_sft_data_is_played_as_its_agent(mini_root, tmp_path):
  """A run's agent alone decides the format of the SFT data its pipeline makes (no library
  here: the plain code agent's), and its short turns leave the gold turns whole. Splits named
  in expert.splits are played whole, for SFT on other tasks than RL's."""
  from sage_jax import pipeline  # noqa: PLC0415

  c = _demo_run(train_scenarios=0)  # RL on the whole train split
  c.agent.update(use_library=False, max_turn_tokens=48)
  c.retrieval.strategy = "none"
  c.reward.variant = "outcome"  # no library: no skill to pay for
  c.expert.update(splits=("dev",), rewrites=False)
  workdir = tmp_path / "run"
  pipeline.Pipeline(c, str(workdir)).close()  # a compact vocabulary is cut to the SFT data
  trajectories = sft_data.read_jsonl(workdir / "expert_trajectories.jsonl")
  assert sorted(t.id for t in trajectories) == sorted(appworld.read_split(mini_root, "dev"))
  assert {t.messages[0]["content"] for t in trajectories} == {prompts.system_prompt(None)}
  # The command, given the run's config, makes the same data: the file a run is given
  # (pipeline.expert_trajectories) holds the prompts its own plays would.
  out = tmp_path / "command.jsonl"
  done = subprocess.run([sys.executable, "-m", "sage_jax.sft.expert", f"--out={out}",
                         "--splits=dev", "--config=configs/sage.py:demo",
                         "--config.agent.use_library=false", "--config.agent.max_turn_tokens=48",
                         "--config.reward.variant=outcome",
                         "--config.retrieval.strategy=none", "--config.expert.rewrites=false"],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  assert ({t.id: t.messages for t in sft_data.read_jsonl(out)}
          == {t.id: t.messages for t in trajectories})


def test_command_line_plays_the_gold_solutions_of_a_split(mini_root, tmp_path):
  out = tmp_path / "test.jsonl"
  done = subprocess.run([sys.executable, "-m", "sage_jax.sft.expert", f"--out={out}",
                         "--splits=test"], capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  by_scenario = appworld.group_by_scenario(appworld.read_split(mini_root, "test"))
  assert [t.id for t in sft_data.read_jsonl(out)] == [
      i for s in sorted(by_scenario) for i in by_scenario[s]]


def test_command_line_stops_on_a_bad_input_file_before_playing(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": "x", "messages": [}\n')
  out = tmp_path / "out.jsonl"
  for given, named in ((bad, f"--input: {bad}:1: not JSON"),
                       (tmp_path / "missing.jsonl", "No such file")):
    done = subprocess.run([sys.executable, "-m", "sage_jax.sft.expert", f"--out={out}",
                           f"--input={given}"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and named in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "gold" not in done.stdout and not out.exists()


def test_a_bad_gold_file_stops_the_expert_before_any_play(mini_root, tok, tmp_path,
                                                          monkeypatch):
  """A task whose gold solution or spec cannot be read fails naming the file before the
  first task is played, in the library and on the command line, not when its scenario's turn
  comes."""
  import shutil  # noqa: PLC0415
  root = tmp_path / "root"
  shutil.copytree(mini_root, root, symlinks=True)
  task_ids = appworld.read_split(str(root), "dev")
  last = root / "data" / "tasks" / task_ids[-1]
  played = []
  monkeypatch.setattr(expert, "play", lambda *args, **kwargs: played.append(args))
  config = expert.ExpertConfig(appworld_root=str(root))
  breakages = (
      ("specs.json", b'{"instruction": ', r"specs.json: not a task spec with an instruction "
       r"\(JSONDecodeError"),
      ("specs.json", b'{"task": "x"}', r"specs.json: not a task spec.*KeyError"),
      ("ground_truth/solution.py", b"print('\xff\xfe')\n\xff", r"solution.py: the gold "
       r"solution is not UTF-8 text"),
  )
  for name, text, message in breakages:
    saved = (last / name).read_bytes()
    (last / name).write_bytes(text)
    with pytest.raises(ValueError, match=message):
      expert.gold_trajectories(task_ids, config, tok, pool=None)
    (last / name).write_bytes(saved)
  (last / "ground_truth" / "solution.py").unlink()
  with pytest.raises(FileNotFoundError, match=rf"{last}/ground_truth: no gold solution"):
    expert.gold_trajectories(task_ids, config, tok, pool=None)
  assert played == []
  out = tmp_path / "out.jsonl"
  done = subprocess.run([sys.executable, "-m", "sage_jax.sft.expert", f"--out={out}",
                         f"--appworld_root={root}", "--splits=dev"],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode != 0 and f"--splits: {last}/ground_truth: no gold" in done.stderr
  assert "Traceback" not in done.stderr and not out.exists()


def test_an_expert_whose_every_play_the_environment_failed_under_stops(mini_root, tok,
                                                                       tmp_path):
  """A broken pool gives no trajectory at all: the expert stops naming the fault, rather
  than return empty data that a run would write to its workdir and reuse."""
  task_ids = appworld.read_split(mini_root, "dev")[:1]
  with appworld_fixtures.broken_pool(mini_root, tmp_path, episode_retries=0) as pool:
    with pytest.raises(rollout.EnvironmentDown,
                       match=r"all 1 episodes of the expert's plays.*no environment worker"):
      expert.gold_trajectories(task_ids, expert.ExpertConfig(appworld_root=mini_root), tok,
                               pool)


def test_command_line_without_verification(gold, tmp_path):
  trajectories, _ = gold
  given = tmp_path / "given.jsonl"
  sft_data.write_jsonl(given, trajectories[:3])
  out = tmp_path / "out.jsonl"
  done = subprocess.run([sys.executable, "-m", "sage_jax.sft.expert", f"--out={out}",
                         "--gold=false", f"--input={given}", "--verify=false"],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  assert report["written"] == 3
  assert sft_data.read_jsonl(out) == trajectories[:3]
  np.testing.assert_array_equal(  # the file tokenises like the in-memory trajectories
      sft_data.load_examples(out, Tokenizer())[0].tokens,
      sft_data.tokenize(trajectories[0], Tokenizer()).tokens)
