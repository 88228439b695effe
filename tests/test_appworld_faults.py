"""Agent code that misbehaves: a clear observation or an error result, and the pool goes on."""

import asyncio
import glob
import logging
import multiprocessing
import os
import random
import re
import signal
import threading
import time

import pytest

from sage_jax.envs import appworld
from sage_jax.envs.appworld import process
from sage_jax.envs.appworld import sandbox
from tests.appworld_fixtures import all_task_ids
from tests.appworld_fixtures import children
from tests.appworld_fixtures import gold_solution
from tests.appworld_fixtures import kill_busy_workers
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config
from tests.appworld_fixtures import pool_templates
from tests.appworld_fixtures import template_pid

# Spins in C (builtin sum over a range never checks for signals), where AppWorld's SIGALRM
# cannot interrupt it: the worker kills the episode process at its own deadline.
C_LEVEL_HANG = "print(sum(range(10**13)))"
# Switches AppWorld's timeout off by a name its guard does not see, then loops.
DISGUISED_ALARM_OFF = ("s = __import__('sig' + 'nal')\ngetattr(s, 'al' + 'arm')(0)\n"
                       "while True:\n    pass")
STOPPED = "was stopped with its process. This episode has ended."
# The module's pool's disk budget per episode: a gold episode's files take ~50 KB, and the
# logs of the 50 MB print below must fit.
DISK_BUDGET_MB = 96

# code -> what the observation says. Every one is the agent's doing: none kills the worker.
FAULTS = {
  "infinite_loop": ("while True:\n    pass", "timed out after"),
  "import_subprocess": ("import subprocess\nsubprocess.run(['ls'])", "subprocess"),
  "os_system": ("import os\nos.system('ls')", "os.system"),
  "open_file": ("print(open('/etc/passwd').read())", "open"),
  "huge_print": ("print('x' * 50_000_000)", "output truncated"),
  "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))",
                  "MemoryError"),
  "os_exit": ("import os\nos._exit(1)", "os._exit"),
  "exception": ("raise ValueError('agent bug')", "ValueError: agent bug"),
  # Text UTF-8 cannot hold failed AppWorld's log of the block (and every later one).
  "lone_surrogate": ("print('name:', chr(0xD800))", "name: ?"),
  "abort": ("import os\nos.abort()", "ended its own process (killed by SIGABRT)"),
  "c_level_hang": (C_LEVEL_HANG, STOPPED),
  "disguised_alarm_off": (DISGUISED_ALARM_OFF, STOPPED),
  # AppWorld patches subprocess to no-ops; posix.execv is the real system call.
  "disguised_exec": ("getattr(__import__('pos' + 'ix'), 'exe' + 'cv')('/bin/true', ['true'])",
                     "PermissionError"),
  # AppWorld patches os.system to a no-op; posix.system is the real one. Exit status 127:
  # the shell could not be started (no new process, no exec).
  "disguised_os_system": ("print(getattr(__import__('pos' + 'ix'), 'sys' + 'tem')('true'))",
                          "32512"),
  "raise_memory_limit": ("r = __import__('reso' + 'urce')\n"
                         "r.setrlimit(r.RLIMIT_AS, (r.RLIM_INFINITY, r.RLIM_INFINITY))",
                         "not allowed to raise maximum limit"),
  "tcp_connect": ("__import__('soc' + 'ket').create_connection(('127.0.0.1', 9), timeout=1)",
                  "PermissionError"),
  # posix.* are the real system calls behind AppWorld's patched os.* names.
  "kill_the_worker": ("o = __import__('pos' + 'ix')\ngetattr(o, 'ki' + 'll')(o.getppid(), 9)",
                      "PermissionError"),
  # AppWorld's save of the block, in the process the code ran in, fails on what the code
  # changed there: the code's failure, not an environment fault left out of training.
  "broken_save": ("o = __import__('o' + 's')\no.makedirs = None",
                  "AppWorld failed after the code ran (TypeError"),
  # No process to kill it from: the fork is refused (seccomp).
  "fork_and_kill_the_worker": (
    "o = __import__('pos' + 'ix')\nparent = o.getppid()\n"
    "if getattr(o, 'fo' + 'rk')() == 0:\n    getattr(o, 'ki' + 'll')(parent, 9)\n"
    "    getattr(o, '_ex' + 'it')(0)\nprint('forked')", "PermissionError"),
}
# The kernel features the escapes above meet (sandbox.py).
needs_signal_scoping = pytest.mark.skipif(sandbox.landlock_abi() < 6,
                                          reason="Landlock signal scoping needs ABI >= 6")


