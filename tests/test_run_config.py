"""Every config file and preset resolves; each bad-config case fails naming the key.

In process and without devices: `run_config.resolve` is what `sage_jax.train` runs before
it builds anything (tests/test_demo.py checks the same through the command line)."""

import importlib.util
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from sage_jax import run_config, storage
from sage_jax.configurable import ConfigError
from sage_jax.sft.expert import ExpertConfig
from sage_jax.train.optimizer import make_schedule
from sage_jax.weights import loader
from sage_jax.weights.loader import ModelSpec, build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")
# Devices each preset is sized for: a CPU, one GPU, one 8-GPU node, a v5p-64 slice (32 chips).
PRESETS = {"demo": 1, "qwen2.5-coder-0.5b": 1, "qwen2.5-7b": 8, "qwen2.5-32b": 32,
           "qwen2.5-32b-lora": 8}


def _config(name, preset):
  spec = importlib.util.spec_from_file_location(f"configs_{name}", os.path.join(CONFIGS,
                                                                                f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(preset)


@pytest.mark.parametrize("preset,devices", PRESETS.items())
@pytest.mark.parametrize("name", ["sage", "grpo", "sft"])
def test_every_preset_resolves(name, preset, devices):
  run = run_config.resolve(_config(name, preset), num_devices=devices)
  if name == "grpo":  # the paper's baseline: K=1 single-task rollouts, no library, outcome
    assert (run.rollout.effective_chain_length, run.agent.use_library,
            run.reward.variant) == (1, False, "outcome")
  elif name == "sage":  # K=2 as in the paper; the demo walks whole scenarios (configs/sage.py)
    assert (run.rollout.chain_length, run.agent.use_library,
            run.reward.variant) == (3 if preset == "demo" else 2, True, "sage")
  else:
    assert run.pipeline.stages == ("sft",)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_presets_stages_reach_their_peak_learning_rate(preset):
  """An epoch-counted SFT's length comes from its data: 35 expert trajectories of the mini
  world, 90 and 150 of AppWorld's train split (with `expert.firsts`, every task played first
  too). At each, as in RL, the schedule reaches the learning rate the preset names."""
  run = run_config.resolve(_config("sage", preset), num_devices=PRESETS[preset])
  stages = [(run.optimizer, run.rl.total_steps * run.grpo.num_mini_batches)]
  stages += [(run.sft_optimizer, run.sft.steps_for(n)) for n in (35, 90, 150)]
  for optimizer, updates in stages:
    assert optimizer.never_peaks(updates) is None, (optimizer, updates)
    schedule = make_schedule(optimizer.for_updates(updates))
    assert max(float(schedule(i)) for i in range(updates)) == pytest.approx(
        optimizer.learning_rate)


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "qwen2.5-32b", "qwen2.5-32b-lora"])
def test_a_real_size_preset_takes_the_weights_it_is_pointed_at(preset):
  """`--config.model.spec=<HF dir>` on a preset that names an architecture: both are kept (the
  loader checks that the checkpoint has the preset's shapes)."""
  config = _config("sage", preset)
  config.model.spec = "/checkpoints/Qwen2.5-Instruct"
  run = run_config.resolve(config, num_devices=PRESETS[preset])
  assert (run.model.spec, run.model.preset) == ("/checkpoints/Qwen2.5-Instruct",
                                                config.model.preset)
  config.model.update(spec="", preset="")
  with pytest.raises(ConfigError, match=r"config.model: spec and preset are both empty: set "
                                        r"spec \(the weights to load\) or preset"):
    run_config.resolve(config, num_devices=PRESETS[preset])


def test_a_spec_that_names_no_weights_here_fails_naming_its_key(tmp_path):
  """What a run checks at its start (`resolve` does not: a launcher resolves configs for
  hosts whose disks it does not see): model.spec names an HF directory, a .gguf file or the
  bundled model on this host."""
  model = lambda spec: ModelSpec(spec=spec, preset="tiny")
  for spec in ("", "qwen2.5-coder-0.5b-instruct", str(tmp_path)):
    loader.check_weights(model(spec))
  (tmp_path / "weights.gguf").write_bytes(b"")
  loader.check_weights(model(str(tmp_path / "weights.gguf")))
  missing = str(tmp_path / "Qwen2.5-7B-Instruct")
  with pytest.raises(ConfigError, match=re.escape(
      f"config.model.spec: {missing!r} is not an HF checkpoint directory, a .gguf file or "
      "'qwen2.5-coder-0.5b-instruct' (no such path on this host)")):
    loader.check_weights(model(missing))
  (tmp_path / "weights.bin").write_bytes(b"")
  with pytest.raises(ConfigError, match=r"config.model.spec: .*weights.bin' is not an HF "
                                        r"checkpoint directory, a .gguf file or '[^']*'$"):
    loader.check_weights(model(str(tmp_path / "weights.bin")))


