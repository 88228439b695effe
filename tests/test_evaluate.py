"""The evaluation entry point on the mini dev split with the scripted skill-format policy."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest

from sage_jax import multihost, stopping, storage
from sage_jax.agent import AgentConfig, ScriptedPolicy
from sage_jax.agent.gold_solutions import scripted_agent
from sage_jax.configurable import ConfigError
from sage_jax.eval import runner as evaluate
from sage_jax.envs import appworld
from sage_jax.eval import metrics
from sage_jax.eval import progress
from sage_jax.rl import rollout
from sage_jax.tokenizer import Tokenizer
from tests.appworld_fixtures import WorkerKillingPolicy
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config, scripted_eval_config


_config = scripted_eval_config


@pytest.fixture(scope="module")
def pool(mini_root, tmp_path_factory):
  outputs = str(tmp_path_factory.mktemp("eval_outputs"))
  config = pool_config(mini_root, outputs)
  with appworld.EnvPool(config) as pool:
    yield pool


def test_scripted_policy_scores_100_with_reuse_in_every_later_task(pool, mini_root, tmp_path):
  report = evaluate.evaluate(_config(), str(tmp_path), pool=pool)
  overall = report["metrics"]["overall"]
  assert overall["tgc"] == 100.0 and overall["sgc"] == 100.0
  # The same outputs scored by AppWorld's own evaluator.
  assert report["appworld"]["task_goal_completion"] == 100.0
  assert report["appworld"]["scenario_goal_completion"] == 100.0
  assert overall["num_tasks"] == 9 and overall["num_scenarios"] == 3
  assert overall["skill_usage_rate"] == 100.0 and overall["p_success_given_use"] == 100.0
  assert overall["success_skill_usage_rate"] == 100.0 and overall["w_use_rate"] == 200 / 3
  assert overall["no_code_rate"] == 0.0 and overall["avg_steps"] == 1.0
  records = report["records"]
  assert [r["task_id"] for r in records] == appworld.read_split(mini_root, "dev")
  for r in records:
    first = r["chain_position"] == 0
    assert bool(r["events"]["generated"]) == first and bool(r["events"]["used"]) != first
  assert set(report["metrics"]["by_difficulty"]) == {"1", "2"}
  table = (tmp_path / "eval_dev.md").read_text()
  assert "| all | 9 | 100.0 | 100.0 |" in table
  transcript = json.loads((tmp_path / "transcripts_dev.jsonl").read_text().splitlines()[1])
  assert "<|im_start|>assistant" in transcript["conversation"] and transcript["success"]
  saved = json.loads((tmp_path / "eval_dev.json").read_text())
  assert saved["metrics"] == report["metrics"]
  library = json.loads((tmp_path / "library_dev.json").read_text())
  assert len(library) == 3 and all(s["uses"] == 2 and s["successes"] == 2 for s in library)


def test_cross_scenario_retrieval_runs_scenarios_in_order(pool, tmp_path):
  c = _config(experiment="eval_ngram", max_scenarios=2, appworld_check=False)
  c.retrieval = dict(strategy="query_ngram", top_k=2)
  report = evaluate.evaluate(c, str(tmp_path), pool=pool)
  overall = report["metrics"]["overall"]
  assert overall["num_tasks"] == 6 and overall["tgc"] == 100.0
  later = [r for r in report["records"] if r["chain_position"] > 0]
  assert all(r["events"]["used"] for r in later)
  # Task 1 of the second scenario saw the first scenario's skill (cross-scenario retrieval).
  second = [r for r in report["records"] if r["group"] == 1]
  assert second[0]["visible_skills"] and not second[0]["events"]["used"]


def _retrieving(strategy, **eval_overrides):
  c = _config(**eval_overrides)
  c.retrieval = dict(strategy=strategy, top_k=2)
  return c


@pytest.mark.parametrize("strategy", ["same_scenario", "query_ngram"])
def test_a_stopped_evaluation_resumes_with_the_scenarios_it_finished(pool, tmp_path, strategy):
  """Stopped after its first scenario (as a signal stops it, at the next turn), the same
  evaluation run again plays only the other two, and reports what one uninterrupted run
  reports: records, metrics, AppWorld's scores of every task, the library (across scenarios,
  the one the first scenario left). An evaluation with other settings refuses the kept
  scenarios."""
  config = functools.partial(_retrieving, strategy)
  whole = evaluate.evaluate(config(), str(tmp_path / "whole"), pool=pool, resume=True)
  assert not (tmp_path / "whole" / "eval_dev_progress").exists()  # removed with the report
  out = tmp_path / "stopped"
  kept = out / "eval_dev_progress"
  one_at_a_time = config(max_concurrent_scenarios=1)  # how fast, not what: may change
  with pytest.raises(stopping.StopRequested):
    with stopping.stop_when(lambda: kept.exists() and any(kept.glob("scenario_*.pkl"))):
      evaluate.evaluate(one_at_a_time, str(out), pool=pool, resume=True)
  assert [p.name for p in kept.iterdir()] == ["scenario_00000.pkl"]
  other = config()
  other.agent = dict(max_steps=5)
  with pytest.raises(ValueError, match="holds scenarios finished by an evaluation with other "
                                       "settings or another checkpoint"):
    evaluate.evaluate(other, str(out), pool=pool, resume=True)
  resumed = evaluate.evaluate(config(), str(out), pool=pool, resume=True)
  assert resumed["resumed_scenarios"] == [0] and not kept.exists()
  assert resumed["records"] == whole["records"] and resumed["metrics"] == whole["metrics"]
  assert resumed["appworld"] == whole["appworld"] and resumed["appworld_unchecked"] == []
  assert (out / "transcripts_dev.jsonl").read_text() == (
      tmp_path / "whole" / "transcripts_dev.jsonl").read_text()
  # The same skills (in the order their scenarios ended, which concurrency decides).
  library = lambda run: sorted(json.loads((run / "library_dev.json").read_text()),
                               key=lambda s: (s["scenario"], s["name"]))
  assert library(out) == library(tmp_path / "whole")


def test_a_finished_report_of_other_settings_is_refused_before_anything_plays(
    pool, tmp_path, monkeypatch):
  """A second evaluation into a workdir would replace the first one's report, transcripts
  and library: one of other settings (or weights) is refused, naming the report, before it
  plays; the same evaluation runs again and writes them anew, and in a training run's own
  directory (`replace_other`) another evaluation replaces them."""
  config = functools.partial(_retrieving, max_scenarios=1, appworld_check=False)
  first = evaluate.evaluate(config("same_scenario"), str(tmp_path), pool=pool, resume=True)
  # Its files, but the lock file each evaluation there takes and names itself in.
  files = lambda: {p.name: p.read_bytes() for p in tmp_path.iterdir()
                   if p.is_file() and p.name != storage.LOCK_FILE}
  written = files()
  assert "eval_dev.json" in written and "transcripts_dev.jsonl" in written

  def refuse(*args, **kwargs):
    raise AssertionError("an evaluation refused by the workdir's report played a scenario")

  with monkeypatch.context() as refused:
    refused.setattr(rollout, "run_chain", refuse)
    with pytest.raises(storage.WorkdirError,
                       match=f"{tmp_path} holds eval_dev.json, the report of a finished "
                             r"evaluation of the dev split with other settings .* use another "
                             f"--workdir \\(or remove {tmp_path / 'eval_dev.json'}"):
      evaluate.evaluate(config("query_ngram"), str(tmp_path), pool=pool, resume=True)
    other_weights = config("same_scenario")
    with pytest.raises(storage.WorkdirError, match="with other settings or another checkpoint"):
      evaluate.evaluate(other_weights, str(tmp_path), pool=pool, resume=True,
                        checkpoint={"run": "r", "stage": "rl", "step": 1})
  assert files() == written
  assert not (tmp_path / "eval_dev_progress").exists()
  # How fast it runs may change, as for a stopped evaluation's kept scenarios.
  again = evaluate.evaluate(config("same_scenario", max_concurrent_scenarios=1), str(tmp_path),
                            pool=pool, resume=True)
  assert again["records"] == first["records"]
  replaced = evaluate.evaluate(config("query_ngram"), str(tmp_path), pool=pool, resume=True,
                               replace_other=True)
  assert replaced["retrieval"] == "query_ngram"
  assert json.loads((tmp_path / "eval_dev.json").read_text())["retrieval"] == "query_ngram"


def test_an_evaluation_stopped_before_its_report_reports_without_starting_anything(
    mini_root, tmp_path, monkeypatch):  # noqa: F811
  """Stopped after its last scenario, before its report was written (AppWorld's check of a
  whole split takes minutes): the same command run again reports the kept scenarios,
  AppWorld's scores of their saved outputs included, without starting AppWorld or building
  the model (for a large model, minutes of loading)."""
  config = _config(policy="model", experiment="eval_tiny", max_scenarios=1)
  config.model = dict(spec="", preset="tiny", seed=0)
  config.agent = dict(max_steps=2, max_turn_tokens=16, max_episode_tokens=2048)
  config.engine = dict(num_slots=2, max_len=2048)
  with monkeypatch.context() as stopped_before_its_report:
    stopped_before_its_report.setattr(progress.Progress, "clear", lambda self: None)
    whole = evaluate.evaluate(config, str(tmp_path), resume=True)
  assert [p.name for p in (tmp_path / "eval_dev_progress").iterdir()] == ["scenario_00000.pkl"]
  (tmp_path / "eval_dev.json").unlink()

  def refuse(*args, **kwargs):
    raise AssertionError("an evaluation with nothing to play started AppWorld or a model")

  monkeypatch.setattr(appworld.EnvPool, "start_in_background", refuse)
  monkeypatch.setattr(multihost, "load_sampling_model", refuse)
  again = evaluate.evaluate(config, str(tmp_path), resume=True)
  assert again["resumed_scenarios"] == [0] and not (tmp_path / "eval_dev_progress").exists()
  assert again["appworld"] is not None and again["appworld_unchecked"] == []
  for key in ("records", "metrics", "appworld"):
    assert again[key] == whole[key], key
  saved = json.loads((tmp_path / "eval_dev.json").read_text())
  assert saved["metrics"] == whole["metrics"] and len(saved["records"]) == 3


def test_kept_scenarios_of_other_settings_are_refused_or_replaced(tmp_path):
  """In a directory that only a training run evaluates in, an evaluation of other weights or
  settings starts afresh; elsewhere the kept scenarios are refused, naming the directory."""
  base = progress.fingerprint({"eval": {"split": "dev", "max_scenarios": 1}}, None)
  assert base == progress.fingerprint({"eval": {"split": "dev", "max_scenarios": 3}}, None)
  other = progress.fingerprint({"eval": {"split": "dev"}}, {"stage": "rl", "step": 2})
  assert other != base
  progress.Progress(tmp_path, "dev", base).record(0, [], [])
  with pytest.raises(storage.WorkdirError,  # the command says it in one line
                     match=f"{tmp_path / 'eval_dev_progress'} holds scenarios"):
    progress.Progress(tmp_path, "dev", other).finished()
  assert progress.Progress(tmp_path, "dev", base).finished()[0]["records"] == []
  assert progress.Progress(tmp_path, "dev", other).finished(replace_other=True) == {}
  assert not (tmp_path / "eval_dev_progress").exists()


def test_metrics_table():
  from tests.test_rewards import rec
  records = [rec(0, True, generated=["f"]), rec(1, False, used=["f"]),
             rec(0, True, task="t_1", group=1), rec(1, True, no_code=1, task="t_2", group=1)]
  for r, d in zip(records, (1, 1, 2, 2)):
    r.difficulty = d
  records[2].scenario = records[3].scenario = "t"
  m = metrics.evaluation_metrics(records)
  assert m["overall"]["tgc"] == 75.0 and m["overall"]["sgc"] == 50.0
  assert m["overall"]["skill_usage_rate"] == 100.0  # only record 1 saw skills, and used one
  assert m["overall"]["success_skill_usage_rate"] == 0.0
  assert m["overall"]["p_success_given_use"] == 0.0
  assert m["overall"]["no_code_rate"] == 25.0
  assert m["by_difficulty"]["2"]["sgc"] == 100.0
  table = metrics.markdown_table(m)
  assert "| difficulty 1 | 2 | 50.0 | 0.0 |" in table
  # Every row has as many cells as the header: no "|" inside a cell.
  rows = [line for line in table.splitlines() if line.startswith("|")]
  assert len({line.count("|") for line in rows}) == 1, rows


def test_appworld_rounding_is_not_a_disagreement():
  from appworld.common.utils import average  # AppWorld's own mean, as its evaluator rounds it

  def theirs(k, n):
    return round(100 * average([1] * k + [0] * (n - k), round_to=4), 1)

  # Every success count of the official splits' sizes (dev 57 tasks / 19 scenarios, test_normal
  # 168 / 56, test_challenge 417 / 139) and the mini world's: 0.05 alone fails e.g. 34 of 57.
  for n in (16, 19, 56, 57, 139, 168, 417):
    for k in range(n + 1):
      ours = {"tgc": 100.0 * k / n, "sgc": 100.0 * k / n}
      assert evaluate.appworld_disagreement(
          ours, {"task_goal_completion": theirs(k, n),
                 "scenario_goal_completion": theirs(k, n)}) is None, (k, n)
      if k < n:  # one task more is a disagreement
        assert evaluate.appworld_disagreement(
            ours, {"task_goal_completion": theirs(k + 1, n),
                   "scenario_goal_completion": theirs(k, n)}) is not None, (k, n)


def test_episodes_the_environment_failed_under_are_left_out_of_the_appworld_check():
  """AppWorld scores whatever state an episode saved; we count an episode the environment
  failed under (here its worker died after the task was done) as failed. The check compares
  the others, on both sides."""
  from tests.test_rewards import rec
  records = [rec(0, True), rec(1, False), rec(2, True)]
  records[1].errors = ["environment worker slot0 died while running 'evaluate'"]
  theirs = {"task_goal_completion": 100.0, "scenario_goal_completion": 100.0}
  checked = evaluate.appworld_checked(records)
  assert [r.task_id for r in checked] == ["s_1", "s_3"]
  assert evaluate.appworld_disagreement(metrics.summarize(checked), theirs) is None
  # Compared over every episode, the fault reads as a disagreement.
  assert evaluate.appworld_disagreement(metrics.summarize(records), theirs) is not None


def test_a_task_the_environment_failed_under_is_played_again_and_checked(
    pool, mini_root, tmp_path):  # noqa: F811
  """A worker killed under a task: the evaluation plays it again, scores the last attempt,
  and AppWorld's own evaluation of the outputs (the last attempt's) agrees. Where the
  environment fails under every episode, the evaluation stops and says so, instead of
  reporting a split of failed tasks."""
  c = _config(experiment="eval_retried", max_scenarios=1)
  c.agent = dataclasses.asdict(scripted_agent(AgentConfig(**c.agent)))
  task_ids = appworld.read_split(mini_root, "dev")[:3]
  tok = Tokenizer()
  policy = WorkerKillingPolicy(ScriptedPolicy(mini_root, tok), pool, {task_ids[1]: 1})
  report = evaluate.evaluate(c, str(tmp_path / "once"), pool=pool, policy=policy,
                             tokenizer=tok)
  overall = report["metrics"]["overall"]
  assert policy.killed == 1 and overall["tgc"] == 100.0 and overall["sgc"] == 100.0
  assert overall["env_failure_rate"] == 0.0 and overall["env_retry_rate"] == 100 / 3
  assert report["appworld"]["task_goal_completion"] == 100.0
  assert [len(r["retried_errors"]) for r in report["records"]] == [0, 1, 0]
  assert report["records"][2]["events"]["used"]  # the library of the retried task's skill

  policy = WorkerKillingPolicy(ScriptedPolicy(mini_root, tok), pool,
                               {t: 3 for t in task_ids})
  c.eval.experiment = "eval_broken"
  with pytest.raises(rollout.EnvironmentDown, match="all 3 episodes .* dev split"):
    evaluate.evaluate(c, str(tmp_path / "broken"), pool=pool, policy=policy, tokenizer=tok)
  assert policy.killed == 9 and not (tmp_path / "broken" / "eval_dev.json").exists()


def test_eval_command_scores_the_scripted_expert(mini_root, tmp_path):
  done = subprocess.run([sys.executable, "-m", "sage_jax.evaluate",
                         "--config=configs/eval.py:demo", f"--workdir={tmp_path}",
                         "--config.eval.max_scenarios=1"],
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  report = (tmp_path / "eval_dev.json").read_text()
  overall = json.loads(report)["metrics"]["overall"]
  assert (overall["num_tasks"], overall["tgc"], overall["sgc"]) == (3, 100.0, 100.0)
  # Another evaluation into the same workdir would replace this one's report.
  other = subprocess.run([sys.executable, "-m", "sage_jax.evaluate",
                          "--config=configs/eval.py:demo", f"--workdir={tmp_path}",
                          "--config.eval.max_scenarios=1",
                          "--config.retrieval.strategy=query_ngram"],
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         capture_output=True, text=True, timeout=600)
  assert other.returncode != 0 and "Traceback" not in other.stderr, other.stderr[-3000:]
  assert (f"WorkdirError: {tmp_path} holds eval_dev.json, the report of a finished evaluation "
          "of the dev split with other settings") in other.stderr, other.stderr[-3000:]
  assert (tmp_path / "eval_dev.json").read_text() == report


@pytest.mark.parametrize("overrides, message", [
    ({"pool.keep_outputs": False}, r"config.pool.keep_outputs: False removes each episode's "
                                   r"saved state .* eval.appworld_check"),
    ({"eval.policy": "model", "agent.max_episode_tokens": 8192},
     r"config.agent.max_episode_tokens: 8192 is more than engine.max_len 4096"),
    ({"eval.policy": "model", "agent.top_k": 100},
     r"config.agent.top_k: 100 is more than engine.max_top_k 64"),
    ({"pool.max_interactions": 3}, r"config.pool.max_interactions: 3 is fewer than the 5 "
                                   r"executions an episode may make \(agent.max_steps 4"),
])
def test_combinations_a_run_refuses_are_refused_before_anything_starts(
    overrides, message, tmp_path):
  """The checks of a training run's agent, engine, pool and eval sections (`run_config`):
  without them the evaluation would play the split and only then fail, or end every long
  episode at the sampler's cache. Nothing starts and no workdir is written."""
  c = _config(max_scenarios=1)
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  with pytest.raises(ConfigError, match=message):
    evaluate.evaluate(c, str(tmp_path / "eval"))
  assert not (tmp_path / "eval").exists()


