"""The Skill Library Agent without AppWorld: parsing, AST skill events, library, retrieval,
prompt, expert rewriting and the episode loop against a fake environment."""

import ast
import asyncio
import dataclasses
import textwrap

import numpy as np
import pytest

from sage_jax import configurable, stopping
from sage_jax.agent import agent as agent_lib
from sage_jax.agent import gold_solutions, parsing, prompts, retrieval, skills
from sage_jax.agent.config import AgentConfig, RetrievalConfig
from sage_jax.agent.library import Skill, SkillLibrary, install_code
from sage_jax.agent.policy import PolicyTurn
from sage_jax.envs.appworld import EpisodeStart
from sage_jax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


def code(text: str) -> str:
  return textwrap.dedent(text).strip() + "\n"


# --- parsing ---------------------------------------------------------------------------------

def test_extract_code_joins_blocks_and_handles_unclosed_and_missing():
  text = "Plan.\n```python\nx = 1\n```\nthen\n```py\nprint(x)\n```\n```json\n{}\n```"
  parsed = parsing.extract_code(text)
  assert parsed.code == "x = 1\n\nprint(x)\n" and parsed.num_blocks == 2 and not parsed.unclosed
  untagged = parsing.extract_code("Plan.\n```\nx = 1\n``` and then\n```\nprint(x)\n```")
  assert untagged.code == "x = 1\n\nprint(x)\n" and untagged.num_blocks == 2
  cut = parsing.extract_code("```python\ndef f():\n    return 1")
  assert cut.code == "def f():\n    return 1\n" and cut.unclosed
  assert parsing.extract_code("I will not write code.").code is None
  assert parsing.extract_code("```python\n\n```").code is None
  assert parsing.extract_code('```python\ns = "```"\n```').code == 's = "```"\n'


def test_extract_code_reads_the_fences_models_write():
  """Beside a Python block, an untagged block is an imagined output, not code; a fence in a
  list item is indented; Windows line ends; an info string; a block closed by the next
  block's opening fence."""
  imagined = "```python\nprint(apis.supervisor.show_profile())\n```\nOutput:\n```\nDone.\n```"
  assert parsing.extract_code(imagined).code == "print(apis.supervisor.show_profile())\n"
  listed = "Steps:\n1. Log in:\n   ```python\n   token = login()\n   print(token)\n   ```\n"
  assert parsing.extract_code(listed).code == "token = login()\nprint(token)\n"
  assert parsing.extract_code("```python\r\nx = 1\r\nprint(x)\r\n```\r\n").code == (
      "x = 1\nprint(x)\n")
  titled = '```python title="step 1"\nprint(1)\n```\nThe output above.\n```\n'
  assert parsing.extract_code(titled).code == "print(1)\n"
  reopened = parsing.extract_code("```python\nx = 1\n```python\ny = 2\n```\nDone.")
  assert reopened.code == "x = 1\n\ny = 2\n" and reopened.num_blocks == 2
  assert parsing.extract_code("```python\nx = 1\n```python\ny = 2").unclosed


# --- skill events ----------------------------------------------------------------------------

SKILL = code('''
  import re

  def count_songs(genre):
      """Counts songs of a genre."""
      token = login("spotify")
      return len([s for s in apis.spotify.songs(token) if s == genre])

  def login(app):
      return apis.supervisor.token(app)

  answer = count_songs("rock")
  apis.supervisor.complete_task(answer=answer)
  ''')


def test_analyze_finds_functions_calls_imports():
  a = skills.analyze(SKILL)
  assert a.syntax_ok and [f.name for f in a.functions] == ["count_songs", "login"]
  count = a.functions[0]
  assert count.signature == "count_songs(genre)" and count.docstring == "Counts songs of a genre."
  assert count.calls == {"login", "len"}
  assert a.top_level_calls == {"count_songs"}  # apis.* are attribute calls, not skills
  assert a.imports == ("import re",) and count.code.startswith("import re\ndef count_songs")
  broken = skills.analyze("def f(:\n  pass")
  assert not broken.syntax_ok and "SyntaxError" in broken.error and broken.functions == ()


