"""Evaluation of the Skill Library Agent on an AppWorld split (used by `sage_jax.evaluate`
and by the training pipeline's dev evaluations).

Runs every scenario of the split (mini world or an official AppWorld root), its tasks in
order, with one skill library for the whole run and the configured retrieval strategy; then
reports TGC, SGC, average interaction steps, average generated tokens, skill usage rate,
success given skill use and no-code rate, overall and per difficulty. Writes
<workdir>/eval_<split>.json (metrics, AppWorld's own scores of the same outputs, per-task
records, the config), eval_<split>.md (the table), transcripts_<split>.jsonl (each task's
conversation, decoded) and library_<split>.json (the final library). The policy is the
model through the sampler engine, or the scripted expert (`eval.policy="scripted"`), which
runs the gold solutions in the skill format.

With several processes, each runs its share of the scenarios on its own pool and sampler;
the records are gathered and process 0 writes the reports (AppWorld's own scores are
computed by each process on its outputs and combined, weighted by tasks and scenarios).

Config sections: eval (EvalConfig), agent (AgentConfig), retrieval (RetrievalConfig), pool
(EnvPoolConfig), model (ModelSpec), engine (the sampler's EngineConfig), sampler_mesh
(SamplerMeshConfig: where each process's copy of the model lives, loaded straight onto it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from etils import epath

from sage_jax import configurable, multihost, storage
from sage_jax.agent.config import AgentConfig, RetrievalConfig
from sage_jax.agent.gold_solutions import ScriptedPolicy, scripted_agent
from sage_jax.agent.library import SkillLibrary
from sage_jax.agent.retrieval import SCENARIO_LOCAL_STRATEGIES, Retriever, make_embedder
from sage_jax.configurable import ConfigError
from sage_jax.envs import appworld
from sage_jax.eval import metrics as metrics_lib
from sage_jax.eval import progress as progress_lib
from sage_jax.rl import rollout
from sage_jax.rl.episode import EpisodeRecord
from sage_jax.sampler import AsyncEngine, Engine, EngineConfig
from sage_jax.tokenizer import Tokenizer
from sage_jax.weights import loader

POLICIES = ("model", "scripted")
# How far AppWorld's TGC/SGC may lie from the exact percentage: it rounds the fraction to 4
# decimals (0.005 points), then the percentage to 1 (0.05); a mean of several processes'
# rounded scores stays within the same bound.
APPWORLD_ROUNDING = 0.06


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """split: dataset split (data/datasets/<split>.txt). data: "mini" (the offline mini world,
  built on first use) or an APPWORLD_ROOT. policy: "model" or "scripted". experiment:
  AppWorld experiment name of the outputs. max_concurrent_scenarios: scenarios run at once
  (0: all when retrieval is per scenario, one at a time otherwise, so the library a task
  sees does not depend on timing; retrieval across scenarios also keeps a multi-process
  evaluation on process 0, with its one library). max_scenarios: evaluate only the first N
  scenarios (0: all). appworld_check: also score the outputs with AppWorld's own evaluator
  (child process) and fail if TGC/SGC disagree (on the episodes the environment did not fail
  under: AppWorld scores whatever such an episode saved, we count it as failed). seed:
  sampler seeds. temperature: the sampling temperature of evaluation (greedy by default,
  also for the dev evaluations inside a training run, whose agent section samples for
  training: set it to the agent's to evaluate what training samples)."""

  split: str = "dev"
  data: str = "mini"
  policy: str = "model"
  experiment: str = "eval"
  max_concurrent_scenarios: int = 0
  max_scenarios: int = 0
  appworld_check: bool = True
  seed: int = 0
  temperature: float = 0.0

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"policy={self.policy!r}; expected one of {POLICIES}")
    if self.max_concurrent_scenarios < 0 or self.max_scenarios < 0:
      raise ValueError("max_concurrent_scenarios and max_scenarios must be >= 0")
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")

  def agent(self, agent: AgentConfig) -> AgentConfig:
    """The agent settings evaluation samples with."""
    return dataclasses.replace(agent, temperature=self.temperature)


