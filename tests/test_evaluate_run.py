"""A trained run evaluated after training (`python -m sage_jax.evaluate --run --step`), and the
policy's own hidden states as the retrieval embedding in training rollouts, in the
pipeline's dev evaluation and in the evaluation of a run.

One small run of the real pipeline (RL only, 1 step, 1 chain of 2 rollouts, a compact
vocabulary) with query-embedding retrieval over the policy's embedding; its checkpoint is
then evaluated by the entry point."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from sage_jax import pipeline

pytestmark = pytest.mark.slow
from tests.appworld_fixtures import demo_expert_file  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from configs import sage as sage_configs  # noqa: E402

POLICY_RETRIEVAL = dict(strategy="query_embedding", embedding_model="policy", top_k=2)


@pytest.fixture(scope="module")
def run_dir(mini_root, demo_expert_file, tmp_path_factory):  # noqa: F811
  c = sage_configs.get_config("demo")
  c.pipeline.update(stages=("rl",), chains_per_step=1, train_scenarios=1, eval_before=False,
                    eval_after=True, eval_train=False, export=False, plot=False,
                    expert_trajectories=demo_expert_file)  # the compact vocabulary's corpus
  c.grpo.group_size = 2
  c.engine.num_slots = 8  # slots split over the session's 8 simulated devices
  c.rl.total_steps = 1
  c.agent.update(max_turn_tokens=16)
  c.eval.max_scenarios = 1
  c.retrieval.update(POLICY_RETRIEVAL)
  workdir = tmp_path_factory.mktemp("run")
  summary = pipeline.run(c, str(workdir))
  # Training rollouts and the dev evaluation ran with the policy's embedding (a random-init
  # model saves no skill, so nothing is embedded: tests/test_agent.py embeds with an engine
  # sharded like the pipeline's).
  assert summary["after"]["num_tasks"] == 3
  report = json.load(open(workdir / "eval_after" / "eval_dev.json"))
  assert report["config"]["retrieval"]["embedding_model"] == "policy"
  assert report["retrieval"] == "query_embedding"
  assert os.path.isdir(workdir / "checkpoints" / "1")
  return workdir


def _evaluate(*args):
  return subprocess.run([sys.executable, "-m", "sage_jax.evaluate", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=600)


def test_evaluate_run_is_the_runs_last_model(run_dir, tmp_path):
  """The checkpoint evaluated under the run's own retrieval and greedy sampling writes the
  same conversations as the run's evaluation after training."""
  out = tmp_path / "eval"
  done = _evaluate(f"--run={run_dir}", "--config=configs/eval.py:run",  # the latest step
                   *(f"--config.retrieval.{k}={v}" for k, v in POLICY_RETRIEVAL.items()),
                   "--config.eval.max_scenarios=1", f"--workdir={out}")
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.load(open(out / "eval_dev.json"))
  assert report["checkpoint"] == {"run": str(run_dir), "stage": "rl", "step": 1}
  run_config = json.load(open(run_dir / "config.json"))
  for section in ("model", "agent", "engine"):  # the run's own, not the preset's
    assert report["config"][section] == run_config[section], section
  assert report["config"]["retrieval"]["embedding_model"] == "policy"
  transcripts = [open(d / "transcripts_dev.jsonl").read()
                 for d in (run_dir / "eval_after", out)]
  assert transcripts[0] == transcripts[1]


def test_a_compact_run_evaluates_with_policy_embeddings_whatever_made_its_sft_data(
    run_dir, tmp_path):
  """Training refuses policy embeddings with a compact vocabulary cut from SFT data it would
  still have to make (before its model exists); a trained run has both, so its evaluation
  retrieves with them even when the run made its SFT data itself."""
  run = tmp_path / "run"
  shutil.copytree(run_dir, run)
  config = json.load(open(run / "config.json"))
  config["pipeline"]["expert_trajectories"] = ""  # as if the run had played the expert
  (run / "config.json").write_text(json.dumps(config))
  done = _evaluate(f"--run={run}", "--config=configs/eval.py:run",
                   *(f"--config.retrieval.{k}={v}" for k, v in POLICY_RETRIEVAL.items()),
                   "--config.eval.max_scenarios=1", f"--workdir={tmp_path / 'eval'}")
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.load(open(tmp_path / "eval" / "eval_dev.json"))
  assert report["config"]["retrieval"]["embedding_model"] == "policy"


