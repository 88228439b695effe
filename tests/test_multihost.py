"""Multi-process runs on one machine: N JAX processes with simulated CPU devices, joined by
`jax.distributed` (CPU collectives over gloo), started by `launch/local.py` as a user would.

The GRPO job (tests/multihost_job.py) checks the update and the stop/resume protocol; the
demo pipeline test runs SFT, SAGE, checkpoints, dev evaluation and export as 2 processes.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sage_jax.envs import appworld
from tests.appworld_fixtures import demo_expert_file  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch", "local.py")
JOB = os.path.join(REPO, "tests", "multihost_job.py")
LAGGING = os.path.join(REPO, "tests", "lagging_storage.py")
STEPS = 4

pytestmark = pytest.mark.slow


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the launcher sets each process's devices
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


# Lines that say why a process stopped: glog's error and fatal lines (a C++ check or abort,
# e.g. in the distributed runtime's teardown), Python's fatal errors and exceptions.
_CAUSE = re.compile(r"^(?:[EF]\d{4} |.*(?:Check failed|Fatal Python error|Terminating process|"
                    r"Error: |exited with))")


def _failure(*outputs: str) -> str:
  """What a failed launch printed: the lines that name a cause, the first Python traceback
  (the process that failed first; the others' shutdown errors follow it) and each output's
  end."""
  causes = [line for output in outputs for line in output.splitlines() if _CAUSE.match(line)]
  joined = "\n".join(outputs)
  first = joined.find("Traceback (most recent call last)")
  head = joined[first:first + 6000] + "\n[...]\n" if first >= 0 else ""
  return ("\n".join(causes[:40]) + "\n[...]\n" + head
          + "\n[...]\n".join(output[-3000:] for output in outputs))


def _launch(num_processes, devices, out, *args, wait=True):
  command = [sys.executable, LAUNCH, f"--num_processes={num_processes}",
             f"--cpu_devices={devices}", f"--workdir={out}", "--", sys.executable, JOB,
             f"--out={out}", *args]
  proc = subprocess.Popen(command, env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  if not wait:
    return proc
  output, _ = proc.communicate(timeout=900)
  assert proc.returncode == 0, _failure(output)
  return {**_result(out), "output": output}


def _result(out):
  with open(os.path.join(out, "result.json")) as f:
    result = json.load(f)
  result["params"] = dict(np.load(os.path.join(out, "params.npz")))
  result["copies"] = [json.load(open(os.path.join(out, f"copy_{i}.json")))
                      for i in range(result["processes"])]
  return result


def _assert_same_params(a, b, atol=1e-5):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=1e-4, err_msg=k)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  return _launch(1, 4, str(tmp_path_factory.mktemp("one")), f"--steps={STEPS}")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  # Process 1 builds its model 40 s after process 0, past gloo's 30 s limit for a peer to
  # arrive at a group's first collective: the run must not depend on hosts being in step.
  return _launch(2, 2, str(tmp_path_factory.mktemp("two")), f"--steps={STEPS}",
                 "--late_start_s=40")


def test_two_process_update_equals_one_process_update(one_process, two_processes):
  """Same global batches, packed by one process or split over two: the same updates."""
  assert (one_process["processes"], two_processes["processes"]) == (1, 2)
  assert one_process["devices"] == two_processes["devices"] == 4
  np.testing.assert_allclose(two_processes["loss"], one_process["loss"], rtol=1e-4)
  _assert_same_params(two_processes["params"], one_process["params"])
  initial = one_process["copies"][0][0]
  assert one_process["copies"][0][-1] != initial  # the updates moved the weights


def test_every_process_samples_from_the_same_weights(one_process, two_processes):
  """After every step's sync, each process's sampling copy equals the others' and the
  single-process copy."""
  copies = two_processes["copies"]
  assert len(copies) == 2 and len(copies[0]) == STEPS + 1  # after the restore, then each step
  assert copies[0] == copies[1]
  np.testing.assert_allclose(copies[0], one_process["copies"][0], rtol=1e-4, atol=1e-4)


def _pids(launcher, num_processes):
  """The pids of a launcher's processes, as it prints them when it starts them."""
  pids = []
  while len(pids) < num_processes:
    line = launcher.stdout.readline()
    assert line, "launcher ended before starting its processes"
    if line.startswith("launch: process"):
      pids.append(int(line.split()[-1]))
  return pids


def _stop(num_processes, devices, out, ckpt, ctrl_c):
  """Starts the job; once a step has been logged, sends SIGTERM to its last process, or
  (ctrl_c) SIGINT to the launcher's process group, as a terminal's Ctrl-C does."""
  proc = _launch(num_processes, devices, out, f"--steps={STEPS}", "--step_sleep_s=2",
                 f"--ckpt={ckpt}", wait=False)
  pids = _pids(proc, num_processes)
  metrics = os.path.join(out, "metrics.jsonl")
  deadline = time.monotonic() + 600
  while not (os.path.exists(metrics) and open(metrics).read().strip()):
    assert time.monotonic() < deadline and proc.poll() is None, _failure(proc.stdout.read())
    time.sleep(0.2)
  if ctrl_c:
    os.killpg(proc.pid, signal.SIGINT)
  else:
    os.kill(pids[-1], signal.SIGTERM)
  output, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, _failure(output)
  if ctrl_c:  # process 0 got it once: from the launcher, not also from the terminal
    assert output.count("saving a checkpoint and stopping") == 1, _failure(output)
  return _result(out)


@pytest.mark.parametrize("first,then,ctrl_c", [((2, 2), (1, 2), False), ((1, 2), (2, 2), True)],
                         ids=["sigterm-2-then-1", "ctrl_c-1-then-2"])
def test_a_signal_stops_every_process_after_one_step_and_resume_changes_process_count(
    first, then, ctrl_c, one_process, tmp_path):
  """SIGTERM to one of 2 processes, or Ctrl-C at the launcher (which passes it on): every
  process saves the same step and stops; a run with the other process count resumes it."""
  ckpt = str(tmp_path / "ckpt")
  stopped = _stop(*first, str(tmp_path / "first"), ckpt, ctrl_c)
  assert stopped["preempted"] and 1 <= stopped["end_step"] < STEPS
  steps = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())
  assert steps == [stopped["end_step"]]  # one checkpoint, of the step all processes stopped at
  resumed = _launch(*then, str(tmp_path / "then"), f"--steps={STEPS}", f"--ckpt={ckpt}")
  assert (resumed["start_step"], resumed["end_step"], resumed["preempted"]) == (
      stopped["end_step"], STEPS, False)
  _assert_same_params(resumed["params"], one_process["params"])


