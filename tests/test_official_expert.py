"""The scripted expert on gold solutions in AppWorld's official form (compiled_solution.py:
`def solution(apis, requester)` with the task's values inside; solution.py beside it is the
task generator's program), on an official-style dataset
built from the mini world: the solutions pass as AppWorld runs them, the expert turns them
into parameterised skills, scores TGC = SGC = 100 (AppWorld's evaluator agrees) and yields
SFT data for every task."""

import ast
import re

import pytest

from sage_jax.agent import gold_solutions, parsing
from sage_jax.envs import appworld
from sage_jax.eval import runner as evaluate
from sage_jax.sft import expert as sft_expert
from sage_jax.tokenizer import Tokenizer
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import official_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config, scripted_eval_config


@pytest.fixture(scope="module")
def pool(official_root, tmp_path_factory):  # noqa: F811
  outputs = str(tmp_path_factory.mktemp("official_outputs"))
  config = pool_config(official_root, outputs)
  with appworld.EnvPool(config) as pool:
    yield pool


def _code(turn: str) -> str:
  return parsing.extract_code(turn).code


def test_official_solutions_pass_as_appworld_runs_them(pool, official_root):  # noqa: F811
  task_ids = appworld.read_split(official_root, "train")
  assert len(task_ids) == 9
  for task_id in task_ids:
    source = gold_solutions.read_solution(official_root, task_id)  # compiled_solution.py
    assert source.count("def ") == 1 and "Canary" not in source
    assert "def solution(apis: ApiCollection, requester: Requester) -> None:" in source
    with pool.episode(task_id, "official_gold") as ep:
      ep.execute(source + "\nsolution(apis, requester)\n").result()
    assert ep.result.success, task_id


def test_values_of_the_task_become_parameters(official_root):  # noqa: F811
  task_id = "ead7476_1"  # Send $45.00 to Daniel Okafor on Venmo with the description '...'.
  solution = gold_solutions.read_solution(official_root, task_id)
  instruction = gold_solutions.read_instruction(official_root, task_id)
  for siblings in ([], [(gold_solutions.read_solution(official_root, t),
                         gold_solutions.read_instruction(official_root, t))
                        for t in ("ead7476_2", "ead7476_3")]):
    name, definition, call = gold_solutions.official_skill(solution, instruction, siblings)
    fn = ast.parse(definition).body[0]
    assert [a.arg for a in fn.args.args] == ["query", "amount", "description"]
    assert call == f"{name}('Daniel Okafor', 45.0, 'Pottery class')"
    assert "Daniel Okafor" not in definition and "Pottery class" not in definition
  assert name == "send_venmo_description"
  # A library skill of that name that is a different function is redefined, not called.
  turns = gold_solutions.expert_turns(solution, {name: f"def {name}(query):\n    return 1\n"},
                              instruction=instruction, siblings=siblings)
  assert f"def {name}(query, amount, description):" in _code(turns[0])
  reuse = gold_solutions.expert_turns(solution, {name: definition}, instruction=instruction,
                              siblings=siblings)
  assert _code(reuse[0]).strip() == call
  assert gold_solutions.official_skill("def solution(apis, requester):\n    pass\n\n"
                               "solution(apis, requester)\n", instruction) is None
  # Imports the skill reads travel with it; those of the entry's annotations do not.
  assert definition.startswith("def send_venmo")
  reads_math = solution.replace("amount=45.0", "amount=math.floor(45.0)")
  with_import = gold_solutions.official_skill("import math\n" + reads_math, instruction)[1]
  assert with_import.startswith("import math\n\n\ndef send_venmo")


def test_a_helper_bound_inside_a_top_level_block_travels_with_the_skill(official_root):  # noqa: F811
  """A name the solution reads that the file binds inside a top-level `try` or `if` (an
  import with its fallback, a helper defined under a condition) comes with its block."""
  task_id = "ead7476_1"
  fallback = ("try:\n    from math import floor\nexcept ImportError:\n"
              "    def floor(x):\n        return int(x)\n\n\n")
  source = gold_solutions.read_solution(official_root, task_id)
  with_block = fallback + source.replace("amount=45.0", "amount=floor(45.0)")
  instruction = gold_solutions.read_instruction(official_root, task_id)
  name, definition, _ = gold_solutions.official_skill(with_block, instruction)
  assert definition.startswith("try:\n    from math import floor\nexcept ImportError:")
  namespace = {}
  exec(definition, namespace)  # noqa: S102 - the skill's own text, as installed
  assert namespace["floor"](45.5) == 45 and callable(namespace[name])