def test_analyze_finds_functions_nested_in_top_level_statements():
  """Definitions inside a top-level if/for/while/with/try/match are module functions (the
  worker traces them); those inside functions or classes are not. A compound statement's
  header rebinds names (`for LIMIT in ...`), its blocks' statements bind in order; a literal
  constant counts as one where it runs whenever the block does (top level, `try`, `with`),
  not in a branch, a loop or a handler."""
  code_ = ("with open('x') as handle:\n"
           "    @decorate\n"
           "    def a(x):\n"
           "        return x\n"
           "for LIMIT in range(3):\n"
           "    while True:\n"
           "        def b(): return LIMIT\n"
           "        break\n"
           "match LIMIT:\n"
           "    case {'k': PAGE, **rest}:\n"
           "        def c(): pass\n"
           "class K:\n"
           "    def method(self): pass\n"
           "def outer():\n"
           "    def inner(): pass\n"
           "if (PAGE := 3) > 1:\n"
           "    import re as regex\n"
           "    PAGE = 4\n"
           "try:\n"
           "    LIMIT = 5\n"
           "except ValueError:\n"
           "    LIMIT = 6\n"
           "finally:\n"
           "    SIZE = 7\n")
  a = skills.analyze(code_)
  assert [(f.name, f.line) for f in a.functions] == [("a", 2), ("b", 7), ("c", 11),
                                                      ("outer", 14)]
  assert a.functions[0].source == "@decorate\ndef a(x):\n    return x"
  assert a.functions[1].source == "def b(): return LIMIT"
  assert a.imports == ()  # not at top level: carried only where a skill reads it
  bound = [(name, b.kind) for name, b in a.bindings]
  assert bound == [("handle", ""), ("a", "function"), ("LIMIT", ""), ("b", "function"),
                   ("PAGE", ""), ("rest", ""), ("c", "function"), ("K", ""),
                   ("outer", "function"), ("PAGE", ""),
                   ("regex", "import"), ("PAGE", ""), ("LIMIT", "constant"), ("LIMIT", ""),
                   ("SIZE", "constant")]


def test_a_saved_function_carries_the_constants_it_last_ran_with():
  """A constant rebound in a later block where the function then ran: it is saved with the
  value it ran with, not the one bound where it was defined."""
  t = skills.SkillTracker()
  t.observe("DIVISOR = 0\ndef scaled(x):\n    return x / DIVISOR\n\nscaled(1)\n",
            skills.BlockTrace(0, (skills.Call(0, 2, "scaled", 0, 1),)))
  assert t.saved_functions() == {}
  t.observe("DIVISOR = 4\nprint(scaled(8))\n",
            skills.BlockTrace(1, (skills.Call(0, 2, "scaled", 1, 0),)))
  assert t.saved_functions()["scaled"].code == (
      "DIVISOR = 4\ndef scaled(x):\n    return x / DIVISOR\n")


def test_a_definition_that_cannot_run_where_it_is_installed_is_not_saved():
  """Its decorator is a task function, its default a computed value, its annotation a task
  class: installed elsewhere, its `def` would fail (and take the rest of the install block
  with it). What it reads of builtins and carried imports is fine; a `from __future__`
  import it carries is left out of the install block, where it could only stand first."""
  code_ = ("from __future__ import annotations\nimport functools\ntoken = len('ab')\n"
           "class Row:\n    pass\n\ndef logged(f):\n    return f\n\n"
           "@logged\ndef decorated(x):\n    return x\n\n"
           "def defaulted(x=token):\n    return x\n\n"
           "def annotated() -> Row:\n    return None\n\n"
           "@functools.lru_cache(maxsize=None)\n"
           "def cached(x: int = 3, *, y: 'Row' = None) -> list[int]:\n    return [x]\n")
  t = skills.SkillTracker()
  t.observe(code_, skills.BlockTrace(0, tuple(
      skills.Call(0, f.line, f.name, 1, 0) for f in skills.analyze(code_).functions)))
  e = t.events()
  assert e.saved == ("cached", "logged")
  assert e.failed_definitions == ("annotated", "decorated", "defaulted")
  lib = SkillLibrary()
  lib.save(t.saved_functions(), scenario="s", task_id="s_1", instruction="")
  code_ = install_code(lib.skills("s"))
  assert "__future__" not in code_
  namespace = {}
  exec(code_, namespace)  # noqa: S102
  assert namespace["cached"](4) == [4]


def test_mentioned_is_static_reachability_only():
  """Without the worker's call records nothing counts as run: only the static diagnostic."""
  library = {"count_songs": {"login", "len"}, "login": set(), "unused": set()}
  t = skills.SkillTracker(library)
  t.observe("answer = count_songs('pop')\n", None)
  e = t.events()
  assert e.mentioned == ("count_songs", "login")  # login is called inside count_songs
  assert e.used == () and e.generated == () and e.saved == ()
  t2 = skills.SkillTracker(library)
  t2.observe("def wrapper(g):\n    return count_songs(g)\n\nwrapper('x')\n", None)
  assert t2.events().mentioned == ("count_songs", "login")
  t3 = skills.SkillTracker(library)
  t3.observe("def never_called():\n    return count_songs('x')\n", None)
  assert t3.events().mentioned == ()  # defined but not reached
  t3.observe("f(\n", None)
  assert t3.events().syntax_errors == 1
  t4 = skills.SkillTracker(library)
  t4.observe("def count_songs(g):\n    return 0\n\ncount_songs('a')\n", None)
  assert t4.events().mentioned == ()  # the task's own version