def test_a_signal_before_the_step_loop_stops_its_process_at_once(tmp_path):
  """SIGTERM to a process that has joined the run but not reached its step loop (its setup,
  an evaluation) stops it at once, as in a single-process run, and the launcher stops the
  other: jax.distributed's handler took the signal for a preemption notice, and the process
  went on into a loop that never met the notice's step and trained to the end."""
  out = tmp_path / "run"
  proc = _launch(2, 2, str(out), f"--steps={STEPS}", "--late_start_s=60", wait=False)
  pids = _pids(proc, 2)
  log = out / "logs" / "process_1.log"
  deadline = time.monotonic() + 300
  while not (log.exists() and "process 1 of 2" in log.read_text()):  # joined, then sleeps
    assert time.monotonic() < deadline and proc.poll() is None, _failure(proc.stdout.read())
    time.sleep(0.2)
  os.kill(pids[1], signal.SIGTERM)
  output, _ = proc.communicate(timeout=300)
  assert proc.returncode != 0 and "launch: process 1 exited" in output, _failure(output)
  assert not (out / "result.json").exists()


def test_a_signal_to_one_process_during_an_evaluation_ends_every_process_share(tmp_path):
  """SIGTERM to process 1 while both evaluate step 1, each share 300 s of turns: every
  process ends its share at its next turn (process 0 hears of the stop through the
  coordination service; before, it played its share to the end), step 1 is saved without its
  evaluation, and a rerun with one process makes that evaluation first."""
  out, ckpt = tmp_path / "first", str(tmp_path / "ckpt")
  proc = _launch(2, 2, str(out), "--steps=2", f"--ckpt={ckpt}", "--eval_turns=600",
                 "--eval_turn_s=0.5", wait=False)
  pids = _pids(proc, 2)
  deadline = time.monotonic() + 600
  while not all((out / f"eval_{i}_1").exists() for i in range(2)):
    assert time.monotonic() < deadline and proc.poll() is None, _failure(proc.stdout.read())
    time.sleep(0.2)
  os.kill(pids[1], signal.SIGTERM)
  try:
    output, _ = proc.communicate(timeout=150)
  except subprocess.TimeoutExpired:
    for pid in (proc.pid, *pids):  # each process leads a group of its own
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    pytest.fail("the processes went on evaluating after the signal:\n"
                + _failure(proc.communicate()[0]))
  assert proc.returncode == 0, _failure(output)
  logs = [output, (out / "logs" / "process_1.log").read_text()]  # process 0 prints here
  assert all("A signal ended the evaluation of step 1" in log for log in logs), _failure(*logs)
  stopped = json.load(open(out / "result.json"))
  assert (stopped["end_step"], stopped["preempted"], stopped["dev_score"]) == (1, True, [None])
  assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == [1]
  rerun = _launch(1, 2, str(tmp_path / "rerun"), "--steps=2", f"--ckpt={ckpt}",
                  "--eval_turns=1", "--eval_turn_s=0")
  assert (rerun["start_step"], rerun["end_step"], rerun["dev_score"]) == (1, 2, [1.0, 2.0])