async def run_scenarios(
    ctx: rollout.RolloutContext, task_ids: Sequence[str], *, experiment: str,
    library: SkillLibrary, max_concurrent: int = 0, seed: int = 0,
    indices: Sequence[int] | None = None,
    finished: Callable[[int, list[EpisodeRecord]], None] | None = None) -> list[EpisodeRecord]:
  """Every scenario of `task_ids` (tasks in order) with one shared library; records in
  split order. The i-th scenario is number `indices[i]` of the split (its group and seed;
  default i); `finished(number, records)` is called as each scenario ends."""
  chains = rollout.scenario_chains(task_ids)
  indices = range(len(chains)) if indices is None else indices
  if len(indices) != len(chains):
    raise ValueError(f"{len(indices)} scenario numbers for {len(chains)} scenarios")
  limit = max_concurrent or len(chains)
  semaphore = asyncio.Semaphore(limit)

  async def one(index: int, chain: rollout.Chain) -> list[EpisodeRecord]:
    async with semaphore:
      records = await rollout.run_chain(ctx, chain, group=index, rollout=0,
                                        experiment=experiment, library=library,
                                        seed=seed * 1_000_003 + index)
    if finished is not None:
      finished(index, records)
    return records

  results = await asyncio.gather(*(one(i, c) for i, c in zip(indices, chains)))
  by_task = {r.task_id: r for chain in results for r in chain}
  return [by_task[t] for c in chains for t in c.task_ids]


def check_evaluation_sections(agent: AgentConfig, engine: EngineConfig | None,
                              pool: appworld.EnvPoolConfig, ev: EvalConfig) -> None:
  """Raises ConfigError on a combination of the sections an evaluation plays with that would
  fail, or cut every long episode short, only once it runs: training runs
  (`run_config.resolve`) and `sage_jax.evaluate` check it before anything starts. `engine`:
  None where no sampler plays (the scripted policy)."""
  if engine is not None and agent.top_k > engine.max_top_k:
    raise ConfigError(f"config.agent.top_k: {agent.top_k} is more than engine.max_top_k "
                      f"{engine.max_top_k}, the candidates the sampler keeps")
  if engine is not None and agent.max_episode_tokens > engine.max_len:
    raise ConfigError(
        f"config.agent.max_episode_tokens: {agent.max_episode_tokens} is more than "
        f"engine.max_len {engine.max_len}, the sampler's cache, where every episode "
        "would end (as token_limit); lower it, or raise engine.max_len")
  if not pool.keep_outputs and ev.appworld_check:
    raise ConfigError(
        "config.pool.keep_outputs: False removes each episode's saved state when it closes, "
        "which eval.appworld_check (AppWorld's own scoring of the saved outputs) reads; set "
        "eval.appworld_check=False too, or keep the outputs")
  # The library's install is an execution too (`worker.Session.install`).
  executions = agent.max_steps + int(agent.use_library)
  if pool.max_interactions < executions:
    raise ConfigError(
        f"config.pool.max_interactions: {pool.max_interactions} is fewer than the "
        f"{executions} executions an episode may make (agent.max_steps {agent.max_steps}"
        + (" and the library's install" if agent.use_library else "") + "); AppWorld "
        "would refuse the later ones. Raise it, or lower agent.max_steps")


def _sections(config: Any) -> dict[str, Any]:
  """The sections of `config` an evaluation uses, built and checked together, so that an
  inconsistent combination fails before AppWorld starts or a model is built."""
  def section(name):
    return config.get(name, None) if hasattr(config, "get") else getattr(config, name, None)

  built = {
      "eval": configurable.build(EvalConfig, section("eval") or {}, "config.eval"),
      "agent": configurable.build(AgentConfig, section("agent") or {}, "config.agent"),
      "retrieval": configurable.build(RetrievalConfig, section("retrieval") or {},
                                      "config.retrieval"),
      "pool": configurable.build(appworld.EnvPoolConfig, section("pool") or {}, "config.pool"),
      "model": section("model"),
      "engine": configurable.build(EngineConfig, section("engine") or {}, "config.engine"),
      "sampler_mesh": configurable.build(multihost.SamplerMeshConfig,
                                         section("sampler_mesh") or {}, "config.sampler_mesh"),
  }
  sampler = built["engine"] if built["eval"].policy == "model" else None
  check_evaluation_sections(built["agent"], sampler, built["pool"], built["eval"])
  if sampler is not None:
    built["sampler_mesh"].check_host(jax.local_device_count(), sampler.num_slots)
  return built