def test_events_follow_call_records():
  """Hand-written records (the worker's are tested in test_skill_events): a definition is
  matched by block, line and name; an incomplete record credits nothing."""
  t = skills.SkillTracker({"lib": set()})
  code_ = "x = 1\n\ndef f():\n    return lib()\n\nf()\n"
  calls = (skills.Call(0, 3, "f", 1, 0), skills.Call("library", 1, "lib", 1, 0))
  t.observe(code_, skills.BlockTrace(0, calls, complete=False))
  assert t.events().used == () and t.events().untraced_blocks == 1
  t.observe(code_, skills.BlockTrace(1, calls))  # records name block 0's definition
  e = t.events()
  assert e.used == ("lib",) and e.generated == ("f",)
  assert t.saved_functions()["f"].line == 3
  t2 = skills.SkillTracker()
  t2.observe(code_, skills.BlockTrace(0, (skills.Call(0, 1, "f", 1, 0),)))  # wrong line
  assert t2.events().generated == () and t2.events().failed_definitions == ("f",)


def _saved(blocks):
  """The functions a task saves when each block ran and called all its definitions."""
  t = skills.SkillTracker()
  for i, code_ in enumerate(blocks):
    calls = tuple(skills.Call(i, f.line, f.name, 1, 0) for f in skills.analyze(code_).functions)
    t.observe(code_, skills.BlockTrace(i, calls))
  return t.saved_functions()


def test_a_saved_function_carries_the_imports_and_literal_constants_it_reads():
  """From its own block and earlier ones, and a local of the same name is the function's
  own. A value computed by code (an API call), or a name rebound by such code, is not run
  again where the skill is installed: a function that reads one is not saved."""
  saved = _saved([
      "import re\nimport json\nLIMIT = 3\nTOKEN = apis.supervisor.show_profile()\n"
      "PAGE = 1\n",
      "SEP: str = ','\nPAGE = len('ab')\n"
      "def f(xs, sep=None):\n    return (sep or SEP).join(\n"
      "        re.sub('a', 'b', x) for x in xs[:LIMIT])\n"
      "def g():\n    LIMIT = 5\n    return LIMIT\n"
      "def h():\n    return TOKEN\n"
      "def k():\n    page = PAGE\n    return page\n",
  ])
  assert sorted(saved) == ["f", "g"]
  f, g = saved["f"], saved["g"]
  assert f.imports == ("import re",) and f.constants == ("LIMIT = 3", "SEP: str = ','")
  assert g.imports == () and g.constants == ()
  namespace = {}
  exec(f.code, namespace)  # noqa: S102 - the carried code runs on its own
  assert namespace["f"](["a", "aa", "c", "d"]) == "b,bb,c"


def test_a_comprehension_variable_does_not_rebind_the_constant_of_its_name():
  """A comprehension's loop variable is its own: the module's `LIMIT` still holds 3."""
  saved = _saved(["LIMIT = 3\nsizes = [LIMIT * 2 for LIMIT in range(2)]\n"
                  "def f():\n    return LIMIT\n"])
  assert saved["f"].constants == ("LIMIT = 3",)
  statement = ast.parse("n = [(last := x) for x in range(3)]").body[0]
  assert skills.module_scope_bindings(statement) == {"n", "last"}


def test_a_name_bound_only_in_a_nested_scope_is_read_from_the_module():
  """A nested function's parameter or a comprehension's variable binds nothing in the
  skill's own scope: the skill reads the module's name (a computed `token`: not saved), as
  it does a name it declares `global`; a `nonlocal` one is the skill's own local."""
  saved = _saved([
      "token = len('ab')\nCOUNT = 0\nn = len('c')\n",
      "def f(x):\n    def helper(token):\n        return token\n    return helper(token) + x\n"
      "def g(xs):\n    sizes = [len(token) for token in xs]\n    return sizes, token\n"
      "def h():\n    global COUNT\n    COUNT += 1\n    return COUNT\n"
      "def k():\n    n = 0\n    def inc():\n        nonlocal n\n        n += 1\n"
      "        return n\n    return inc()\n",
  ])
  assert sorted(saved) == ["h", "k"]
  assert saved["h"].constants == ("COUNT = 0",) and saved["k"].constants == ()
  namespace = {}
  exec(saved["h"].code + saved["k"].code, namespace)  # noqa: S102
  assert (namespace["h"](), namespace["k"]()) == (1, 1)