def test_the_scripted_policy_uses_no_sampler_cache():
  """It samples from no engine, with budgets of its own (`scripted_agent`) beyond the default
  engine's cache: the agent is not checked against the engine section."""
  c = _config()
  c.agent = dict(max_episode_tokens=32768)
  assert evaluate._sections(c)["agent"].max_episode_tokens == 32768


def test_cli_refuses_an_inconsistent_config_in_one_line(tmp_path):
  done = subprocess.run([sys.executable, "-m", "sage_jax.evaluate",
                         "--config=configs/eval.py:demo", f"--workdir={tmp_path / 'out'}",
                         "--config.pool.keep_outputs=false"],
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        timeout=300)
  assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert "ConfigError: config.pool.keep_outputs: False removes" in done.stderr
  assert not (tmp_path / "out").exists()


def test_cli_needs_config_and_workdir():
  done = subprocess.run([sys.executable, "-m", "sage_jax.evaluate"], capture_output=True,
                        text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode != 0 and "--workdir" in done.stderr


def test_misspelt_section_of_an_eval_config_is_named(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = tmp_path / "my_eval.py"
  config.write_text(f"import sys\nsys.path.insert(0, {repo!r})\nfrom configs import eval as e\n\n"
                    "def get_config():\n  c = e.get_config('demo')\n"
                    "  c.retreival = dict(strategy='query_ngram')\n  return c\n")
  done = subprocess.run([sys.executable, "-m", "sage_jax.evaluate", f"--config={config}",
                         f"--workdir={tmp_path / 'out'}"], cwd=repo, capture_output=True,
                        text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert done.returncode != 0
  assert "config.retreival: unknown section of an evaluation config" in done.stderr
  assert not (tmp_path / "out").exists()


def test_eval_presets_build():
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  from configs import eval as eval_configs
  for preset in ("demo", "tiny", "qwen2.5-coder-0.5b"):
    sections = evaluate._sections(eval_configs.get_config(preset))
    assert sections["eval"].split == "dev"
  with pytest.raises(ValueError, match="unknown eval preset"):
    eval_configs.get_config("nope")


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_evaluation_path(pool, real_hf_dir, tmp_path):
  """The real Qwen2.5-Coder-0.5B-Instruct through sampler, agent and evaluation (one scenario,
  one short turn per task: the path, not the score; BENCHMARKS.md has the full baseline)."""
  c = _config(policy="model", experiment="eval_real", max_scenarios=1)
  c.model = dict(spec=real_hf_dir, preset="")
  c.agent = dict(max_steps=1, max_turn_tokens=12, max_episode_tokens=2048, temperature=0.0)
  c.engine = dict(num_slots=1, max_len=2048, prefill_buckets=(512,), min_attend=1024,
                  steps_per_call=4, max_top_k=8)
  report = evaluate.evaluate(c, str(tmp_path), pool=pool)
  overall = report["metrics"]["overall"]
  assert overall["num_tasks"] == 3 and overall["avg_steps"] == 1.0
  assert overall["avg_generated_tokens"] <= 12
  assert report["appworld"]["task_goal_completion"] == overall["tgc"]
  for r in report["records"]:
    assert r["end_reason"] in ("max_steps", "completed") and not r["errors"]
