"""Orbax checkpoints: keep last N + best on dev, config beside them, atomic finalisation,
restore into another sharding, failed reads and saves named; metrics JSONL / TensorBoard with
resume truncation."""

import contextlib
import dataclasses
import gc
import json
import os
import re
import resource
import signal
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from sage_jax import sharding as shd
from sage_jax import storage
from sage_jax.model import get_preset, init_model
from sage_jax.rl import grpo
from sage_jax.train import checkpoint as ckpt
from sage_jax.train import loop
from sage_jax.train import metrics as metrics_lib
from sage_jax.train import state as state_lib
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.step import Trainer
from tests import fake_gcs

CFG = get_preset("tiny").replace(vocab_size=64)


@pytest.fixture(scope="module")
def trainer():
  return Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(grpo.GRPOConfig()),
                 OptimizerConfig(learning_rate=1e-3))


def test_keep_last_and_best_and_config(tmp_path, trainer):
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), keep_last=2, keep_best=1,
                                 best_metric="dev/tgc", save_every=1)
  run_config = {"model": CFG, "lr": 1e-3, "buckets": (16, 32)}
  saver = ckpt.Checkpointer(config, run_config=run_config)
  dev = {2: 0.9, 4: 0.1}
  for step in range(1, 7):
    metrics = {"dev/tgc": dev[step]} if step in dev else None
    assert saver.save(step, trainer.state, meta={"step": step}, metrics=metrics)
  saver.wait()
  assert not saver.save(6, trainer.state)  # an existing step is not overwritten
  assert saver.all_steps() == [2, 5, 6]  # last two + the best on dev (step 4 was worse)
  assert saver.latest_step() == 6 and saver.best_step() == 2
  assert saver.read_meta(2) == {"step": 2, "metrics": {"dev/tgc": 0.9}}
  with open(tmp_path / "ck" / ckpt.CONFIG_FILE) as f:
    written = json.load(f)
  assert written["model"]["hidden_size"] == 64 and written["buckets"] == [16, 32]
  saver.close()


def test_the_best_checkpoint_survives_a_restart(tmp_path, trainer):
  """A resumed run (a new Checkpointer over the same directory) still knows which kept step
  was best on dev, and keeps it."""
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), keep_last=2, keep_best=1,
                                 best_metric="dev/tgc", save_every=1, async_save=False)
  dev = {2: 0.9, 4: 0.1}
  for steps in ((1, 2, 3), (4, 5, 6)):  # a restart between them
    saver = ckpt.Checkpointer(config)
    for step in steps:
      metrics = {"dev/tgc": dev[step]} if step in dev else None
      saver.save(step, trainer.state, meta={"step": step}, metrics=metrics)
    saver.close()
  saver = ckpt.Checkpointer(config)
  assert saver.all_steps() == [2, 5, 6] and saver.best_step() == 2
  saver.close()


def test_a_run_resumed_under_another_best_metric_ranks_only_by_it(tmp_path, trainer):
  """checkpoint.best_metric may change on resume: the steps ranked by the old metric rank
  below every one the new metric ranks (never kept as the best), and saving goes on."""
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), keep_last=1, keep_best=1,
                                 best_metric="dev/tgc", save_every=1, async_save=False)
  saver = ckpt.Checkpointer(config)
  for step, tgc in ((1, 0.9), (2, 0.1)):
    saver.save(step, trainer.state, meta={"step": step}, metrics={"dev/tgc": tgc})
  saver.close()
  config = dataclasses.replace(config, best_metric="dev/sgc")
  for steps in ((3, 4), (5, 6)):  # and a rerun after it
    saver = ckpt.Checkpointer(config)
    for step in steps:
      metrics = {"dev/tgc": 1.0, "dev/sgc": 0.5} if step == 3 else {"dev/tgc": 0.95}
      assert saver.save(step, trainer.state, meta={"step": step}, metrics=metrics)
    saver.close()
  saver = ckpt.Checkpointer(config)
  assert saver.all_steps() == [3, 6] and saver.best_step() == 3
  saver.close()