@pytest.fixture(scope="module")
def two_saved_steps(tmp_path_factory):
  """The checkpoint directory of a 2-process run that saved steps 1 and 2."""
  out = tmp_path_factory.mktemp("saved")
  _launch(2, 2, str(out / "run"), "--steps=2", "--save_every=1", f"--ckpt={out / 'ckpt'}")
  return out / "ckpt"


def _truncate_largest(files):
  largest = max(files, key=lambda p: p.stat().st_size)
  os.truncate(largest, largest.stat().st_size // 2)


def _truncated_as_recorded(step_dir):
  """A data file cut short: every process's check against files.json finds it. Returns
  what process 0 reports."""
  _truncate_largest(p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d")
  return "(truncated)"


def _unrecorded_and_read_by_process_1_only(step_dir):
  """A data file of process 1's shards cut short, in a step without files.json (a process
  killed before writing it): only process 1's read fails. Returns what process 0 reports."""
  (step_dir / "files.json").unlink()
  _truncate_largest(p for p in (step_dir / "state" / "ocdbt.process_1").rglob("*")
                    if p.is_file() and p.parent.name == "d")
  return "(read by process 1)"


@pytest.mark.parametrize("damage", [_truncated_as_recorded, _unrecorded_and_read_by_process_1_only])
def test_every_process_falls_back_from_a_damaged_step_to_the_same_step(
    damage, two_saved_steps, one_process, tmp_path):
  """Step 2 damaged: both processes resume from step 1, whichever of them failed to read
  step 2, and list the steps again only once process 0 has moved it aside (slowly, as a copy
  on an object store), so that both save the new step 2."""
  ckpt = tmp_path / "ckpt"
  shutil.copytree(two_saved_steps, ckpt)
  reported = damage(ckpt / "2")
  resumed = _launch(2, 2, str(tmp_path / "run"), f"--steps={STEPS}", "--save_every=1",
                    f"--ckpt={ckpt}", "--slow_move_s=5")
  assert f"{reported}; moved to {ckpt}/damaged/2; resuming from step 1" in resumed["output"]
  assert (resumed["start_steps"], resumed["end_step"]) == ([1, 1], STEPS)
  assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == list(range(1, STEPS + 1))
  assert os.listdir(ckpt / "damaged") == ["2"]
  _assert_same_params(resumed["params"], one_process["params"])


def test_a_process_whose_listing_shows_no_step_resumes_with_process_0(
    two_saved_steps, one_process, tmp_path):
  """Process 1's listing of the checkpoint directory lags behind (NFS, an object store) and
  shows no step: it resumes from process 0's newest step with it, not afresh."""
  ckpt = tmp_path / "ckpt"
  shutil.copytree(two_saved_steps, ckpt)
  resumed = _launch(2, 2, str(tmp_path / "run"), f"--steps={STEPS}", "--save_every=1",
                    f"--ckpt={ckpt}", "--lagging_listing=1")
  assert (resumed["start_steps"], resumed["end_step"]) == ([2, 2], STEPS)
  assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == list(range(1, STEPS + 1))
  _assert_same_params(resumed["params"], one_process["params"])


def _files(directory):
  return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*")
          if p.is_file()}


def _failed_launch(out, *args):
  """Runs the job as 2 processes that must fail; (process 0's output and the launcher's,
  process 1's log)."""
  proc = _launch(2, 2, str(out), *args, wait=False)
  output, _ = proc.communicate(timeout=600)
  log = (out / "logs" / "process_1.log").read_text()
  assert proc.returncode != 0, _failure(output, log)
  return output, log


def test_a_step_that_process_0_does_not_list_is_not_saved_over(two_saved_steps, tmp_path):
  """Process 0's listing lags behind and shows no step: both processes start afresh, and at
  the first save, of a step that process 1 sees there, both fail naming it; the step is left
  as it was, not replaced on one host and kept on the other."""
  ckpt = tmp_path / "ckpt"
  shutil.copytree(two_saved_steps, ckpt)
  output, log = _failed_launch(tmp_path / "run", f"--steps={STEPS}", "--save_every=1",
                               f"--ckpt={ckpt}", "--lagging_listing=0")
  for text in (output, log):
    assert re.search(r"CheckpointSaveError: checkpoint step 1 was not saved: \S+/1: "
                     r"process\(es\) \[1\] list it there and process 0 does not", text), (
                         _failure(output, log))
  assert _files(ckpt) == _files(two_saved_steps)


def test_every_process_fails_with_process_0_when_its_shared_decision_fails(
    two_saved_steps, tmp_path):
  """Process 0 cannot move damaged step 2 aside (a file named damaged is in the way, as a
  permission or storage error would be): every process fails at once with process 0's
  error, none waits for it until the launcher stops it; step 2 stays where it was."""
  ckpt = tmp_path / "ckpt"
  shutil.copytree(two_saved_steps, ckpt)
  _truncated_as_recorded(ckpt / "2")
  (ckpt / "damaged").write_text("in the way")
  output, log = _failed_launch(tmp_path / "run", f"--steps={STEPS}", f"--ckpt={ckpt}")
  for text in (output, log):
    assert "LeadFailed: process 0 failed: FileExistsError" in text, _failure(output, log)
  assert "launch: process 1 exited with 1" in output, _failure(output, log)
  assert (ckpt / "2" / "files.json").exists()


def _run_entry(workdir, *command):
  """`python *command` as 2 processes of 2 CPU devices each."""
  return subprocess.run([sys.executable, LAUNCH, "--num_processes=2", "--cpu_devices=2",
                         f"--workdir={workdir}", "--", sys.executable, *command],
                        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=900)


def _launch_entry(workdir, *command):
  done = _run_entry(workdir, *command)
  assert done.returncode == 0, _failure(done.stdout, done.stderr)
  return done.stdout


def test_an_evaluation_that_retrieves_across_scenarios_keeps_one_library(tmp_path):
  """Retrieval across scenarios shows a task the skills of every scenario played before it. As
  2 processes the evaluation shows each task what one process shows it (process 0 plays
  every scenario, with one library); each process playing its share from an empty library
  showed the second scenario's first task nothing. Process 1, with nothing to play, starts
  no AppWorld (and loads no model)."""
  def visible(out):
    report = json.load(open(out / "eval_dev.json"))
    return [(r["task_id"], r["visible_skills"]) for r in report["records"]]

  evaluate = ["-m", "sage_jax.evaluate", "--config=configs/eval.py:demo",
              "--config.eval.max_scenarios=2", "--config.retrieval.strategy=query_ngram",
              "--config.pool.num_workers=1", "--config.eval.appworld_check=false"]
  logs = tmp_path / "pool_logs"
  _launch_entry(tmp_path / "two", *evaluate, f"--workdir={tmp_path / 'two'}",
                f"--config.pool.log_dir={logs}")
  assert os.listdir(logs) == ["process_0"] and (logs / "process_0" / "template.log").exists()
  subprocess.run([sys.executable, *evaluate, f"--workdir={tmp_path / 'one'}"],
                 env={**_env(), "JAX_PLATFORMS": "cpu"}, cwd=REPO, capture_output=True,
                 text=True, timeout=600, check=True)
  one = visible(tmp_path / "one")
  assert len(one) == 6 and one[3][1]  # the second scenario's first task sees skills
  assert visible(tmp_path / "two") == one


def test_an_evaluation_stopped_as_one_process_resumes_as_two(tmp_path, mini_root):  # noqa: F811
  """A SIGTERM ends an evaluation after its first scenario, which stays kept; run again as 2
  processes, they share the scenarios left, and the report holds every scenario as one
  uninterrupted run's does. The kept episodes' outputs are on the stopped process's host
  only, so AppWorld's own scores cover the others and the report lists the kept ones."""
  evaluate = ["-m", "sage_jax.evaluate", "--config=configs/eval.py:demo",
              "--config.eval.max_concurrent_scenarios=1", "--config.pool.num_workers=1",
              f"--workdir={tmp_path}"]
  kept = tmp_path / "eval_dev_progress"
  proc = subprocess.Popen([sys.executable, *evaluate], env={**_env(), "JAX_PLATFORMS": "cpu"},
                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  deadline = time.monotonic() + 600
  while not (kept.exists() and any(kept.glob("scenario_*.pkl"))):
    assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-5000:]
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)
  proc.communicate(timeout=300)
  assert proc.returncode != 0 and not (tmp_path / "eval_dev.json").exists()
  finished = sorted(int(p.stem.split("_")[1]) for p in kept.glob("scenario_*.pkl"))
  assert finished and len(finished) < 3

  _launch_entry(tmp_path / "logs", *evaluate)
  report = json.load(open(tmp_path / "eval_dev.json"))
  assert report["resumed_scenarios"] == finished and not kept.exists()
  overall = report["metrics"]["overall"]
  assert (overall["num_tasks"], overall["tgc"], overall["sgc"]) == (9, 100.0, 100.0)
  assert [r["task_id"] for r in report["records"]] == appworld.read_split(mini_root, "dev")
  assert report["appworld_unchecked"] == [r["task_id"] for r in report["records"]
                                          if r["group"] in finished]
  assert report["appworld"]["task_goal_completion"] == 100.0
  library = json.load(open(tmp_path / "library_dev.json"))
  assert len(library) == 3 and all(s["uses"] == 2 and s["successes"] == 2 for s in library)


