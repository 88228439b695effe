"""Expert trajectories for SFT, executed against the real AppWorld engine; only successes kept.

    python -m sage_jax.sft.expert --out=expert.jsonl                       # mini world gold
    python -m sage_jax.sft.expert --out=expert.jsonl --input=strong.jsonl  # collected elsewhere

Gold mode: every scenario of the given tasks (a run's: those it trains on, `Pipeline`; the
command's: those of `--splits`) is walked as one chain (its tasks in order, one skill library
carried along), each task played by `agent.gold_solutions.ScriptedPolicy`: the gold solution
rewritten into the skill format (the first task defines the scenario's function with a
docstring and calls it; later tasks call the library skill). The agent, the env pool and
AppWorld's evaluation are the ones rollouts use, so the system prompt, the task message and
the observations are exactly what the model will see.

Input mode: trajectories in the JSONL format of `sft.data` (e.g. from a stronger model) are
replayed the same way: grouped into scenario chains by task id (`metadata.task_id`, else
`id`), their assistant turns played back in order against the real engine; the observations
are the engine's own. Without `--verify` they are only validated and copied.

Self-distillation (`ExpertConfig.source = "self"`, the paper's ablation): the trajectories
come from the starting policy itself, rejection-sampled over temperatures: every scenario of
the given tasks is played at `temperatures[0]`; the scenarios that yield no selected
trajectory are played again at the next temperature, and so on
(`self_distilled_trajectories`).

Every play runs as the agent it is given, the skills each task sees picked by the retriever
it is given; a run gives its own `agent` and `retrieval` (`Pipeline.expert_trajectories`),
so the prompt SFT trains on is the one RL and evaluation show: the same format
(`agent.use_library`), skills, and cuts of the listing and of execution outputs. Scripted
plays (gold, replayed) keep budgets of at least `gold_solutions.SCRIPTED_BUDGET_FLOORS`
(`scripted_agent`): their turns are fixed, and a run's short turns would cut them to
failures, leaving no SFT data. Self-distillation samples as the run's agent, budgets, stop
strings, top_p and top_k included, at each try's temperature. The command plays as the agent
and retrieval of `--config` (a run's config file and overrides, as the training command
takes them: a file made for the run, given as `pipeline.expert_trajectories`, then holds the
prompts its own plays would), its expert section giving `--selection`, `--rewrites` and
`--firsts` where the command line leaves them; without `--config`, as the default agent
(`--use_library`) with the default retrieval (the skills of the task's scenario).

Selection (`ExpertConfig.selection`): "scenario" (default, the paper's rule) keeps a
scenario's trajectories only when its first `scenario_tasks` (2) tasks succeeded, so that
every kept chain shows a skill written and then reused; "task" keeps every successful task.
Either way a trajectory is kept only if AppWorld says the task succeeded, and it is written
from the token-level conversation (`sft.data.messages_from_ids`), checked to tokenise back to
exactly the same ids and loss mask.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import sys
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from absl import app, flags

from sage_jax import config_file, multihost
from sage_jax.agent.config import AgentConfig, RetrievalConfig
from sage_jax.agent.gold_solutions import (ScriptedPolicy, TextTurnsSession, check_readable,
                                          scripted_agent)
from sage_jax.agent.policy import TaskContext
from sage_jax.agent.retrieval import EMBEDDING_STRATEGIES, Retriever
from sage_jax.envs import appworld
from sage_jax.rl import rollout
from sage_jax.sft import data as data_lib
from sage_jax.tokenizer import Tokenizer
from sage_jax.train.loop import step_seed


SELECTIONS = ("scenario", "task")
# Ids of a task's extra gold trajectories: `<task id><suffix>` (ExpertConfig.rewrites, .firsts).
REWRITE_SUFFIX = ":rewrite"
FIRST_SUFFIX = ":first"
SOURCES = ("gold", "self")


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
  """appworld_root: the data root (None: the mini world, built on first use). splits: the
  splits a run's expert plays whole for its SFT data (`Pipeline.expert_task_ids`); () (the
  default): the tasks the run trains on, `pipeline.train_split` cut to
  `pipeline.train_scenarios` (a cut refuses other splits than the train split: SFT keeps only
  the training scenarios' examples). The functions below play the task ids they are given.
  num_workers: AppWorld worker processes of the `sft.expert` command's own pool (a training
    run plays in its pool: pool.num_workers).
  outputs_root: where AppWorld writes episode outputs (None: a temporary directory).
  experiment_prefix: AppWorld experiment names. selection: "scenario" (keep a scenario's
  successful tasks when its first `scenario_tasks` tasks succeeded; the paper's rule) or
  "task" (every successful task). source: "gold" (the gold solutions, scripted) or "self"
  (self-distillation: the starting policy, rejection-sampled over `temperatures`, in order).
  rewrites: with gold, also keep for every task after a chain's first one a second
  trajectory, in which the expert writes the skill again although the library shown to it has
  it (id `<task id>:rewrite`): an SFT policy that reuses skills only about half the time, the
  choice RL's skill reward (and, through chains, its outcome) is about. firsts: with gold,
  also keep for every task after a chain's first one a trajectory of it played first, with an
  empty library, so writing the skill (id `<task id>:first`): RL's random chains
  (`rollout.chain_order` "random") put any task of a scenario first, and a policy that saw a
  later task only calling its skill calls it there too, undefined. seed: self-distillation's
  sampling seed (derived from the run's seed); each temperature's plays draw their own seeds
  from it, so a temperature listed twice is a second, different try.

  The agent the expert plays as is not set here: it is the run's `agent` section (whose
  `use_library` decides the format of the SFT data as it does RL's), given to the functions
  below with the run's retriever."""

  appworld_root: str | None = None
  splits: tuple[str, ...] = ()
  num_workers: int = 2
  outputs_root: str | None = None
  experiment_prefix: str = "expert"
  selection: str = "scenario"
  scenario_tasks: int = 2
  source: str = "gold"
  temperatures: tuple[float, ...] = (0.3, 0.7, 1.0)
  rewrites: bool = False
  firsts: bool = False
  seed: int = 0

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f"source={self.source!r}; expected one of {SOURCES}")
    if not self.temperatures or any(t < 0 for t in self.temperatures):
      raise ValueError(f"temperatures={self.temperatures} must be a non-empty list of "
                       "values >= 0")
    if self.selection not in SELECTIONS:
      raise ValueError(f"selection={self.selection!r}; expected one of {SELECTIONS}")
    if self.scenario_tasks < 1:
      raise ValueError(f"scenario_tasks={self.scenario_tasks} must be >= 1")


@dataclasses.dataclass
class ExpertStats:
  tasks: int = 0
  succeeded: int = 0
  kept: int = 0
  failed: list[str] = dataclasses.field(default_factory=list)
  not_selected: list[str] = dataclasses.field(default_factory=list)  # succeeded, scenario not
  untokenisable: list[str] = dataclasses.field(default_factory=list)
  # With `rewrites` / `firsts`: later tasks whose extra play failed or did not tokenise (not
  # kept).
  rewrites_failed: list[str] = dataclasses.field(default_factory=list)
  firsts_failed: list[str] = dataclasses.field(default_factory=list)


class ReplayPolicy:
  """A policy that answers task `t` with the assistant turns of the given trajectory of `t`."""

  def __init__(self, turns_by_task: dict[str, list[str]], tokenizer: Tokenizer):
    self._turns, self._tok = turns_by_task, tokenizer

  def session(self, context: TaskContext) -> TextTurnsSession:
    return TextTurnsSession(self._turns.get(context.task_id, []), self._tok)


def task_of_id(trajectory_id: str) -> str:
  """The task a trajectory id belongs to (an extra trajectory's id is its task's plus a
  suffix)."""
  for suffix in (REWRITE_SUFFIX, FIRST_SUFFIX):
    if trajectory_id.endswith(suffix):
      return trajectory_id.removesuffix(suffix)
  return trajectory_id


def task_id_of(trajectory: data_lib.Trajectory) -> str:
  return str(trajectory.metadata.get("task_id") or task_of_id(trajectory.id))


def record_to_trajectory(record: Any, tokenizer: Tokenizer,
                         source: str) -> data_lib.Trajectory | None:
  """The trajectory of a rollout record, or None if it would not tokenise back to the same
  ids and loss mask (e.g. a turn cut by the token budget)."""
  messages = data_lib.messages_from_ids(record.tokens.tolist(), record.turns, tokenizer)
  trajectory = data_lib.Trajectory(
      id=record.task_id, messages=tuple(messages),
      metadata=json.loads(json.dumps({  # plain JSON values, as read back from the file
          "task_id": record.task_id, "scenario": record.scenario,
          "chain_position": record.chain_position, "source": source,
          "skills": record.events.to_dict(), "visible_skills": list(record.visible_skills),
          "num_steps": record.num_steps})))
  example = data_lib.tokenize(trajectory, tokenizer)
  n = len(example.tokens)
  if (n > len(record.tokens) or not np.array_equal(example.tokens, record.tokens[:n])
      or not np.array_equal(example.loss_mask, record.loss_mask[:n])
      or record.loss_mask[n:].any()):
    return None
  return trajectory


def _chains(task_ids: Iterable[str]) -> list[rollout.Chain]:
  return rollout.scenario_chains(sorted(set(task_ids)))



def play(policy: Any, chains: Sequence[rollout.Chain], tokenizer: Tokenizer,
         config: ExpertConfig, source: str, pool: appworld.EnvPool | None = None,
         seed: int = 0, agent: AgentConfig = AgentConfig(),
         retriever: Retriever | None = None) -> tuple[list[data_lib.Trajectory], ExpertStats]:
  """Runs `policy` as `agent` on the chains (one library per chain, the skills each task sees
  picked by `retriever`, by default those of its scenario) in the real engine (`pool`, or a
  pool started for the call), sampling seeds from `seed`; returns the successful
  trajectories that `config.selection` keeps, in chain order. Given the run's agent and
  retriever, the trajectories hold the prompts and observations its rollouts hold. With
  several processes, each plays its share of the chains and every process returns them
  all."""
  root = appworld.resolve_root(config.appworld_root or "mini")
  if pool is None:
    pool_config = appworld.EnvPoolConfig(num_workers=config.num_workers, appworld_root=root,
                                         outputs_root=config.outputs_root, keep_outputs=False)
    with appworld.EnvPool(pool_config) as started:
      return play(policy, chains, tokenizer, config, source, started, seed, agent, retriever)
  ctx = rollout.RolloutContext(policy, pool, tokenizer, agent,
                               Retriever() if retriever is None else retriever, root)
  rollout_config = rollout.RolloutConfig(group_size=1,
                                         chain_length=max(len(c.task_ids) for c in chains),
                                         experiment_prefix=config.experiment_prefix,
                                         seed=seed)
  share = multihost.share(len(chains))

  def run() -> rollout.RolloutBatch:
    batch = asyncio.run(rollout.run_groups(ctx, chains[share], rollout_config,
                                           first_group=share.start))
    # Before any file is written: a run reuses the expert data it finds in its workdir.
    rollout.check_environment(batch.flat(), "the expert's plays on this process")
    return batch

  batch = multihost.all_succeed(run)
  stats = ExpertStats()
  out = []
  for group in (g for part in multihost.allgather_objects(batch.records) for g in part):
    chain = group[0]
    selected = config.selection == "task" or all(
        r.success for r in chain[:config.scenario_tasks])
    for record in chain:
      stats.tasks += 1
      if not record.success:
        stats.failed.append(record.task_id)
        continue
      stats.succeeded += 1
      if not selected:
        stats.not_selected.append(record.task_id)
        continue
      trajectory = record_to_trajectory(record, tokenizer, source)
      if trajectory is None:
        stats.untokenisable.append(record.task_id)
        continue
      out.append(trajectory)
  stats.kept = len(out)
  return out, stats


def gold_trajectories(task_ids: Sequence[str], config: ExpertConfig, tokenizer: Tokenizer,
                      pool: appworld.EnvPool | None = None, agent: AgentConfig = AgentConfig(),
                      retriever: Retriever | None = None
                      ) -> tuple[list[data_lib.Trajectory], ExpertStats]:
  """The gold solutions of `task_ids`, executed as `scripted_agent(agent)` (in the skill
  format when `agent.use_library`), skills picked by `retriever`; successes only."""
  root = appworld.resolve_root(config.appworld_root or "mini")
  config = dataclasses.replace(config, appworld_root=root)
  check_readable(root, task_ids)
  chains = _chains(task_ids)
  scripted = scripted_agent(agent)
  out, stats = play(ScriptedPolicy(root, tokenizer), chains, tokenizer, config, "gold", pool,
                    agent=scripted, retriever=retriever)
  if not agent.use_library:
    return out, stats
  later = [t for chain in chains for t in chain.task_ids[1:]]
  if config.rewrites:
    again = dataclasses.replace(config, experiment_prefix=f"{config.experiment_prefix}_rewrite")
    rewritten, rewrite_stats = play(ScriptedPolicy(root, tokenizer, rewrite=True), chains,
                                    tokenizer, again, "gold_rewrite", pool, agent=scripted,
                                    retriever=retriever)
    out += [dataclasses.replace(t, id=f"{t.id}{REWRITE_SUFFIX}") for t in rewritten
            if t.metadata["chain_position"] > 0]
    stats.rewrites_failed = _failed(rewrite_stats, later)
  if config.firsts:
    alone = [rollout.Chain(appworld.scenario_id(t), (t,)) for t in later]
    again = dataclasses.replace(config, experiment_prefix=f"{config.experiment_prefix}_first")
    played, first_stats = play(ScriptedPolicy(root, tokenizer), alone, tokenizer, again,
                               "gold_first", pool, agent=scripted, retriever=retriever)
    out += [dataclasses.replace(t, id=f"{t.id}{FIRST_SUFFIX}") for t in played]
    stats.firsts_failed = _failed(first_stats, later)
  stats.kept = len(out)
  return out, stats


def _failed(stats: ExpertStats, task_ids: Sequence[str]) -> list[str]:
  """The tasks of `task_ids` that an extra play failed or could not tokenise."""
  lost = set(stats.failed + stats.untokenisable)
  return [t for t in task_ids if t in lost]


def self_distilled_trajectories(policy_at: Callable[[AgentConfig], Any],
                                task_ids: Sequence[str], config: ExpertConfig,
                                tokenizer: Tokenizer, pool: appworld.EnvPool | None = None,
                                agent: AgentConfig = AgentConfig(),
                                retriever: Retriever | None = None
                                ) -> tuple[list[data_lib.Trajectory], ExpertStats]:
  """Rejection sampling from the starting policy (`policy_at(agent)`: it sampling as
  `agent`): the scenarios of `task_ids` are played at each of `config.temperatures` in turn,
  as `agent` at that temperature (its budgets, stop strings, top_p and top_k are the run's),
  each scenario until a play of it yields selected trajectories, which are kept (source
  "self@<temperature>"). The stats count every play."""
  root = appworld.resolve_root(config.appworld_root or "mini")
  config = dataclasses.replace(config, appworld_root=root)
  remaining = list(task_ids)
  out, total = [], ExpertStats()
  for i, temperature in enumerate(config.temperatures):
    if not remaining:
      break
    attempt = dataclasses.replace(config, experiment_prefix=f"{config.experiment_prefix}_t{i}")
    sampled = dataclasses.replace(agent, temperature=temperature)
    kept, stats = play(policy_at(sampled), _chains(remaining), tokenizer, attempt,
                       f"self@{temperature:g}", pool, step_seed(config.seed, i), sampled,
                       retriever)
    for field in dataclasses.fields(ExpertStats):
      setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
    accepted = {appworld.scenario_id(task_id_of(t)) for t in kept}
    remaining = [t for t in remaining if appworld.scenario_id(t) not in accepted]
    out += kept
  return out, total


def replayed_trajectories(trajectories: Sequence[data_lib.Trajectory], config: ExpertConfig,
                          tokenizer: Tokenizer, source: str = "input",
                          pool: appworld.EnvPool | None = None,
                          agent: AgentConfig = AgentConfig(),
                          retriever: Retriever | None = None
                          ) -> tuple[list[data_lib.Trajectory], ExpertStats]:
  """Trajectories collected elsewhere, replayed against the engine as
  `scripted_agent(agent)`, skills picked by `retriever`; successes only."""
  turns: dict[str, list[str]] = {}
  ids: dict[str, str] = {}
  for t in trajectories:
    tid = task_id_of(t)
    if tid in turns:
      raise data_lib.FormatError(
          f"two input trajectories for task {tid!r} ({ids[tid]!r} and {t.id!r}); a replay "
          "plays one per task: keep one of them (an expert file made with rewrites or firsts "
          "holds a task's other version beside it)")
    turns[tid], ids[tid] = [m["content"] for m in t.messages if m["role"] == "assistant"], t.id
  return play(ReplayPolicy(turns, tokenizer), _chains(turns), tokenizer, config, source, pool,
              agent=scripted_agent(agent), retriever=retriever)


def _define_flags() -> None:
  config_file.define_flag("config", "A run's config (configs/sage.py:<preset>): play as its "
                          "agent, retrieval and expert settings.")
  flags.DEFINE_string("out", None, "Output JSONL of expert trajectories.")
  flags.DEFINE_string("appworld_root", None,
                      "AppWorld data root (default: the mini world, built if needed).")
  flags.DEFINE_list("splits", ["train"], "Splits whose gold solutions are played.")
  flags.DEFINE_bool("gold", True, "Play the gold solutions of --splits.")
  flags.DEFINE_list("input", [], "JSONL files of trajectories collected elsewhere.")
  flags.DEFINE_bool("verify", True, "Replay --input trajectories against the engine (else "
                    "only validate and copy them).")
  flags.DEFINE_integer("num_workers", 2, "AppWorld worker processes.")
  flags.DEFINE_bool("use_library", True, "Without --config: the Skill Library Agent (else "
                    "the plain code agent); the other agent and retrieval settings are the "
                    "defaults.")
  flags.DEFINE_enum("selection", "scenario", list(SELECTIONS),
                    "scenario: keep a scenario when its first two tasks succeeded (the "
                    "paper's rule); task: keep every successful task.")
  flags.DEFINE_bool("rewrites", False, "Gold: also every later task writing the skill its "
                    "library has (id <task>:rewrite).")
  flags.DEFINE_bool("firsts", False, "Gold: also every later task played first, with an "
                    "empty library (id <task>:first).")
  flags.mark_flag_as_required("out")


def _played_as(f: flags.FlagValues) -> tuple[AgentConfig, RetrievalConfig, ExpertConfig]:
  """The agent, retrieval and expert settings and the AppWorld data of `--config` (a flag given
  on the command line wins over its expert and data keys), else the defaults with the
  flags'."""
  from_flags = {"selection": f.selection, "rewrites": f.rewrites, "firsts": f.firsts,
                "num_workers": f.num_workers, "appworld_root": f.appworld_root}
  if f.config is None:
    return AgentConfig(use_library=f.use_library), RetrievalConfig(), ExpertConfig(**from_flags)
  if f["use_library"].present:
    raise app.UsageError("--use_library with --config: set --config.agent.use_library")
  # The schema resolves the run's sections as training does (placeholders, derived seeds).
  from sage_jax import run_config  # noqa: PLC0415 - it builds on this module's ExpertConfig

  run = run_config.resolve(f.config)
  if run.expert.source != "gold":
    raise app.UsageError(f"config.expert.source={run.expert.source!r} samples the policy "
                         "model, which this command does not load: the run makes its own data")
  if run.retrieval.embedding_model == "policy" and run.retrieval.strategy in EMBEDDING_STRATEGIES:
    raise app.UsageError("config.retrieval.embedding_model='policy' retrieves with the policy "
                         "model, which this command does not load: the run makes its own data")
  given = {name: value for name, value in from_flags.items() if f[name].present}
  expert = dataclasses.replace(run.expert, appworld_root=run.pipeline.data, **given)
  return run.agent, run.retrieval, expert


def main(argv) -> None:
  del argv
  f = flags.FLAGS
  logging.getLogger("httpx").setLevel(logging.WARNING)
  tokenizer = Tokenizer()
  agent, retrieval, config = _played_as(f)
  config = dataclasses.replace(config,
                               appworld_root=appworld.resolve_root(config.appworld_root or "mini"))
  retriever = Retriever(retrieval)
  inputs = {}
  for path in f.input:  # read before any play: a bad file stops the command at once
    try:
      inputs[path] = data_lib.read_jsonl(path)
    except (OSError, data_lib.FormatError) as e:
      raise app.UsageError(f"--input: {e}") from e
  kept: list[data_lib.Trajectory] = []
  report: dict[str, Any] = {}
  if f.gold:
    task_ids = [t for split in f.splits for t in appworld.read_split(config.appworld_root, split)]
    try:  # a bad gold file stops the command in one line, before any play
      check_readable(config.appworld_root, task_ids)
    except (OSError, ValueError) as e:
      raise app.UsageError(f"--splits: {e}") from e
    trajectories, stats = gold_trajectories(task_ids, config, tokenizer, agent=agent,
                                            retriever=retriever)
    kept += trajectories
    report["gold"] = dataclasses.asdict(stats)
  for path, given in inputs.items():
    if f.verify:
      trajectories, stats = replayed_trajectories(given, config, tokenizer, source=path,
                                                  agent=agent, retriever=retriever)
      report[path] = dataclasses.asdict(stats)
    else:
      for t in given:
        data_lib.tokenize(t, tokenizer)  # fails loudly on anything it cannot tokenise
      trajectories = given
      report[path] = {"tasks": len(given), "kept": len(given), "verified": False}
    kept += trajectories
  ids = collections.Counter(t.id for t in kept)
  duplicates = sorted(i for i, n in ids.items() if n > 1)
  if duplicates:
    raise data_lib.FormatError(f"several trajectories for {duplicates[:5]}; give each task "
                               "one source")
  report["written"] = data_lib.write_jsonl(f.out, kept)
  report["out"] = f.out
  print(json.dumps(report), file=sys.stdout)


if __name__ == "__main__":
  _define_flags()
  config_file.run(main)