def test_half_written_checkpoint_is_ignored_and_cleaned(tmp_path, trainer):
  directory = tmp_path / "ck"
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory), async_save=False))
  saver.save(3, trainer.state, meta={"step": 3})
  saver.close()
  # What a kill in the middle of saving step 4 leaves behind: orbax's temporary directory.
  partial = directory / "4.orbax-checkpoint-tmp-1234567"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "junk").write_bytes(b"\0" * 100)
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory)))
  assert saver.latest_step() == 3  # the unfinished step 4 does not count
  state, meta = saver.restore(trainer.abstract_state())
  assert meta["step"] == 3
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  saver.save(4, state, meta={"step": 4})  # the resumed run redoes step 4
  saver.wait()
  assert not partial.exists()  # the leftover was removed (orbax cleans up on start)
  assert saver.all_steps() == [3, 4]
  saver.close()


def test_a_read_only_checkpointer_leaves_a_live_runs_files_alone(tmp_path, trainer):
  """Export and evaluation read a run that may still be training: its save under way (orbax's
  temporary directory) is not cleaned up, nothing is written into the run, and no save."""
  directory = tmp_path / "ck"
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory), async_save=False))
  saver.save(1, trainer.state, meta={"step": 1})
  saver.close()
  (directory / "1" / ckpt.FILES_RECORD).unlink()  # a step whose record is not written yet
  under_way = directory / "2.orbax-checkpoint-tmp-1764400000000"
  (under_way / "state").mkdir(parents=True)
  (under_way / "state" / "part").write_bytes(b"\0" * 100)
  before = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
  reader = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory), read_only=True))
  assert reader.all_steps() == [1]
  state, meta = reader.restore(trainer.abstract_state(), 1)
  assert meta["step"] == 1
  with pytest.raises(ValueError, match="opened read-only, so step 2 cannot be saved"):
    reader.save(2, state)
  reader.close()
  assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == before


def test_a_read_only_checkpointer_over_a_missing_directory_lists_no_step(tmp_path):
  """A stage's checkpoints read before the stage has saved (the pipeline's resume checks, an
  export or evaluation of the stage): no step, nothing created, and the error of a model
  restored from there names the directory."""
  from configs import sage as sage_configs  # noqa: PLC0415
  from sage_jax import run_checkpoint, run_config  # noqa: PLC0415

  run_dir = tmp_path / "run"
  directory = run_dir / run_checkpoint.STAGE_DIRS["sft"]
  reader = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory), read_only=True))
  assert reader.all_steps() == [] and reader.latest_step() is None
  with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint in {directory}")):
    reader.restore_params({})
  reader.close()
  run = run_config.resolve(sage_configs.get_config("demo"))
  with pytest.raises(FileNotFoundError, match=re.escape(
      f"{run_dir}: no sft checkpoints ({directory} does not exist or holds no finished step)")):
    run_checkpoint.restore_model(str(run_dir), run, stage="sft")
  assert not run_dir.exists()


def test_a_loop_that_does_not_resume_refuses_a_directory_with_checkpoints(tmp_path, trainer):
  """Its steps 1, 2, ... would mix with the ones there (and a later resume would take the
  old run's newest step)."""
  config = ckpt.CheckpointConfig(directory=str(tmp_path / "ck"), async_save=False, resume=False)
  saver = ckpt.Checkpointer(config)
  assert loop.restore_latest(trainer, saver) == 0  # nothing there yet
  saver.save(5, trainer.state, meta={"step": 5})
  saver.close()
  with pytest.raises(ValueError, match=r"ck holds checkpoints \(latest step 5\) and resuming "
                                       r"is off"):
    loop.restore_latest(trainer, ckpt.Checkpointer(config))


def test_restore_into_a_sharded_trainer(tmp_path, trainer):
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(tmp_path / "ck")))
  saver.save(1, trainer.state, meta={"step": 1})
  saver.wait()
  mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=4, tensor=2))
  sharded = Trainer(shd.create_sharded(lambda: init_model(CFG, seed=7), mesh),
                    grpo.make_loss_fn(grpo.GRPOConfig()), OptimizerConfig(learning_rate=1e-3),
                    mesh=mesh)
  state, _ = saver.restore(sharded.abstract_state())
  for a, b, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state),
                        jax.tree.leaves(sharded.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == want.sharding
  saver.close()


def test_restore_params_reads_only_the_params_into_the_models_sharding(tmp_path, trainer):
  """A finished stage's model taken up by the next (a run resumed after SFT)."""
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(tmp_path / "ck")))
  saver.save(2, trainer.state, meta={"step": 2})
  saver.wait()
  mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=4, tensor=2))
  model = shd.create_sharded(lambda: init_model(CFG, seed=7), mesh)
  target = state_lib.abstract_like(nnx.state(model))
  params = saver.restore_params(target)
  assert jax.tree.structure(params) == jax.tree.structure(target)
  for a, b, want in zip(jax.tree.leaves(params), jax.tree.leaves(trainer.params),
                        jax.tree.leaves(target)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == want.sharding
  other = state_lib.abstract_like(nnx.state(init_model(CFG.replace(hidden_size=32), seed=0)))
  with pytest.raises(ckpt.CheckpointError, match="checkpoint step 2"):
    saver.restore_params(other)
  saver.close()
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(tmp_path / "none"))).restore_params(
        target)