def _train(*args):
  """`python -m sage_jax.train` on one CPU device, as a user runs it."""
  return subprocess.run([sys.executable, "-m", "sage_jax.train", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                             "JAX_PLATFORMS": "cpu"})


def test_a_training_runs_directory_given_as_the_weights_names_its_export(tmp_path):
  """model.spec naming a training run's workdir or one of its checkpoint directories (each
  holds the run's config.json, not a model's) fails at the run's start in one line naming the
  run's export and the command that makes one, before anything is written or started."""
  import json  # noqa: PLC0415

  from sage_jax import run_checkpoint  # noqa: PLC0415
  from sage_jax.train.checkpoint import CheckpointConfig, Checkpointer  # noqa: PLC0415

  run = tmp_path / "run"
  run.mkdir()
  recorded = _recorded(_config("sage", "demo"))
  (run / "config.json").write_text(json.dumps(recorded, default=str))
  for stage in ("rl", "sft"):  # the copy of the run's config.json each stage's saver writes
    Checkpointer(CheckpointConfig(directory=str(run / run_checkpoint.STAGE_DIRS[stage])),
                 run_config=recorded).close()
  for given, what, stage in (
      (run, "a training run's workdir", ""),
      (run / "checkpoints", f"the rl checkpoint directory of the training run in {run}", ""),
      (run / "sft" / "checkpoints", f"the sft checkpoint directory of the training run in {run}",
       " --stage=sft")):
    with pytest.raises(ConfigError, match=re.escape(
        f"config.model.spec: {str(given)!r} is {what}, not model weights: pass the run's HF "
        f"export ({run}/hf), or export a checkpoint with `python -m sage_jax.export "
        f"--workdir={run}{stage} --out=DIR`")):
      loader.check_weights(ModelSpec(spec=str(given)))
  out = _train("--config=configs/sage.py:qwen2.5-coder-0.5b", f"--config.model.spec={run}",
               f"--workdir={tmp_path / 'new'}")
  assert out.returncode != 0
  assert (f"ConfigError: config.model.spec: {str(run)!r} is a training run's workdir, not model "
          "weights") in out.stderr, out.stderr[-3000:]
  assert "Traceback" not in out.stderr and not (tmp_path / "new").exists()


@pytest.mark.parametrize("found", ["a file", "a model no export wrote"])
def test_a_workdir_whose_export_directory_holds_something_else_fails_at_the_start(
    tmp_path, found):
  """<workdir>/hf, which the run's export replaces when the run ends, holding a file or a
  directory that is no export fails the run at its start in one line, before config.json
  records the run, not at its end after every stage has trained. (Here a run with no stage
  and no evaluation, which would otherwise go straight to its export.)"""
  workdir = tmp_path / "run"
  hf = workdir / "hf"
  if found == "a file":
    workdir.mkdir()
    hf.write_text("notes")
    problem = f"{hf} is a file, not a directory an export can replace"
  else:
    hf.mkdir(parents=True)
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    problem = f"{hf} is not empty and is not a previous export (it has no sage_jax_export.json)"
  out = _train("--config=configs/sage.py:demo", f"--workdir={workdir}",
               "--config.pipeline.stages=()", "--config.pipeline.eval_before=false",
               "--config.pipeline.eval_after=false", "--config.pipeline.eval_train=false",
               "--config.pipeline.plot=false", "--config.model.vocabulary=full")
  assert out.returncode != 0
  assert (f"WorkdirError: {problem}; the run exports its model there when it ends "
          "(config.pipeline.export): move it away, or set --config.pipeline.export=false"
          ) in out.stderr, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  assert sorted(set(os.listdir(workdir)) - {storage.LOCK_FILE}) == ["hf"]


def test_unknown_preset_names_the_known_ones():
  with pytest.raises(ValueError, match="unknown preset 'big'; known: demo"):
    _config("sage", "big")


def _with(overrides, devices=1):
  config = _config("sage", "demo")
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  return run_config.resolve(config, num_devices=devices, local_devices=devices)