def test_without_siblings_of_its_shape_the_values_stated_in_the_instruction_are_parameters():
  """Official solutions of one scenario are often written differently (other variables, other
  APIs): then the values the instruction states are the parameters, in whatever case and
  punctuation it states them, and the keys of the data (`passwords["phone"]`) are not, even
  where the instruction says the word."""
  solution = (
      "def solution(apis, requester):\n"
      "    passwords = {p['account_name']: p['password']\n"
      "                 for p in apis.supervisor.show_account_passwords()}\n"
      "    number = apis.supervisor.show_profile()['phone_number']\n"
      "    token = apis.phone.login(username=number, password=passwords['phone'])['access_token']\n"
      "    label = 'Go to sleep'\n"
      "    alarm = next(a for a in apis.phone.show_alarms(access_token=token)\n"
      "                 if label.lower() in a['label'].lower())\n"
      "    apis.phone.update_alarm(alarm_id=alarm['alarm_id'], minutes=30, access_token=token)\n"
      "    apis.supervisor.complete_task(answer=alarm['title'])\n")
  instruction = "Move my go-to-sleep phone alarm 30 minutes later and tell me its title."
  other = solution.replace("minutes=30", "minutes=-20").replace("label = ", "text = ").replace(
      "label.lower()", "text.lower()")
  name, definition, call = gold_solutions.official_skill(
      solution, instruction, [(other, "Move my wake-up phone alarm 20 minutes earlier.")])
  fn = next(n for n in ast.parse(definition).body if isinstance(n, ast.FunctionDef))
  assert [a.arg for a in fn.args.args] == ["label", "minutes"]
  assert call == f"{name}('Go to sleep', 30)"
  assert "passwords['phone']" in definition and "alarm['title']" in definition
  # `label = 'Go to sleep'`, bound nowhere else, became the parameter itself.
  assert "label = " not in definition and "label.lower()" in definition


def test_a_key_the_data_is_read_by_is_not_a_parameter_however_it_is_used():
  """A field's name tested with `in`, or read with `.get`, is the data's key when the function
  also reads the data by it, though the instruction says the word."""
  solution = (
      "def solution(apis, requester):\n"
      "    profile = apis.venmo.show_profile(email='a@b.c', access_token='t')\n"
      "    note = profile.get('note', '')\n"
      "    if 'message' in profile and profile['message'] == 'no account':\n"
      "        apis.phone.send_text_message(phone_number='1', message='Get on venmo.')\n"
      "    apis.supervisor.complete_task(answer=note)\n")
  instruction = "Send the message 'Get on venmo.' and tell me the note on my profile."
  name, definition, call = gold_solutions.official_skill(solution, instruction)
  assert call == f"{name}('Get on venmo.')"
  assert "'message' in profile" in definition and "profile.get('note', '')" in definition


def test_helpers_of_the_solution_file_travel_with_the_skill(pool, official_root):  # noqa: F811
  """A solution file's helper functions and constants that the solution reads (and those they
  read) are carried with the skill, in the file's order; the others, and those that only
  share a name with one of its locals, are not."""
  task_id = "ead7476_1"
  source = gold_solutions.read_solution(official_root, task_id)
  # `users` at the top is not the solution's: its `users` is a local of its own.
  helpers = ("CENTS = 100\nusers = []\n\n\ndef unused():\n    return 0\n\n\n"
             "def in_cents(x):\n    return round(x * CENTS)\n\n\n"
             "def dollars(x):\n    return in_cents(x) / CENTS\n\n\n")
  with_helpers = source.replace("def solution(", helpers + "def solution(").replace(
      "amount=45.0", "amount=dollars(45.0)")
  instruction = gold_solutions.read_instruction(official_root, task_id)
  name, definition, call = gold_solutions.official_skill(with_helpers, instruction)
  assert [n.name if isinstance(n, ast.FunctionDef) else ast.unparse(n)
          for n in ast.parse(definition).body] == ["CENTS = 100", "in_cents", "dollars", name]
  values = [ast.literal_eval(a) for a in ast.parse(call).body[0].value.args]
  assert sorted(map(str, values)) == ["45.0", "Daniel Okafor", "Pottery class"]
  [turn] = gold_solutions.expert_turns(with_helpers, instruction=instruction)
  with pool.episode(task_id, "official_helpers") as ep:
    ep.execute(_code(turn)).result()
  assert ep.result.success
  # The library's skill of that name is the same function: called, not written again.
  [reuse] = gold_solutions.expert_turns(with_helpers, {name: definition},
                                        instruction=instruction)
  assert _code(reuse).strip() == call


def _task(root: str, task_id: str) -> tuple[str, str]:
  return (gold_solutions.read_solution(root, task_id),
          gold_solutions.read_instruction(root, task_id))