def test_a_runs_model_is_restored_without_its_optimizer_state(tmp_path):
  """Export and evaluation read a checkpoint's params only: its optimizer state (twice the
  params under Adam) stays on disk, whatever optimizer wrote it (here a momentum SGD's, which
  the run's AdamW could not restore into)."""
  import optax  # noqa: PLC0415
  from configs import sage as sage_configs  # noqa: PLC0415
  from sage_jax import run_checkpoint, run_config  # noqa: PLC0415
  from sage_jax.weights import loader  # noqa: PLC0415

  c = sage_configs.get_config("demo")
  c.model.update(preset="tiny", vocabulary="full")
  run = run_config.resolve(c)
  model = loader.build_model(run.model)
  params = nnx.state(model)
  sgd = optax.sgd(0.1, momentum=0.9)
  state = state_lib.create_train_state(params, sgd, seed=0)
  directory = tmp_path / "run" / run_checkpoint.STAGE_DIRS["rl"]
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory)))
  saver.save(3, state, meta={"step": 3})
  saver.close()
  restored, step = run_checkpoint.restore_model(str(tmp_path / "run"), run)
  assert step == 3
  for a, b in zip(jax.tree.leaves(nnx.state(restored)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_preemption_guard_turns_sigterm_into_a_flag():
  import signal
  with ckpt.PreemptionGuard() as guard:
    assert not guard.requested
    os.kill(os.getpid(), signal.SIGTERM)
    assert guard.requested and guard.signal == signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_metrics_jsonl_tensorboard_and_resume_truncation(tmp_path):
  config = metrics_lib.MetricsConfig(log_dir=str(tmp_path), progress=True)
  writer = metrics_lib.MetricsWriter(config, total_steps=5)
  for step in range(1, 5):
    values = writer.write(step, {"loss": np.float32(step), "reward/mean": 0.1 * step,
                                 "skip": "text", "vector": np.ones(3)})
    writer.progress(step, values)
  writer.close()
  rows = metrics_lib.read_jsonl(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert rows[0]["loss"] == 1.0 and "skip" not in rows[0] and "vector" not in rows[0]
  assert any(name.startswith("events") for name in os.listdir(tmp_path / "tb"))
  with open(tmp_path / metrics_lib.METRICS_FILE, "a") as f:
    f.write('{"step": 5, "lo')  # a line cut by a kill
  # Resuming at step 3 redoes steps 3 and 4: their old lines go.
  writer = metrics_lib.MetricsWriter(config, total_steps=5, start_step=2)
  writer.write(3, {"loss": 30.0, "ratio_max": 1e39})  # beyond float32: infinity there
  writer.close()
  rows = metrics_lib.read_jsonl(str(tmp_path))
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
  assert rows[2]["ratio_max"] == 1e39
  # TensorBoard's view: the first file's steps, then the resumed file's purge mark and step.
  files = sorted(os.listdir(tmp_path / "tb"))
  assert len(files) == 2 and all(f.startswith("events.out.tfevents.") for f in files)
  first, resumed = (_tensorboard_events(tmp_path / "tb" / f) for f in files)
  assert first[0].file_version == resumed[0].file_version == "brain.Event:2"
  assert [(e.step, {v.tag: v.simple_value for v in e.summary.value}) for e in first[1:]] == [
      (s, {"loss": s, "reward/mean": pytest.approx(0.1 * s)}) for s in range(1, 5)]
  purge, step3 = resumed[1:]
  assert (purge.step, purge.session_log.status) == (3, purge.session_log.START)
  assert step3.step == 3 and [(v.tag, v.simple_value) for v in step3.summary.value] == [
      ("loss", 30.0), ("ratio_max", float("inf"))]
  # Started over from step 0 (killed before its first checkpoint): every earlier step goes.
  metrics_lib.MetricsWriter(config, total_steps=5).close()
  (third,) = set(os.listdir(tmp_path / "tb")) - set(files)
  purge = _tensorboard_events(tmp_path / "tb" / third)[1]
  assert (purge.step, purge.session_log.status) == (1, purge.session_log.START)


def test_metrics_of_the_resumed_step_join_its_line(tmp_path):
  """A resumed run's owed evaluation is logged at the restored step: one line per step."""
  config = metrics_lib.MetricsConfig(log_dir=str(tmp_path), progress=False, tensorboard=False)
  writer = metrics_lib.MetricsWriter(config, total_steps=4)
  for step in (1, 2):
    writer.write(step, {"loss": float(step)})
  writer.close()
  writer = metrics_lib.MetricsWriter(config, total_steps=4, start_step=2)
  writer.write(2, {"dev/success": 0.5, "loss": 20.0})
  writer.write(3, {"loss": 3.0})
  writer.close()
  rows = metrics_lib.read_jsonl(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert (rows[1]["loss"], rows[1]["dev/success"]) == (20.0, 0.5)
  writer = metrics_lib.MetricsWriter(config, total_steps=4, start_step=3)
  writer.write(4, {"loss": 4.0})  # a later step only appends
  writer.close()
  assert [(r["step"], r["loss"]) for r in metrics_lib.read_jsonl(str(tmp_path))] == [
      (1, 1.0), (2, 20.0), (3, 3.0), (4, 4.0)]


def _tensorboard_events(path):
  """The Event protos of a TensorBoard event file, read and checked with tensorboardX's own
  protos and record checksum (TFRecord framing: length, its checksum, data, its checksum)."""
  import struct  # noqa: PLC0415

  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  from tensorboardX.record_writer import masked_crc32c  # noqa: PLC0415
  events, data = [], open(path, "rb").read()
  while data:
    header, (length_crc,) = data[:8], struct.unpack("<I", data[8:12])
    (length,) = struct.unpack("<Q", header)
    record, (record_crc,) = data[12:12 + length], struct.unpack("<I", data[12 + length:16 + length])
    assert (length_crc, record_crc) == (masked_crc32c(header), masked_crc32c(record))
    events.append(event_pb2.Event.FromString(record))
    data = data[16 + length:]
  return events


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_when_no_step_reads_nothing_is_moved(tmp_path, trainer, capfd, monkeypatch):
  directory = tmp_path / "ck"
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory), async_save=False))
  for step in (1, 2):
    saver.save(step, trainer.state, meta={"step": step})
  saver.close()
  # A run whose config no longer fits its checkpoints, and a storage outage: the newest step's
  # files are all there as written, so its read error is raised and nothing is moved aside.
  other = Trainer(init_model(CFG.replace(hidden_size=32), seed=0),
                  grpo.make_loss_fn(grpo.GRPOConfig()), OptimizerConfig(learning_rate=1e-3))
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory)))
  with pytest.raises(ckpt.CheckpointError, match="checkpoint step 2 cannot be read"):
    saver.restore_newest_intact(other.abstract_state())
  outage = OSError("503 Service Unavailable")
  monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore",
                      lambda *args, **kwargs: (_ for _ in ()).throw(outage))
  with pytest.raises(ckpt.CheckpointError, match="checkpoint step 2 cannot be read.*503") as e:
    saver.restore_newest_intact(trainer.abstract_state())
  # Contents damaged at their sizes read alike: the way to the older step is named.
  assert str(e.value).endswith(f"move {directory / '2'} aside to resume from step 1")
  assert saver.all_steps() == [1, 2] and not (directory / ckpt.DAMAGED_DIR).exists()
  saver.close()
  gc.collect()  # orbax's abandoned reads report themselves when collected: not a word
  assert "never" not in capfd.readouterr().err