@pytest.mark.parametrize("overrides,devices,message", [
    ({"rollout.group_sise": 4}, 1, r"config.rollout.group_sise: unknown key"),
    ({"grpo.group_size": "4"}, 1, r"config.grpo.group_size: expected int, got str '4'"),
    ({"reward.variant": "skill"}, 1, r"config.reward: variant='skill'; expected one of"),
    ({"engine.prefill_buckets": [64, "x"]}, 1, r"config.engine.prefill_buckets\[1\]"),
    ({"model.remat": "all"}, 1, r"config.model: remat='all'; expected 'none', 'full' or 'dots'"),
    ({"model.attention_block": -8}, 1, r"config.model: attention_block=-8; expected 0"),
    ({"grpo.group_size": 1}, 1, r"config.grpo.group_size: 1 leaves no group"),
    ({"grpo.group_size": 1, "grpo.advantage_estimator": "drgrpo"}, 1,
     r"config.grpo.group_size: 1 leaves no group.*'drgrpo' advantage is 0"),
    ({"grpo.chain_length": 4}, 1, r"config.grpo.chain_length: 4 exceeds the 3 tasks"),
    ({"grpo.chain_length": 2, "grpo.single_task": True}, 1,
     r"config.grpo.chain_length: 2 with grpo.single_task=True, whose rollouts are single"),
    ({"model.dtype": "bf16"}, 1, r"config.model: dtype='bf16': unknown dtype 'bf16'; expected "
                                 r"one of \['bfloat16', 'float16', 'float32'\]"),
    ({"model.param_dtype": "fp32"}, 1, r"config.model: param_dtype='fp32': unknown dtype"),
    ({"pipeline.stages": ("rl", "sft")}, 1, r"config.pipeline: stages=\('rl', 'sft'\): each "
                                            r"of \('sft', 'rl'\) at most once, in that order"),
    ({"pipeline.chains_per_step": 3, "grpo.group_size": 2, "mesh.data": 4, "mesh.fsdp": 1}, 4,
     r"config.pipeline.chains_per_step: 3 chains x grpo.group_size 2 = 6 rollouts per step, not "
     r"divisible by the mesh's data axis \(4\)"),
    ({"mesh.tensor": 3}, 8, r"config.mesh: .*8 devices are not divisible by 3"),
    ({"engine.num_slots": 12}, 8, r"config.engine.num_slots: 12 slots do not split"),
    ({"sampler_mesh.tensor": 3}, 8, r"config.sampler_mesh.tensor: 3 does not divide the 8 "
                                    r"devices of a host"),
    ({"sampler_mesh.param_dtype": "fp8"}, 1, r"config.sampler_mesh: .*param_dtype='fp8'"),
    ({"sampler_mesh.merge_lora": "sometimes"}, 1, r"config.sampler_mesh: "
     r"merge_lora='sometimes'; expected one of \('auto', 'always', 'never'\)"),
    ({"sampler_mesh.fuse_projections": "yes"}, 1, r"config.sampler_mesh: "
     r"fuse_projections='yes'; expected one of \('auto', 'always', 'never'\)"),
    ({"sampler_mesh.merge_lora": "always"}, 1, r"config.sampler_mesh.merge_lora: 'always' with "
     r"model.lora_rank=0, which adds no adapters to merge"),
    ({"agent.temperature": 0.0}, 1, r"config.agent.temperature: 0.0 samples greedily; RL"),
    ({"retrieval.strategy": "skill_embedding", "retrieval.embedding_model": "policy"}, 1,
     r"config.retrieval.embedding_model: 'policy' embeds with the policy model, and the expert "
     r"plays that make the SFT data retrieve skills with it, but a 'compact' vocabulary"),
    ({"expert.splits": ("dev",)}, 1, r"config.expert.splits: \('dev',\) with "
     r"pipeline.train_scenarios=3, which keeps for SFT only the first 3 scenarios of "
     r"pipeline.train_split 'train': leave expert.splits unset"),
    ({"expert.splits": ("train", "dev")}, 1, r"config.expert.splits: \('train', 'dev'\)"),
    # the combinations that failed only at the first episode, update or evaluation
    ({"agent.max_episode_tokens": 4096}, 1, r"config.agent.max_episode_tokens: 4096 is more "
                                            r"than engine.max_len 2048"),
    ({"batch.length_buckets": (512, 1024)}, 1, r"config.batch.length_buckets: the largest, "
                                               r"1024, holds fewer positions than an episode"),
    ({"pool.keep_outputs": False}, 1, r"config.pool.keep_outputs: False removes"),
    ({"eval.policy": "scripted"}, 1, r"config.eval.policy: 'scripted'; a training run"),
    ({"checkpoint.read_only": True}, 1, r"config.checkpoint.read_only: True writes no"),
    ({"agent.top_p": 0.0}, 1, r"config.agent: top_p=0.0 must be in \(0, 1\]"),
    ({"agent.top_k": 1000}, 1, r"config.agent.top_k: 1000 is more than engine.max_top_k 64"),
    ({"agent.stop_strings": ("",)}, 1, r"config.agent: stop_strings holds an empty string"),
    ({"eval.temperature": -1.0}, 1, r"config.eval: temperature=-1.0 must be >= 0"),
    ({"optimizer.b1": 2.0}, 1, r"config.optimizer: b1=2.0 and b2=0.999 must be in \[0, 1\)"),
    ({"grpo.single_task": True, "grpo.chain_length": 1}, 1,
     r"config.agent.use_library: True with grpo.single_task=True, whose rollouts keep no "),
    ({"pool.max_interactions": 1}, 1, r"config.pool.max_interactions: 1 is fewer than the 2 "
     r"executions an episode may make \(agent.max_steps 1 and the library's install\)"),
    ({"pool.max_interactions": 3, "agent.max_steps": 4, "agent.use_library": False}, 1,
     r"config.pool.max_interactions: 3 is fewer than the 4 executions .*max_steps 4\); "),
    ({"pipeline.train_split": "dev", "expert.splits": ()}, 1, r"config.eval.split: 'dev' is a "
     r"split the run trains on \(expert.splits and pipeline.train_split\): its evaluations"),
    ({"expert.splits": ("train", "dev"), "pipeline.train_scenarios": 0}, 1,
     r"config.eval.split: 'dev' is a split the run trains on \(expert.splits\)"),
    ({"checkpoint.best_metric": "dev/TGC"}, 1, r"config.checkpoint.best_metric: 'dev/TGC' is "
     r"not a number the dev evaluation reports.*one of num_tasks, num_scenarios, tgc, sgc"),
    ({"checkpoint.best_metric": "tgc"}, 1, r"config.checkpoint.best_metric: 'tgc' is not"),
    ({"metrics.jsonl": False}, 1, r"config.pipeline.plot: True draws the curves from "),
    ({"model.remat_layers": (1,)}, 1, r"config.model: remat_layers=\(1,\) with remat='none' "
     r"remats no layer"),
    ({"agent.use_library": False}, 1, r"config.reward.variant: 'sage' pays for the library "
     r"skills .*agent.use_library=False keeps no library"),
])
def test_bad_configs_name_the_key(overrides, devices, message):
  with pytest.raises(ConfigError, match=message):
    _with(overrides, devices)


