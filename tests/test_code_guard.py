"""The code guard refuses agent code that reaches into the interpreter (where it could forge
the call records the skill rewards read) and lets ordinary task code through: every gold
solution of the mini world in both of its forms, and through a pool, the forgery of a
skill use is refused before it runs."""

import json
import subprocess
import sys

import pytest

from sage_jax.agent import gold_solutions
from sage_jax.agent.skills import BlockTrace, SkillTracker, analyze
from sage_jax.envs import appworld
from sage_jax.envs.appworld import code_guard
from tests.appworld_fixtures import all_task_ids, gold_solution, official_form
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config

LIBRARY = 'def my_skill(x):\n    """A library skill."""\n    return apis.supervisor.show_profile()\n'
# Marks the library skill as called and returned without calling it.
FORGE_USE = """
imp = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__
tracer = imp("sys").gettrace().__self__
for key, f in list(tracer._functions.items()):
    if f.name == "my_skill":
        tracer._touched.setdefault(key, f.counts())
        f.returned += 1
print("never called my_skill")
"""
# The same through string.Formatter, whose format_field a subclass overrides: it is handed
# the object that a format field's attributes lead to.
FORMAT_FORGE_USE = """
import string
grabbed = []
class Grab(string.Formatter):
    def format_field(self, value, format_spec):
        grabbed.append(value)
        return ""
def get(obj, path):
    Grab().format("{0" + path + "}", obj)
    return grabbed.pop()
imp = get(get, ".__globals__[__builtins__].__import__")
tracer = get(get(imp("sys"), ".gettrace")(), ".__self__")
for key, f in list(get(tracer, "._functions").items()):
    if f.name == "my_skill":
        get(tracer, "._touched").setdefault(key, f.counts())
        f.returned += 1
print("never called my_skill")
"""


@pytest.mark.parametrize("code", [
    FORGE_USE,
    "t = os.sys.gettrace()",
    "g = __import__('gc')",
    "x = print.__self__",
    "f = (i for i in []).gi_frame.f_back",
    "try:\n    1 / 0\nexcept Exception as e:\n    frame = e.__traceback__",
    "name = '_' * 2 + 'self__'\nt = getattr(print, name)",
    "import functools\nt = functools.reduce(getattr, ['__self__'], print)",
    "import operator\nt = operator.attrgetter('__self__')(print)",
    "from operator import attrgetter",
    "import string\nt = string.Formatter().get_field('0.x', [print], {})",
    FORMAT_FORGE_USE,
    "from string import Formatter",
    "import string as s\nclass F(s.Formatter):\n    pass",
    "t = formatter.vformat('{0.x}', [print], {})",
    "t = formatter.convert_field(print, 'r')",
    "match print:\n    case object(__self__=t):\n        pass",
    "v = vars()",
    "g = globals()['apis']",
    "eval('1')",
    "t = type(print)._private",
    "from os import _exit",
    # the builtins, by module or through an allowed module's attribute
    "import builtins\nbuiltins.exec('x = 1')",
    "from builtins import getattr as g",
    "import enum\nenum.bltns.exec('x = 1')",
    "import typing\nf = typing.types.FunctionType",
    # attributes set by a name in a string, AppWorld's own helpers
    "from unittest import mock\nmock.patch('os.sep', '!').start()",
    "import unittest.mock",
    "from appworld.common.utils import getter_plus",
    "from appworld.common import utils\nutils.import_module_file('x.py')",
    "from appworld.common import utils\nobjects = utils.gc.get_objects()",
    "from appworld import requester\nrequester.requests.logging.handlers.pickle.loads(b'')",
    # the interpreter's import and exec under other names, deep in allowed imports
    "from appworld.apps import model_lib\nc = model_lib.event.legacy.util.compat\n"
    "c.exec_('import gc')",
    "from appworld.apps.model_lib.event.legacy.util.compat import import_",
    "from appworld import requester\n"
    "i = requester.requests.logging.config.BaseConfigurator.importer",
    # code run from text: string annotations, which pydantic evaluates as a class is made
    "from appworld.apps.model_lib import PydanticModel\nclass M(PydanticModel):\n"
    "    x: \"exec('t = 1')\"",
    "def f(x: \"List['print(__import__(\\\"sys\\\").gettrace())']\"):\n    pass",
    "from appworld.apps.model_lib import validate_arguments\n@validate_arguments\n"
    "def f(x: 'eval(\"1\")') -> int:\n    return 1",
    "from pydantic import create_model",
    # AppWorld's own objects changed under it (its bookkeeping of every later block fails)
    "requester.request_tracker = None",
    "del apis.spotify",
    "apis.supervisor.complete_task = print",
    "setattr(requester, 'request_tracker', None)",
    "import typing\nr = typing.ForwardRef('print(1)')",
    "import typing\ndef f(x: 'print(1)'):\n    pass\n\ntyping.get_type_hints(f)",
    "import functools\n@functools.singledispatch\ndef f(x):\n    pass",
    "import yaml\nyaml.unsafe_load('!!python/object/apply:print [1]')",
    "import yaml\nyaml.load('!!python/object/apply:print [1]', Loader=yaml.Loader)",
    "from yaml import *",
    # what AppWorld runs is the block stripped: with blank space before it, it parses only so
    " import sys\nprint(sys.gettrace())",
    "\n\timport sys",
    # IPython's shell runs text as code
    "ip = get_ipython()\nip.ev('1')",
    # a module's attribute is read by annotations and by AppWorld's own code
    "import typing\ntyping.T = 'print(1)'",
    "import json\nsetattr(json, 'loads', print)",
])
def test_interpreter_reaching_code_is_refused(code):
  assert code_guard.refusal(code) is not None