def test_a_line_break_inside_a_string_does_not_shift_the_saved_source():
  """Python breaks lines at \\n and \\r only: a \\u2028 or \\f in a string literal is text."""
  for sep in ("\u2028", "\x0c", "\x85"):
    saved = _saved([f"SEP = ' {sep} '\ndef first(): return 1\ndef second(): return 2\n"])
    assert saved["first"].source == "def first(): return 1", sep
    assert saved["second"].source == "def second(): return 2", sep


def test_a_constant_a_default_value_reads_is_carried():
  """`page_size=page_size`: inside the function the name is its parameter; the `def` reads
  the task's constant, which travels with the skill so that the `def` runs elsewhere."""
  saved = _saved(["page_size = 3\ndef first_n(items, page_size=page_size):\n"
                  "    return items[:page_size]\n"])
  assert saved["first_n"].constants == ("page_size = 3",)
  namespace = {}
  exec(saved["first_n"].code, namespace)  # noqa: S102
  assert namespace["first_n"]([1, 2, 3, 4]) == [1, 2, 3]


def test_skills_whose_constants_clash_each_read_their_own_once_installed():
  lib = SkillLibrary()
  for task, (name, value) in enumerate([("first", 3), ("second", 5), ("third", 3)]):
    lib.save(_saved([f"LIMIT = {value}\ndef {name}():\n    return LIMIT\n"]), scenario="s",
             task_id=f"s_{task}", instruction="")
  code_ = install_code(lib.skills("s"))
  assert "LIMIT__second = 5" in code_ and code_.count("LIMIT = 3") == 2
  namespace = {}
  exec(code_, namespace)  # noqa: S102
  assert [namespace[n]() for n in ("first", "second", "third")] == [3, 5, 3]


def test_skills_that_import_a_name_differently_each_read_their_own_once_installed():
  """`import datetime` in one, `from datetime import datetime` in the next: the later one's
  import is renamed, so neither sees the other's; the same import twice stays one."""
  lib = SkillLibrary()
  lib.save(_saved(["import datetime\ndef days_between(a, b):\n    return (datetime.date."
                   "fromisoformat(b) - datetime.date.fromisoformat(a)).days\n"]),
           scenario="s", task_id="s_1", instruction="")
  lib.save(_saved(["from datetime import datetime\ndef year_of(text):\n"
                   "    return datetime.fromisoformat(text).year\n"]),
           scenario="s", task_id="s_2", instruction="")
  lib.save(_saved(["import datetime\ndef today():\n    return datetime.date(2024, 1, 2)\n"]),
           scenario="s", task_id="s_3", instruction="")
  code_ = install_code(lib.skills("s"))
  assert "from datetime import datetime as datetime__year_of" in code_
  assert code_.count("import datetime\n") == 2  # days_between's and today's: the same
  namespace = {}
  exec(code_, namespace)  # noqa: S102
  assert namespace["days_between"]("2024-01-01", "2024-01-31") == 30
  assert namespace["year_of"]("2024-05-06") == 2024
  assert namespace["today"]().day == 2


# --- library and retrieval -------------------------------------------------------------------

def _skill(name, scenario, instruction, doc="", calls=(), task=None):
  return Skill(name=name, code=f"def {name}():\n    return 1\n", signature=f"{name}()",
               docstring=doc, scenario=scenario, source_task=task or f"{scenario}_1",
               source_instruction=instruction, calls=tuple(calls))


