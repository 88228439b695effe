"""A run resumed after its SFT stage (RL started from a copy of a finished SFT run, as
bench/real_model.py does for its SAGE and GRPO arms) starts from SFT's last params and keeps
nothing else of SFT: SFT's optimizer state (Adam: twice the params) would otherwise sit beside
RL's own for the whole run, which put the real 0.5B's SAGE stage over a 24 GB machine."""

import dataclasses
import gc
import json
import os
import re
import shutil
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax import compact_tokenizer, pipeline, run_config
from sage_jax.configurable import ConfigError
from sage_jax.train import rl_loop
from sage_jax.train.checkpoint import Checkpointer

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from configs import sage as sage_configs  # noqa: E402
from tests.appworld_fixtures import demo_expert_file  # noqa: E402, F401 - pytest fixture
from tests.appworld_fixtures import mini_root  # noqa: E402, F401 - pytest fixture
from tests.appworld_fixtures import pool_templates  # noqa: E402


def _live_bytes() -> int:
  gc.collect()
  return sum(a.nbytes for a in jax.live_arrays())


def test_resuming_after_sft_keeps_only_its_params(tmp_path, demo_expert_file):  # noqa: F811
  c = sage_configs.get_config("demo")
  c.pipeline.update(stages=("sft",), eval_before=False, eval_after=False, eval_train=False,
                    export=False, plot=False, expert_trajectories=demo_expert_file)
  # SFT saves on its own cadence, not RL's: every 2nd step and the last.
  c.sft.update(total_steps=3, save_every=2)
  c.checkpoint.update(save_every=1, keep_last=3)
  c.pool.num_workers = 2
  c.engine.num_slots = 8  # slots split over the session's 8 simulated devices
  workdir = str(tmp_path / "run")
  pipeline.run(c, workdir)
  saved = os.listdir(os.path.join(workdir, "sft", "checkpoints"))
  assert sorted(int(d) for d in saved if d.isdigit()) == [2, 3]

  pipe = pipeline.Pipeline(c, workdir)
  try:
    # Nothing of SFT on a file plays an episode: no AppWorld runs until something asks for it.
    assert not pool_templates()
    pipe.pool.wait_started()
    assert len(pool_templates()) == 1  # the template; the workers are its children
    leaves = lambda: jax.tree.leaves(nnx.state(pipe.model, nnx.Param))
    param_bytes = sum(x.nbytes for x in leaves())
    initial = np.asarray(leaves()[0])
    pipe.adopt_sft_result()  # read when first used
    assert np.array_equal(initial, np.asarray(leaves()[0]))
    before = _live_bytes()
    pipe.read_sft_result("an evaluation")
    after = _live_bytes()
    # The model holds SFT's params now (and the sampler its copy of them) ...
    assert not np.array_equal(initial, np.asarray(leaves()[0]))
    # ... in place of the fresh ones: nothing of SFT's trainer stays alive.
    assert after - before < param_bytes / 2, (before, after, param_bytes)
  finally:
    pipe.close()


def test_more_sft_steps_continue_sft_until_rl_has_trained_from_it(tmp_path, demo_expert_file):  # noqa: F811
  """A rerun with a larger sft.total_steps continues the finished SFT stage; once RL has
  trained from SFT's result, changing it is refused (RL's checkpoints belong to that model)."""
  c = sage_configs.get_config("demo")
  c.pipeline.update(stages=("sft",), eval_before=False, eval_after=False, eval_train=False,
                    export=False, plot=False, expert_trajectories=demo_expert_file,
                    chains_per_step=1, train_scenarios=1)
  c.sft.update(total_steps=2, save_every=2)
  c.grpo.group_size = 2
  c.agent.update(max_turn_tokens=16)
  c.rl.total_steps = 1
  c.pool.num_workers = 2
  c.engine.num_slots = 8  # slots split over the session's 8 simulated devices
  workdir = tmp_path / "run"
  steps = lambda stage: sorted(int(d) for d in os.listdir(workdir / stage) if d.isdigit())
  pipeline.run(c, str(workdir))
  c.sft.total_steps = 3
  pipeline.run(c, str(workdir))
  assert steps("sft/checkpoints") == [2, 3]
  logged = [json.loads(line)["step"] for line in open(workdir / "sft" / "metrics.jsonl")]
  assert logged == [1, 2, 3]
  c.pipeline.stages = ("sft", "rl")
  pipeline.run(c, str(workdir))
  assert steps("checkpoints") == [1]
  c.sft.total_steps = 4
  with pytest.raises(ConfigError, match=r"RL trained \(steps \[1\]\) from the SFT result of "
                                        r"step 3, and config.sft.total_steps=4 would change"):
    pipeline.Pipeline(c, str(workdir))
  assert steps("sft/checkpoints") == [2, 3]
  # Counted in epochs (total_steps 0, as the real-model presets do), the SFT stage ends where
  # it ended: the run resumes.
  c.sft.total_steps = 0
  pipe = pipeline.Pipeline(c, str(workdir))
  try:
    assert not pipe.sft_pending
  finally:
    pipe.close()