def test_evaluate_run_errors_are_clear(run_dir, tmp_path):
  missing = _evaluate(f"--run={run_dir}", "--step=7", "--stage=rl",
                      "--config=configs/eval.py:run", f"--workdir={tmp_path}")
  assert missing.returncode != 0
  assert "no checkpoint step 7; available steps: [1]" in missing.stderr
  not_a_run = _evaluate(f"--run={tmp_path}", "--config=configs/eval.py:run",
                        f"--workdir={tmp_path}")
  assert not_a_run.returncode != 0 and "not a training run's workdir" in not_a_run.stderr
  bad_value = _evaluate(f"--run={run_dir}", "--config=configs/eval.py:run",
                        "--config.retrieval.strategy=random", f"--workdir={tmp_path}")
  assert bad_value.returncode != 0 and "config.retrieval" in bad_value.stderr
  misspelt = _evaluate(f"--run={run_dir}", "--config=configs/eval.py:run",
                       "--config.retrieval.stratgy=query_ngram", f"--workdir={tmp_path}")
  assert misspelt.returncode != 0 and (
      "config section 'retrieval' has no key 'stratgy'" in misspelt.stderr)
  own_model = _evaluate(f"--run={run_dir}", "--config=configs/eval.py:run",
                        "--config.model.preset=mini", f"--workdir={tmp_path}")
  assert own_model.returncode != 0 and (
      "--config.model.preset: with --run the model and agent sections are the run's own"
      in own_model.stderr)
  # The host's sections may be set, and are checked against this host as the run's were.
  no_split = _evaluate(f"--run={run_dir}", "--config=configs/eval.py:run",
                       "--config.sampler_mesh.tensor=3", f"--workdir={tmp_path}")
  assert no_split.returncode != 0 and (
      "config.sampler_mesh.tensor: 3 does not divide the 8 devices" in no_split.stderr)
  scripted = _evaluate(f"--run={run_dir}", "--config=configs/eval.py:demo",
                       f"--workdir={tmp_path}")
  assert scripted.returncode != 0 and "config.eval.policy must be 'model'" in scripted.stderr


def test_evaluate_run_samples_on_a_mesh_of_its_own(run_dir, tmp_path):
  """A run trained with 8 slots over 8 devices, evaluated with its copy of the weights split
  over 2 devices and 4 slots (a host unlike the run's): the command line's engine and
  sampler_mesh keys replace the run's, its other keys stay the run's."""
  out = tmp_path / "eval"
  done = _evaluate(f"--run={run_dir}", "--config=configs/eval.py:run",
                   "--config.sampler_mesh.tensor=2", "--config.engine.num_slots=4",
                   "--config.eval.max_scenarios=1", f"--workdir={out}")
  assert done.returncode == 0, done.stderr[-4000:]
  config = json.load(open(out / "eval_dev.json"))["config"]
  run_config = json.load(open(run_dir / "config.json"))
  assert config["sampler_mesh"] == {**run_config["sampler_mesh"], "tensor": 2}
  assert config["engine"] == {**run_config["engine"], "num_slots": 4}
  assert config["agent"] == run_config["agent"]


