"""Skill events observed at run time in the real AppWorld worker, and the SAGE rewards on them:
honest skill use and generation earn the bonuses; gaming attempts (swallowed exceptions,
dead branches, a failed call then a hand-written solution, a redefinition after a failure)
earn none."""

import asyncio
import dataclasses
import textwrap

import pytest

from sage_jax.agent import AgentConfig, Retriever, gold_solutions, parsing
from sage_jax.agent.library import SkillLibrary, install_code
from sage_jax.agent.skills import BlockTrace, SkillTracker, analyze
from sage_jax.envs import appworld
from sage_jax.rl import rewards, rollout
from sage_jax.sft.expert import ReplayPolicy
from sage_jax.tokenizer import Tokenizer
from tests import test_calltrace_versions as calltrace_cases
from tests.appworld_fixtures import gold_solution
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config

SCENARIO = "1d3abf7"  # save_note_to_file(title, file_path)
SKILL = "save_note_to_file"
MISSING = f"{SKILL}('No such note', '~/documents/nothing.txt')\n"  # raises StopIteration


def block(text: str) -> str:
  return textwrap.dedent(text).strip() + "\n"


def fenced(code: str) -> str:
  return f"```python\n{code.strip()}\n```"


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


@pytest.fixture(scope="module")
def pool(mini_root, tmp_path_factory):  # noqa: F811
  outputs = str(tmp_path_factory.mktemp("skill_event_outputs"))
  with appworld.EnvPool(pool_config(mini_root, outputs)) as pool:
    yield pool


@pytest.fixture(scope="module")
def gold(mini_root):  # noqa: F811
  """Task 1's skill-format turn (defines and calls the skill) and task 2's gold solution."""
  first = gold_solutions.expert_turns(gold_solution(mini_root, f"{SCENARIO}_1"))[0]
  return parsing.extract_code(first).code, gold_solution(mini_root, f"{SCENARIO}_2")


def run_blocks(pool, task_id, blocks, library_code=None, outputs=None):
  """Executes `blocks` in one episode; returns the tracker fed with the worker's traces.
  `outputs`: a list that gets each block's output."""
  library = {f.name: f.calls for f in analyze(library_code or "").functions}
  tracker = SkillTracker(library)

  async def go():
    async with pool.episode(task_id, "events", library_code=library_code) as ep:
      assert ep.start.library_ok in (None, True), ep.start.library_output
      for code in blocks:
        output = await ep.execute(code)
        if outputs is not None:
          outputs.append(output)
        tracker.observe(code, BlockTrace.from_dict(ep.last_trace), output)
    return ep.result

  return tracker, asyncio.run(go())


def run_where_installed(pool, tracker, code):
  """Saves what task 1's `tracker` saves, then runs `code` in task 2 with those skills
  installed; returns task 2's tracker and the output of `code`."""
  library = SkillLibrary()
  library.save(tracker.saved_functions(), scenario=SCENARIO, task_id=f"{SCENARIO}_1",
               instruction="")
  outputs = []
  tracker, _ = run_blocks(pool, f"{SCENARIO}_2", [code], install_code(library.skills(SCENARIO)),
                          outputs)
  return tracker, outputs[0]


# --- events, one episode each ----------------------------------------------------------------

def test_generated_needs_a_successful_call(pool, gold):
  first, _ = gold
  definition = first[:first.index(f"\n\n\n{SKILL}(")]
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", [definition])  # define only
  e = tracker.events()
  assert e.generated == () and e.saved == () and e.failed_definitions == (SKILL,)
  # Defined and called, but the block's last line fails: the skill worked, it is saved.
  tracker, result = run_blocks(pool, f"{SCENARIO}_1", [first + "1 / 0\n"])
  e = tracker.events()
  assert e.generated == (SKILL,) and e.saved == (SKILL,) and result.success
  assert tracker.saved_functions()[SKILL].source.startswith(f"def {SKILL}(")