def evaluate(config: Any, workdir: str, *, pool: appworld.EnvPool | None = None,
             policy: Any = None, engine: Any = None,
             make_engine: Callable[[], Engine] | None = None,
             tokenizer: Tokenizer | None = None, checkpoint: dict | None = None,
             resume: bool = False, replace_other: bool = False,
             hold_workdir: bool = True) -> dict:
  """Runs the evaluation described by `config` (a ConfigDict or mapping of sections) and
  writes the reports into `workdir`; returns the report. `pool` / `policy` / `tokenizer`
  may be given (tests and the training pipeline share them); otherwise they are built from
  the config. `engine`: the sampler engine to evaluate, or the one a given `policy` samples
  from; the policy embedding of retrieval reads its weights. `make_engine` builds it instead
  (a trained run's checkpoint, which every process reads together), unless nothing is left
  to play.
  `checkpoint`: which trained checkpoint the engine holds (run, stage, step), for the report.
  `resume`: keep each finished scenario in the workdir, and play only those a stopped run of
  the same evaluation did not finish (`sage_jax.eval.progress`); scenarios kept there by an
  evaluation with other settings are refused, or with `replace_other` (a training run's own
  evaluation directories) removed. The finished report of an evaluation of the split with
  other settings is refused too (`check_report`), unless `replace_other`. `hold_workdir`:
  process 0 holds `workdir` while the evaluation runs (`storage.WorkdirLock`: another run
  there fails at once); the training pipeline, which holds its run's workdir, evaluates into
  it without."""
  s = _sections(config)
  out = storage.open_workdir(workdir)
  with multihost.all_succeed(lambda: storage.WorkdirLock(
      out, hold=hold_workdir and multihost.is_lead())):
    return _evaluate(config, s, out, pool=pool, policy=policy, engine=engine,
                     make_engine=make_engine, tokenizer=tokenizer, checkpoint=checkpoint,
                     resume=resume, replace_other=replace_other)