@pytest.fixture(scope="module")
def pool(mini_root, tmp_path_factory):  # noqa: F811
  outputs = str(tmp_path_factory.mktemp("fault_outputs"))
  # AppWorld's limit stays one that gold solutions meet on a busy CPU (the cores are shared
  # with other test processes); a short kill grace, so that the hang faults resolve sooner.
  # The faults below aim past the code guard (they reach posix, signal, resource through
  # __import__) at the limits beneath it: off here (tests/test_code_guard.py tests it).
  config = pool_config(mini_root, outputs, kill_grace_s=2.0, keep_outputs=False,
                       code_guard=False, max_output_mb=DISK_BUDGET_MB)
  with appworld.EnvPool(config) as pool:
    yield pool


def _check_gold_still_passes(pool, root, task_id, experiment):
  with pool.episode(task_id, experiment) as ep:
    ep.execute(gold_solution(root, task_id)).result()
  assert ep.result.success, ep.result


@needs_signal_scoping
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_gives_observation_and_the_next_episode_is_served(pool, mini_root, fault):  # noqa: F811
  code, expected = FAULTS[fault]
  task_id = all_task_ids(mini_root)[0]
  restarts = pool.worker_restarts
  name = fault.replace("memory", "mem")  # see test_experiment_names_must_not_say_memory
  with pool.episode(task_id, f"fault_{name}") as ep:
    observation = ep.execute(code).result()
    assert len(observation) <= pool.config.max_output_chars + 100
    assert expected in observation, observation[:300]
    if "This episode has ended." in observation:
      assert ep.execute("print(1)").result() == observation  # nothing runs any more
  result = ep.result
  assert result is not None and result in pool.results
  assert result.error is None and result.evaluation is not None  # the agent's failure
  assert not result.success and result.num_steps == 1
  assert pool.worker_restarts == restarts  # no agent code got the worker killed
  _check_gold_still_passes(pool, mini_root, all_task_ids(mini_root)[1], f"after_{name}")


def test_experiment_names_must_not_say_memory(pool, mini_root):  # noqa: F811
  with pytest.raises(ValueError, match="contains 'memory'"):
    pool.begin(all_task_ids(mini_root)[0], "memory_bomb")


def test_hard_timeout_stops_the_code_near_appworlds_limit(pool, mini_root):  # noqa: F811
  start = time.monotonic()
  with pool.episode(all_task_ids(mini_root)[0], "alarm_deadline") as ep:
    observation = ep.execute(DISGUISED_ALARM_OFF).result()
  elapsed = time.monotonic() - start
  config = pool.config
  assert STOPPED in observation
  # Well before the pool's own call_timeout_s, which would have cost the worker.
  assert config.timeout_seconds + config.kill_grace_s <= elapsed < config.call_timeout_s