def test_last_successful_version_is_saved(pool):
  blocks = [block("""
      def f(x):
          return x + 1

      f(1)
      """), block("""
      def f(x):
          raise ValueError(x)

      def f(x):  # redefined in the same block: this is the version that runs
          return x + 3

      f(1)
      """), block("""
      def f(x):
          raise ValueError(x)

      f(1)
      """)]
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", blocks)
  e = tracker.events()
  assert e.generated == ("f",) and e.saved == ("f",) and e.failed_definitions == ()
  assert "x + 3" in tracker.saved_functions()["f"].source


def test_library_use_direct_nested_and_through_task_function(pool):
  library = block("""
      def inner(x):
          return x * 2

      def outer(x):
          return inner(x) + 1

      def spare():
          return 0
      """)
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", ["outer(1)\n"], library)
  assert tracker.events().used == ("inner", "outer")
  helper = block("""
      import functools

      @functools.lru_cache(maxsize=None)
      def helper(x):
          return inner(x)

      helper(2)
      """)
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", ["\n\n" + helper], library)
  e = tracker.events()
  assert e.used == ("inner",) and e.generated == ("helper",)  # decorated, shifted lines


def test_gaming_attempts_are_not_use(pool, gold):
  first, _ = gold
  library = first[:first.index(f"\n\n\n{SKILL}(")] + "\n"
  swallowed = block(f"""
      try:
          {MISSING}
      except Exception:
          pass
      """)
  dead = block(f"""
      if False:
          {SKILL}('Hardware store', '~/documents/hardware_store.txt')
      """)
  # A task function that ran the skill and then raised, swallowed: the skill's return is
  # discarded with it.
  wrapped = block(f"""
      def wrapper():
          {SKILL}('Hardware store', '~/documents/wrapped.txt')
          raise RuntimeError('changed my mind')

      try:
          wrapper()
      except RuntimeError:
          pass
      """)
  for blocks, failed in (([swallowed], (SKILL,)), ([dead], ()), ([MISSING], (SKILL,)),
                         ([wrapped], (SKILL,))):
    tracker, _ = run_blocks(pool, f"{SCENARIO}_2", blocks, library)
    e = tracker.events()
    assert e.used == () and e.failed_uses == failed and e.mentioned == (SKILL,), blocks
    assert e.generated == ()
  # Redefined after failing, then run: an update of the skill, not a use.
  tracker, _ = run_blocks(pool, f"{SCENARIO}_2", [MISSING, first], library)
  e = tracker.events()
  assert e.used == () and e.updated == (SKILL,) and e.saved == (SKILL,)


def test_a_use_whose_calls_ask_nothing_of_the_apps_is_idle(pool, gold):
  first, _ = gold
  library = first[:first.index(f"\n\n\n{SKILL}(")] + "\n\n" + block("""
      def nothing():
          return None

      def docs_only():
          return apis.api_docs.show_app_descriptions()

      def through(f):
          return f()

      def profile_pages():
          yield apis.supervisor.show_profile()

      def first_page():
          for page in profile_pages():
              return page
      """)
  code = block(f"""
      nothing()
      docs_only()
      through(lambda: {SKILL}('Hardware store', '~/documents/hardware_store.txt'))
      through(nothing)
      first_page()
      """)
  tracker, _ = run_blocks(pool, f"{SCENARIO}_2", [code], library)
  e = tracker.events()
  assert e.used == tuple(sorted((SKILL, "nothing", "docs_only", "through", "profile_pages",
                                 "first_page")))
  # `through` made a request in one of its calls (the skill's), not in the other.
  assert e.idle_uses == ("docs_only", "nothing")


def test_a_block_is_read_as_appworld_runs_it_and_builtin_names_are_not_saved(pool):
  """AppWorld runs a block stripped, so a leading \r (a line break to Python, not to a
  count of newlines) shifted every recorded line by one: the version of `f` that never ran
  was saved. A skill named like a builtin would turn ordinary code into skill use."""
  shifted = "\rdef f(x): return 'A: never ran'\ndef f(x): return 'B: ran'\nprint(f(1))\n"
  outputs = []
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", [shifted], outputs=outputs)
  assert outputs[0].strip() == "B: ran"
  assert "B: ran" in tracker.saved_functions()["f"].source
  shadowing = block("""
      def len(items):
          return 0

      print(len([1, 2]))
      """)
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", [shadowing])
  e = tracker.events()
  assert e.saved == e.generated == () and e.failed_definitions == ("len",)