def test_library_save_update_and_install():
  lib = SkillLibrary()
  a = skills.analyze(SKILL)
  saved = lib.save({f.name: f for f in a.functions}, scenario="s1", task_id="s1_1",
                   instruction="How many rock songs?")
  assert [s.name for s in saved] == ["count_songs", "login"] and len(lib) == 2
  lib.record_use([lib.get("s1", "count_songs")], success=True)
  same = lib.save({"login": skills.analyze("# the same code\n" + SKILL).functions[1]},
                  scenario="s1", task_id="s1_2", instruction="How many pop songs?")[0]
  assert same.version == 1 and same.source_task == "s1_1"  # written again: the same version
  changed = dataclasses.replace(a.functions[0], source=a.functions[0].source.replace(
      "== genre", "== genre.lower()"))
  again = lib.save({"count_songs": changed}, scenario="s1", task_id="s1_2",
                   instruction="How many pop songs?")[0]
  assert again.version == 2 and again.created_by == "s1_1" and again.source_task == "s1_2"
  assert again.uses == 1 and again.successes == 1
  assert [s.name for s in lib.skills("s1")] == ["login", "count_songs"]
  code_ = install_code(lib.skills())
  compile(code_, "<library>", "exec")
  assert code_.count("def login") == 1 and "import re" in code_
  assert install_code([]) is None
  clone = SkillLibrary.from_list(lib.to_list())
  assert [s.to_dict() for s in clone.skills()] == lib.to_list()
  copy_ = lib.copy()
  copy_.record_use(copy_.skills(), success=False)
  assert lib.get("s1", "login").uses == 0


LIB = [
    _skill("count_rock", "s1", "How many rock songs are in my Spotify library?",
           "Count songs of a genre in the Spotify library.", calls=["spotify_login"]),
    _skill("spotify_login", "s1", "How many rock songs are in my Spotify library?",
           "Log in to Spotify."),
    _skill("pay_friend", "s2", "Send $20 to Ann on Venmo for lunch.",
           "Send a Venmo payment to a person by name."),
    _skill("count_notes", "s3", "How many of my Simple Note notes are tagged work?",
           "Count notes with a tag."),
]


def test_retrieval_strategies():
  lib = SkillLibrary(LIB)
  query = "How many jazz songs are in my Spotify library?"
  same = retrieval.Retriever(RetrievalConfig(strategy="same_scenario"))
  assert [s.name for s in same.retrieve(lib, scenario="s2", instruction=query)] == ["pay_friend"]
  assert retrieval.Retriever(RetrievalConfig(strategy="none")).retrieve(
      lib, scenario="s1", instruction=query) == []
  for strategy in ("query_ngram", "query_embedding", "skill_embedding"):
    r = retrieval.Retriever(RetrievalConfig(strategy=strategy, top_k=1,
                                            embedding_model="hashing"))
    got = [s.name for s in r.retrieve(lib, scenario="unknown", instruction=query)]
    # The best match comes with the library skill it calls.
    assert got == ["count_rock", "spotify_login"], strategy
  pay = retrieval.Retriever(RetrievalConfig(strategy="query_ngram", top_k=1)).retrieve(
      lib, scenario="x", instruction="Send $45 to Bob on Venmo for pottery.")
  assert [s.name for s in pay] == ["pay_friend"]
  strict = retrieval.Retriever(RetrievalConfig(strategy="query_ngram", min_score=0.99))
  assert strict.retrieve(lib, scenario="x", instruction=query) == []


def test_retrieval_across_scenarios_installs_each_skill_with_its_own_callees():
  """Two scenarios each save a `login`: each skill installed calls its own scenario's."""
  def returning(skill, value):
    return dataclasses.replace(skill, code=f"def {skill.name}(*args):\n    return {value!r}\n")
  venmo = "Send money to Ann on Venmo."
  lib = SkillLibrary([
      returning(_skill("login", "s1", venmo), "venmo token"),
      dataclasses.replace(_skill("send_money", "s1", venmo, calls=["login"]),
                          code="def send_money(who):\n    return login()\n"),
      returning(_skill("login", "s2", "Send money to Bob on Venmo please."), "spotify token"),
  ])
  r = retrieval.Retriever(RetrievalConfig(strategy="query_ngram", top_k=5))
  # s2's login matches best: s1's send_money, which calls s1's login, is left out.
  got = r.retrieve(lib, scenario="x", instruction="Send money to Bob on Venmo please.")
  assert [(s.scenario, s.name) for s in got] == [("s2", "login")]
  # send_money matches best: it comes with its own login, and s2's is left out.
  got = r.retrieve(lib, scenario="x", instruction="Send money to Ann on Venmo.")
  assert [(s.scenario, s.name) for s in got] == [("s1", "login"), ("s1", "send_money")]
  namespace = {}
  exec(install_code(got), namespace)  # noqa: S102
  assert namespace["send_money"]("Ann") == "venmo token"