def test_answers_are_out_of_reach_of_agent_code(pool, mini_root):  # noqa: F811
  own, other = all_task_ids(mini_root)[0], appworld.read_split(mini_root, "test")[-1]
  tasks = os.path.join(mini_root, "data", "tasks")
  code = (
    "import pathlib\n"
    f"tasks = pathlib.Path({tasks!r})\n"
    "print('GLOB', sorted(str(p) for p in tasks.glob('*/ground_truth/*')))\n"
    f"for relative in ['{own}/ground_truth/solution.py', '{own}/ground_truth/answer.json',\n"
    f"                 '{other}/ground_truth/private_data.json', '{other}/specs.json']:\n"
    "    try:\n"
    "        print('READ', relative, len((tasks / relative).read_text()))\n"
    "    except OSError as e:\n"
    "        print('DENIED', relative, type(e).__name__)\n"
    "io = __import__('_i' + 'o')\n"
    "try:\n"
    f"    io.FileIO({os.path.join(tasks, own, 'ground_truth', 'solution.py')!r}).read()\n"
    "except OSError as e:\n"
    "    print('DENIED FileIO', type(e).__name__)\n"
    f"for relative in ['{own}/ground_truth/answer.json', '{other}/ground_truth/answer.json',\n"
    f"                 '{own}/specs.json']:\n"
    "    try:\n"
    "        print('SIZE', relative, (tasks / relative).stat().st_size)\n"
    "    except OSError as e:\n"
    "        print('NO SIZE', relative, type(e).__name__)\n")
  with pool.episode(own, "read_answers") as ep:
    observation = ep.execute(code).result()
  assert "GLOB []" in observation, observation
  # Where the kernel lets an unprivileged process make a mount namespace (as here), the
  # episode sees nothing of the tasks directory but its own task's public files: answers
  # are not there to read, nor to `stat` (Landlock governs reads, not metadata). Elsewhere
  # Landlock still refuses every read.
  hidden = "the data's other files hidden, their sizes too (mount namespace)" in (
      pool._template.protections)
  assert hidden or not sandbox.hiding_available(tasks)  # used wherever the kernel allows it
  refused = "FileNotFoundError" if hidden else "PermissionError"
  for relative in (f"{own}/ground_truth/solution.py", f"{own}/ground_truth/answer.json",
                   f"{other}/ground_truth/private_data.json", f"{other}/specs.json"):
    assert f"DENIED {relative} {refused}" in observation, observation
  assert f"DENIED FileIO {refused}" in observation
  assert "READ" not in observation
  assert f"\nSIZE {own}/specs.json" in "\n" + observation  # its own public files are there
  if hidden:
    assert f"NO SIZE {own}/ground_truth/answer.json FileNotFoundError" in observation
    assert f"NO SIZE {other}/ground_truth/answer.json FileNotFoundError" in observation
  _check_gold_still_passes(pool, mini_root, own, "after_read_answers")


def test_writes_outside_the_experiment_directory_fail(pool, mini_root, tmp_path):  # noqa: F811
  task_id = all_task_ids(mini_root)[0]
  experiments = os.path.join(pool.outputs_root, "experiments", "outputs")
  inside = os.path.join(experiments, "writes", "tasks", task_id, "inside.txt")
  outside = [str(tmp_path / "escape.txt"), os.path.join(mini_root, "escape.txt"),
             os.path.join(experiments, "other_experiment.txt"),
             os.path.join(experiments, "writes", "tasks", "other_task.txt")]
  code = (
    "import pathlib\nio = __import__('_i' + 'o')\n"
    f"for path in {outside!r}:\n"
    "    pathlib.Path(path).write_text('x')  # AppWorld's guard makes this a no-op\n"
    "    try:\n"
    "        io.FileIO(path, 'w').write(b'x')\n"
    "        print('WROTE', path)\n"
    "    except OSError as e:\n"
    "        print('DENIED', type(e).__name__)\n"
    f"io.FileIO({inside!r}, 'w').write(b'x')\n")
  with pool.episode(task_id, "writes") as ep:
    observation = ep.execute(code).result()
    assert os.path.exists(inside), observation  # its own directory is writable
  assert observation.count("DENIED PermissionError") == len(outside), observation
  assert not any(os.path.exists(p) for p in outside)


# Writes through the real system calls (AppWorld's guard makes open and pathlib's writes
# no-ops or refuses them): `put(name, size)` writes one file of `size` bytes in one call.
PUT = ("o = __import__('pos' + 'ix')\n"
       "def put(name, size):\n"
       "    fd = o.open(name, o.O_WRONLY | o.O_CREAT, 0o644)\n"
       "    print('wrote', o.write(fd, b'x' * size))\n"
       "    o.close(fd)\n")
OVER_BUDGET = re.compile(r"files took too much disk: its directory took ([0-9.]+) MB, more "
                         rf"than its {DISK_BUDGET_MB} MB budget; the code {re.escape(STOPPED)}")


