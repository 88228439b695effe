"""The main job end to end on the embedded default, with reduced step counts:
train (SFT -> SAGE) -> checkpoint -> resume -> evaluate -> export -> transformers reload."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import transformers

from sage_jax import storage
from sage_jax.tokenizer import Tokenizer
from tests import fake_gcs
from tests.appworld_fixtures import demo_expert_file  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The demo's shape at a fraction of its cost: one SFT step, short turns, 2 chains a step, one
# training and one dev scenario, without AppWorld's own re-scoring (tests/test_evaluate.py has
# it), without redraws (after one SFT step no rollout writes code: every chain would be
# redrawn; tests/test_train_rl_appworld.py covers dynamic sampling) and without evaluating the
# training scenario (the gs:// run does).
SHORT = ("--config.sft.total_steps=1", "--config.eval.max_scenarios=1",
         "--config.pool.num_workers=2", "--config.agent.max_turn_tokens=48",
         "--config.pipeline.train_scenarios=1", "--config.eval.appworld_check=false",
         "--config.grpo.max_redraws=0", "--config.pipeline.chains_per_step=2",
         "--config.pipeline.eval_train=false")


def _expert(path):
  """Reads the demo's SFT data from `path` instead of playing the gold solutions again (the
  gs:// run plays them, and checks that it made the same file)."""
  return f"--config.pipeline.expert_trajectories={path}"


# Runs that check only what training wrote: no evaluations, export or plots.
TRAIN_ONLY = ("--config.pipeline.eval_before=false", "--config.pipeline.eval_after=false",
              "--config.pipeline.export=false", "--config.pipeline.plot=false")


# The demo as the README runs it, on one CPU device (not the test session's 8 simulated ones,
# which only slow a 2-core machine down; tests/test_multihost.py runs it sharded).
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _command(workdir, *overrides, config="configs/sage.py:demo"):
  return [sys.executable, "-m", "sage_jax.train", f"--config={config}",
          f"--workdir={workdir}", *SHORT, *overrides]


