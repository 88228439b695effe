"""sage_jax.storage on a local directory and on a fake GCS bucket: whole-file writes, reads,
mirrors of growing files, staged directories, and the checks a workdir gets at startup (one
run at a time, writable, its JSON files readable)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from sage_jax import storage
from tests import fake_gcs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Commands on one CPU device (not the test session's 8 simulated ones: they only slow the
# startup down).
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
# An existing directory where writing fails, for root too (sysfs makes no files).
UNWRITABLE = "/sys/kernel"


def _cli(module, *args, timeout=300):
  return subprocess.run([sys.executable, "-m", f"sage_jax.{module}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, env=ONE_DEVICE)


def _last_line(done):
  """The one line a command that failed with a known error ends with."""
  assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
  return done.stderr.strip().splitlines()[-1]


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
  if request.param == "local":
    return str(tmp_path / "run")
  url = request.getfixturevalue("gcs_url")
  bucket = f"unit-{uuid.uuid4().hex[:8]}"
  fake_gcs.create_bucket(url, bucket)
  return f"gs://{bucket}/run"


def test_json_and_text_round_trip(root):
  top = storage.open_workdir(root)
  assert storage.read_json(top / "config.json") is None
  storage.write_json(top / "config.json", {"a": [1, 2]})
  storage.write_json(top / "config.json", {"a": "ä"})  # a second write replaces the first
  assert storage.read_json(top / "config.json") == {"a": "ä"}
  storage.write_text(top / "eval" / "report.md", "| x |\n")
  assert (top / "eval" / "report.md").read_text() == "| x |\n"
  assert storage.file_sizes(top) == {"config.json": len(json.dumps({"a": "ä"}, indent=2)),
                                     "eval/report.md": 6}


def test_mirror_uploads_each_change_whole(root):
  mirror = storage.LocalMirror(root)
  assert storage.is_remote(root) != (mirror.local == os.path.abspath(root))
  target = storage.path(root) / "metrics.jsonl"
  with open(os.path.join(mirror.local, "metrics.jsonl"), "a") as f:
    for step in (1, 2):
      f.write(f'{{"step": {step}}}\n')
      f.flush()
      mirror.sync()
      assert target.read_text().splitlines()[-1] == f'{{"step": {step}}}'
  mirror.close()
  assert target.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_staged_dir_replaces_a_remote_target(root, tmp_path):
  target = storage.path(root) / "hf"
  storage.write_text(target / "stale.json", "{}")
  with storage.staged_dir(target) as local:
    # Locally the target itself (its writer replaces it); else a fresh directory, uploaded.
    assert (local == os.fspath(target)) != storage.is_remote(root)
    if os.path.exists(local):
      os.remove(os.path.join(local, "stale.json"))
    os.makedirs(os.path.join(local, "sub"))
    open(os.path.join(local, "sub", "weights.bin"), "wb").write(b"123")
    open(os.path.join(local, "config.json"), "w").write("{}")
  assert storage.file_sizes(target) == {"config.json": 2, "sub/weights.bin": 3}
  copy = tmp_path / "copy"
  storage.copy_tree(target, copy)
  assert (copy / "sub" / "weights.bin").read_bytes() == b"123"


def test_local_relative_paths_become_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert os.fspath(storage.open_workdir("runs/a")) == str(tmp_path / "runs" / "a")
  assert (tmp_path / "runs" / "a").is_dir()
  assert storage.local_subdir("runs/a", "appworld") == str(tmp_path / "runs" / "a" / "appworld")
  assert storage.local_subdir("gs://b/run", "appworld") is None


def test_bad_workdirs_are_named(gcs_url):
  with pytest.raises(storage.WorkdirError, match=r"foo://x/run: unknown scheme foo://"):
    storage.open_workdir("foo://x/run")
  with pytest.raises(storage.WorkdirError,
                     match=r"gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist"):
    storage.open_workdir("gs://no-such-bucket/run")
  with pytest.raises(storage.WorkdirError, match=r"^--workdir=foo://x/run: unknown scheme"):
    storage.open_workdir("foo://x/run", flag="--workdir")


def test_a_workdir_that_is_a_file_ends_the_run_in_one_line(tmp_path):
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(storage.WorkdirError, match=r"a_file: not a directory$"):
    storage.open_workdir(tmp_path / "a_file")
  done = _cli("train", "--config=configs/sage.py:demo", f"--workdir={tmp_path / 'a_file'}")
  assert _last_line(done) == f"WorkdirError: --workdir={tmp_path / 'a_file'}: not a directory"


@pytest.mark.skipif(not os.path.isdir(UNWRITABLE), reason=f"no {UNWRITABLE}")
def test_an_unwritable_workdir_ends_the_run_in_one_line():
  """Checked by a test write when the workdir opens, not when the first file is written (a
  raw OSError in training; in an evaluation, AppWorld's template dying with its outputs
  directory)."""
  message = f"{UNWRITABLE}: cannot be written to (Permission denied); use a directory"
  with pytest.raises(storage.WorkdirError, match=re.escape(message)):
    storage.open_workdir(UNWRITABLE)
  train = _cli("train", "--config=configs/sage.py:demo", f"--workdir={UNWRITABLE}")
  assert _last_line(train).startswith(f"WorkdirError: --workdir={message}")
  evaluation = _cli("evaluate", "--config=configs/eval.py:demo", f"--workdir={UNWRITABLE}")
  assert _last_line(evaluation).startswith(f"WorkdirError: {message}")


def test_a_workdir_lock_is_held_until_released(tmp_path):
  """Two holders conflict (in one process too); a released lock is taken again. Nothing is
  held for a bucket, nor by a run's other processes (`hold=False`). (The next test kills a
  holder.)"""
  workdir = storage.open_workdir(tmp_path / "run")
  with storage.WorkdirLock(workdir, "--workdir") as held:
    holder = f"pid {os.getpid()} on host "
    assert (workdir / storage.LOCK_FILE).read_text().startswith(holder)
    in_use = f"--workdir={workdir}: in use by another run ({holder}"
    with pytest.raises(storage.WorkdirError, match=f"^{re.escape(in_use)}"):
      storage.WorkdirLock(workdir, "--workdir")
    storage.WorkdirLock(workdir, hold=False).release()
    held.release()
    storage.WorkdirLock(workdir).release()
  storage.WorkdirLock("gs://bucket/run").release()


def test_a_second_run_on_a_workdir_fails_while_the_first_runs(tmp_path):
  """A resubmitted job overlapping a live one on the same workdir: the second command, a
  training or an evaluation, fails at once in one line naming the run that holds the workdir
  and writes nothing there; once that run is killed (SIGKILL: no cleanup), the workdir is
  free."""
  workdir = tmp_path / "run"
  lock = workdir / storage.LOCK_FILE
  train = ["--config=configs/sage.py:demo", f"--workdir={workdir}"]
  first = subprocess.Popen([sys.executable, "-m", "sage_jax.train", *train], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=ONE_DEVICE)
  try:
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text().startswith(f"pid {first.pid} ")
               and (workdir / "config.json").exists()):
      assert time.monotonic() < deadline and first.poll() is None, first.communicate()[1]
      time.sleep(0.1)
    recorded = (workdir / "config.json").read_text()  # the first run's
    held = f"{workdir}: in use by another run (pid {first.pid} on host "
    assert _last_line(_cli("train", *train)).startswith(f"WorkdirError: --workdir={held}")
    evaluation = _cli("evaluate", "--config=configs/eval.py:demo", f"--workdir={workdir}")
    assert _last_line(evaluation).startswith(f"WorkdirError: {held}")
    assert first.poll() is None and (workdir / "config.json").read_text() == recorded
    assert not (workdir / "eval_dev.json").exists()
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate()
  storage.WorkdirLock(workdir, "--workdir").release()


def test_a_json_file_that_does_not_parse_is_named(tmp_path):
  """A cut-short config.json (a disk that filled, an edit) fails each command that reads it
  in one line naming the file, instead of json's error naming neither file nor command."""
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text('{"model": {"spec": ')
  message = f"{run / 'config.json'}: not valid JSON (Expecting value: line 1 column 20"
  with pytest.raises(storage.WorkdirError,
                     match=rf"^{re.escape(message)}.*; repair or remove it$"):
    storage.read_json(run / "config.json")
  for module, args in (
      ("train", ["--config=configs/sage.py:demo", f"--workdir={run}"]),
      ("evaluate", [f"--run={run}", "--config=configs/eval.py:run",
                    f"--workdir={tmp_path / 'eval'}"]),
      ("export", [f"--workdir={run}", f"--out={tmp_path / 'hf'}"]),
      ("generate", [f"--model={run}", "--prompt=hi"])):
    line = _last_line(_cli(module, *args))
    assert message in line, (module, line)
  assert sorted(os.listdir(tmp_path)) == ["run"]
