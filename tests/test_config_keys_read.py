"""Every key of run_config's sections changes what a run does: the code reads it, and no code
path replaces it with a value of its own.

A static check of the source, not a record of attribute reads over a run. A run reads only
the keys of the branches it takes (`grpo.kl_clamp` only with KL on, `retrieval.ngram` only
with n-gram retrieval, `pool.sandbox` only where it can confine), so a recording would call
every switched-off feature dead, or need one run per combination of switches. The static
check sees every branch; what keeps it from passing trivially:

- reads inside the dataclass's own `__post_init__` (validation) do not count, and neither
  does `dataclasses.replace(x, key=...)`, which writes;
- a field name that several sections share (`seed`, `logprob_chunk`, `eval_every`, ...)
  counts as read for a section only where the receiver says which one: it names the section
  (`run.rl.seed`, `rollout_config.seed`), or is a local given one (`ev = s["eval"]`), or is
  a parameter (or the `self.<name>` of an
  `__init__` parameter) annotated with the section's dataclass;
- a key that code replaces with a value not derived from the key itself
  (`dataclasses.replace(trainer_config, logprob_chunk=grpo.logprob_chunk)`) is overwritten;
  one derived from the key (`replace(rollout_config, seed=step_seed(rollout_config.seed,
  step))`) is not. So is a key replaced in a section passed on as a dict
  (`{**config["eval"], "data": root}`). A key read as `x["key"]` counts too: sections go to
  the AppWorld worker processes as dicts.

What it cannot see: a key read and handed on to code that then does nothing with it
(`sft.eval_every` reached the SFT loop without an evaluation to run; tests/test_demo.py
checks that it evaluates).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import os
import re

from sage_jax import run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("sage_jax", "launch")
# Keys some code path replaces by design, each read as set on every other path.
ALLOWED_OVERWRITES = {
    "agent.temperature": "self-distillation samples at expert.temperatures, evaluation at "
                         "eval.temperature",
    "checkpoint.keep_best": "without dev evaluation (SFT, rl.eval_every=0) nothing ranks "
                            "checkpoints",
    "pool.outputs_root": "unset, the pool writes to a scratch directory it removes",
    "eval.split": "the evaluation of the training scenarios (pipeline.eval_train) runs on "
                  "pipeline.train_split",
    "eval.max_scenarios": "the evaluation of the training scenarios covers "
                          "pipeline.train_scenarios",
    "model.param_dtype": "a model loaded to be sampled alone (evaluation, generation) is held "
                         "in sampler_mesh.param_dtype, as a training run's sampling copy is",
    **{f"{section}.{key}": "OptimizerConfig.for_updates resolves warmup_ratio and a decay to "
                           "the last update into steps once the stage's length is known"
       for section in ("optimizer", "sft_optimizer")
       for key in ("warmup_steps", "warmup_ratio", "decay_steps")},
}


def _modules():
  for top in SOURCES:
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(root, name)
          with open(path) as f:
            yield os.path.relpath(path, REPO), ast.parse(f.read(), path)


def _annotation_names(node) -> set[str]:
  return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
          if isinstance(n, (ast.Name, ast.Attribute))} if node is not None else set()


class _Reads(ast.NodeVisitor):
  """(receiver source, field, classes the receiver is annotated as) of every attribute load,
  and the keyword writes of every `dataclasses.replace`."""

  def __init__(self, section_classes: set[str]):
    self.section_classes = section_classes
    self.reads: list[tuple[str, str, frozenset]] = []
    self.replaces: list[tuple[str, str, str, frozenset]] = []
    self._params: list[dict[str, set[str]]] = [{}]
    self._self_attrs: list[dict[str, set[str]]] = [{}]
    self._skip_class: list[str] = [""]
    self._aliases: list[dict[str, str]] = [{}]

  def _annotated(self, receiver: ast.AST) -> frozenset:
    if isinstance(receiver, ast.Name) and receiver.id == "self" and self._skip_class[-1]:
      return frozenset({self._skip_class[-1]})  # a section's own method reads it
    if isinstance(receiver, ast.Name):
      return frozenset(self._params[-1].get(receiver.id, ()))
    if (isinstance(receiver, ast.Attribute) and isinstance(receiver.value, ast.Name)
        and receiver.value.id == "self"):
      return frozenset(self._self_attrs[-1].get(receiver.attr, ()))
    return frozenset()

  def visit_ClassDef(self, node):
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                 and n.name == "__init__"), None)
    attrs = {}
    if init is not None:
      for a in init.args.args + init.args.kwonlyargs:
        attrs[a.arg] = _annotation_names(a.annotation) & self.section_classes
    self._self_attrs.append(attrs)
    self._skip_class.append(node.name if node.name in self.section_classes else "")
    self.generic_visit(node)
    self._skip_class.pop()
    self._self_attrs.pop()

  def visit_FunctionDef(self, node):
    if self._skip_class and self._skip_class[-1] and node.name == "__post_init__":
      return  # the section's own validation
    params = dict(self._params[-1])
    for a in node.args.args + node.args.kwonlyargs:
      params[a.arg] = _annotation_names(a.annotation) & self.section_classes
    self._params.append(params)
    self._aliases.append(dict(self._aliases[-1]))
    self.generic_visit(node)
    self._aliases.pop()
    self._params.pop()

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_Assign(self, node):
    """`ev, cfg = s["eval"], s["retrieval"]`: the names stand for what they were given."""
    for target in node.targets:
      pairs = [(target, node.value)]
      if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
        pairs = list(zip(target.elts, node.value.elts))
      for name, value in pairs:
        if isinstance(name, ast.Name):
          self._aliases[-1][name.id] = ast.unparse(value)
    self.generic_visit(node)

  def _receiver(self, node) -> str:
    text = ast.unparse(node)
    alias = self._aliases[-1].get(text) if isinstance(node, ast.Name) else None
    return f"{text} {alias}" if alias else text

  def visit_Attribute(self, node):
    if isinstance(node.ctx, ast.Load):
      self.reads.append((self._receiver(node.value), node.attr, self._annotated(node.value)))
    self.generic_visit(node)

  def visit_Subscript(self, node):
    """`settings["key"]`: a section sent as a dict (e.g. to the AppWorld worker processes)."""
    if (isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)):
      self.reads.append((ast.unparse(node.value), node.slice.value, frozenset()))
    self.generic_visit(node)

  def visit_Dict(self, node):
    """`{**config["eval"], "data": root}`: a section sent on as a dict, a key replaced."""
    for unpacked in (v for k, v in zip(node.keys, node.values) if k is None):
      for key, value in zip(node.keys, node.values):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
          self.replaces.append((ast.unparse(unpacked), key.value, ast.unparse(value),
                                self._annotated(unpacked)))
    self.generic_visit(node)

  def visit_Call(self, node):
    func = ast.unparse(node.func)
    if func in ("dataclasses.replace", "replace") and node.args:
      target = node.args[0]
      for kw in node.keywords:
        if kw.arg is not None:
          self.replaces.append((ast.unparse(target), kw.arg, ast.unparse(kw.value),
                                self._annotated(target)))
    self.generic_visit(node)


def _names_section(receiver: str, annotated: frozenset, section: str, cls: type) -> bool:
  words = re.sub(r"[^\w]", " ", receiver).replace("_", " ").split()
  return section in words or receiver.endswith(f"{section}_config") or (
      cls.__name__ in annotated) or section.replace("_", " ") in receiver.replace("_", " ")


def _section_fields():
  for section, cls in run_config.SECTIONS.items():
    for field in dataclasses.fields(cls):
      yield section, cls, field.name


def _problems() -> dict[str, list[str]]:
  classes = {cls.__name__ for cls in run_config.SECTIONS.values()}
  reads, replaces = [], []
  for _, tree in _modules():
    visitor = _Reads(classes)
    visitor.visit(tree)
    reads += visitor.reads
    replaces += visitor.replaces
  owners = collections.Counter(name for _, _, name in _section_fields())
  problems = collections.defaultdict(list)
  for section, cls, name in _section_fields():
    key = f"{section}.{name}"
    if owners[name] == 1:
      found = any(attr == name for _, attr, _ in reads)
    else:
      found = any(attr == name and _names_section(receiver, annotated, section, cls)
                  for receiver, attr, annotated in reads)
    if not found:
      problems["read by nothing"].append(key)
    for target, kw, value, annotated in replaces:
      derived = re.search(rf"(?<![\w.]){re.escape(target)}\.{name}\b", value)
      if key in ALLOWED_OVERWRITES or key in run_config.SET_BY_THE_RUN:
        continue
      if kw == name and not derived and (
          owners[name] == 1 and any(f.name == name for f in dataclasses.fields(cls))
          or _names_section(target, annotated, section, cls)):
        problems["overwritten"].append(f"{key} (replace({target}, {kw}={value}))")
  return dict(problems)


def test_every_config_key_is_read_and_not_overwritten():
  assert _problems() == {}


def test_keys_the_run_sets_cannot_be_set():
  from sage_jax.configurable import ConfigError  # noqa: PLC0415
  import pytest  # noqa: PLC0415

  for key, source in run_config.SET_BY_THE_RUN.items():
    config = run_config.defaults()
    section, field = key.split(".")
    default = config[section][field]
    config[section][field] = 0.5 if isinstance(default, float) else "/somewhere/else"
    with pytest.raises(ConfigError, match=f"config.{key}: set by the run from"):
      run_config.resolve(config)


def test_the_check_sees_an_unread_and_an_overwritten_key(tmp_path, monkeypatch):
  """The check itself fails on a field nothing reads and on a key the code overwrites."""

  @dataclasses.dataclass(frozen=True)
  class ProbeConfig:
    never_read_anywhere_xyz: int = 0

  module = tmp_path / "launch_probe.py"
  module.write_text("import dataclasses\n"
                    "def f(run):\n"
                    "  return dataclasses.replace(run.rollout, group_size=3)\n")
  monkeypatch.setitem(run_config.SECTIONS, "probe", ProbeConfig)
  original = _modules

  def with_probe():
    yield from original()
    yield "launch_probe.py", ast.parse(module.read_text())

  monkeypatch.setitem(globals(), "_modules", with_probe)
  problems = _problems()
  assert problems["read by nothing"] == ["probe.never_read_anywhere_xyz"]
  assert problems["overwritten"] == [
      "rollout.group_size (replace(run.rollout, group_size=3))"]