def _train(workdir, *overrides, config="configs/sage.py:demo", env=ONE_DEVICE):
  out = subprocess.run(_command(workdir, *overrides, config=config), cwd=REPO,
                       capture_output=True, text=True, timeout=1500, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  return out.stdout


# The gs:// run's: it evaluates the training scenario too, and trains with a KL term.
KL = ("--config.pipeline.eval_train=true", "--config.grpo.kl_coef=0.05",
      "--config.grpo.num_mini_batches=1", "--config.optimizer.warmup_steps=0",
      "--config.grpo.entropy_coef=0.1", "--config.optimizer.learning_rate=0.01")


@pytest.mark.long
def test_demo_trains_resumes_evaluates_and_exports_with_a_gs_workdir(gcs_url, tmp_path,
                                                                    demo_expert_file):  # noqa: F811
  """The short demo with --workdir=gs://... (a fake GCS server; the other runs of this file
  and of tests/test_learning_appworld.py have local workdirs): the run's files are in the
  bucket, none in a local "gs:" directory; a rerun resumes from the bucket's checkpoint; the
  export command reads the run from the bucket and writes what transformers loads.

  With kl_coef > 0 the KL reference is the model RL starts from, also after the resume: the
  first step's KL is 0 (policy == reference), the resumed second step's is not. One update a
  step (the demo makes 4, whose later ones already see a moved policy); an entropy bonus
  moves the policy (after one SFT step no rollout writes code, all score alike, so their
  advantages are 0)."""
  fake_gcs.create_bucket(gcs_url, "runs")
  env = {**ONE_DEVICE, **fake_gcs.server_env(gcs_url)}
  workdir = "gs://runs/demo"
  root = storage.path(workdir)
  stdout = _train(workdir, "--config.rl.total_steps=1", *KL, env=env)
  assert ("| metric | train before | train after SFT | train after | dev before | dev after |"
          in stdout)
  summary = storage.read_json(root / "summary.json")
  assert summary["workdir"] == workdir
  assert summary["weights"] == {"run": workdir, "stage": "rl", "step": 1}
  for stage in ("before", "after", "train_before", "train_after_sft", "train_after"):
    assert set(summary[stage]) >= {"tgc", "sgc", "avg_steps", "avg_generated_tokens"}, stage
  # The training scenario's evaluations are of the train split, the dev ones of dev.
  assert storage.read_json(root / "eval_after_sft" / "eval_train.json")["split"] == "train"
  config = storage.read_json(root / "config.json")
  assert config["grpo"]["chain_length"] == 3
  # Dev evaluation samples greedily (the eval section), training at the agent's temperature.
  assert config["agent"]["temperature"] > 0 and config["eval"]["temperature"] == 0.0
  assert storage.read_json(root / "eval_before" / "eval_dev.json")["temperature"] == 0.0
  for name in ("expert_trajectories.jsonl", "tokenizer/tokenizer.json", "sft/done.json",
               "sft/checkpoints/1/files.json", "checkpoints/1/files.json",
               "checkpoints/config.json", "eval_after/eval_dev.json", "plots/training.png",
               "hf/config.json", "hf/model.safetensors.index.json", "hf/tokenizer.json"):
    assert (root / name).exists(), name
  assert any(f.name.startswith("events.out.tfevents") for f in (root / "tb").iterdir())
  assert not os.path.exists(os.path.join(REPO, "gs:"))
  # The SFT data the other runs read instead of playing the gold solutions is this run's.
  assert (root / "expert_trajectories.jsonl").read_text() == open(demo_expert_file).read()

  evaluated = lambda name, split="dev": storage.read_json(
      root / name / f"eval_{split}.json").get("checkpoint")
  assert evaluated("eval_before") is None  # the starting weights
  assert evaluated("eval_after") == {"run": workdir, "stage": "rl", "step": 1}

  # Resume: one more RL step continues from the bucket's checkpoint of step 1; SFT is not
  # redone. The evaluation after RL is redone for step 2, the one before is kept.
  before = storage.read_json(root / "eval_before" / "eval_dev.json")
  _train(workdir, "--config.rl.total_steps=2", *KL, env=env)
  assert storage.read_json(root / "eval_before" / "eval_dev.json") == before
  assert evaluated("eval_after") == {"run": workdir, "stage": "rl", "step": 2}
  assert evaluated("eval_after_sft", "train") == {"run": workdir, "stage": "sft", "step": 1}
  assert evaluated("eval_after", "train") == {"run": workdir, "stage": "rl", "step": 2}
  # The rerun's summary is of step 2; the one of step 1 was moved aside as it started.
  assert storage.read_json(root / "summary.json")["weights"]["step"] == 2
  assert storage.read_json(root / "summary.previous.json")["weights"]["step"] == 1
  metrics = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
  rows = metrics(root)
  assert [r["step"] for r in rows] == [1, 2]
  assert abs(rows[0]["kl"]) < 1e-6 and rows[1]["kl"] > 1e-6
  assert [r["step"] for r in metrics(root / "sft")] == [1]
  assert (root / "checkpoints" / "2" / "files.json").exists()
  # chains_per_step x group_size x chain_length episodes per SAGE step.
  assert all(r["compute/episodes"] == 2 * 4 * 3 for r in rows)

  # The export command writes what transformers loads; it equals the run's own export.
  out = subprocess.run([sys.executable, "-m", "sage_jax.export", f"--workdir={workdir}",
                        "--out=gs://runs/export"], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1])["step"] == 2
  export = storage.path("gs://runs/export")
  assert "Dev evaluation" in (export / "README.md").read_text()
  for remote, local in ((export, "export"), (root / "hf", "hf"), (root / "tokenizer", "tokenizer")):
    storage.copy_tree(remote, tmp_path / local)
  # The export carries the run's compact tokenizer, sized to the model's vocabulary.
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
  text = "<|im_start|>user\nHello world"
  assert tok(text)["input_ids"] == Tokenizer(tmp_path / "tokenizer").encode(text)
  assert tok.decode(tok(text)["input_ids"]) == text
  assert len(tok) == json.load(open(tmp_path / "export" / "config.json"))["vocab_size"]
  ids = torch.tensor([tok(text)["input_ids"]])
  logits = []
  for d in (tmp_path / "hf", tmp_path / "export"):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    with torch.no_grad():
      logits.append(model(ids).logits.numpy())
  np.testing.assert_array_equal(logits[0], logits[1])

  # The SFT stage's checkpoint exports too, here to a local directory.
  out = subprocess.run([sys.executable, "-m", "sage_jax.export", f"--workdir={workdir}",
                        "--stage=sft", "--step=1", f"--out={tmp_path / 'sft_export'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == {
      "out": str(tmp_path / "sft_export"), "stage": "sft", "step": 1}
  assert (tmp_path / "sft_export" / "config.json").exists()


def test_sigterm_stops_the_run_after_its_step_and_a_rerun_finishes_it(
    tmp_path, demo_expert_file):  # noqa: F811
  """A SIGTERM during SFT (a preemption) stops the run after the SFT step in progress, with a
  checkpoint of that step: SFT is not marked done, no later stage runs, and the command exits
  with 143 so that a retry loop reruns it. The rerun resumes SFT from that checkpoint (here
  told to stop one step later) and goes on to RL."""
  workdir = tmp_path / "run"
  quick = (*TRAIN_ONLY, "--config.rl.total_steps=1", "--config.pipeline.chains_per_step=1",
           _expert(demo_expert_file))
  proc = subprocess.Popen(_command(workdir, "--config.sft.total_steps=300", *quick), cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=ONE_DEVICE)
  sft_metrics = workdir / "sft" / "metrics.jsonl"
  deadline = time.monotonic() + 900
  while not (sft_metrics.exists() and sft_metrics.read_text().strip()):
    assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-5000:]
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=600)
  assert proc.returncode == 143, stderr[-5000:]
  assert "run the same command again to resume" in stderr
  stopped = len(sft_metrics.read_text().splitlines())
  assert 1 <= stopped < 300
  saved = [int(d) for d in os.listdir(workdir / "sft" / "checkpoints") if d.isdigit()]
  assert max(saved) == stopped  # the step the signal stopped at was saved
  assert not (workdir / "sft" / "done.json").exists()
  for later in ("metrics.jsonl", "checkpoints", "summary.json", "eval_after_sft"):
    assert not (workdir / later).exists(), later

  _train(workdir, f"--config.sft.total_steps={stopped + 1}", *quick)
  rows = [json.loads(line) for line in sft_metrics.read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, stopped + 2))
  assert (workdir / "sft" / "done.json").exists()
  assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == [1]