def test_policy_embeddings_retrieve_for_the_expert_when_the_model_exists_first():
  """Skills retrieved by the policy's embeddings resolve where the model exists before the SFT
  data is made (the full vocabulary) or the data is given (a compact vocabulary is cut to it)."""
  policy = {"retrieval.strategy": "skill_embedding", "retrieval.embedding_model": "policy"}
  assert _with({**policy, "model.vocabulary": "full"}).retrieval.embedding_model == "policy"
  _with({**policy, "pipeline.expert_trajectories": "expert.jsonl"})
  _with({**policy, "retrieval.embedding_model": "hashing"})
  trained = _config("sage", "demo")  # a compact vocabulary the run made: `evaluate --run`
  trained.retrieval.update(strategy="skill_embedding", embedding_model="policy")
  assert run_config.resolve(trained, trained=True).retrieval.embedding_model == "policy"


def test_the_expert_plays_the_training_scenarios_unless_its_splits_are_named():
  """expert.splits unset: the expert plays the scenarios RL trains on. Splits named there are
  played whole: the train split (the demo's), or others for SFT on other tasks than RL's,
  with RL on every scenario, or unused with SFT data given; a `train_scenarios` cut refuses
  other splits (test_bad_configs_name_the_key)."""
  assert ExpertConfig().splits == () and _with({}).expert.splits == ("train",)
  elsewhere = {"eval.split": "test"}  # the demo evaluates on dev
  _with({**elsewhere, "pipeline.train_split": "dev", "expert.splits": ()})
  _with({**elsewhere, "pipeline.train_split": "dev", "expert.splits": ("dev",)})
  _with({**elsewhere, "expert.splits": ("dev",), "pipeline.train_scenarios": 0})
  _with({"expert.splits": ("dev",), "pipeline.expert_trajectories": "expert.jsonl"})