def test_same_scenario_lists_the_newest_skills_first():
  """A listing cut to fit the prompt hides the oldest skills, not the one just updated."""
  lib = SkillLibrary()
  a = skills.analyze(SKILL)
  lib.save({f.name: f for f in a.functions}, scenario="s1", task_id="s1_1", instruction="")
  changed = dataclasses.replace(a.functions[0], source=a.functions[0].source.replace(
      "== genre", "== genre.lower()"))
  lib.save({"count_songs": changed}, scenario="s1", task_id="s1_2", instruction="")
  got = retrieval.Retriever(RetrievalConfig()).retrieve(lib, scenario="s1", instruction="")
  assert [s.name for s in got] == ["count_songs", "login"]
  listing = prompts.skill_listing(got, max_chars=1)  # room for the first skill only
  assert "def count_songs(" in listing and "def login(" not in listing


def test_hashing_embedder_is_normalised_and_deterministic():
  e = retrieval.HashingEmbedder(64)
  m = e.embed(["hello world", "hello world", ""])
  assert m.shape == (3, 64) and np.allclose(np.linalg.norm(m[:2], axis=1), 1.0)
  assert np.array_equal(m[0], m[1]) and not m[2].any()


def test_policy_embedder_embeds_with_the_engines_current_weights(tok):
  from flax import nnx

  from sage_jax import multihost
  from sage_jax.model import get_preset, init_model
  from sage_jax.sampler import Engine, EngineConfig

  # As the training pipeline's sampler: weights on a mesh over this host's devices.
  model = init_model(get_preset("tiny"), seed=0)
  sync = multihost.WeightSync(model, multihost.SamplerMeshConfig())
  engine = Engine(model, EngineConfig(num_slots=1, max_len=64, prefill_buckets=(32,),
                                      min_attend=32), eos_ids=[tok.eos_id], mesh=sync.mesh)
  config = RetrievalConfig(strategy="skill_embedding", embedding_model="policy")
  e = retrieval.make_embedder(config, engine=engine, tokenizer=tok)
  texts = ["count songs", "count songs", "pay a friend on venmo"]
  m = e.embed(texts)
  assert m.shape == (3, 64) and np.allclose(m[0], m[1], atol=1e-5)
  r = retrieval.Retriever(config, e)
  assert len(r.retrieve(SkillLibrary(LIB), scenario="x", instruction="songs")) >= 1
  engine.update_params(nnx.state(init_model(get_preset("tiny"), seed=1)))
  assert not np.allclose(e.embed(texts), m, atol=1e-3)  # the engine's new weights embed
  with pytest.raises(ValueError, match="needs a model policy"):
    retrieval.make_embedder(config, tokenizer=tok)


def test_minilm_is_the_default_and_ranks_by_meaning():
  """all-MiniLM-L6-v2 from its package: it finds the skill that means what the task asks
  though they share no word, where hashed n-grams rank another skill first."""
  assert RetrievalConfig().embedding_model == "minilm"
  library = SkillLibrary([
      _skill("gym_mix", "s1", "Start my gym mix.", "Start a music playlist on Spotify."),
      _skill("venmo_send", "s2", "Send $20 to Ann.",
             "Send a Venmo payment to a person by name."),
      _skill("settle_debt", "s3", "Pay back Bob.",
             "Return the outstanding balance owed to a friend."),
  ])
  task = "Play upbeat tunes for my workout."
  assert not any(set(retrieval.words(task)) & set(retrieval.words(s.description))
                 for s in library.skills())

  def best(embedding_model):
    r = retrieval.Retriever(RetrievalConfig(strategy="skill_embedding", top_k=1,
                                            embedding_model=embedding_model))
    return [s.name for s in r.retrieve(library, scenario="x", instruction=task)]

  assert best("minilm") == ["gym_mix"]
  assert best("hashing") != ["gym_mix"]
  m = retrieval.MiniLMEmbedder().embed(["How many rock songs are in my library?",
                                        "How many jazz songs are in my library?",
                                        "Send money on Venmo to Ann"])
  assert m.shape == (3, 384) and m[0] @ m[1] > m[0] @ m[2]


def test_minilm_loads_offline(tmp_path):
  """In a fresh process with the hub switched off and an empty HF cache to fall back on."""
  import os
  import subprocess
  import sys

  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
  done = subprocess.run([sys.executable, "-c", "from sage_jax.agent import retrieval; "
                         "print(retrieval.MiniLMEmbedder().embed(['hi']).shape)"],
                        capture_output=True, text=True, env=env, timeout=300)
  assert done.returncode == 0 and "(1, 384)" in done.stdout, done.stderr[-2000:]


def test_unknown_embedding_models_are_refused():
  with pytest.raises(ValueError, match=r"embedding_model='bert'; expected one of "
                                       r"\('minilm', 'policy', 'hashing'\)"):
    RetrievalConfig(strategy="query_embedding", embedding_model="bert")