def test_sigterm_during_a_dev_evaluation_ends_it_and_a_rerun_makes_it(
    tmp_path, demo_expert_file):  # noqa: F811
  """A SIGTERM while the dev evaluation after SFT step 1 plays its episodes (its first
  scenario finished, the second under way) ends it at their next turn, not at its end: the
  run saves step 1 without that evaluation and exits with 143. The rerun makes the
  evaluation of step 1 first, playing only the second scenario, then trains and evaluates
  step 2."""
  workdir = tmp_path / "run"
  command = _command(workdir, "--config.pipeline.stages=('sft',)", "--config.sft.total_steps=2",
                     "--config.sft.eval_every=1", "--config.eval.max_scenarios=2",
                     "--config.eval.max_concurrent_scenarios=1",
                     *TRAIN_ONLY, _expert(demo_expert_file))
  proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, env=ONE_DEVICE)
  evaluation = workdir / "eval_sft_step1"
  kept = evaluation / "eval_dev_progress"  # holds each scenario the evaluation finished
  deadline = time.monotonic() + 900
  while not (kept.exists() and any(kept.glob("scenario_*.pkl"))):
    assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-5000:]
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=600)
  assert proc.returncode == 143, stderr[-5000:]
  assert "A signal ended the evaluation of step 1" in stderr, stderr[-5000:]
  assert not (evaluation / "eval_dev.json").exists()
  saved = [int(d) for d in os.listdir(workdir / "sft" / "checkpoints") if d.isdigit()]
  assert saved == [1]
  metrics = workdir / "sft" / "metrics.jsonl"
  assert [(r["step"], "dev/tgc" in r) for r in map(json.loads, open(metrics))] == [(1, False)]

  rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                         env=ONE_DEVICE)
  assert rerun.returncode == 0, rerun.stderr[-5000:]
  # The evaluation made first joins step 1's line.
  assert [(r["step"], "dev/tgc" in r) for r in map(json.loads, open(metrics))] == [
      (1, True), (2, True)]
  assert json.load(open(evaluation / "eval_dev.json"))["resumed_scenarios"] == [0]
  assert not kept.exists()


def test_a_stopped_run_exits_as_the_signal_it_caught():
  """Ctrl-C gives the shell's 130; SIGTERM, and a stop that another process's signal or a
  preemption notice asked for, 143 (the test above runs the whole path with SIGTERM)."""
  from sage_jax import pipeline
  assert pipeline.preempted_exit_code(signal.SIGINT) == 130
  assert pipeline.preempted_exit_code(signal.SIGTERM) == pipeline.preempted_exit_code(None) == 143


def test_sft_only_config(tmp_path, demo_expert_file):  # noqa: F811
  workdir = tmp_path / "sft"
  stdout = _train(workdir, "--config.pipeline.eval_before=false", "--config.sft.eval_every=1",
                  _expert(demo_expert_file), config="configs/sft.py:demo")
  assert "| tgc |" in stdout
  # sft.eval_every: dev evaluation during SFT, logged with its step.
  assert os.path.exists(workdir / "eval_sft_step1" / "eval_dev.json")
  (row,) = [json.loads(line) for line in open(workdir / "sft" / "metrics.jsonl")]
  assert "dev/tgc" in row
  assert not os.path.exists(workdir / "metrics.jsonl")  # no RL steps
  assert (workdir / "hf" / "config.json").exists()
  # The run's export holds what `sage_jax.export` writes beside a checkpoint's model.
  card = (workdir / "hf" / "README.md").read_text()
  step = json.load(open(workdir / "sft" / "done.json"))["step"]
  assert f"- Checkpoint: sft step {step}" in card and "| tgc |" in card, card
  assert (json.load(open(workdir / "hf" / "sage_jax_config.json"))
          == json.load(open(workdir / "config.json")))