# --- rewards on whole chains -----------------------------------------------------------------

def test_the_worker_records_reach_the_skill_events(pool):
  """The blocks whose call records `test_calltrace_versions` checks on a bare IPython
  (generators that yield then raise, or are left early, coroutines, calls that returned
  inside calls that raised...), run in the AppWorld worker: the library skills whose calls
  returned are used, those called that never did are failed uses."""
  library = {f.name for f in analyze(calltrace_cases.LIBRARY).functions}
  for code, (returned, failed) in calltrace_cases.BLOCKS.items():
    tracker, _ = run_blocks(pool, f"{SCENARIO}_1", [code], calltrace_cases.LIBRARY)
    e = tracker.events()
    assert (set(e.used), set(e.failed_uses)) == (returned & library, failed & library), code


def test_rewards_pay_only_for_skills_that_ran(pool, gold, mini_root, tok):  # noqa: F811
  first, task2 = gold
  by_hand = task2.replace(SKILL, "copy_note_by_hand")
  cases = {  # task 2's turns -> expected (rewards, used) of the chain
      "use": ([fenced(f"{SKILL}('Hardware store', '~/documents/hardware_store.txt')\n"
                      "apis.supervisor.complete_task()")], [2.0, 2.0], (SKILL,)),
      "swallowed": ([fenced(f"try:\n    {MISSING}except Exception:\n    pass\n\n{by_hand}")],
                    [1.0, 1.0], ()),
      "dead_branch": ([fenced(f"if False:\n    {MISSING}\n{by_hand}")], [1.0, 1.0], ()),
      "raised_then_by_hand": ([fenced(MISSING), fenced(by_hand)], [1.0, 1.0], ()),
      "redefined_after_failure": ([fenced(MISSING), fenced(task2)], [1.0, 1.0], ()),
      # Task 1 also saved a skill that does nothing, which task 2 calls: paid for by default,
      # not when idle uses earn nothing (below).
      "idle": ([fenced(f"noop()\n{by_hand}")], [2.0, 2.0], ("noop",)),
  }
  first_turns = {"idle": fenced("def noop():\n    return None\n\nnoop()\n\n" + first)}
  agent = AgentConfig()
  base = rollout.RolloutContext(None, pool, tok, agent, Retriever(), mini_root)
  chain = rollout.Chain(SCENARIO, (f"{SCENARIO}_1", f"{SCENARIO}_2"))

  async def run_all():
    jobs = []
    for g, (turns, _, _) in enumerate(cases.values()):
      turn = first_turns.get(list(cases)[g], fenced(first))
      policy = ReplayPolicy({chain.task_ids[0]: [turn], chain.task_ids[1]: turns}, tok)
      ctx = dataclasses.replace(base, policy=policy)
      jobs.append(rollout.run_chain(ctx, chain, group=g, rollout=0, experiment=f"reward{g}",
                                    library=SkillLibrary()))
    return await asyncio.gather(*jobs)

  results = asyncio.run(run_all())
  for (name, (_, expected, used)), records in zip(cases.items(), results):
    assert all(r.success for r in records), name
    assert records[1].events.used == used, name
    assert rewards.chain_rewards(records, rewards.RewardConfig()) == expected, name
  redefined = results[list(cases).index("redefined_after_failure")][1]
  assert redefined.events.updated == (SKILL,) and redefined.used_skill_sources == {}
  idle = results[list(cases).index("idle")]
  assert idle[0].events.saved == ("noop", SKILL) and idle[1].events.idle_uses == ("noop",)
  strict = rewards.RewardConfig(credit_idle_uses=False)
  assert rewards.chain_rewards(idle, strict) == [1.0, 1.0]
  assert rewards.chain_rewards(results[0], strict) == [2.0, 2.0]  # the skill's use requests


def test_install_code_round_trip_is_traced_as_library(pool, gold):
  """Library skills installed the way rollouts install them are recognised as the library."""
  first, _ = gold
  library = SkillLibrary()
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", [first])
  library.save(tracker.saved_functions(), scenario=SCENARIO, task_id=f"{SCENARIO}_1",
               instruction="")
  code = install_code(library.skills(SCENARIO))
  call = f"{SKILL}('Hardware store', '~/documents/hardware_store.txt')\n"
  tracker, result = run_blocks(pool, f"{SCENARIO}_2", [call], code)
  assert tracker.events().used == (SKILL,) and tracker.events().generated == ()