def test_the_trainer_trains_the_policy_the_rollouts_sample():
  assert _with({}).grpo.temperature == 0.8  # the demo's agent.temperature
  assert _with({"agent.temperature": 1.0}).grpo.temperature == 1.0
  sft_only = _with({"agent.temperature": 0.0, "pipeline.stages": ("sft",)})
  assert sft_only.grpo.temperature == 1.0  # no RL: nothing samples for the trainer


def test_unknown_section_and_seed_type():
  config = _config("sage", "demo").to_dict()
  with pytest.raises(ConfigError, match=r"config.rollouts: unknown section"):
    run_config.resolve({**config, "rollouts": {"group_size": 2}})
  with pytest.raises(ConfigError, match=r"config.seed: expected int, got 1.5"):
    run_config.resolve({**config, "seed": 1.5})


def test_the_schema_defaults_resolve():
  """The defaults agree with each other (the agent's episodes fit the engine's cache)."""
  run = run_config.resolve(run_config.defaults())
  assert run.agent.max_episode_tokens <= run.engine.max_len


def test_the_grpo_knobs_are_in_the_grpo_section():
  """G, K, single-task rollouts, the advantage estimator, the loss type and KL: one section;
  set anywhere else, or wrong, the error names the key in config.grpo."""
  config = run_config.defaults()
  assert "advantage" not in config and not {"group_size", "chain_length"} & set(config.rollout)
  assert {"group_size", "chain_length", "single_task", "advantage_estimator", "advantage_std",
          "advantage_epsilon", "loss_aggregation", "ratio_level", "kl_coef",
          "kl_estimator"} <= set(config.grpo)
  run = _with({"grpo.group_size": 4, "grpo.chain_length": 3, "grpo.advantage_epsilon": 0.1})
  assert (run.rollout.group_size, run.rollout.chain_length, run.advantage.epsilon) == (4, 3, 0.1)
  assert not hasattr(run.grpo, "group_size")
  for overrides, message in (
      ({"rollout.group_size": 4}, "config.rollout.group_size: a GRPO knob; set "
                                  "config.grpo.group_size"),
      ({"grpo.advantage_estimator": "ppo"}, "config.grpo.advantage_estimator: 'ppo'; expected "
                                            "one of"),
      ({"grpo.advantage_epsilon": -1.0}, "config.grpo.advantage_epsilon must be >= 0"),
      ({"grpo.chain_length": 0}, "config.grpo.chain_length must be >= 1, got 0"),
      ({"grpo.single_task": "yes"}, "config.grpo.single_task: expected bool")):
    with pytest.raises(ConfigError) as e:
      _with(overrides)
    assert str(e.value).startswith(message), str(e.value)
  with pytest.raises(ConfigError, match=r"config.advantage: its keys are GRPO knobs in "
                                        r"config.grpo \(advantage_estimator"):
    run_config.resolve({**_config("sage", "demo").to_dict(), "advantage": {"estimator": "rloo"}})


def test_new_method_knobs_resolve_and_are_validated():
  run = _with({"model.vocabulary": "full", "expert.source": "self",
               "expert.temperatures": [0.2, 0.8],
               "expert.selection": "task", "grpo.advantage_estimator": "rloo",
               "grpo.ratio_level": "sequence",
               "grpo.kl_clamp": 10.0, "reward.truncated_turns": "outcome"})
  assert run.expert.temperatures == (0.2, 0.8) and run.grpo.ratio_level == "sequence"
  assert run.advantage.estimator == "rloo" and run.reward.truncated_turns == "outcome"
  assert _with({"grpo.advantage_std": "unbiased"}).advantage.std == "unbiased"
  # GRPO's std settings with an estimator that does not divide by the std do nothing.
  for estimator in ("rloo", "drgrpo"):
    for key, value in (("grpo.advantage_std", "unbiased"), ("grpo.advantage_epsilon", 0.1)):
      with pytest.raises(ConfigError, match=rf"config.grpo.advantage_std: .* GRPO's division "
                                            rf"by the group's std .* which '{estimator}' does"):
        _with({"grpo.advantage_estimator": estimator, key: value})
  with pytest.raises(ValueError, match="source"):
    _with({"expert.source": "teacher"})
  with pytest.raises(ConfigError, match="config.model.vocabulary: 'compact' is cut to the SFT"):
    _with({"expert.source": "self"})
  with pytest.raises(ValueError, match="rloo"):
    _with({"grpo.advantage_estimator": "rloo", "grpo.group_size": 1})