def test_a_process_that_cannot_start_its_episodes_stops_every_process_with_its_error(tmp_path):
  """An evaluation whose process 1 cannot start AppWorld episodes: every process fails at once,
  naming process 1's error. Process 0 waited in the gather of the records until the runtime
  (or a launcher) gave up on process 1, and its log named no cause."""
  out = tmp_path / "run"
  done = _run_entry(out, os.path.join(REPO, "tests", "failing_start.py"), "sage_jax.evaluate",
                    "--config=configs/eval.py:demo", "--config.eval.max_scenarios=2",
                    "--config.pool.num_workers=1", f"--workdir={out}")
  log = (out / "logs" / "process_1.log").read_text()
  assert done.returncode != 0
  for text in (done.stdout + done.stderr, log):
    assert "ProcessFailed: process 1 failed: EpisodeError: Cannot start" in text, _failure(
        done.stdout, done.stderr, log)


def test_processes_that_read_different_sft_data_stop_before_training(
    tmp_path, demo_expert_file):  # noqa: F811
  """Process 1 reads the SFT examples in another order (a host-local copy of the data that
  differs): every process fails before the first step, naming the file and what each process
  read. Before, each process packed its share of the examples its own copy put at a step's
  indices (and an epoch-counted SFT ran as many steps as its own copy asked for)."""
  out = tmp_path / "run"
  done = _run_entry(out, os.path.join(REPO, "tests", "divergent_sft_data.py"), "sage_jax.train",
                    "--config=configs/sft.py:demo", f"--workdir={out}",
                    f"--config.pipeline.expert_trajectories={demo_expert_file}",
                    "--config.sft.total_steps=0", "--config.pipeline.eval_before=false",
                    "--config.pipeline.eval_after=false", "--config.pipeline.export=false")
  log = (out / "logs" / "process_1.log").read_text()
  assert done.returncode != 0
  read = f"the SFT data read from {demo_expert_file} differs between processes: process 0 has"
  for text in (done.stdout + done.stderr, log):
    assert read in text and "; process 1 has" in text, _failure(done.stdout, done.stderr, log)
  assert not (out / "sft" / "metrics.jsonl").exists()


