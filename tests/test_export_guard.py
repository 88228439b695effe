"""Exports replace only a directory that is missing, empty or a previous export, never one that
is or contains the run's workdir or the source model: replacing deletes what is there."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from sage_jax import export, run_checkpoint, run_config, storage
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.model import lora
from sage_jax.train import state as state_lib
from sage_jax.train.checkpoint import CheckpointConfig, Checkpointer
from sage_jax.weights import gguf_import, hf, loader
from sage_jax.weights.peft_adapter import save_peft_adapter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from configs import sage as sage_configs  # noqa: E402


@pytest.fixture(scope="module")
def model():
  return loader.build_model(loader.ModelSpec(preset="tiny"))


def _foreign(directory):
  """A directory holding files no export wrote (a run's checkpoints)."""
  (directory / "checkpoints").mkdir(parents=True)
  (directory / "checkpoints" / "precious").write_text("step 100")
  return directory / "checkpoints" / "precious"


def test_save_hf_refuses_a_directory_it_did_not_write(model, tmp_path):
  precious = _foreign(tmp_path / "out")
  with pytest.raises(hf.ExportError, match=r"out is not empty and is not a previous export"):
    hf.save_hf(model, str(tmp_path / "out"))
  assert precious.read_text() == "step 100"
  assert os.listdir(tmp_path) == ["out"]  # nothing written beside it either


def _adapted():
  return lora.add_adapters(loader.build_model(loader.ModelSpec(preset="tiny")),
                           lora.LoraConfig(rank=2, alpha=4.0))


def test_an_export_replaces_no_directory_beside_its_own(tmp_path):
  """`<out>.tmp` is a name a user may have chosen: the export writes elsewhere."""
  adapted = _adapted()
  for save, out in ((hf.save_hf, "out"), (save_peft_adapter, "adapter")):
    precious = _foreign(tmp_path / f"{out}.tmp")
    save(adapted, str(tmp_path / out))
    assert precious.read_text() == "step 100"
    assert (tmp_path / out / hf.EXPORT_MARKER).exists()
  assert sorted(os.listdir(tmp_path)) == ["adapter", "adapter.tmp", "out", "out.tmp"]


def test_a_killed_exports_directory_is_removed_by_the_next_and_a_link_is_followed(
    model, tmp_path):
  """A killed export leaves its directory (`<out>.tmp-<pid>-<hex>`): the next export to the
  same target removes it once its process is gone. A target that is a link to a previous
  export is replaced where the link points, the link kept."""
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  abandoned = tmp_path / f"out.tmp-{dead}-0123abcd"
  (abandoned / "partial").mkdir(parents=True)
  running = tmp_path / f"out.tmp-{os.getpid()}-89abcdef"  # an export still under way
  running.mkdir()
  hf.save_hf(model, str(tmp_path / "out"))
  assert sorted(os.listdir(tmp_path)) == ["out", running.name]
  os.rename(tmp_path / "out", tmp_path / "real")
  os.symlink(tmp_path / "real", tmp_path / "out")
  hf.save_hf(model, str(tmp_path / "out"))
  assert os.path.islink(tmp_path / "out") and (tmp_path / "real" / hf.EXPORT_MARKER).exists()


def test_an_export_interrupted_while_writing_the_adapters_leaves_the_previous_one(
    tmp_path, monkeypatch):
  """The merged weights, the PEFT adapters and the model card are all written before the
  directory takes the place of the previous export."""
  from sage_jax.weights import peft_adapter  # noqa: PLC0415

  adapted = _adapted()
  tok = tokenizer_lib.ensure_qwen25_tokenizer_dir()
  out = tmp_path / "hf"
  export.write_model(adapted, str(out), tok, text_files={"README.md": "first"})
  before = {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}
  assert (out / export.ADAPTER_DIR / "adapter_model.safetensors").exists()

  def disk_full(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(peft_adapter, "save_file", disk_full)
  with pytest.raises(OSError, match="disk full"):
    export.write_model(adapted, str(out), tok, text_files={"README.md": "second"})
  assert {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)} == before
  assert (out / "README.md").read_text() == "first"
  assert os.listdir(tmp_path) == ["hf"]  # the unfinished one is removed


def test_save_hf_replaces_an_empty_directory_and_its_previous_export(model, tmp_path):
  (tmp_path / "out").mkdir()
  hf.save_hf(model, str(tmp_path / "out"), max_shard_bytes=100_000)
  assert (tmp_path / "out" / hf.EXPORT_MARKER).exists()
  files = hf.save_hf(model, str(tmp_path / "out"))
  assert sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")) == files


def test_peft_adapter_export_refuses_a_directory_it_did_not_write(tmp_path):
  adapted = _adapted()
  precious = _foreign(tmp_path / "adapter")
  with pytest.raises(hf.ExportError, match="adapter is not empty"):
    save_peft_adapter(adapted, str(tmp_path / "adapter"))
  assert precious.exists()
  save_peft_adapter(adapted, str(tmp_path / "fresh"))
  save_peft_adapter(adapted, str(tmp_path / "fresh"))  # its own previous export
  assert (tmp_path / "fresh" / "adapter_model.safetensors").exists()


def test_gguf_conversion_refuses_the_directory_of_its_gguf(tmp_path):
  gguf_path = tmp_path / "models" / "qwen.gguf"
  gguf_path.parent.mkdir()
  gguf_path.write_bytes(b"GGUF")
  (gguf_path.parent / hf.EXPORT_MARKER).write_text("{}")  # even inside a previous export
  with pytest.raises(hf.ExportError, match=f"would delete {gguf_path}"):
    gguf_import.export_hf(gguf_path, gguf_path.parent)
  precious = _foreign(tmp_path / "other")
  with pytest.raises(hf.ExportError, match="other is not empty"):
    gguf_import.export_hf(gguf_path, tmp_path / "other")
  assert gguf_path.read_bytes() == b"GGUF" and precious.exists()


def _run_dir(tmp_path, spec=""):
  """A run's workdir as far as the export reads it before restoring a checkpoint."""
  workdir = tmp_path / "runs" / "x"
  precious = _foreign(workdir)
  (workdir / "config.json").write_text(json.dumps({"model": {"spec": spec}, "pipeline": {}}))
  (workdir / hf.EXPORT_MARKER).write_text("{}")  # the workdir is refused even so
  return workdir, precious


@pytest.mark.parametrize("target", ["workdir", "its parent"])
def test_run_export_refuses_the_workdir_and_what_contains_it(tmp_path, target):
  workdir, precious = _run_dir(tmp_path)
  out = workdir if target == "workdir" else workdir.parent
  with pytest.raises(hf.ExportError, match=f"would delete {workdir}"):
    export.export(str(workdir), str(out))
  assert precious.exists()


def test_run_export_refuses_the_source_model(tmp_path, model):
  hf.save_hf(model, str(tmp_path / "base"))  # a previous export, now the run's base model
  workdir, _ = _run_dir(tmp_path, spec=str(tmp_path / "base"))
  with pytest.raises(hf.ExportError, match=f"would delete {tmp_path / 'base'}"):
    export.export(str(workdir), str(tmp_path / "base"))
  assert (tmp_path / "base" / "config.json").exists()


def _cli(module, *args):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_export_cli_refuses_the_workdir(tmp_path):
  workdir, precious = _run_dir(tmp_path)
  result = _cli("sage_jax.export", f"--workdir={workdir}", f"--out={workdir}",
                "--dtype=bfloat16")
  assert result.returncode != 0
  assert f"{workdir}: exporting there would delete {workdir}" in result.stderr
  assert "Traceback" not in result.stderr  # one line, not a traceback
  assert precious.exists()


def _tiny_run(workdir, checkpoints):
  """A training run's workdir as the pipeline leaves it: its config.json and, for each stage
  of `checkpoints` (stage -> steps), that stage's checkpoint directory, with the copy of
  config.json the run's checkpointer writes, holding those steps of a tiny model."""
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  config = sage_configs.get_config("demo")
  config.model.update(preset="tiny", vocabulary="full")
  run = run_config.resolve(config)
  recorded = run_config.with_seeds(config, run)
  workdir.mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps(recorded, default=str))
  state = state_lib.create_train_state(nnx.state(loader.build_model(run.model)),
                                       optax.sgd(0.1), seed=0)
  for stage, steps in checkpoints.items():
    saver = Checkpointer(CheckpointConfig(
        directory=str(workdir / run_checkpoint.STAGE_DIRS[stage]), async_save=False),
        run_config=recorded)
    for step in steps:
      saver.save(step, state)
    saver.close()
  return workdir