def _evaluate(config: Any, s: dict[str, Any], out: epath.Path, *,
              pool: appworld.EnvPool | None, policy: Any, engine: Any,
              make_engine: Callable[[], Engine] | None, tokenizer: Tokenizer | None,
              checkpoint: dict | None, resume: bool, replace_other: bool) -> dict:
  """`evaluate` of `config`'s sections `s` into the workdir `out`, opened and held."""
  ev, retrieval_cfg = s["eval"], s["retrieval"]
  agent_cfg = ev.agent(s["agent"])
  plain = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  settings_key = lambda sections, weights: progress_lib.fingerprint(
      {name: sections.get(name) for name in s}, weights)
  key = settings_key(plain, checkpoint)
  if not replace_other:
    multihost.from_lead(lambda: check_report(out, ev.split, key, settings_key))
  root = appworld.resolve_root(ev.data)
  task_ids = appworld.first_scenarios(appworld.read_split(root, ev.split), ev.max_scenarios)
  scenarios = list(appworld.group_by_scenario(task_ids).values())
  across = retrieval_cfg.strategy not in SCENARIO_LOCAL_STRATEGIES
  max_concurrent = ev.max_concurrent_scenarios or (1 if across else 0)
  progress, finished = None, {}
  # Across scenarios, the library a scenario leaves is the next one's only when they run one
  # at a time; otherwise the scenarios cannot be resumed one by one.
  if resume and across and max_concurrent != 1:
    logging.info("Retrieval across scenarios, %d of them at once: a stopped run of this "
                 "evaluation will not resume (it does with eval.max_concurrent_scenarios=1)",
                 max_concurrent)
  elif resume:
    progress = progress_lib.Progress(out, ev.split, key)
    on_disk = multihost.from_lead(lambda: progress.finished(replace_other))
    # An earlier run may have played more scenarios (max_scenarios).
    finished = {i: entry for i, entry in on_disk.items() if i < len(scenarios)}
    for i, entry in finished.items():
      if [r.task_id for r in entry["records"]] != scenarios[i]:
        raise ValueError(f"{progress.directory}: scenario {i} holds tasks "
                         f"{[r.task_id for r in entry['records']]}, not the {ev.split} split's "
                         f"{scenarios[i]}; remove it to start this evaluation afresh")
    if finished:
      logging.info("%d of %d scenarios of the %s split were finished before: playing the rest",
                   len(finished), len(scenarios), ev.split)
  remaining = [i for i in range(len(scenarios)) if i not in finished]
  # Retrieval across scenarios shows a task the skills of every scenario played before it:
  # one library, so process 0 plays them all, as one process would (the others' shares would
  # start from an empty library and make the scores depend on the number of processes).
  own = (remaining if multihost.is_lead() else []) if across else remaining[
      multihost.share(len(remaining))]
  own_task_ids = [t for i in own for t in scenarios[i]]
  tokenizer = tokenizer or Tokenizer()
  own_pool = None
  if pool is None:  # several processes: each pool keeps its outputs on its own host
    own_pool = appworld.EnvPool(multihost.pool_config(s["pool"], root, out))
  # A process with no scenario to play (every one kept by a stopped run; across scenarios,
  # any but process 0) starts no AppWorld and loads no model of its own: it only reports.
  # A trained run's checkpoint (`make_engine`) is read unless no process plays any.
  driver = retriever = None
  try:
    if own_pool is not None:  # AppWorld starts while the model is built
      multihost.all_succeed(lambda: own and own_pool.start_in_background())
    if engine is None and make_engine is not None and remaining:
      engine = make_engine()  # by every process alike: reading a checkpoint is collective
    if policy is None and ev.policy == "scripted":
      policy, agent_cfg = ScriptedPolicy(root, tokenizer), scripted_agent(agent_cfg)
    elif policy is None and own:
      if engine is None:
        spec = configurable.build(loader.ModelSpec, s["model"] or {}, "config.model")
        loader.check_tokenizer(spec)
        model, mesh = multihost.load_sampling_model(spec, s["sampler_mesh"],
                                                  s["engine"].num_slots)
        engine = Engine(model, s["engine"], eos_ids=[tokenizer.eos_id, tokenizer.endoftext],
                        detokenize=tokenizer.decode, mesh=mesh)
      driver = AsyncEngine(engine)
      policy = rollout.SamplerPolicy(driver, agent_cfg)
    if own:
      retriever = Retriever(retrieval_cfg, make_embedder(retrieval_cfg, engine=engine,
                                                         tokenizer=tokenizer))
  except BaseException:
    if own_pool is not None:
      own_pool.close()
    raise
  # The finished scenarios' records, and (on process 0, which reports them) their library.
  before = [r for i in sorted(finished) for r in finished[i]["records"]]
  library = (progress_lib.restored_library(finished, across) if multihost.is_lead()
             else SkillLibrary())
  started = time.time()

  def keep(index: int, records: list[EpisodeRecord]) -> None:
    """Keeps a finished scenario for a rerun, unless the environment failed under one of its
    episodes (a rerun plays it again)."""
    if progress is not None and not any(r.env_failed for r in records):
      scenario = records[0].scenario
      progress.record(index, records, library.skills() if across else library.skills(scenario))

  def play(pool: appworld.EnvPool) -> tuple[list[EpisodeRecord], list[str], Any]:
    """This process's share: its records, the tasks AppWorld's check scored, its scores."""
    try:
      records = []
      if own:
        ctx = rollout.RolloutContext(policy, pool, tokenizer, agent_cfg, retriever, root)
        records = asyncio.run(run_scenarios(ctx, own_task_ids, experiment=ev.experiment,
                                            library=library, max_concurrent=max_concurrent,
                                            seed=ev.seed, indices=own, finished=keep))
        rollout.check_environment(records, f"this process's share of the {ev.split} split")
      # The finished scenarios' episodes are scored too where their outputs are still here
      # (one process: <workdir>/appworld); those whose outputs are gone stay unchecked.
      kept = [r for r in (before if multihost.is_lead() else []) if pool.outputs_root
              and os.path.isdir(appworld.saved_dbs(pool.outputs_root, r.experiment, r.task_id))]
      checked = ([r.task_id for r in appworld_checked(kept + records)]
                 if ev.appworld_check else [])
      scores = (metrics_lib.appworld_scores(
          pool.outputs_root, ev.experiment, checked,
          evaluation_timeout_s=pool.config.evaluation_timeout_s) if checked else None)
      return records, checked, scores
    finally:
      if own_pool is not None:
        own_pool.close()
      if driver is not None:
        driver.close()

  records, checked, own_scores = multihost.all_succeed(lambda: play(pool or own_pool))
  elapsed = time.time() - started
  played = [r for part in multihost.allgather_objects(records) for r in part]
  order = {t: n for n, t in enumerate(task_ids)}
  records = sorted(played + before, key=lambda r: order[r.task_id])
  metrics = metrics_lib.evaluation_metrics(records)
  report = {"split": ev.split, "data_root": root, "experiment": ev.experiment,
            "policy": ev.policy, "retrieval": retrieval_cfg.strategy,
            "temperature": agent_cfg.temperature, "elapsed_s": elapsed, "metrics": metrics}
  if checkpoint is not None:
    report["checkpoint"] = checkpoint
  if finished:
    report["resumed_scenarios"] = sorted(finished)
  disagreement = None
  if ev.appworld_check:
    parts = multihost.allgather_objects((own_scores, checked))
    theirs = _combine_scores([(scores, len(ids), len({appworld.scenario_id(t) for t in ids}))
                              for scores, ids in parts])
    scored = {t for _, ids in parts for t in ids}
    compared = [r for r in records if r.task_id in scored]
    report["appworld"] = theirs
    report["appworld_unchecked"] = [r.task_id for r in records if r.task_id not in scored]
    disagreement = (appworld_disagreement(metrics_lib.summarize(compared), theirs)
                    if compared else None)
    if disagreement:
      report["appworld_disagrees"] = disagreement
  report["config"] = plain
  report["records"] = [r.summary() for r in records]
  skills = [s for part in multihost.allgather_objects(library.to_list()) for s in part]
  name = f"eval_{ev.split}"
  if multihost.is_lead():
    storage.write_json(out / f"{name}.json", report, default=str)
    title = f"{ev.split} split, policy {ev.policy}, retrieval {retrieval_cfg.strategy}"
    storage.write_text(out / f"{name}.md", metrics_lib.markdown_table(metrics, title))
    storage.write_json(out / f"library_{ev.split}.json", skills)
    storage.write_text(out / f"transcripts_{ev.split}.jsonl", "".join(
        json.dumps({"task_id": r.task_id, "success": r.success,
                    "conversation": tokenizer.decode(r.tokens.tolist())}) + "\n"
        for r in records))
    if progress is not None:  # the report holds every scenario now
      progress.clear()
  if disagreement:  # after the report is written: the episodes' results are kept
    raise RuntimeError(f"{disagreement} (report: {out / name}.json)")
  return report