def test_group_size_one_is_fine_without_rl():
  # Every estimator centres a reward on its group's: alone in its group, it is 0.
  assert _with({"grpo.group_size": 1, "pipeline.stages": ["sft"]}).rollout.group_size == 1


def test_remat_and_attention_block_reach_the_model():
  model = build_model(ModelSpec(preset="tiny", remat="dots", remat_layers=(1,),
                                attention_block=512))
  assert (model.config.remat, model.config.remat_layers) == ("dots", (1,))
  assert model.config.attention_block == 512
  for preset in ("qwen2.5-coder-0.5b", "qwen2.5-7b", "qwen2.5-32b"):
    spec = run_config.resolve(_config("sage", preset)).model
    assert (spec.remat, spec.attention_block) == ("full", 1024)
  # The layers to remat are checked against the model's (tiny: 2), not silently ignored.
  with pytest.raises(ValueError, match=r"remat_layers=\(1, 2\): layers \[2\] are not among "
                                       r"the model's 2 \(0-1\)"):
    build_model(ModelSpec(preset="tiny", remat="full", remat_layers=(1, 2)))


def test_component_seeds_derive_from_the_run_seed():
  def seeds(seed, **sections):
    config = _config("sage", "demo")
    config.seed = seed
    for name, value in sections.items():
      config[name].seed = value
    run = run_config.resolve(config)
    return {name: getattr(run, name).seed for name in run_config.SEEDED_SECTIONS}

  zero, one = seeds(0), seeds(1)
  assert set(zero) >= {"model", "rollout", "rl", "sft", "trainer", "eval"}
  assert zero == seeds(0)  # reproducible
  assert all(zero[k] != one[k] for k in zero)  # every component moves with the run seed
  assert len(set(zero.values())) == len(zero)  # and no two components share a stream
  assert seeds(1, rollout=7) == {**one, "rollout": 7}  # a component seed set on its own stays


@pytest.mark.parametrize("override, named", [
    ("--config.rollotu.group_size=4", "the config has no section 'rollotu' "
                                      "(Did you mean \"rollout\" instead of \"rollotu\"?)"),
    ("--config.grpo.group_sise=4", "config section 'grpo' has no key 'group_sise' "
                                   "(Did you mean \"group_size\" instead of \"group_sise\"?)"),
    ("--config.rollout.nothing_like_it=4", "config section 'rollout' has no key 'nothing_like_it'"),
    ("--config.sft.temperature=0.5", "config section 'sft' has no key 'temperature' (the config "
                                     "has config.agent.temperature, config.eval.temperature, "
                                     "config.grpo.temperature)"),
    ("--config.nope=4", "the config has no key 'nope'")])
def test_unknown_override_exits_with_one_line_naming_it(override, named, tmp_path):
  # The pipeline's own entry point (sage_jax.train delegates to it).
  done = subprocess.run([sys.executable, "-m", "sage_jax.pipeline",
                         "--config=configs/sage.py:demo", f"--workdir={tmp_path}", override], capture_output=True, text=True,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        timeout=120)
  assert done.returncode != 0
  assert done.stderr.strip() == f"{override}: {named}."