def test_an_export_replaces_only_an_export_of_the_same_checkpoint(model, tmp_path):
  """A run's export records the run, stage and step it is of: exporting another run's or
  another checkpoint over it (run B's SFT over run A's final model) is refused in one line
  naming both, before the restore, unless --overwrite; an export that records none (by an
  earlier version, or not of a run) counts as another. The same checkpoint is exported again
  over its own export."""
  a = _tiny_run(tmp_path / "a", {"rl": [1, 2]})
  b = _tiny_run(tmp_path / "b", {"sft": [1]})
  out = a / "hf"
  export.export(str(a), str(out))
  of_a = {"run": str(a), "stage": "rl", "step": 2}
  assert json.load(open(out / hf.EXPORT_MARKER))["of"] == of_a
  export.export(str(a), str(out))  # the same checkpoint again
  with pytest.raises(hf.ExportError, match=rf"holds the export of run {a}, rl step 2, and this "
                                           rf"one is of run {a}, rl step 1"):
    export.export(str(a), str(out), step=1)
  files = {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}
  refused = _cli("sage_jax.export", f"--workdir={b}", "--stage=sft", f"--out={out}")
  assert refused.returncode != 0
  assert (f"{out} holds the export of run {a}, rl step 2, and this one is of run {b}, sft step "
          "1: exporting there would replace it; choose another --out, or pass --overwrite to "
          "replace it") in refused.stderr, refused.stderr[-2000:]
  assert "Traceback" not in refused.stderr
  assert {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)} == files
  replaced = _cli("sage_jax.export", f"--workdir={b}", "--stage=sft", f"--out={out}",
                  "--overwrite")
  assert replaced.returncode == 0, replaced.stderr[-2000:]
  assert json.load(open(out / hf.EXPORT_MARKER))["of"] == {"run": str(b), "stage": "sft",
                                                           "step": 1}
  hf.save_hf(model, str(tmp_path / "unrecorded"))
  with pytest.raises(hf.ExportError, match=r"unrecorded holds the export of no recorded run"):
    export.export(str(a), str(tmp_path / "unrecorded"))