def test_a_read_error_names_the_file_and_what_went_wrong(tmp_path, trainer):
  """A data file cut short in a step without files.json (orbax's read finds it): the message
  gives the array store's own words and file, not orbax's wrapper around them ("See full
  TensorStore details: <bound method ...>")."""
  directory = tmp_path / "ck"
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory), async_save=False))
  saver.save(1, trainer.state, meta={"step": 1})
  saver.close()
  (directory / "1" / ckpt.FILES_RECORD).unlink()
  data = max((p for p in (directory / "1").rglob("*") if p.parent.name == "d"),
             key=lambda p: p.stat().st_size)
  os.truncate(data, data.stat().st_size // 2)
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory)))
  with pytest.raises(ckpt.CheckpointError) as error:
    saver.restore(trainer.abstract_state(), 1)
  saver.close()
  assert error.value.path == f"{directory}/1/state/"
  assert re.fullmatch(r'OUT_OF_RANGE: Error reading "[\w./]+" in OCDBT database at local file '
                      r'"\S+/1/state/": Requested byte range \[\d+, \d+\) is not valid for '
                      r"value of size \d+", error.value.problem), error.value.problem


@contextlib.contextmanager
def _files_limited_to(size):
  """Within the block, this process cannot write a file past `size` bytes (EFBIG, as a full
  disk fails a write)."""
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails, the process lives
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (size, limits[1]))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("stopped", [False, True], ids=["last-step", "signal"])
def test_a_failed_last_save_fails_the_loop_naming_its_step(tmp_path, trainer, stopped):
  """The last save (written in the background) fails, at the end of the run or at a stop:
  the loop raises an error naming the step and the problem, instead of returning as if the
  run had finished or stopped with a checkpoint."""
  directory = tmp_path / "ck"
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory), save_every=100))
  last = 2 if stopped else 3
  with contextlib.ExitStack() as full_disk:

    def one_step(step, _):
      if step == last - 1:
        full_disk.enter_context(_files_limited_to(1000))
        if stopped:
          os.kill(os.getpid(), signal.SIGTERM)
      return {"loss": 1.0}

    with pytest.raises(ckpt.CheckpointSaveError) as error:
      loop.run_steps(trainer, one_step, total_steps=3, checkpointer=saver,
                     metrics=metrics_lib.MetricsConfig(progress=False))
  saver.close()
  assert error.value.step == last
  assert str(error.value).startswith(f"checkpoint step {last} was not saved: {directory}/")
  assert "File too large" in error.value.problem
  assert ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(directory))).all_steps() == []