def test_a_run_evaluation_stopped_before_its_report_reads_no_checkpoint(run_dir, tmp_path,
                                                                        monkeypatch):
  """Stopped after its last scenario, before its report: run again, it reports the kept
  scenarios without reading the checkpoint (for a large model, minutes) or starting AppWorld.
  """
  from configs import eval as eval_configs  # noqa: PLC0415
  from sage_jax import evaluate, run_checkpoint  # noqa: PLC0415
  from sage_jax.envs import appworld  # noqa: PLC0415
  from sage_jax.eval import progress  # noqa: PLC0415

  config = eval_configs.get_config("run")
  config.eval.max_scenarios = 1
  with monkeypatch.context() as stopped_before_its_report:
    stopped_before_its_report.setattr(progress.Progress, "clear", lambda self: None)
    whole = evaluate.evaluate_run(str(run_dir), config, str(tmp_path))
  assert (tmp_path / "eval_dev_progress").exists()

  def refuse(*args, **kwargs):
    raise AssertionError("an evaluation with nothing to play read a model or started AppWorld")

  monkeypatch.setattr(run_checkpoint, "restore_sampling_model", refuse)
  monkeypatch.setattr(appworld.EnvPool, "start_in_background", refuse)
  again = evaluate.evaluate_run(str(run_dir), config, str(tmp_path))
  assert again["resumed_scenarios"] == [0] and again["appworld_unchecked"] == []
  assert again["checkpoint"] == whole["checkpoint"] == {"run": str(run_dir), "stage": "rl",
                                                        "step": 1}
  for key in ("records", "metrics", "appworld"):
    assert again[key] == whole[key], key


def test_the_run_preset_without_a_run_is_refused(tmp_path):
  """It evaluates a trained run's model; without --run it names none (it used to evaluate
  the bundled model instead, on the whole dev split)."""
  out = _evaluate("--config=configs/eval.py:run", f"--workdir={tmp_path / 'eval'}")
  assert out.returncode != 0 and "pass --run=RUN_DIR" in out.stderr, out.stderr[-2000:]
  assert not (tmp_path / "eval").exists()


def _generate(*args):
  return subprocess.run([sys.executable, "-m", "sage_jax.generate", "--temperature=0",
                         "--max_new_tokens=12", "--prompt=How many songs are in my library?",
                         *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_generate_samples_the_runs_checkpoint(run_dir, tmp_path):
  """`generate --model=RUN` samples the run's last checkpoint with the run's (compact)
  tokenizer: the completion its export gives."""
  exported = tmp_path / "hf"
  done = subprocess.run([sys.executable, "-m", "sage_jax.export", f"--workdir={run_dir}",
                         f"--out={exported}"], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  from_run, from_export = _generate(f"--model={run_dir}"), _generate(f"--model={exported}")
  for done in (from_run, from_export):
    assert done.returncode == 0, done.stderr[-4000:]
  assert "the rl stage's checkpoint at step 1" in from_run.stderr
  assert from_run.stdout.strip() and from_run.stdout == from_export.stdout
  # The run's sampler mesh, or this host's: --tensor replaces the run's, checked as it is.
  split = _generate(f"--model={run_dir}", "--tensor=2")
  assert split.returncode == 0 and split.stdout.strip(), split.stderr[-4000:]
  assert "Sampling on 8 of this host's devices: data=4, fsdp=1, tensor=2" in split.stderr
  no_split = _generate(f"--model={run_dir}", "--tensor=3")
  assert no_split.returncode != 0 and (
      "config.sampler_mesh.tensor: 3 does not divide the 8 devices" in no_split.stderr)
  missing = _generate(f"--model={run_dir}", "--step=7")
  assert missing.returncode != 0 and "available steps: [1]" in missing.stderr
  not_a_run = _generate(f"--model={exported}", "--stage=sft")
  assert not_a_run.returncode != 0 and "is not one" in not_a_run.stderr
  # The stage the run has is named; bad inputs end in one line, not a traceback.
  other_stage = _generate(f"--model={run_dir}", "--stage=sft")
  assert other_stage.returncode != 0
  assert "no sft checkpoints" in other_stage.stderr and "pass --stage=rl" in other_stage.stderr
  nowhere = _generate(f"--model={tmp_path / 'nowhere'}")
  assert nowhere.returncode != 0 and "no such directory or file" in nowhere.stderr
  no_step = subprocess.run([sys.executable, "-m", "sage_jax.export", f"--workdir={run_dir}",
                            "--step=7", f"--out={tmp_path / 'hf7'}"], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
  assert no_step.returncode != 0 and "available steps: [1]" in no_step.stderr
  for done in (other_stage, nowhere, no_step):
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