@pytest.mark.parametrize("code", [
    "class Song:\n    def __init__(self, title):\n        super().__init__()\n"
    "        self.title = title\n\n\nprint(Song.__name__, Song('x').title)",
    "login = getattr(apis.spotify, 'login')\nok = hasattr(apis, 'venmo')",
    "songs = apis.spotify.show_songs(page_index=0)\nsongs[0]['title'] = 'x'",
    "import collections\nP = collections.namedtuple('P', 'a b')\nprint(P(1, 2)._asdict())",
    "def f(x):\n    '''Doc.'''\n    return x\n\n\nprint(f.__doc__)",
    "import datetime, json, re\nprint(json.dumps({'t': datetime.date.today().isoformat()}))",
    "import re\nprint(re.compile('a+').findall('aab'))",
    # formatting that gives back only text
    "x = 3.5\nprint('{} {:>6} {0.real}'.format(x, 'a'), f'{x!r:>5} {x.real}')",
    "print('{name}'.format_map({'name': 'a'}))",
    "import string\nprint(string.Template('$a').substitute(a=1))",
    "import yaml\nprint(yaml.safe_load('a: 1'), yaml.load('b: 2', Loader=yaml.SafeLoader))",
    "import typing\ndef f(x: typing.List[int]) -> typing.Optional[str]:\n    return None",
    "def f(songs: 'list[Song]', n: 'int' = 3) -> 'Optional[Song]':\n    return None\n"
    "x: 'not an expression ((' = 1",  # forward references, and a string that is not code
    # what AppWorld's own solutions and agents import of it
    "from appworld.collections.apis import ApiCollection\nfrom appworld.requester import "
    "Requester\nfrom appworld.common.datetime import VanillaDateTime as DateTime, pendulum\n"
    "from appworld.common.utils import find_all_from_pages, find_one, list_of, set_of",
    "def broken(:\n    pass",  # AppWorld reports the syntax error
])
def test_ordinary_code_passes(code):
  assert code_guard.refusal(code) is None