@pytest.mark.parametrize("flood", ["one_file", "many_files"])
def test_an_episode_over_its_disk_budget_ends_and_its_files_are_removed(pool, mini_root,  # noqa: F811
                                                                        flood):
  budget = DISK_BUDGET_MB * 2**20
  code = PUT + (f"put('flood', {4 * budget})" if flood == "one_file" else
                f"for i in range(400):\n    put(f'flood{{i}}', {budget // 16})")
  task_id = all_task_ids(mini_root)[0]
  directory = os.path.join(pool.outputs_root, "experiments", "outputs", f"disk_{flood}",
                           "tasks", task_id)
  restarts = pool.worker_restarts
  with pool.episode(task_id, f"disk_{flood}") as ep:
    assert "wrote 1" in ep.execute(PUT + "put('small', 1)").result()  # within the budget
    observation = ep.execute(code).result()
    took = OVER_BUDGET.search(observation)
    assert took, observation[:500]
    assert not os.path.exists(directory)  # freed at once, not when the episode closes
    assert ep.execute("print(1)").result() == observation  # the episode has ended
  if flood == "one_file":  # the file stopped growing at the budget (RLIMIT_FSIZE)
    assert float(took.group(1)) < DISK_BUDGET_MB + 1
  result = ep.result
  assert result.error is None and not result.success  # the agent's failure, not the pool's
  assert "more than its disk budget" in result.evaluation.refused
  assert pool.worker_restarts == restarts
  _check_gold_still_passes(pool, mini_root, all_task_ids(mini_root)[1], f"after_disk_{flood}")


@pytest.fixture
def unconfined_pool(mini_root, tmp_path):  # noqa: F811
  """A pool with sandbox="off": confined agent code starts no process at all
  (tests/test_sandbox_syscalls.py), unconfined code can, and the worker still ends it.
  Closed after its test: the tests below count this module's pool's processes."""
  config = pool_config(mini_root, str(tmp_path), num_workers=1, sandbox="off",
                       code_guard=False)
  with appworld.EnvPool(config) as pool:
    yield pool


def test_processes_forked_by_agent_code_end_with_the_episode(unconfined_pool,
                                                            mini_root):  # noqa: F811
  code = ("o = __import__('pos' + 'ix')\npid = getattr(o, 'fo' + 'rk')()\n"
          "if pid == 0:\n    o.setsid()  # a session of its own, out of the process group\n"
          "    while True:\n        pass\nprint('PID', pid)")
  with unconfined_pool.episode(all_task_ids(mini_root)[0], "left_behind") as ep:
    pid = int(ep.execute(code).result().split()[1])
    assert os.path.exists(f"/proc/{pid}")
  assert not os.path.exists(f"/proc/{pid}")


def test_a_fork_that_returns_from_agent_code_never_answers_for_the_episode(unconfined_pool,
                                                                        mini_root):  # noqa: F811
  # The child returns from agent code into the episode process's own code: it must end there,
  # not save over the episode's databases or send the pool a second answer.
  code = ("o = __import__('pos' + 'ix')\npid = getattr(o, 'fo' + 'rk')()\n"
          "print('child' if pid == 0 else 'parent')")
  with unconfined_pool.episode(all_task_ids(mini_root)[0], "fork_returns") as ep:
    for i in range(3):
      assert "parent" in ep.execute(code).result()
      assert f"step {i}" in ep.execute(f"print('step {i}')").result()


def test_steps_count_every_execution_once(pool, mini_root):  # noqa: F811
  task_id = all_task_ids(mini_root)[0]
  with pool.episode(task_id, "steps") as ep:
    for code in ("import subprocess", "raise ValueError('x')", FAULTS["infinite_loop"][0],
                 "print(1)"):  # blocked, failed, timed out, ran
      ep.execute(code).result()
    assert ep.num_steps == 4
    assert STOPPED in ep.execute(C_LEVEL_HANG).result()  # killed: a step too
    ep.execute("print(1)").result()  # answered by the ended episode: nothing ran
  assert ep.result.num_steps == 5


def _kill_busy_workers_soon(delay_s: float) -> threading.Timer:
  """`kill_busy_workers` in `delay_s` seconds, while the episode runs its code."""
  timer = threading.Timer(delay_s, kill_busy_workers)
  timer.start()
  return timer


def test_a_worker_killed_from_outside_is_an_environment_error(pool, mini_root):  # noqa: F811
  restarts = pool.worker_restarts
  with pool.episode(all_task_ids(mini_root)[0], "killed_from_outside") as ep:
    _kill_busy_workers_soon(1.0)
    observation = ep.execute(FAULTS["infinite_loop"][0]).result()
  assert "EnvironmentError" in observation and ep.error
  assert ep.result.error and ep.result.evaluation is None and ep.result.num_steps == 1
  assert pool.worker_restarts > restarts
  _check_gold_still_passes(pool, mini_root, all_task_ids(mini_root)[1], "after_outside_kill")