def _rl_resumed_without_sft_checkpoints(workdir, expert_file, kl_coef):
  """A run whose RL stage saved step 1 after SFT, SFT's checkpoints then removed (to free
  disk, as is common for a large model), and its config for 2 RL steps."""
  c = sage_configs.get_config("demo")
  c.pipeline.update(stages=("sft", "rl"), eval_before=False, eval_after=False, eval_train=False,
                    export=False, plot=False, expert_trajectories=expert_file,
                    chains_per_step=1, train_scenarios=1)
  c.sft.total_steps = 1
  c.grpo.update(group_size=2, kl_coef=kl_coef)
  c.agent.update(max_turn_tokens=16)
  c.rl.total_steps = 1
  c.pool.num_workers = 2
  c.engine.num_slots = 8  # slots split over the session's 8 simulated devices
  pipeline.run(c, str(workdir))
  shutil.rmtree(workdir / "sft" / "checkpoints")
  c.rl.total_steps = 2
  return c


def _rl_steps(workdir):
  return sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())


def test_a_resumed_rl_stage_without_kl_needs_no_sft_checkpoint(
    tmp_path, demo_expert_file):  # noqa: F811
  """RL resumed from its own checkpoint with KL off uses nothing of SFT's params: they are
  not read (minutes for a large model), and their removal does not stop the run."""
  workdir = tmp_path / "run"
  c = _rl_resumed_without_sft_checkpoints(workdir, demo_expert_file, kl_coef=0.0)
  summary = pipeline.run(c, str(workdir))
  assert "preempted" not in summary and _rl_steps(workdir) == [1, 2]
  assert not (workdir / "sft" / "checkpoints").exists()
  # Fewer RL steps than the run has trained: refused before config.json records them.
  recorded = (workdir / "config.json").read_text()
  c.rl.total_steps = 1
  with pytest.raises(ConfigError, match=r"its RL stage is at step 2, past "
                                        r"config.rl.total_steps=1; keep it"):
    pipeline.Pipeline(c, str(workdir))
  assert (workdir / "config.json").read_text() == recorded


def test_a_resumed_rl_stage_with_kl_names_the_missing_sft_checkpoint(
    tmp_path, demo_expert_file):  # noqa: F811
  """KL's reference is SFT's result, which RL's checkpoints do not hold: the rerun fails,
  naming the directory and the KL reference, before RL touches its checkpoints."""
  workdir = tmp_path / "run"
  c = _rl_resumed_without_sft_checkpoints(workdir, demo_expert_file, kl_coef=0.05)
  logged = (workdir / "metrics.jsonl").read_text()
  missing = re.escape(f"{workdir}/sft/checkpoints")
  with pytest.raises(FileNotFoundError, match=rf"{missing}: .*step 1.*KL's reference"):
    pipeline.run(c, str(workdir))
  assert _rl_steps(workdir) == [1] and (workdir / "metrics.jsonl").read_text() == logged


def test_an_evaluation_is_reused_only_for_its_checkpoint_and_settings():
  """A rerun may change the evaluation settings (eval.*, the agent, retrieval): a report
  made under others is not the evaluation asked for."""
  config = {"eval": {"split": "dev", "max_scenarios": 2, "temperature": 0.0},
            "agent": {"max_steps": 6}, "retrieval": {"strategy": "same_scenario"},
            "rl": {"total_steps": 2}}
  step = {"run": "gs://b/run", "stage": "rl", "step": 2}
  report = {"config": json.loads(json.dumps(config)), "checkpoint": step}
  assert pipeline.reusable(report, config, {**step, "run": "/mnt/run"})  # the run moved
  assert pipeline.reusable(report, {**config, "rl": {"total_steps": 4}}, step)
  assert not pipeline.reusable(report, config, {**step, "step": 3})
  assert not pipeline.reusable(report, config, None)
  assert not pipeline.reusable(None, config, step)
  for section, change in (("eval", {"max_scenarios": 0}), ("eval", {"temperature": 0.7}),
                          ("agent", {"max_steps": 8}), ("retrieval", {"strategy": "query_ngram"})):
    changed = {**config, section: {**config[section], **change}}
    assert not pipeline.reusable(report, changed, step), (section, change)