def check_report(workdir: storage.PathLike, split: str, key: str,
                 settings_key: Callable[[dict, dict | None], str]) -> None:
  """Raises WorkdirError when `workdir` holds the finished report of an evaluation of `split`
  whose settings and checkpoint (`settings_key(config, checkpoint)`, as `progress` keys its
  scenarios) are not `key`'s: its report, transcripts and library would be replaced by
  another evaluation's. The same evaluation run again writes them anew."""
  report_path = storage.path(workdir) / f"eval_{split}.json"
  report = storage.read_json(report_path)
  if report is not None and settings_key(report.get("config") or {},
                                         report.get("checkpoint")) != key:
    raise storage.WorkdirError(
        f"{workdir} holds {report_path.name}, the report of a finished evaluation of the "
        f"{split} split with other settings or another checkpoint, which this one would "
        f"replace: use another --workdir (or remove {report_path} to replace it)")


def appworld_checked(records: Sequence[EpisodeRecord]) -> list[EpisodeRecord]:
  """The episodes the AppWorld cross-check compares: not those the environment failed
  under, which we count as failed while AppWorld scores whatever state they saved."""
  return [r for r in records if not r.env_failed]


def appworld_disagreement(ours: dict, theirs: dict) -> str | None:
  """Why our TGC/SGC (`evaluation_metrics`' "overall") and AppWorld's differ by more than
  AppWorld's rounding, or None."""
  if (abs(theirs["task_goal_completion"] - ours["tgc"]) > APPWORLD_ROUNDING
      or abs(theirs["scenario_goal_completion"] - ours["sgc"]) > APPWORLD_ROUNDING):
    return (f"TGC/SGC disagree with AppWorld's evaluation: ours {ours['tgc']}/{ours['sgc']}, "
            f"AppWorld's {theirs}")
  return None


def _combine_scores(parts: Sequence[tuple[dict | None, int, int]]) -> dict | None:
  """AppWorld's TGC and SGC over every process's tasks: per-process scores weighted by
  their tasks and scenarios; None when no process scored any."""
  scored = [(s, tasks, scen) for s, tasks, scen in parts if s is not None]
  if not scored:
    return None
  if len(scored) == 1:
    return scored[0][0]
  mean = lambda key, i: (sum(p[0][key] * p[i] for p in scored) / max(sum(p[i] for p in scored), 1))
  return {"task_goal_completion": mean("task_goal_completion", 1),
          "scenario_goal_completion": mean("scenario_goal_completion", 2)}