def test_configs_reject_bad_values():
  with pytest.raises(ValueError, match="strategy"):
    RetrievalConfig(strategy="random")
  with pytest.raises(ValueError, match="max_steps"):
    AgentConfig(max_steps=0)
  with pytest.raises(ValueError, match="config.agent.unknown_key: unknown key"):
    configurable.build(AgentConfig, {"unknown_key": 1}, "config.agent")
  built = configurable.build(AgentConfig, {"stop_strings": ["```\n"]}, "config.agent")
  assert built.stop_strings == ("```\n",)


# --- prompt and expert -----------------------------------------------------------------------

def test_system_prompt_lists_skills_and_baseline_has_no_library():
  text = prompts.system_prompt(LIB[:2])
  assert "apis.api_docs" in text and "complete_task" in text and "# Skills" in text
  assert "def count_rock():" in text and "Count songs of a genre" in text
  assert "The library is empty" in prompts.system_prompt([])
  assert "# Skills" not in prompts.system_prompt(None)
  short = prompts.skill_listing(LIB, max_chars=60)
  assert "more skills not shown" in short
  # An async skill is listed as Python writes one.
  (listed,) = skills.analyze('async def fetch(x):\n    """Fetch x."""\n    return x\n').functions
  fetch = dataclasses.replace(_skill("fetch", "s", ""), signature=listed.signature,
                              docstring="Fetch x.")
  assert 'async def fetch(x):\n    """Fetch x."""' in prompts.skill_listing([fetch], 1000)


GOLD = code('''
  def total_received_from(name):
      users = apis.venmo.search_users(query=name)
      return sum(u["amount"] for u in users)


  answer = total_received_from('Ann Lee')
  apis.supervisor.complete_task(answer=answer)
  ''')


def test_expert_defines_with_docstring_then_reuses():
  first = gold_solutions.expert_turns(GOLD)
  assert len(first) == 1
  c = parsing.extract_code(first[0]).code
  a = skills.analyze(c)
  assert a.functions[0].docstring.startswith("Total received from.")
  assert "name: the name." in a.functions[0].docstring
  assert "total_received_from" in a.top_level_calls
  second = parsing.extract_code(gold_solutions.expert_turns(GOLD, ["total_received_from"])[0]).code
  assert "def " not in second and "total_received_from('Ann Lee')" in second
  plain = gold_solutions.expert_turns("x = apis.a.b()\napis.supervisor.complete_task()\n")
  assert parsing.extract_code(plain[0]).code.startswith("x = apis.a.b()")


# --- the episode loop ------------------------------------------------------------------------

class FakeEpisode:
  """An AsyncEpisode stand-in: code containing 'complete_task' completes the task, code
  containing 'boom' fails."""

  def __init__(self):
    self.start = EpisodeStart(task_id="abc1234_1", instruction="Do the thing.",
                              supervisor={"first_name": "A", "last_name": "B", "email": "e",
                                          "phone_number": "1"},
                              app_descriptions={"spotify": "music", "supervisor": "s"},
                              datetime="2023-05-18T12:00:00")
    self.task_completed = False
    self.error = None
    self.last_trace = None  # no call records: skill events need the real worker
    self.executed = []

  async def execute(self, code):
    self.executed.append(code)
    if "boom" in code:
      return "Execution failed. Traceback:\nValueError: boom"
    if "complete_task" in code:
      self.task_completed = True
    return "Execution successful."


class ListPolicy:
  """Replays fixed texts; records the requests it saw."""

  def __init__(self, tok, texts, logprob=-0.5, end=True):
    self.tok, self.texts, self.logprob, self.end = tok, texts, logprob, end
    self.requests = []

  def session(self, context):
    policy = self

    class Session:
      async def generate(self, request):
        policy.requests.append(request)
        ids = policy.tok.encode(policy.texts[request.turn_index])[:request.max_new_tokens]
        reason = "max_new_tokens"
        if policy.end and len(ids) < request.max_new_tokens:
          ids, reason = ids + [policy.tok.eos_id], "eos"
        lp = np.full(len(ids), policy.logprob, np.float32)
        return PolicyTurn(ids, lp, lp * 2, reason)

      async def close(self):
        pass

    return Session()


def _run(tok, texts, config=AgentConfig(), skills_=(), **kw):
  episode = FakeEpisode()
  policy = ListPolicy(tok, texts, **kw)
  trace = asyncio.run(agent_lib.run_task(policy=policy, episode=episode, tokenizer=tok,
                                         config=config, skills=list(skills_), scenario="abc1234"))
  return trace, episode, policy