def test_an_evaluation_that_appworld_contradicted_is_made_again():
  """runner.evaluate writes its report, flagged `appworld_disagrees`, before it fails: the
  rerun evaluates the same checkpoint again rather than taking up the failed scores."""
  config = {"eval": {"split": "dev"}, "agent": {"max_steps": 6}, "retrieval": {}}
  step = {"run": "/mnt/run", "stage": "rl", "step": 4}
  report = {"config": config, "checkpoint": step, "metrics": {"overall": {"tgc": 80.0}}}
  assert pipeline.reusable(report, config, step)
  disagreed = {**report, "appworld_disagrees": "TGC/SGC disagree with AppWorld's evaluation"}
  assert not pipeline.reusable(disagreed, config, step)


def test_the_summary_table_writes_token_counts_whole():
  table = pipeline.summary_table({"before": {"tgc": 33.333, "avg_generated_tokens": 1475.3},
                                  "after": {"tgc": 100.0, "avg_generated_tokens": 13613.2}})
  assert "| tgc | 33.3 | 100 |" in table
  assert "| avg_generated_tokens | 1475 | 13613 |" in table  # not 1.48e+03


def _sft_on_file(expert_file):
  """The demo's SFT stage on a given file, without evaluations: a Pipeline of it starts no
  AppWorld."""
  c = sage_configs.get_config("demo")
  c.pipeline.update(stages=("sft",), eval_before=False, eval_after=False, eval_train=False,
                    export=False, plot=False, expert_trajectories=expert_file)
  c.engine.num_slots = 8  # slots split over the session's 8 simulated devices
  return c


def test_a_directory_holding_another_config_json_is_no_workdir(
    tmp_path, demo_expert_file):  # noqa: F811
  """A model's directory (a run's HF export, <workdir>/hf) is refused as --workdir, naming
  what its config.json looks like; the file stays as it was."""
  hf = tmp_path / "run" / "hf"
  hf.mkdir(parents=True)
  text = json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                     "hidden_size": 896, "seed": 0})
  (hf / "config.json").write_text(text)
  with pytest.raises(ConfigError, match=re.escape(
      f"{hf}/config.json is not a training run's config: it looks like an HF model config "
      "(model_type 'qwen2')")):
    pipeline.Pipeline(_sft_on_file(demo_expert_file), str(hf))
  assert (hf / "config.json").read_text() == text and os.listdir(hf) == ["config.json"]


def test_a_run_that_failed_before_training_leaves_its_workdir_to_the_next(
    tmp_path, demo_expert_file, caplog):  # noqa: F811
  """A bad pipeline.data, or more train_scenarios than its train split has, fails naming its
  key, before config.json records the run. A workdir whose run stopped before it saved or
  evaluated anything (its config.json alone) takes the next config, whatever it changes; once
  it holds a result, that config is the experiment's."""
  workdir = tmp_path / "run"
  bad = _sft_on_file(demo_expert_file)
  bad.pipeline.data = str(tmp_path / "nonexistent")
  with pytest.raises(ConfigError, match=re.escape(
      f"config.pipeline.data: {bad.pipeline.data!r} holds no AppWorld data")):
    pipeline.Pipeline(bad, str(workdir))
  assert not (workdir / "config.json").exists()
  more = _sft_on_file(demo_expert_file)  # the mini world's train split has 7 scenarios
  more.pipeline.train_scenarios = 8
  with pytest.raises(ConfigError, match=r"config.pipeline.train_scenarios: 8, but the 'train' "
                                        r"split of \S+ has 7 scenarios; set at most 7"):
    pipeline.Pipeline(more, str(workdir))
  assert not (workdir / "config.json").exists()
  # What a run that crashed before its first checkpoint leaves: its config.json.
  stopped = _sft_on_file(demo_expert_file)
  stopped.seed = 5
  (workdir / "config.json").write_text(json.dumps(
      run_config.with_seeds(stopped, run_config.resolve(stopped)), default=str))
  c = _sft_on_file(demo_expert_file)
  with caplog.at_level("WARNING"):
    pipe = pipeline.Pipeline(c, str(workdir))
  pipe.close()
  assert "stopped before it saved or evaluated anything: this config replaces it" in caplog.text
  assert json.loads((workdir / "config.json").read_text())["seed"] == 0
  (workdir / "eval_before").mkdir()
  (workdir / "eval_before" / "eval_dev.json").write_text("{}")
  with pytest.raises(ConfigError, match=r"config.seed: 0 -> 5"):
    pipeline.Pipeline(stopped, str(workdir))