def test_a_worker_killed_while_evaluating_leaves_nothing_once_the_pool_closes(mini_root,  # noqa: F811
                                                                              tmp_path):
  """A worker killed mid-evaluation cannot remove the copy of the saved state its evaluation
  made: the copy is in the pool's own directory, which the pool's close removes (the
  configured outputs stay)."""
  task_id = all_task_ids(mini_root)[0]
  outputs = tmp_path / "outputs"
  with appworld.EnvPool(pool_config(mini_root, str(outputs), num_workers=1)) as pool:
    own = pool._scratch
    # On a loaded machine the evaluation may finish between the copy and the kill: then the
    # kill ended nothing, and the episode is played again.
    for attempt in range(5):
      with pool.episode(task_id, f"killed_evaluating_{attempt}") as ep:
        ep.execute(gold_solution(mini_root, task_id)).result()
        evaluation = ep.evaluate()
        deadline = time.monotonic() + 60
        while not (copies := glob.glob(os.path.join(own, "sage_jax_evaluation_*"))):
          assert not evaluation.done() and time.monotonic() < deadline, "no copy was made"
          time.sleep(0.002)
        assert kill_busy_workers([template_pid(pool)]) == 1
        error = evaluation.result().error
      if error is not None:
        break
    assert "died" in error
    assert ep.result.error and all(os.path.isdir(c) for c in copies)
  assert not os.path.exists(own)
  assert (outputs / "experiments" / "outputs" / f"killed_evaluating_{attempt}").is_dir()


def _pool_processes(num_workers: int = 0) -> dict[int, list[int]]:
  """This process's pool templates, each with the pids of its workers, once each template
  has `num_workers` (a slot replaces its worker after handing out the episode's result)."""
  deadline = time.monotonic() + 60
  while True:
    found = {template: [worker for worker, _ in children(template)]
             for template in pool_templates()}
    if all(len(w) >= num_workers for w in found.values()) or time.monotonic() > deadline:
      return found
    time.sleep(0.1)


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except OSError:
    return False


def test_workers_are_forks_of_one_template_which_is_replaced_when_it_dies(pool, mini_root):  # noqa: F811
  """A pool starts AppWorld once, in its template process, and forks its workers from it: a
  worker replaced after a fault is a new fork of the same template. A template killed from
  outside takes its workers with it: the episode under way ends as an environment error, and
  the next worker comes from a new template."""
  n = pool.config.num_workers
  (template, workers), = _pool_processes(n).items()
  assert len(workers) == n
  with pool.episode(all_task_ids(mini_root)[0], "killed_worker") as ep:
    _kill_busy_workers_soon(1.0)
    ep.execute(FAULTS["infinite_loop"][0]).result()
  assert ep.result.error
  (same, after), = _pool_processes(n).items()
  assert same == template and len(after) == n and set(after) != set(workers)

  with pool.episode(all_task_ids(mini_root)[0], "killed_template") as ep:
    threading.Timer(1.0, os.kill, (template, signal.SIGKILL)).start()
    observation = ep.execute(FAULTS["infinite_loop"][0]).result()
  assert "EnvironmentError" in observation and ep.result.error
  _check_gold_still_passes(pool, mini_root, all_task_ids(mini_root)[1], "after_template_kill")
  (new, _), = _pool_processes().items()
  assert new != template and not _running(template)
  assert not any(_running(pid) for pid in workers + after)


def test_a_failed_template_request_ends_neither_the_template_nor_its_workers(mini_root,  # noqa: F811
                                                                             tmp_path):
  """A request the template cannot serve (here: reaping a process that is not its worker;
  in a run: a fork refused by the process limit) fails alone: the template would take every
  worker, with its episode, down with it."""
  config = pool_config(mini_root, str(tmp_path))
  template = process.WorkerTemplate(config)
  try:
    worker = process.WorkerProcess(template, config, "w0")
    with pytest.raises(process.WorkerFault, match="ChildProcessError"):
      template.exit_code(os.getpid(), wait=False)
    assert template.alive and worker.alive
    assert worker.call({"op": "close"}, 30)["ok"]
    worker.kill()
    assert not worker.alive and not _running(worker.pid)
    assert process.WorkerProcess(template, config, "w1").call({"op": "close"}, 30)["ok"]
  finally:
    template.close()