# Walks the attributes that the modules agent code may import reach (AppWorld's allowed
# modules, and the parts of appworld its solutions and agents import), a few steps deep,
# through modules and classes, skipping the attributes the guard refuses; prints what it
# found of the interpreter's internals. Runs apart: the test process does not import appworld.
WALK = r"""
import builtins, collections, gc, importlib, inspect, json, logging.config, string, sys, types
from appworld.common.safety_guard import ALLOWED_MODULE_NAMES
from sage_jax.envs.appworld import code_guard
internal_modules = {"builtins", "sys", "gc", "inspect", "importlib", "types", "ctypes", "code",
                    "codeop", "runpy", "marshal", "unittest", "_thread", "threading",
                    "subprocess", "pickle", "copyreg", "dill", "pkgutil", "zipimport", "asyncio"}
internal = {id(getattr(builtins, n)): n for n in (
    "exec", "eval", "compile", "getattr", "setattr", "delattr", "globals", "locals", "vars",
    "__import__", "breakpoint")}
for f in (types.FunctionType, types.CodeType, importlib.import_module, gc.get_objects,
          gc.get_referrers, inspect.currentframe, sys._getframe, logging.config.dictConfig):
  internal[id(f)] = f.__qualname__
roots = sorted(set(ALLOWED_MODULE_NAMES) - code_guard.FORBIDDEN_MODULES - {"appworld"}) + [
    "appworld", "appworld.common.utils", "appworld.common.datetime",
    "appworld.collections.apis", "appworld.requester"]
queue = collections.deque((importlib.import_module(name), name, 0) for name in roots)
seen, found = set(), []
while queue:
  obj, path, depth = queue.popleft()
  if id(obj) in seen or depth == 10:  # the walk ends before that: nothing new is reached
    continue
  seen.add(id(obj))
  try:
    names = dir(obj)
  except Exception:
    continue
  for name in names:
    if code_guard.refusal(f"x.{name}") is not None:
      continue
    try:
      value = getattr(obj, name)
    except Exception:
      continue
    if isinstance(value, types.ModuleType) and value.__name__.split(".")[0] in internal_modules:
      found.append(f"{path}.{name}: {value.__name__}")
    elif id(value) in internal:
      found.append(f"{path}.{name}: {internal[id(value)]}")
    elif isinstance(value, type) and issubclass(value, string.Formatter):
      found.append(f"{path}.{name}: a string.Formatter")
    elif isinstance(value, (types.ModuleType, type)):
      queue.append((value, f"{path}.{name}", depth + 1))
sys.__stdout__.write("FOUND" + json.dumps(found))
"""


def test_what_allowed_imports_reach_holds_no_interpreter_internals():
  out = subprocess.run([sys.executable, "-c", WALK], capture_output=True, text=True,
                       timeout=600)
  assert "FOUND" in out.stdout, out.stderr[-3000:]
  assert json.loads(out.stdout.split("FOUND", 1)[1]) == []


def test_every_gold_solution_passes(mini_root):  # noqa: F811
  for task_id in all_task_ids(mini_root):
    solution = gold_solution(mini_root, task_id)
    assert code_guard.refusal(solution) is None, task_id
    assert code_guard.refusal(official_form(solution)) is None, task_id
    for turn in gold_solutions.expert_turns_for_task(mini_root, task_id):
      assert code_guard.refusal(turn.split("```python\n", 1)[-1].split("```")[0]) is None


@pytest.mark.parametrize("forge", [FORGE_USE, FORMAT_FORGE_USE], ids=["import", "format_field"])
def test_a_forged_skill_use_is_refused_in_a_world(mini_root, tmp_path, forge):  # noqa: F811
  config = pool_config(mini_root, str(tmp_path / "outputs"), num_workers=1)
  with appworld.EnvPool(config) as pool:
    with pool.episode(all_task_ids(mini_root)[0], "forge_use", library_code=LIBRARY) as ep:
      assert ep.start.library_ok
      output = ep.execute(forge).result()
      trace = ep.last_trace
  assert output.startswith("Execution failed.") and "never called" not in output
  tracker = SkillTracker({"my_skill": analyze(LIBRARY).functions[0].calls})
  tracker.observe(forge, BlockTrace.from_dict(trace))
  assert tracker.events().used == ()


def test_a_string_annotation_made_at_run_time_is_checked_in_a_world(mini_root, tmp_path):  # noqa: F811
  """A string bound to a name reaches pydantic as an annotation without being written in
  one: typing's evaluation of it is checked as the code is, and a harmless one still
  works."""
  forged = ("from appworld.apps.model_lib import PydanticModel\n"
            "T = \"print(__import__('sys').gettrace())\"\nclass M(PydanticModel):\n    x: T\n")
  harmless = ("from appworld.apps.model_lib import PydanticModel\nS = 'int'\n"
              "class N(PydanticModel):\n    x: S\n\nprint(N(x='3').x + 1)")
  assert code_guard.refusal(forged) is None  # nothing in its text is refused
  config = pool_config(mini_root, str(tmp_path / "outputs"), num_workers=1)
  with appworld.EnvPool(config) as pool:
    with pool.episode(all_task_ids(mini_root)[0], "forward_reference") as ep:
      refused = ep.execute(forged).result()
      ran = ep.execute(harmless).result()
  assert refused.startswith("Execution failed.") and "CallTracer" not in refused
  assert "is not evaluated: the attribute 'gettrace' is not allowed" in refused
  assert ran.strip() == "4"