def test_a_given_sft_file_sft_would_fail_on_fails_before_the_run_is_recorded(
    tmp_path, demo_expert_file):  # noqa: F811
  """A pipeline.expert_trajectories file that is not SFT data, holds nothing of the scenarios
  the run trains on, or holds trajectories longer than engine.max_len, fails naming its key
  before config.json records the run (and before the evaluations before training): the key
  is not resumable, and a rerun may still give another file."""
  workdir, given = tmp_path / "run", tmp_path / "expert.jsonl"
  trajectory = json.loads(open(demo_expert_file).readline())
  c = _sft_on_file(str(given))
  c.pipeline.eval_before = True
  key = re.escape("config.pipeline.expert_trajectories: ")

  def lengthened(line: str) -> str:  # its last reply 1000 lines longer
    t = json.loads(line)
    last = max(i for i, m in enumerate(t["messages"]) if m["role"] == "assistant")
    t["messages"][last]["content"] += "\nx = 1" * 1000
    return json.dumps(t) + "\n"

  for text, error in (("this is not json\n", rf"{key}{re.escape(str(given))}:1: not JSON"),
                      (json.dumps({**trajectory, "id": "zzz_1"}) + "\n",
                       rf"{key}.* holds no trajectory of the scenarios the run trains on"),
                      ("".join(map(lengthened, open(demo_expert_file))),
                       rf"{key}.* holds \d+ trajectories longer than config.engine.max_len=2048 "
                       r"tokens \(e.g. \S+, \d+ tokens\)")):
    given.write_text(text)
    with pytest.raises(ConfigError, match=error):
      pipeline.Pipeline(c, str(workdir))
    assert not (workdir / "config.json").exists()
  shutil.copy(demo_expert_file, given)
  pipeline.Pipeline(c, str(workdir)).close()
  assert (workdir / "config.json").exists()


def test_rl_without_evaluations_keeps_the_best_checkpoint_it_has(
    tmp_path, demo_expert_file):  # noqa: F811
  """rl.eval_every=0 on resume ranks no new step, and the step earlier evaluations kept as
  the best stays (orbax deleted it at the next save when best-keeping was off)."""
  workdir = tmp_path / "run"
  c = _sft_on_file(demo_expert_file)
  c.pipeline.update(stages=("rl",), chains_per_step=1, train_scenarios=1)
  c.grpo.group_size = 2
  c.rl.update(total_steps=6, eval_every=0)
  c.checkpoint.update(keep_last=1, keep_best=1, async_save=False)
  c.pool.num_workers = 2
  pipe = pipeline.Pipeline(c, str(workdir))
  try:
    state = rl_loop.grpo_trainer(pipe.model, pipe.run.grpo, pipe.run.optimizer,
                                 pipe.run.trainer, mesh=pipe.mesh).state
    earlier = Checkpointer(dataclasses.replace(
        pipe.run.checkpoint, directory=str(workdir / "checkpoints")))
    for step, tgc in ((1, 0.9), (2, 0.1), (3, None)):  # evaluated every 2 steps before
      earlier.save(step, state, metrics=None if tgc is None else {"dev/tgc": tgc})
    earlier.close()
    resumed = pipe._rl_checkpointer()
    for step in (4, 5):
      resumed.save(step, state)
    resumed.close()
  finally:
    pipe.close()
  assert _rl_steps(workdir) == [1, 5]