def test_an_answer_that_is_not_json_is_a_worker_fault(mini_root, tmp_path):  # noqa: F811
  """A worker whose answer is not JSON (a protocol broken by a bug or a corrupted channel)
  is killed and faults, so that the pool restarts it and the episode gets an environment
  error, rather than handing the caller a decoding error with the worker still up. The
  worker is real; its channel is swapped for a pipe that carries such an answer."""
  config = pool_config(mini_root, str(tmp_path))
  template = process.WorkerTemplate(config)
  try:
    worker = process.WorkerProcess(template, config, "w0")
    real_channel, (ours, theirs) = worker._channel, multiprocessing.Pipe()
    worker._channel = ours
    theirs.send_bytes(b"\xff{not json")
    with pytest.raises(process.WorkerFault, match=r"w0 gave an answer that is not JSON while "
                       r"running 'close': b'\\xff\{not json'"):
      worker.call({"op": "close"}, 30)
    assert not worker.alive and not _running(worker.pid)
    real_channel.close()
    assert template.alive
  finally:
    template.close()


@pytest.mark.slow
def test_hundred_episodes_with_random_faults_give_hundred_records(pool, mini_root):  # noqa: F811
  rng = random.Random(0)
  task_ids = all_task_ids(mini_root)
  plan = []
  for i in range(100):
    task_id = task_ids[i % len(task_ids)]
    roll = rng.random()
    if roll < 0.03:
      plan.append((task_id, "kill_workers"))  # an environment fault, from outside
    elif roll < 0.35:
      plan.append((task_id, FAULTS[rng.choice(sorted(FAULTS))][0]))
    else:
      plan.append((task_id, gold_solution(mini_root, task_id)))
  if not any(code == "kill_workers" for _, code in plan):  # at least one, whatever the draws
    plan[rng.randrange(len(plan))] = (task_ids[0], "kill_workers")
  before = len(pool.results)

  async def one(i, task_id, code):
    async with pool.episode(task_id, f"random_{i}") as ep:
      if code == "kill_workers":
        _kill_busy_workers_soon(1.0)
        code = FAULTS["infinite_loop"][0]
      observation = await ep.execute(code)
      await ep.evaluate()
    return ep.result, observation

  async def run():
    return await asyncio.gather(*(one(i, t, c) for i, (t, c) in enumerate(plan)))

  results, observations = zip(*asyncio.run(run()))
  assert len(results) == 100 and all(r is not None for r in results)
  assert len(pool.results) - before == 100
  assert any(r.error for r in results)
  faults = [r for r, (t, c) in zip(results, plan) if c != gold_solution(mini_root, t)]
  assert not any(r.success for r in faults)
  # A gold episode fails only when a worker was killed under it, from outside.
  golds = [(r, o) for r, o, (t, c) in zip(results, observations, plan)
           if c == gold_solution(mini_root, t)]
  failed = [(r, o) for r, o in golds if r.error is None and not r.success]
  assert not failed, failed  # each with the observation that says why
  assert sum(r.error is not None for r, _ in golds) <= 2 * sum(c == "kill_workers" for _, c in plan)


def test_data_inside_what_agent_code_reads_is_refused(tmp_path):
  with pytest.raises(sandbox.SandboxError, match="lies inside"):
    sandbox.check_secret_not_readable([str(tmp_path / "venv")], str(tmp_path / "venv" / "data"))
  sandbox.check_secret_not_readable([str(tmp_path / "venv")], str(tmp_path / "venv2"))


def test_without_landlock_confinement_refuses_and_says_how_to_opt_out(monkeypatch):
  monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
  assert sandbox.protections() == []
  with pytest.raises(sandbox.SandboxError, match="sandbox='off'.*read every task's answers"):
    sandbox.confine([], [])


def test_sandbox_off_is_the_documented_weaker_mode(mini_root, tmp_path, caplog):  # noqa: F811
  task_id = all_task_ids(mini_root)[0]
  solution = os.path.join(mini_root, "data", "tasks", task_id, "ground_truth", "solution.py")
  config = pool_config(mini_root, str(tmp_path), num_workers=1, sandbox="off")
  with caplog.at_level(logging.INFO), appworld.EnvPool(config) as pool:
    with pool.episode(task_id, "unconfined") as ep:
      observation = ep.execute(f"import pathlib\nprint(len(pathlib.Path({solution!r})"
                               ".read_text()))").result()
  assert observation.strip() == str(len(gold_solution(mini_root, task_id)))
  assert any("NOT AT ALL" in r.getMessage() for r in caplog.records)