def test_every_process_decides_on_the_workdir_as_process_0_reads_it(tmp_path):
  """The workdir records that SFT finished at step 9, past the 2 steps of the rerun, and
  process 1's storage does not show that record yet (NFS, an object store): both processes
  take process 0's reading and refuse the rerun at once. On its own reading, process 1 went on
  towards SFT, into a collective that process 0 never reached, and the two waited for each
  other until the runtime gave up minutes later. RL has no checkpoint directory yet: both
  list no step there, and create none."""
  workdir = tmp_path / "run"
  marker = workdir / "sft" / "done.json"
  marker.parent.mkdir(parents=True)
  marker.write_text(json.dumps({"finished": 0, "step": 9}))
  done = _run_entry(workdir, LAGGING, "1", str(marker), "sage_jax.train",
                    "--config=configs/sage.py:demo", f"--workdir={workdir}",
                    "--config.sft.total_steps=2")
  log = (workdir / "logs" / "process_1.log").read_text()
  refused = (f"ConfigError: --workdir {workdir}: its SFT stage finished at step 9, past "
             "config.sft.total_steps=2")
  for text in (done.stderr, log):
    assert refused in text, _failure(done.stdout, done.stderr, log)
  assert "launch: process 1 exited with 1" in done.stderr, _failure(done.stderr, log)
  assert not (workdir / "checkpoints").exists()