def test_a_rerun_keeps_the_export_of_the_weights_it_holds(tmp_path, demo_expert_file):  # noqa: F811
  """A rerun of a finished run leaves <workdir>/hf as it is when it holds the export of the
  run's result (as its record says); an export without its record (cut short) is made again,
  and so is one of other weights (more steps)."""
  c = _sft_on_file(demo_expert_file)
  c.pipeline.export = True
  c.sft.total_steps = 1
  workdir = tmp_path / "run"
  hf = workdir / "hf"
  weights = lambda: sorted((p.name, p.stat().st_ino, p.stat().st_mtime_ns)
                           for p in hf.glob("*.safetensors"))
  record = lambda: json.loads((hf / pipeline.EXPORT_RECORD).read_text())
  pipeline.run(c, str(workdir))
  exported = weights()
  assert exported and (record()["stage"], record()["step"]) == ("sft", 1)
  assert pipeline.run(c, str(workdir))["export"] == str(hf)
  assert weights() == exported
  (hf / pipeline.EXPORT_RECORD).unlink()
  pipeline.run(c, str(workdir))
  assert weights() != exported and record()["step"] == 1
  exported = weights()
  c.sft.total_steps = 2
  pipeline.run(c, str(workdir))
  assert weights() != exported and record()["step"] == 2
  card = (hf / "README.md").read_text()
  assert "- Checkpoint: sft step 2" in card


def test_training_scenarios_evaluated_on_the_dev_split_are_refused(
    tmp_path, demo_expert_file):  # noqa: F811
  """With eval.split the train split, pipeline.eval_train's evaluation would write over the
  dev evaluation's report (both eval_before/eval_train.json): refused, naming both keys,
  before config.json records the run."""
  c = _sft_on_file(demo_expert_file)
  c.pipeline.update(eval_before=True, eval_train=True)
  c.eval.split = c.pipeline.train_split
  with pytest.raises(ConfigError, match=re.escape(
      "config.pipeline.eval_train: True with eval.split == pipeline.train_split ('train'): "
      "the dev evaluation scores that split already") + r".*\(eval_before/eval_train.json\)"):
    pipeline.Pipeline(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_a_spec_that_names_no_weights_fails_before_the_run_starts(
    tmp_path, demo_expert_file):  # noqa: F811
  """A model.spec that is no checkpoint here fails naming its key before AppWorld starts and
  config.json records the run, not when the model is built."""
  c = _sft_on_file(demo_expert_file)
  c.pipeline.eval_before = True  # a run that plays episodes starts AppWorld at once
  c.model.update(spec=str(tmp_path / "Qwen2.5-7B-Instruct"), preset="", vocabulary="full")
  with pytest.raises(ConfigError, match=r"config.model.spec: .*Qwen2.5-7B-Instruct' is not an "
                                        r"HF checkpoint directory"):
    pipeline.Pipeline(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists() and not pool_templates()


def test_a_compact_tokenizer_cut_short_is_made_again(tmp_path, demo_expert_file):  # noqa: F811
  """A compact tokenizer directory that a stopped write left without all its files is not
  taken up: the next start writes it whole."""
  workdir = tmp_path / "run"
  tokenizer = workdir / compact_tokenizer.RUN_SUBDIR
  pipeline.Pipeline(_sft_on_file(demo_expert_file), str(workdir)).close()
  written = {name: (tokenizer / name).read_text() for name in compact_tokenizer.FILES}
  (tokenizer / "merges.txt").unlink()
  pipeline.Pipeline(_sft_on_file(demo_expert_file), str(workdir)).close()
  assert {name: (tokenizer / name).read_text() for name in compact_tokenizer.FILES} == written


def test_a_given_sft_file_that_changed_under_a_started_run_is_refused(
    tmp_path, demo_expert_file):  # noqa: F811
  """The run reads a given SFT file again at every start: once a compact vocabulary was cut
  from it (or SFT saved a step), other contents would train on ids the vocabulary lacks, or
  mix data within SFT. Refused, naming the key; the file as it was starts again, and a new
  workdir takes the new file."""
  given = tmp_path / "expert.jsonl"
  lines = open(demo_expert_file).read().splitlines(keepends=True)
  given.write_text("".join(lines))
  workdir = tmp_path / "run"
  pipeline.Pipeline(_sft_on_file(str(given)), str(workdir)).close()
  assert json.loads((workdir / pipeline.EXPERT_FILE_RECORD).read_text())["path"] == str(given)
  given.write_text("".join(lines[:-1]))
  with pytest.raises(ConfigError, match=re.escape(
      f"config.pipeline.expert_trajectories: {given} changed since this run first read it")
      + r".*the run's compact vocabulary was cut from it: SFT would go on with other data"):
    pipeline.Pipeline(_sft_on_file(str(given)), str(workdir))
  pipeline.Pipeline(_sft_on_file(str(given)), str(tmp_path / "other")).close()
  given.write_text("".join(lines))
  pipeline.Pipeline(_sft_on_file(str(given)), str(workdir)).close()