def test_a_tuple_key_given_twice_as_whole_tuples_exits_with_one_line(tmp_path):
  """ml_collections would join them: (512, 1024) then (256,) set (512, 1024, 256)."""
  done = subprocess.run([sys.executable, "-m", "sage_jax.train", "--config=configs/sage.py:demo",
                         f"--workdir={tmp_path / 'run'}",
                         "--config.batch.length_buckets=(512, 1024)",
                         "--config.batch.length_buckets=(256,)"],
                        capture_output=True, text=True, timeout=120,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert done.stderr.strip() == (
      "--config.batch.length_buckets is given 2 times ((512, 1024), (256,)), which would set "
      "(512, 1024, 256): ml_collections joins repeated tuple overrides. Give the whole tuple "
      "once.")
  assert not (tmp_path / "run").exists()


def test_value_the_schema_refuses_exits_with_its_message(tmp_path):
  done = subprocess.run([sys.executable, "-m", "sage_jax.train", "--config=configs/sage.py:demo",
                         f"--workdir={tmp_path}", "--config.grpo.group_size=0"],
                        capture_output=True, text=True, timeout=120,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert done.returncode != 0 and "Traceback" not in done.stderr
  assert done.stderr.strip().splitlines()[-1] == (
      "ConfigError: config.grpo.group_size must be >= 1, got 0")


def test_a_given_sft_file_that_does_not_parse_stops_the_run_naming_its_key(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": "x", "messages": [}\n')
  done = subprocess.run([sys.executable, "-m", "sage_jax.train", "--config=configs/sage.py:demo",
                         f"--workdir={tmp_path / 'run'}",
                         f"--config.pipeline.expert_trajectories={bad}",
                         "--config.engine.num_slots=8"],  # over the session's 8 devices
                        capture_output=True, text=True, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert done.stderr.strip().splitlines()[-1].startswith(
      f"ConfigError: config.pipeline.expert_trajectories: {bad}:1: not JSON")


def test_tuple_and_unset_keys_can_be_overridden_on_the_command_line(tmp_path):
  """Sequence-valued keys (stages, length and prefill buckets, splits) stay tuples, the type
  ml_collections overrides from flags; a bad value still fails naming its key. Keys unset by
  default (component seeds, optional GRPO clamps, AppWorld paths) are typed placeholders,
  which flags can set too (a plain None cannot be overridden)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  base = [sys.executable, "-m", "sage_jax.tools.memory_plan", "--config=configs/sage.py:demo",
          "--hosts=1", "--devices_per_host=1"]
  done = subprocess.run(base + ["--config.pipeline.stages=('rl',)",
                                "--config.batch.length_buckets=(256, 512, 4096)",
                                "--config.engine.prefill_buckets=(32, 128)",
                                "--config.expert.splits=('train', 'dev')",
                                "--config.pipeline.train_scenarios=0",
                                "--config.rollout.seed=7", "--config.grpo.dual_clip_c=3",
                                "--config.pool.outputs_root=/tmp/outputs"],
                        capture_output=True, text=True, cwd=repo, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  config = _config("sage", "demo")
  config.pipeline.stages = ("rl",)
  config.batch.length_buckets = (256, 512, 4096)
  run = run_config.resolve(config)
  assert run.pipeline.stages == ("rl",) and run.batch.length_buckets == (256, 512, 4096)
  assert run.grpo.dual_clip_c is None and run.pool.outputs_root is None
  assert run.rollout.seed == run_config.component_seed(0, "rollout")
  config.grpo.dual_clip_c, config.rollout.seed = 3, 7  # a float key takes an int
  run = run_config.resolve(config)
  assert run.grpo.dual_clip_c == 3.0 and run.rollout.seed == 7
  config.pipeline.stages = ("rl", "eval")
  with pytest.raises(ConfigError, match="stages"):
    run_config.resolve(config)



def _recorded(config):
  return run_config.with_seeds(config, run_config.resolve(config))


def test_a_run_recorded_with_a_retired_key_still_resolves(tmp_path):
  """A run of an earlier version recorded keys this one has not (expert.use_library, now
  agent.use_library): its export and evaluation read its config.json without them."""
  import json  # noqa: PLC0415

  from sage_jax import run_checkpoint  # noqa: PLC0415
  recorded = _recorded(_config("sage", "demo"))
  recorded["expert"]["use_library"] = True
  (tmp_path / "config.json").write_text(json.dumps(recorded))
  with pytest.raises(ConfigError, match=r"config.expert.use_library: unknown key"):
    run_config.resolve(ml_collections.ConfigDict(recorded))
  run = run_config.resolve(run_checkpoint.read_config(str(tmp_path)))
  assert run.agent.use_library and run.expert == run_config.resolve(
      _config("sage", "demo")).expert


def test_a_rerun_may_change_how_the_run_goes_not_its_experiment(tmp_path):
  """The workdir's config.json records the experiment its checkpoints belong to: a rerun may
  run it longer, lay it out, evaluate and checkpoint it otherwise, not change what it trains."""
  recorded = _recorded(_config("sage", "demo"))
  longer = _config("sage", "demo")
  longer.rl.total_steps += 10
  longer.engine.num_slots = 4
  longer.pipeline.eval_after = False
  longer.checkpoint.keep_last = 7
  run_config.check_resume(recorded, _recorded(longer), "run/config.json")
  other = _config("sage", "demo")
  other.optimizer.learning_rate = 1e-6
  other.seed = 5
  with pytest.raises(ConfigError, match=r"run/config.json records the run this workdir holds, "
                     r"and this config changes \d+ of its settings \(.*config.optimizer."
                     r"learning_rate: 0.0002 -> 1e-06.*config.seed: 0 -> 5.*move that "
                     r"config.json aside"):
    run_config.check_resume(recorded, _recorded(other), "run/config.json")
  # What the file holds after a JSON round trip (tuples as lists) is the same config.
  import json  # noqa: PLC0415
  run_config.check_resume(json.loads(json.dumps(recorded)), recorded, "run/config.json")
  # A key the record lacks (written by a version without it) is not compared.
  older = json.loads(json.dumps(recorded))
  del older["grpo"]["ratio_level"]
  run_config.check_resume(older, recorded, "run/config.json")
  # The expert's splits unset (its plays are the training scenarios) resume a workdir whose
  # expert named the train split: the SFT examples made once there are the same.
  unset = json.loads(json.dumps(recorded))
  unset["expert"]["splits"] = []
  run_config.check_resume(recorded, unset, "run/config.json")
  run_config.check_resume(unset, recorded, "run/config.json")
  unset["expert"]["splits"] = ["dev"]
  with pytest.raises(ConfigError, match=r"config.expert.splits"):
    run_config.check_resume(recorded, unset, "run/config.json")
  # Each of these changes what the run trains on, sees or samples with (the tasks the expert
  # plays, the agent's prompt and the skills retrieval shows, also in the SFT data made once
  # per workdir).
  for key, value in (("pipeline.data", "/data/appworld"), ("pipeline.stages", ("rl",)),
                     ("pipeline.train_scenarios", 5),
                     ("engine.max_len", 4096), ("pool.max_output_chars", 100),
                     ("sampler_mesh.param_dtype", "bfloat16"), ("trainer.seed", 3),
                     ("agent.max_observation_chars", 100), ("agent.use_library", False),
                     ("retrieval.strategy", "query_ngram")):
    changed = _config("sage", "demo")
    section, field = key.split(".")
    changed[section][field] = value
    if key == "agent.use_library":  # SAGE's reward needs the library
      changed.reward.variant = "outcome"
    with pytest.raises(ConfigError, match=rf"config.{key}: "):
      run_config.check_resume(recorded, _recorded(changed), "run/config.json")
  changed = _config("sage", "demo")
  changed.pipeline.train_split = "test"
  changed.expert.splits = ("test",)  # the demo names its train split
  with pytest.raises(ConfigError, match=r"config.pipeline.train_split: "):
    run_config.check_resume(recorded, _recorded(changed), "run/config.json")
  # RL added after an SFT-only run.
  sft_only = _config("sage", "demo")
  sft_only.pipeline.stages = ("sft",)
  run_config.check_resume(_recorded(sft_only), recorded, "run/config.json")


def test_a_config_json_of_no_run_is_named_for_what_it_looks_like():
  run_config.check_recorded(_recorded(_config("sage", "demo")), "w/config.json")
  for found, looks in (({"model_type": "qwen2"}, "an HF model config (model_type 'qwen2')"),
                       ({"seed": 0}, "some other file (no `pipeline` section)"),
                       ([1, 2], "some other file (no `pipeline` section)")):
    with pytest.raises(ConfigError, match=re.escape(
        f"w/config.json is not a training run's config: it looks like {looks}")):
      run_config.check_recorded(found, "w/config.json")


def test_train_refuses_to_resume_a_workdir_under_another_experiment(tmp_path):
  import json  # noqa: PLC0415
  config = _config("sage", "demo")
  config.grpo.group_size = 8
  workdir = tmp_path / "run"
  (workdir / "eval_before").mkdir(parents=True)
  (workdir / "eval_before" / "eval_dev.json").write_text("{}")  # the run has a result
  text = json.dumps(_recorded(config), default=str)
  (workdir / "config.json").write_text(text)
  out = _train("--config=configs/sage.py:demo", f"--workdir={workdir}")
  assert out.returncode != 0
  assert "config.grpo.group_size: 8 -> 4" in out.stderr, out.stderr[-3000:]
  assert (workdir / "config.json").read_text() == text  # the record stays
  # Not resuming is no way around it: a new run would mix with the one the workdir holds.
  fresh = _train("--config=configs/sage.py:demo", f"--workdir={workdir}",
                 "--config.checkpoint.resume=false")
  assert fresh.returncode != 0
  assert (f"--workdir {workdir} holds a run ({workdir}/config.json; eval_before/eval_dev.json),"
          " and checkpoint.resume=False starts a new one") in fresh.stderr, fresh.stderr[-3000:]
  assert (workdir / "config.json").read_text() == text