def test_a_model_export_or_checkpoint_directory_given_as_the_run_is_named(model, tmp_path):
  """`export --workdir` and `evaluate --run` given a run's HF export (a model: its config.json
  is no run's) or one of the run's checkpoint directories (which hold a copy of the run's
  config.json) say what it is, and which workdir to pass, in one line; so does `generate
  --model` given a checkpoint directory (it samples a run's workdir or a model)."""
  run = _tiny_run(tmp_path / "run", {"rl": [1], "sft": [1]})
  hf.save_hf(model, str(run / "hf"))
  model_export = (f"{run / 'hf'} is a model export, not a training run's workdir (its "
                  "config.json looks like an HF model config (model_type 'qwen2')): pass the "
                  f"workdir of the run, {run}")
  checkpoints = (f"{run / 'checkpoints'} is the rl checkpoint directory of the run in {run}, "
                 f"not a training run's workdir: pass the run's workdir, {run}")
  for given, error in ((run / "hf", model_export), (run / "checkpoints", checkpoints)):
    refused = _cli("sage_jax.export", f"--workdir={given}", f"--out={tmp_path / 'out'}")
    assert refused.returncode != 0 and error in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
  evaluated = _cli("sage_jax.evaluate", f"--run={run / 'hf'}", "--config=configs/eval.py:run",
                   f"--workdir={tmp_path / 'eval'}")
  assert evaluated.returncode != 0 and model_export in evaluated.stderr, evaluated.stderr[-2000:]
  generated = _cli("sage_jax.generate", f"--model={run / 'checkpoints'}", "--prompt=hi")
  assert generated.returncode != 0 and f"--model={checkpoints}" in generated.stderr, (
      generated.stderr[-2000:])
  with pytest.raises(FileNotFoundError, match=re.escape(
      f"{run / 'sft' / 'checkpoints'} is the sft checkpoint directory of the run in {run}, not "
      f"a training run's workdir: pass the run's workdir, {run} (with --stage=sft)")):
    run_checkpoint.read_config(str(run / "sft" / "checkpoints"))
  assert not (tmp_path / "out").exists() and not (tmp_path / "eval").exists()


def test_write_model_exports_in_the_dtype_asked_for(model, tmp_path):
  assert model.config.param_dtype == "float32"
  export.write_model(model, str(tmp_path / "out"), tokenizer_lib.ensure_qwen25_tokenizer_dir(),
                     dtype="bfloat16")
  config = json.load(open(tmp_path / "out" / "config.json"))
  assert config["dtype"] == config["torch_dtype"] == "bfloat16"
  index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
  for name, fname in index["weight_map"].items():
    with safe_open(str(tmp_path / "out" / fname), framework="np") as f:
      assert f.get_slice(name).get_dtype() == "BF16", name
  assert index["metadata"]["total_size"] == 2 * model.config.num_params()
  assert set(os.listdir(tmp_path / "out")) == {
      *index["weight_map"].values(), "config.json", "generation_config.json",
      "model.safetensors.index.json", hf.EXPORT_MARKER, *tokenizer_lib.TOKENIZER_FILES}
  # Readable as any other file this process creates (safetensors writes its files 0600).
  umask = os.umask(0)
  os.umask(umask)
  for name in os.listdir(tmp_path / "out"):
    assert os.stat(tmp_path / "out" / name).st_mode & 0o777 == 0o666 & ~umask, name