def test_episode_masks_logprobs_turns_and_events(tok):
  texts = ["Let me look.", "```python\ndef f():\n    raise boom\nf()\n```",
           "```python\ndef f():\n    return 1\nf()\napis.supervisor.complete_task()\n```"]
  trace, episode, policy = _run(tok, texts)
  assert trace.end_reason == "completed" and trace.num_steps == 3 and trace.no_code_turns == 1
  assert len(episode.executed) == 2
  ids, mask = trace.conversation.ids, np.asarray(trace.conversation.loss_mask)
  assert int(mask.sum()) == trace.generated_tokens
  # The mask covers exactly the policy's tokens, and logprobs sit exactly under the mask.
  generated = [i for t in trace.turns for i in ids[t.token_start:t.token_end]]
  expected = [i for text in texts for i in tok.encode(text) + [tok.eos_id]]
  assert generated == expected and int(mask.sum()) == len(expected)
  assert np.all((trace.sampler_logprobs != 0) == (mask == 1))
  assert np.allclose(trace.sampler_logprobs[mask == 1], -0.5)
  assert np.allclose(trace.model_logprobs[mask == 1], -1.0)
  assert prompts.FORMAT_ERROR in tok.decode(ids)
  # Each turn's new ids continue exactly where the policy's sequence stopped.
  seq = []
  for r, t in zip(policy.requests, trace.turns):
    seq += r.new_ids
    assert seq == r.prompt_ids
    seq += ids[t.token_start:t.token_end]
  assert trace.events.generated == () and trace.events.mentioned == ()
  roles = [t.role for t in trace.conversation.turns]
  assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_a_stop_asked_during_a_turn_ends_the_episode_before_the_next(tok):
  """Within `stopping.stop_when` (a dev evaluation), a stop asked while a turn runs ends the
  episode before the next turn, with StopRequested; outside it the episode runs on."""
  texts = ["```python\nprint(1)\n```"] * 3
  for stoppable in (True, False):
    episode, policy = FakeEpisode(), ListPolicy(tok, texts)
    work = agent_lib.run_task(policy=policy, episode=episode, tokenizer=tok,
                              config=AgentConfig(max_steps=3), skills=[], scenario="abc1234")
    asked = lambda: len(policy.requests) > 0  # noqa: E731 - asked during the first turn
    if stoppable:
      with stopping.stop_when(asked), pytest.raises(stopping.StopRequested):
        asyncio.run(work)
      assert len(policy.requests) == len(episode.executed) == 1
    else:
      assert asyncio.run(work).num_steps == 3


def test_episode_limits_end_cleanly(tok):
  texts = ["```python\nprint(1)\n```"] * 10
  trace, _, _ = _run(tok, texts, AgentConfig(max_steps=3))
  assert trace.end_reason == "max_steps" and trace.num_steps == 3
  assert trace.conversation.turns[-1].role == "assistant"
  long = ["```python\n" + "x = 1\n" * 200 + "```"] * 10
  trace, _, _ = _run(tok, long, AgentConfig(max_turn_tokens=50, max_episode_tokens=100_000))
  assert all(t.token_end - t.token_start == 50 for t in trace.turns)
  assert all(t.finish_reason == "max_new_tokens" for t in trace.turns)
  for limit in (700, 900, 1200):
    trace, _, _ = _run(tok, long, AgentConfig(max_turn_tokens=400, max_episode_tokens=limit))
    assert trace.end_reason == "token_limit" and len(trace.conversation) <= limit
  prose = ["I will think about this at great length first. " * 40] * 3
  trace, _, _ = _run(tok, prose, AgentConfig(max_steps=3, max_turn_tokens=30))
  assert trace.truncated_turns == 3 and trace.no_code_turns == 0  # cut, not code-less
  trace, _, _ = _run(tok, ["No code here."] * 3, AgentConfig(max_steps=3))
  assert trace.truncated_turns == 0 and trace.no_code_turns == 3
  tiny = AgentConfig(max_episode_tokens=50)
  trace, _, _ = _run(tok, texts, tiny)
  assert trace.end_reason == "token_limit" and trace.num_steps == 0


def test_baseline_mode_shows_no_library_and_saves_nothing(tok):
  texts = ["```python\ndef f():\n    return 1\nf()\napis.supervisor.complete_task()\n```"]
  trace, _, _ = _run(tok, texts, AgentConfig(use_library=False), skills_=LIB)
  assert trace.visible_skills == () and trace.saved == {}
  assert "# Skills" not in tok.decode(trace.conversation.ids)