def test_grpo_baseline_config(tmp_path):
  workdir = tmp_path / "grpo"
  _train(workdir, "--config.rl.total_steps=1", "--config.pipeline.eval_before=false",
         "--config.pipeline.eval_after=false", "--config.pipeline.plot=false",
         config="configs/grpo.py:demo")
  config = json.load(open(workdir / "config.json"))
  assert config["grpo"]["single_task"] and config["reward"]["variant"] == "outcome"
  (row,) = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert row["step"] == 1  # one task per rollout: chain position 0 only
  assert any(k.startswith("reward/pos0") for k in row)
  assert not any(k.startswith("reward/pos1") for k in row)
  # chains_per_step x group_size single-task episodes, every one logged with its tokens.
  assert row["compute/episodes"] == 2 * 4 and row["compute/trained_tokens"] > 0
  assert row["compute/prompt_tokens"] > row["compute/generated_tokens"] > 0


@pytest.mark.long
def test_run_seed_sets_initialisation_data_order_and_rollouts(tmp_path,
                                                              demo_expert_file):  # noqa: F811
  """`--config.seed` alone: the same seed reproduces the SFT and SAGE steps exactly, another
  seed changes them (initial weights, data order, sampled rollouts). The SFT data is the
  gold trajectories, which no seed changes.

  The second run of seed 0 also sets `pipeline.compilation_cache_dir`, which overrides the
  environment's cache (the test session sets one): its compiled train steps land there, and
  compiling them afresh changes no number."""
  cache = tmp_path / "jax_cache"

  def steps(name, seed, *overrides):
    workdir = tmp_path / name
    _train(workdir, f"--config.seed={seed}", "--config.rl.total_steps=1",
           "--config.pipeline.chains_per_step=1", *TRAIN_ONLY, _expert(demo_expert_file),
           *overrides)
    (sft,) = [json.loads(line) for line in open(workdir / "sft" / "metrics.jsonl")]
    (rl,) = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return ({k: sft[k] for k in ("loss", "grad_norm", "batch/real_positions")},
            {k: rl[k] for k in ("logprob", "entropy", "generated_tokens/total")})

  first = steps("a", 0)
  again = steps("b", 0, f"--config.pipeline.compilation_cache_dir={cache}")
  other = steps("c", 1)
  assert first == again
  assert first[0]["loss"] != other[0]["loss"] and first[1]["logprob"] != other[1]["logprob"]
  assert any(name.startswith("jit_train_step-") for name in os.listdir(cache))


def test_bad_config_fails_before_compiling(tmp_path):
  """The command's checks come before any work (tests/test_run_config.py has every check's
  message): a misspelt key, and a value checked against the devices."""
  for override, key in (
      ("--config.pipeline.chains_per_step=3", "config.pipeline.chains_per_step"),
      ("--config.rollout.group_sise=4", "group_sise")):
    # 3 chains x group size 2 = 6 rollouts do not split over a data axis of 4.
    extra = (["--config.mesh.data=4", "--config.mesh.fsdp=1", "--config.grpo.group_size=2"]
             if "chains" in override else [])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, "-m", "sage_jax.train", "--config=configs/sage.py:demo",
                          f"--workdir={tmp_path / 'bad'}", override, *extra], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert key in out.stderr, (override, out.stderr[-2000:])
    assert not os.path.exists(tmp_path / "bad" / "config.json")
  evaluation = subprocess.run([sys.executable, "-m", "sage_jax.train",
                               "--config=configs/eval.py:demo", f"--workdir={tmp_path / 'bad'}"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
  assert evaluation.returncode != 0 and "run it with `python -m sage_jax.evaluate`" in (
      evaluation.stderr), evaluation.stderr[-2000:]
  assert not os.path.exists(tmp_path / "bad")


def test_bad_workdir_fails_at_startup_by_name(gcs_url, tmp_path):
  env = {**ONE_DEVICE, **fake_gcs.server_env(gcs_url), "PYTHONPATH": REPO}
  cache = "--config.pipeline.compilation_cache_dir=foo://x/cache"
  for workdir, extra, error in (
      ("gs://no-such-bucket/run", [],
       "--workdir=gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist"),
      ("foo://x/run", [], "--workdir=foo://x/run: unknown scheme foo://"),
      (str(tmp_path / "run"), [cache], f"{cache}: unknown scheme foo://")):
    out = subprocess.run([sys.executable, "-m", "sage_jax.train",
                          f"--config={REPO}/configs/sage.py:demo", f"--workdir={workdir}", *extra],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert error in out.stderr, out.stderr[-2000:]
  assert not os.listdir(tmp_path)  # nothing local in the bucket's place, no workdir