def test_a_skill_reads_the_constants_of_its_task_where_it_is_installed(pool):
  """A task binds an import and a constant in one block, then defines and calls a skill that
  reads them; another task's skill binds the same name to another value. Installed together
  in a third world, each reads its own, and both count as used."""
  library = SkillLibrary()
  for task, blocks in ((1, ["import json\nLIMIT = 2\n", block("""
      def first_items(items):
          return json.dumps(items[:LIMIT])

      print(first_items([1, 2, 3]))
      """)]), (2, [block("""
      LIMIT = 5
      def limit():
          return LIMIT

      print(limit())
      """)])):
    tracker, _ = run_blocks(pool, f"{SCENARIO}_{task}", blocks)
    library.save(tracker.saved_functions(), scenario=SCENARIO, task_id=f"{SCENARIO}_{task}",
                 instruction="")
  assert sorted(s.name for s in library.skills(SCENARIO)) == ["first_items", "limit"]
  outputs = []
  tracker, _ = run_blocks(pool, f"{SCENARIO}_3", ["print(first_items([1, 2, 3]), limit())\n"],
                          install_code(library.skills(SCENARIO)), outputs)
  assert outputs[0].strip() == "[1, 2] 5"
  assert tracker.events().used == ("first_items", "limit")


def test_a_skill_reading_a_value_its_task_computed_is_not_saved(pool):
  """A skill whose body reads what the task's code computed (an API result, a class, a
  constant set in a branch) ran here but would raise NameError where installed: it is not
  saved. One that calls another function of the task, or reads a literal constant, is."""
  blocks = [block("""
      import json
      WIDTH = 2
      user = apis.supervisor.show_profile()["email"]
      class Page:
          size = 3
      if True:
          LIMIT = 4

      def helper(items):
          return items[:WIDTH]

      def portable(items):
          return json.dumps(helper(items))

      def by_user(items):
          return [user] + items

      def by_class(items):
          return items[:Page.size]

      def by_branch(items):
          return items[:LIMIT]

      print(portable([1, 2, 3]), by_user([1]), by_class([1]), by_branch([1]))
      """)]
  outputs = []
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", blocks, outputs=outputs)
  assert outputs[0].startswith("[1, 2]"), outputs
  e = tracker.events()
  assert e.saved == e.generated == ("helper", "portable")
  assert e.failed_definitions == ("by_branch", "by_class", "by_user")
  tracker, output = run_where_installed(pool, tracker, "print(portable([5, 6, 7]))\n")
  assert output.strip() == "[5, 6]" and tracker.events().used == ("helper", "portable")


def test_a_skill_written_inside_try_or_if_is_generated_and_runs_where_installed(pool):
  """Code that wraps its work in `try/except` (or an `if`) still defines its functions in the
  module's scope: the one that ran is generated and saved, dedented with the import and the
  constant of its block (a multi-line string keeps its text), and runs in another world; the
  one in the branch that never ran is not."""
  code = ("try:\n"
          "    import json\n"
          "    SEPARATOR = ' | '\n"
          "    def join_titles(titles):\n"
          '        header = """titles:\n'
          '      """\n'  # six spaces inside the string: a plain dedent would cut four
          "        return header + json.dumps(SEPARATOR.join(titles))\n"
          "\n"
          "    print(join_titles(['a', 'b']))\n"
          "except Exception as error:\n"
          "    print('failed', error)\n"
          "if False:\n"
          "    def never():\n"
          "        return 0\n")
  outputs = []
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", [code], outputs=outputs)
  assert outputs[0].strip() == 'titles:\n      "a | b"'
  e = tracker.events()
  assert e.generated == ("join_titles",) and e.failed_definitions == ("never",)
  assert tracker.saved_functions()["join_titles"].code == (
      "import json\nSEPARATOR = ' | '\ndef join_titles(titles):\n"
      '    header = """titles:\n      """\n'
      "    return header + json.dumps(SEPARATOR.join(titles))\n")
  tracker, output = run_where_installed(pool, tracker, 'print(join_titles(["c"]))\n')
  assert output.strip() == 'titles:\n      "c"'
  assert tracker.events().used == ("join_titles",)