def test_a_damaged_step_on_gcs_is_copied_aside_and_its_number_saved_again(gcs_url, trainer):
  """An object store has no directories to rename: a damaged step is copied aside whole, then
  leaves the listing, so that a new save of its number is not skipped."""
  fake_gcs.create_bucket(gcs_url, "damaged-steps")
  directory = storage.path("gs://damaged-steps/ck")
  config = ckpt.CheckpointConfig(directory=os.fspath(directory), keep_best=0, async_save=False)
  saver = ckpt.Checkpointer(config)
  for step in (1, 2):
    saver.save(step, trainer.state, meta={"step": step})
  saver.close()
  written = storage.file_sizes(directory / "2")
  lost = next(name for name in written if "/d/" in name)
  (directory / "2" / lost).unlink()
  saver = ckpt.Checkpointer(config)
  _, meta = saver.restore_newest_intact(trainer.abstract_state())
  assert meta["step"] == 1 and saver.all_steps() == [1]
  moved = storage.file_sizes(directory / ckpt.DAMAGED_DIR / "2")
  assert moved == {name: size for name, size in written.items() if name != lost}
  assert saver.save(2, trainer.state, meta={"step": 2})
  saver.close()


def test_resume_never_holds_two_train_states(tmp_path, trainer):
  """The fresh state is released before the checkpoint is read, so a resumed run peaks at one
  train state (holding both OOM-killed a resumed 0.5B SFT on a 24 GB machine)."""
  saver = ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(tmp_path / "ck")))
  saver.save(3, trainer.state, meta={"step": 3})
  saver.wait()
  fresh = Trainer(init_model(CFG, seed=1), grpo.make_loss_fn(grpo.GRPOConfig()),
                  OptimizerConfig(learning_rate=1e-3))
  moments = [weakref.ref(x) for x in jax.tree.leaves(fresh.state.opt_state)]
  alive_when_read = []
  read = saver.restore_newest_intact

  def spy(abstract):
    gc.collect()
    alive_when_read.append(sum(ref() is not None for ref in moments))
    return read(abstract)

  saver.restore_newest_intact = spy
  assert loop.restore_latest(fresh, saver) == 3
  assert moments and alive_when_read == [0]
  for a, b in zip(jax.tree.leaves(fresh.state), jax.tree.leaves(trainer.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  saver.close()