def test_a_library_skill_with_another_tasks_constant_is_not_called(official_root):  # noqa: F811
  """A module constant of the solution file travels with the skill as it is: a library skill
  whose constant holds another task's value is not this task's skill, though its function
  is the same."""
  def with_constant(task_id: str) -> tuple[str, str]:
    source, instruction = _task(official_root, task_id)
    description = re.search(r"description=('[^']*')", source)[1]
    source = source.replace(f"description={description}", "description=DESCRIPTION").replace(
        "def solution(", f"DESCRIPTION = {description}\n\n\ndef solution(")
    return source, instruction
  first, second = with_constant("ead7476_1"), with_constant("ead7476_2")
  name, definition, call = gold_solutions.official_skill(*first, [second])
  assert definition.startswith("DESCRIPTION = 'Pottery class'\n")
  library = {name: gold_solutions.with_docstrings(definition)}
  [again] = gold_solutions.expert_turns(first[0], library, instruction=first[1],
                                        siblings=[second])
  assert _code(again).strip() == call
  [turn] = gold_solutions.expert_turns(second[0], library, instruction=second[1],
                                       siblings=[first])
  assert "DESCRIPTION = 'Half of the cabin deposit'" in _code(turn)
  assert f"def {name}(" in _code(turn)


def test_the_tasks_part_of_an_f_string_is_a_parameter(pool, official_root):  # noqa: F811
  """AppWorld's compiled solutions write the task's values into f-strings too
  (f"~/photographs/vacations/Petra/{file_name}"): the part of such a piece that changes
  between the sibling solutions, cut at word boundaries, becomes a parameter, so the
  scenario's tasks share one skill, which solves each with its own values."""
  def with_fstring(task_id: str) -> tuple[str, str]:
    source, instruction = _task(official_root, task_id)
    path = re.search(r"file_path='~/documents/(\w+)\.txt'", source)
    source = source.replace(path[0], f"file_path=f'{{folder}}/{path[1]}.txt'").replace(
        "    passwords = ", "    folder = '~/documents'\n    passwords = ", 1)
    return source, instruction
  tasks = {t: with_fstring(t) for t in ("1d3abf7_1", "1d3abf7_2", "1d3abf7_3")}
  skills = {t: gold_solutions.official_skill(*task, [v for u, v in tasks.items() if u != t])
            for t, task in tasks.items()}
  [(name, definition)] = {(n, d) for n, d, _ in skills.values()}  # one skill for them all
  assert "f'{folder}/{value}.txt'" in definition and "grocery_list" not in definition
  call = skills["1d3abf7_2"][2]
  assert call == f"{name}('Hardware store', 'hardware_store')"
  # Task 2, with the skill task 1 wrote in the library, calls it; the call solves task 2.
  [turn] = gold_solutions.expert_turns(
      tasks["1d3abf7_2"][0], {name: gold_solutions.with_docstrings(definition)},
      instruction=tasks["1d3abf7_2"][1], siblings=[tasks["1d3abf7_1"], tasks["1d3abf7_3"]])
  assert _code(turn).strip() == call
  with pool.episode("1d3abf7_2", "official_fstring") as ep:
    ep.execute(f"{definition}\n\n\n{call}\n").result()
  assert ep.result.success


def test_an_f_strings_parameter_splits_no_word_and_its_format_spec_is_not_one():
  """Cities sharing their first letter ("Budapest", "Berlin") are still whole parameters;
  the ".2f" of a format spec is the code's, not the task's."""
  def solution(city: str, amount: float) -> str:
    return ("def solution(apis, requester):\n"
            f"    total = {amount}\n"
            "    apis.supervisor.complete_task("
            f"answer=f'{{total:.2f}} spent on the {city} trip')\n")
  first, second = ((solution("Budapest", 12.5), "What did the Budapest trip cost?"),
                   (solution("Berlin", 8.0), "What did the Berlin trip cost?"))
  name, definition, call = gold_solutions.official_skill(*first, [second])
  assert "f'{total:.2f} spent on the {value} trip'" in definition
  assert call == f"{name}(12.5, 'Budapest')"
  assert gold_solutions.official_skill(*second, [first])[1] == definition


def test_a_value_bound_in_a_nested_function_stays_there(pool, official_root):  # noqa: F811
  """A variable assigned once, but inside a function nested in the solution, is not the
  skill's parameter itself: the skill runs as the solution does."""
  task_id = "ead7476_1"
  source, instruction = _task(official_root, task_id)
  nested = source.replace(
      "    apis.venmo.create_transaction(",
      "    def describe():\n        description = 'Pottery class'\n        return description\n"
      "    apis.venmo.create_transaction(").replace("description='Pottery class'",
                                                   "description=describe()")
  [turn] = gold_solutions.expert_turns(nested, instruction=instruction)
  assert "description = description_2" in _code(turn)
  with pool.episode(task_id, "official_nested") as ep:
    ep.execute(_code(turn)).result()
  assert ep.result.success