def test_write_model_exports_in_the_dtype_of_the_source_checkpoint(model, tmp_path):
  """A run trained with float32 master weights from a bfloat16 checkpoint (an official Qwen2.5
  release) exports bfloat16, as the release ships; a float32 source, a random init and a GGUF
  source (the bundled model: no dtype to keep) keep the params' dtype; `dtype` wins."""
  import torch  # noqa: PLC0415

  from tests.hf_reference import tiny_hf_model  # noqa: PLC0415

  tokenizer = tokenizer_lib.ensure_qwen25_tokenizer_dir()
  tiny_hf_model(str(tmp_path / "bf16"), dtype=torch.bfloat16)
  tiny_hf_model(str(tmp_path / "f32"))
  trained = loader.load_model(str(tmp_path / "bf16"), param_dtype="float32")
  assert trained.config.param_dtype == "float32"
  for name, (weights, base, dtype, want) in {
      "from_bf16": (trained, tmp_path / "bf16", None, "bfloat16"),
      "from_f32": (loader.load_model(str(tmp_path / "f32")), tmp_path / "f32", None, "float32"),
      "random_init": (model, "", None, "float32"),
      "asked": (trained, tmp_path / "bf16", "float32", "float32")}.items():
    export.write_model(weights, str(tmp_path / name), tokenizer, base_model=str(base),
                       dtype=dtype)
    config = json.load(open(tmp_path / name / "config.json"))
    assert config["dtype"] == config["torch_dtype"] == want, name
    index = json.load(open(tmp_path / name / "model.safetensors.index.json"))
    for tensor, fname in index["weight_map"].items():
      with safe_open(str(tmp_path / name / fname), framework="np") as f:
        assert f.get_slice(tensor).get_dtype() == {"bfloat16": "BF16", "float32": "F32"}[want]
  # The bfloat16 export of bfloat16 weights held in float32 is the source, bit for bit.
  source = load_file(str(tmp_path / "bf16" / "model.safetensors"))
  index = json.load(open(tmp_path / "from_bf16" / "model.safetensors.index.json"))
  exported = {}
  for fname in set(index["weight_map"].values()):
    exported.update(load_file(str(tmp_path / "from_bf16" / fname)))
  assert source.keys() == exported.keys()
  for tensor in source:
    assert np.array_equal(source[tensor].view(np.uint16), exported[tensor].view(np.uint16))
  assert export.source_dtype(loader.BUNDLED_0P5B) is None  # read without fetching it


def test_a_remote_output_directory_is_checked_too(gcs_url, model):
  from tests import fake_gcs  # noqa: PLC0415

  fake_gcs.create_bucket(gcs_url, "exports")
  storage.write_text("gs://exports/run/checkpoints/precious", "step 100")
  with pytest.raises(hf.ExportError, match="gs://exports/run is not empty"):
    export.write_model(model, "gs://exports/run", tokenizer_lib.ensure_qwen25_tokenizer_dir())
  export.write_model(model, "gs://exports/hf", tokenizer_lib.ensure_qwen25_tokenizer_dir())
  export.write_model(model, "gs://exports/hf", tokenizer_lib.ensure_qwen25_tokenizer_dir())
  assert storage.read_json(f"gs://exports/hf/{hf.EXPORT_MARKER}")["written_by"] == "sage_jax"
  assert storage.path("gs://exports/run/checkpoints/precious").read_text() == "step 100"


def test_the_model_card_of_untrained_weights_says_no_stage_trained():
  """A run's export before any stage trained (stages=() or eval only) holds the base model."""
  config = sage_configs.get_config("demo")
  card = export.model_card(config, None, 0, {})
  assert "- Checkpoint: none (the base model's weights, untrained)" in card
  assert "- Checkpoint: rl step 3" in export.model_card(config, "rl", 3, {})


def test_the_model_card_shows_the_run_s_evaluation_only_for_the_weights_it_evaluated():
  """summary.json's before/after table is of the pipeline's final weights: an export of an
  earlier checkpoint (--stage=sft --step=N) names the checkpoint it is of instead."""
  config = sage_configs.get_config("demo")
  table = "| metric | dev before | dev after |\n|---|---|---|\n| tgc | 0 | 100 |"
  summary = {"weights": {"run": "/runs/a", "stage": "rl", "step": 10}, "table": table}
  assert table in export.model_card(config, "rl", 10, summary)
  for stage, step in (("sft", 240), ("rl", 8)):
    card = export.model_card(config, stage, step, summary)
    assert table not in card and "is of another checkpoint (rl step 10)" in card, card
  untrained = {"weights": {"stage": None, "step": 0}, "table": table}
  assert table in export.model_card(config, None, 0, untrained)
  assert "another checkpoint (the base model's weights)" in export.model_card(
      config, "sft", 1, untrained)
  assert table not in export.model_card(config, "rl", 10, {"table": table})  # of unknown weights
