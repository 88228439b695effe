"""Shared fixtures of the AppWorld tests: one cached mini world per session, and the demo's SFT
data made once for every test worker."""

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from sage_jax.envs import appworld

WORKER_COMMAND = b"sage_jax.envs.appworld.worker"


@pytest.fixture(scope="session")
def mini_root() -> str:
  return appworld.ensure_mini_world()


@pytest.fixture(scope="session")
def demo_expert_file(mini_root, tmp_path_factory) -> str:
  """The demo's SFT data as its pipeline makes it (the gold plays of the mini train split, which
  the demo names in expert.splits, and their rewrites; tests/test_demo.py checks the bytes
  against a run's own), made once for the session's test workers: runs that do not test that
  stage read it through `pipeline.expert_trajectories` instead of playing the split again
  (~30 s a run)."""
  from configs import sage as sage_configs  # noqa: PLC0415
  from sage_jax import run_config  # noqa: PLC0415
  from sage_jax.agent.retrieval import Retriever  # noqa: PLC0415
  from sage_jax.sft import data as sft_data  # noqa: PLC0415
  from sage_jax.sft import expert  # noqa: PLC0415
  from sage_jax.tokenizer import Tokenizer  # noqa: PLC0415

  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's
  path = shared / "demo_expert_trajectories.jsonl"
  with open(shared / "demo_expert_trajectories.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      run = run_config.resolve(sage_configs.get_config("demo"))
      config = dataclasses.replace(run.expert, appworld_root=mini_root,
                                   outputs_root=str(shared / "demo_expert_outputs"))
      task_ids = [t for split in run.expert.splits for t in appworld.read_split(mini_root, split)]
      trajectories, _ = expert.gold_trajectories(task_ids, config, Tokenizer(), agent=run.agent,
                                                 retriever=Retriever(run.retrieval))
      sft_data.write_jsonl(f"{path}.partial", trajectories)
      os.replace(f"{path}.partial", path)
  return str(path)


def task_dir(root: str, task_id: str) -> str:
  return os.path.join(root, "data", "tasks", task_id)


def gold_solution(root: str, task_id: str) -> str:
  with open(os.path.join(task_dir(root, task_id), "ground_truth", "solution.py")) as f:
    return f.read()


def ground_truth_answer(root: str, task_id: str):
  with open(os.path.join(task_dir(root, task_id), "ground_truth", "answer.json")) as f:
    return json.load(f)


def all_task_ids(root: str) -> list[str]:
  return [t for split in ("train", "dev", "test") for t in appworld.read_split(root, split)]


def pool_config(root: str, outputs: str, **overrides) -> appworld.EnvPoolConfig:
  """Limits that hold for gold solutions on a busy 2-core CPU: test files run in parallel
  and CI runs other jobs too (a gold solution that takes 1.5 s alone has taken over 5 s)."""
  values = dict(num_workers=2, appworld_root=root, outputs_root=outputs, timeout_seconds=20,
                call_timeout_s=90.0, start_timeout_s=120.0, memory_limit_mb=1536,
                max_interactions=20, max_output_chars=5000)
  return appworld.EnvPoolConfig(**(values | overrides))


def scripted_eval_config(**eval_overrides):
  """An evaluation config of the scripted expert (configs/eval.py's sections), on the mini dev
  split unless `eval_overrides` say otherwise."""
  import ml_collections  # noqa: PLC0415

  c = ml_collections.ConfigDict()
  c.eval = dict(split="dev", data="mini", policy="scripted", experiment="eval_scripted",
                appworld_check=True) | eval_overrides
  c.agent = dict(max_steps=4)
  c.retrieval = dict(strategy="same_scenario")
  c.pool = dict()
  c.model = dict(spec="", preset="tiny")
  c.engine = dict()
  return c


def appworld_metrics(outputs_root: str, experiment: str, task_ids: list[str]) -> dict:
  """AppWorld's own TGC/SGC of an experiment, computed in a separate process."""
  code = (
    "import json, sys\n"
    "from appworld.evaluator import evaluate_tasks\n"
    "m = evaluate_tasks(json.loads(sys.argv[1]), experiment_name=sys.argv[2],"
    " include_details=True, save_reports=False)\n"
    "sys.__stdout__.write('METRICS' + json.dumps(m['aggregate']))\n")
  done = subprocess.run([sys.executable, "-c", code, json.dumps(task_ids), experiment],
                        capture_output=True, text=True, check=True,
                        env=dict(os.environ, APPWORLD_ROOT=outputs_root))
  return json.loads(done.stdout.rpartition("METRICS")[2])


# --- An official-style dataset: the mini world's data with gold solutions in AppWorld's form --

OFFICIAL_SCENARIOS = ("1d3abf7", "e95e02e", "ead7476")  # an action, an answer, a float value
CANARY = "# Canary String: appworld:0000000:00000000-0000-0000-0000-000000000000\n"
COMPILED_HEADER = (CANARY + "from appworld.collections.apis import ApiCollection\n"
                   "from appworld.requester import Requester\n\n\n")
# The task generator's program, as AppWorld ships it beside the compiled solution: it needs
# the generator's inputs (main_user, public_data) and packages the worlds block.
GENERATOR_SOLUTION = CANARY + """from typing import Any

from icecream import ic as ic
from munch import Munch

from appworld.apps.admin.models import MainUserMunch
from appworld.collections.apis import ApiCollection
from appworld.common.utils import AnswerType, find_all_from_pages
from appworld.requester import Requester


def ic_output_handler(*args: Any) -> str:
    print()
    return ">> "


ic.configureOutput(ic_output_handler)


def solution(
    main_user: MainUserMunch, apis: ApiCollection, requester: Requester, public_data: Munch
) -> AnswerType:
    answer = _solution(main_user, apis, requester, public_data)
    apis.supervisor.complete_task(answer=answer, status="success")
    return answer


def _solution(
    main_user: MainUserMunch, apis: ApiCollection, requester: Requester, public_data: Munch
) -> AnswerType:
    access_token = apis.venmo.access_token_from(main_user)
    return find_all_from_pages(apis.venmo.show_transactions, access_token=access_token)
"""


def official_form(solution: str) -> str:
  """A mini-world gold solution (procedure + call + complete_task) rewritten the way
  AppWorld's own data writes them: `def solution(apis, requester):` with the call's values
  substituted into the procedure's body and its result given to complete_task."""
  import ast
  import copy

  tree = ast.parse(solution)
  fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
  rest = [n for n in tree.body if n is not fn]
  call_stmt = next(n for n in rest if isinstance(getattr(n, "value", None), ast.Call)
                   and getattr(n.value.func, "id", None) == fn.name)
  values = dict(zip([a.arg for a in fn.args.args], call_stmt.value.args))

  class Inline(ast.NodeTransformer):
    def visit_Name(self, node):  # noqa: N802 - ast's name
      return copy.deepcopy(values[node.id]) if node.id in values else node

  body = [Inline().visit(copy.deepcopy(s)) for s in fn.body]
  if any(isinstance(n, ast.Return) for s in body[:-1] for n in ast.walk(s)):
    raise ValueError(f"{fn.name} returns early: not convertible")
  if isinstance(body[-1], ast.Return):
    last = body.pop()
    target = call_stmt.targets if isinstance(call_stmt, ast.Assign) else None
    body.append(ast.Assign(targets=target, value=last.value) if target else ast.Expr(last.value))
  body += [s for s in rest if s is not call_stmt]
  new = ast.FunctionDef(name="solution", args=ast.arguments(
      posonlyargs=[], args=[ast.arg("apis", ast.Name("ApiCollection")),
                            ast.arg("requester", ast.Name("Requester"))],
      kwonlyargs=[], kw_defaults=[], defaults=[]), body=body, decorator_list=[],
      returns=ast.Constant(None))
  return COMPILED_HEADER + ast.unparse(ast.fix_missing_locations(new)) + "\n"


def _copy_tree(src: str, dst: str) -> None:
  """Copies files without their (read-only) modes."""
  import shutil
  for d, _, files in os.walk(src):
    out = os.path.join(dst, os.path.relpath(d, src))
    os.makedirs(out, exist_ok=True)
    for f in files:
      shutil.copyfile(os.path.join(d, f), os.path.join(out, f))


@pytest.fixture(scope="session")
def official_root(mini_root, tmp_path_factory) -> str:
  """An APPWORLD_ROOT in AppWorld's format holding OFFICIAL_SCENARIOS (split "train") with
  official-form gold solutions (compiled_solution.py, and the generator's solution.py)."""
  root = str(tmp_path_factory.mktemp("official_appworld"))
  data = os.path.join(mini_root, "data")
  for part in ("base_dbs", "api_docs"):
    _copy_tree(os.path.join(data, part), os.path.join(root, "data", part))
  task_ids = [t for t in all_task_ids(mini_root) if t.split("_")[0] in OFFICIAL_SCENARIOS]
  for task_id in task_ids:
    _copy_tree(task_dir(mini_root, task_id), task_dir(root, task_id))
    truth = os.path.join(task_dir(root, task_id), "ground_truth")
    with open(os.path.join(truth, "compiled_solution.py"), "w") as f:
      f.write(official_form(gold_solution(mini_root, task_id)))
    with open(os.path.join(truth, "solution.py"), "w") as f:
      f.write(GENERATOR_SOLUTION)
  os.makedirs(os.path.join(root, "data", "datasets"))
  with open(os.path.join(root, "data", "datasets", "train.txt"), "w") as f:
    f.write("\n".join(sorted(task_ids)) + "\n")
  return root


def children(pid: int) -> list[tuple[int, bytes]]:
  """(pid, command line) of the processes whose parent is `pid`."""
  found = []
  for name in os.listdir("/proc"):
    try:
      with open(f"/proc/{name}/stat") as f:
        parent = int(f.read().rpartition(")")[2].split()[1])
      with open(f"/proc/{name}/cmdline", "rb") as f:
        command = f.read()
    except (OSError, ValueError, IndexError):
      continue
    if parent == pid:
      found.append((int(name), command))
  return found


def pool_templates() -> list[int]:
  """The template processes of this process's pools (their workers are their children)."""
  return [pid for pid, command in children(os.getpid()) if WORKER_COMMAND in command]


@contextlib.contextmanager
def broken_pool(root: str, tmp_path: Any, **overrides) -> Iterator[appworld.EnvPool]:
  """A one-worker pool of a copy of `root` whose data went away after it started (the copy
  renamed) and whose template process then died: no worker can be started any more, so
  every episode fails under the environment, before it opens its world."""
  data = os.path.join(tmp_path, "data_volume")
  _copy_tree(root, data)
  config = pool_config(data, os.path.join(tmp_path, "outputs"), **({"num_workers": 1}
                                                                    | overrides))
  with appworld.EnvPool(config) as pool:
    os.rename(data, data + "_unmounted")
    os.kill(template_pid(pool), signal.SIGKILL)
    yield pool


def template_pid(pool: appworld.EnvPool) -> int:
  """The process `pool`'s workers are forked from, now."""
  return pool._template._proc.pid


def kill_busy_workers(templates: list[int] | None = None) -> int:
  """Kills, from outside (an environment fault), each worker of `templates` (default: of
  every pool of this process) that is running an episode (has a child); returns how many."""
  killed = 0
  for template in pool_templates() if templates is None else templates:
    for worker, _ in children(template):
      if children(worker):
        os.kill(worker, signal.SIGKILL)
        killed += 1
  return killed


class WorkerKillingPolicy:
  """Wraps a policy: before its first turn in the first `kills[task_id]` episodes of a task,
  kills the busy workers of `pool` from outside (an environment fault under the episode)."""

  def __init__(self, inner: Any, pool: appworld.EnvPool, kills: dict[str, int]):
    self.inner, self.kills, self.killed = inner, dict(kills), 0
    self._templates = [template_pid(pool)]

  def session(self, context: Any) -> Any:
    inner, policy = self.inner.session(context), self
    kill = policy.kills.get(context.task_id, 0) > 0
    if kill:
      policy.kills[context.task_id] -= 1

    class Session:
      async def generate(self, request):
        nonlocal kill
        if kill:
          kill = False
          policy.killed += kill_busy_workers(policy._templates)
        return await inner.generate(request)

      async def close(self):
        await inner.close()

    return Session()