def _safetensors(directory):
  from safetensors.numpy import load_file  # noqa: PLC0415
  out = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(directory, name)))
  return out


def test_a_finished_command_leaves_the_run_before_the_interpreter_exits(tmp_path):
  """Each process of a finished multi-process command ends its part in the run itself
  (`multihost.finish`: the shutdown barrier and disconnect), before the interpreter's exit
  hooks start; JAX's own hook would do it only after clearing the backends."""
  from sage_jax.model import get_preset, init_model  # noqa: PLC0415
  from sage_jax.tokenizer import ensure_qwen25_tokenizer_dir  # noqa: PLC0415
  from sage_jax.weights import hf  # noqa: PLC0415
  from tests.exit_marker import EXIT_MARKER  # noqa: PLC0415
  model_dir = str(tmp_path / "model")
  hf.save_hf(init_model(get_preset("tiny")), model_dir,
             tokenizer_dir=str(ensure_qwen25_tokenizer_dir()))
  marker = os.path.join(REPO, "tests", "exit_marker.py")
  env = {**_env(), "TF_CPP_MIN_LOG_LEVEL": "0"}  # the runtime's INFO lines say when it leaves
  done = subprocess.run([sys.executable, LAUNCH, "--num_processes=2", "--cpu_devices=1",
                         f"--workdir={tmp_path}", "--", sys.executable, marker,
                         "sage_jax.generate", f"--model={model_dir}", "--prompt=hi",
                         "--max_new_tokens=2"],
                        env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  outputs = [done.stderr, open(tmp_path / "logs" / "process_1.log").read()]
  assert done.returncode == 0, _failure(done.stdout, *outputs)
  for output in outputs:
    left = output.find("Distributed task shutdown initiated")
    assert 0 <= left < output.find(EXIT_MARKER), _failure(output)


@pytest.mark.long
def test_demo_pipeline_runs_as_two_processes(tmp_path, demo_expert_file):  # noqa: F811
  """The expert's plays (each process its share), SFT, a SAGE step with per-process
  environment delays, checkpoints, the dev evaluation after training (one scenario: one
  process has none to run) and export, as 2 processes x 2 CPU devices; then `export` and
  `generate` as 2 processes. Every weight sync checks that the processes' sampling copies
  agree (the run fails otherwise)."""
  workdir = tmp_path / "run"
  overrides = ["--config.sft.total_steps=2", "--config.rl.total_steps=1",
               "--config.eval.max_scenarios=1", "--config.pool.num_workers=2",
               "--config.agent.max_turn_tokens=48",
               "--config.pipeline.train_scenarios=1", "--config.grpo.max_redraws=0",
               "--config.pipeline.eval_train=false", "--config.pipeline.eval_before=false",
               f"--config.pool.log_dir={tmp_path / 'pool_logs'}"]
  command = [sys.executable, LAUNCH, "--num_processes=2", "--cpu_devices=2",
             "--config=configs/sage.py:demo", f"--workdir={workdir}", "--",
             sys.executable, os.path.join(REPO, "tests", "delayed_train.py"),
             "--config=configs/sage.py:demo", f"--workdir={workdir}", *overrides]
  done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True,
                        timeout=2400)
  log = open(workdir / "logs" / "process_1.log").read()
  assert done.returncode == 0, _failure(done.stdout, done.stderr, log)
  assert "| tgc |" in done.stdout and "| tgc |" not in log  # process 0 reports
  assert "Gloo" not in done.stdout  # collectives' connection reports go to stderr
  rl = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  sft = [json.loads(line) for line in open(workdir / "sft" / "metrics.jsonl")]
  assert [r["step"] for r in rl] == [1] and [r["step"] for r in sft] == [1, 2]
  # Every process ran its own share of the step's 3 chains x 4 rollouts x 3 tasks (1 and 2),
  # and of the chains redrawn in place of those without a signal.
  assert all(r["sampling/kept_chains"] == 3 and r["episodes"] >= 36 and r["episodes"] % 12 == 0
             and r["time/sync_s"] > 0 for r in rl)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "config.json"]
  report = json.load(open(workdir / "eval_after" / "eval_dev.json"))
  assert len(report["records"]) == 3 and report["appworld"] is not None
  assert not os.path.exists(workdir / "appworld")  # outputs stayed on each host
  # Each process's pool logs apart (in one directory both appended to the same files).
  for i in range(2):
    assert (tmp_path / "pool_logs" / f"process_{i}" / "template.log").exists()
  # The shares of the gold plays, gathered: the SFT data one process makes.
  assert (workdir / "expert_trajectories.jsonl").read_text() == open(demo_expert_file).read()
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  model = transformers.AutoModelForCausalLM.from_pretrained(str(workdir / "hf")).eval()
  ids = transformers.AutoTokenizer.from_pretrained(str(workdir / "hf"))("<|im_start|>user\n")
  with torch.no_grad():
    assert torch.isfinite(model(torch.tensor([ids["input_ids"]])).logits).all()
  # The export entry point as 2 processes: the same weights as the pipeline's export.
  _launch_entry(tmp_path / "export", "-m", "sage_jax.export", f"--workdir={workdir}",
                f"--out={tmp_path / 'hf2'}")
  exported, again = _safetensors(workdir / "hf"), _safetensors(tmp_path / "hf2")
  assert exported.keys() == again.keys()
  for k in exported:
    np.testing.assert_array_equal(exported[k], again[k], err_msg=k)
  # The generate entry point as 2 processes: each generates, process 0 prints what one
  # process alone prints.
  generate = ["-m", "sage_jax.generate", f"--model={workdir / 'hf'}", "--prompt=hi",
              "--max_new_tokens=4"]
  two = _launch_entry(tmp_path / "generate", *generate)
  one = subprocess.run([sys.executable, *generate], env={**_env(), "JAX_PLATFORMS": "cpu"},
                       cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
  launched = [line for line in two.splitlines() if line.startswith("launch: process")]
  assert len(launched) == 2
  assert two.replace("\n".join(launched) + "\n", "") == one.stdout