def test_siblings_phrased_in_another_order_name_the_same_skill(official_root):  # noqa: F811
  """The name's words keep one order for the whole scenario, so a sibling that says them in
  another order calls the skill its scenario wrote."""
  tasks = [_task(official_root, f"ead7476_{i}") for i in (1, 2, 3)]
  tasks[1] = (tasks[1][0], "On Venmo, send $120.00 to Hannah Brooks with the description "
              "'Half of the cabin deposit'.")
  skills = [gold_solutions.official_skill(*task, tasks[:i] + tasks[i + 1:])
            for i, task in enumerate(tasks)]
  [name] = {name for name, _, _ in skills}
  definition = skills[0][1]
  [turn] = gold_solutions.expert_turns(tasks[1][0], {name: definition}, instruction=tasks[1][1],
                                       siblings=[tasks[0], tasks[2]])
  assert _code(turn).strip() == skills[1][2]


def test_a_name_that_is_a_keyword_or_a_builtin_gets_a_suffix():
  """`def return(...)` would not parse, and `def open(...)` would hide the builtin."""
  def task(verb: str, item: str) -> tuple[str, str]:
    return (f"def solution(apis, requester):\n    apis.amazon.{verb}_item(name={item!r})\n"
            f"    apis.supervisor.complete_task()\n", f"{verb.title()} {item}.")
  for verb in ("return", "open"):
    name, definition, call = gold_solutions.official_skill(
        *task(verb, "Blue Kettle"), [task(verb, "Red Lamp")])
    assert name == f"{verb}_task" and call == f"{verb}_task('Blue Kettle')"
    compile(definition, "<skill>", "exec")


def test_a_solution_that_cannot_be_rewritten_is_named(official_root, tmp_path):  # noqa: F811
  """A gold solution the expert cannot rewrite stops the build before any play, naming its
  task."""
  import shutil  # noqa: PLC0415
  task_id = "ead7476_1"
  root = tmp_path / "root"
  shutil.copytree(f"{official_root}/data/tasks/{task_id}", root / "data" / "tasks" / task_id)
  (root / "data" / "tasks" / task_id / "ground_truth" / "compiled_solution.py").write_text(
      "def solution(apis, requester):\n    apis.supervisor.complete_task(\n")
  with pytest.raises(ValueError, match=rf"task {task_id}: .*SyntaxError"):
    gold_solutions.check_readable(str(root), [task_id])


def test_the_generator_program_alone_is_named_as_not_a_gold_solution(official_root, tmp_path):  # noqa: F811
  """Without compiled_solution.py the task's solution.py is AppWorld's generator program,
  which needs the generator's inputs: a clear error, not broken expert turns."""
  import shutil  # noqa: PLC0415
  task_id = "ead7476_1"
  root = tmp_path / "root"
  shutil.copytree(f"{official_root}/data/tasks/{task_id}", root / "data" / "tasks" / task_id)
  (root / "data" / "tasks" / task_id / "ground_truth" / "compiled_solution.py").unlink()
  with pytest.raises(ValueError, match=r"solution.py is AppWorld's task-generator program "
                     r"\(its `solution` takes main_user, public_data.*compiled_solution.py"):
    gold_solutions.expert_turns_for_task(str(root), task_id)


def test_scripted_expert_scores_100_and_reuses_its_skills(pool, official_root, tmp_path):  # noqa: F811
  config = scripted_eval_config(split="train", data=official_root, experiment="eval_official")
  # Fixed turns are not cut by a run's turn budget (the eval presets' 384 tokens cut gold
  # solutions of real AppWorld size: a syntax error, and a failed task with no reason given).
  config.agent.max_turn_tokens = 64
  report = evaluate.evaluate(config, str(tmp_path), pool=pool)
  overall = report["metrics"]["overall"]
  assert overall["tgc"] == 100.0 and overall["sgc"] == 100.0
  assert report["appworld"]["task_goal_completion"] == 100.0
  assert report["appworld"]["scenario_goal_completion"] == 100.0
  for r in report["records"]:
    first = r["chain_position"] == 0
    assert bool(r["events"]["generated"]) == first and bool(r["events"]["used"]) != first
  tok = Tokenizer()
  trajectories, stats = sft_expert.gold_trajectories(
      appworld.read_split(official_root, "train"),
      sft_expert.ExpertConfig(appworld_root=official_root), tok, pool=pool)
  assert stats.tasks == stats.succeeded == stats.kept == 9 and len(trajectories) == 9