def test_a_skill_carries_the_constants_its_task_bound_in_code_that_ran(pool):
  """A block that raised before rebinding a constant (or that the code guard refused) left
  the constant as it was: the skill is saved with the value it ran with, and a computed
  value it never bound does not make the skill unsaveable. What a failed block bound before
  its failing line, or may have bound in a `finally` around it, counts."""
  define = [block("""
      LIMIT = 5
      def limit():
          return LIMIT
      """)]
  for rebind, printed, constants in (
      ("1/0\nLIMIT = 99\n", "5", ("LIMIT = 5",)),
      ("LIMIT = 99; x = globals()\n", "5", ("LIMIT = 5",)),  # refused by the code guard
      ("1/0\nLIMIT = len('abc')\n", "5", ("LIMIT = 5",)),
      ("LIMIT = 7\n1/0\n", "7", ("LIMIT = 7",)),
      ("try:\n    1/0\nfinally:\n    LIMIT = 8\n", "8", None)):  # 8: not told by the text
    outputs = []
    tracker, _ = run_blocks(pool, f"{SCENARIO}_1", [*define, rebind, "print(limit())\n"],
                            outputs=outputs)
    assert outputs[1].startswith("Execution failed.") and outputs[2].strip() == printed
    saved = tracker.saved_functions()
    if constants is None:
      assert saved == {} and tracker.events().failed_definitions == ("limit",), rebind
    else:
      assert saved["limit"].constants == constants, rebind


def test_a_name_a_nested_scope_binds_is_still_read_from_the_module(pool):
  """A nested function's parameter and a comprehension's variable are theirs alone: the
  skill's own `LIMIT` is the module's constant, which it carries where it is installed."""
  blocks = ["LIMIT = 3\n", block("""
      def scaled(xs):
          def pick(LIMIT):
              return LIMIT
          firsts = [LIMIT for LIMIT in xs]
          return pick(firsts[0]) * LIMIT

      print(scaled([2]))
      """)]
  outputs = []
  tracker, _ = run_blocks(pool, f"{SCENARIO}_1", blocks, outputs=outputs)
  assert outputs[1].strip() == "6"
  assert tracker.saved_functions()["scaled"].constants == ("LIMIT = 3",)
  tracker, output = run_where_installed(pool, tracker, "print(scaled([4]))\n")
  assert output.strip() == "12" and tracker.events().used == ("scaled",)


_SAME_OUTPUT_SCRIPT = r"""
import json, os, sys
from sage_jax.envs.appworld.worker import _outputs_root
os.environ["APPWORLD_ROOT"] = _outputs_root(sys.argv[1], sys.argv[4])
from appworld import AppWorld
from sage_jax.envs.appworld.calltrace import CallTracer
blocks = json.loads(sys.argv[2])
outputs = []
for traced in (False, True):
  with AppWorld(task_id=sys.argv[3], experiment_name=f"same_{traced}") as world:
    tracer = CallTracer()
    run = (lambda code: tracer.run(world.execute, code)[0]) if traced else world.execute
    outputs.append([run(code) for code in blocks] + [world.evaluate().success])
sys.__stdout__.write("OUT" + json.dumps(outputs))
"""


def test_tracing_changes_nothing_appworld_returns(mini_root, gold, tmp_path):  # noqa: F811
  """The same blocks, with and without the hook: identical outputs (tracebacks included)
  and the same evaluation."""
  import json
  import subprocess
  import sys

  first, _ = gold
  blocks = ["def f(x):\n    return 1 / x\n\nprint(f(2))\n", "f(0)\n", MISSING.replace(
      SKILL, "save_note"), first]
  done = subprocess.run([sys.executable, "-c", _SAME_OUTPUT_SCRIPT, mini_root,
                         json.dumps(blocks), f"{SCENARIO}_1", str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  plain, traced = json.loads(done.stdout.rpartition("OUT")[2])
  assert plain == traced
  assert "ZeroDivisionError" in plain[1] and plain[-1] is True
