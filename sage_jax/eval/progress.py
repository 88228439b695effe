"""The scenarios an evaluation has finished, kept so that a stopped evaluation resumes.

An evaluation of a large model over a whole split can run for hours on preemptible machines.
After each scenario, the process that played it writes the scenario's episode records and the
skills its library then held into <workdir>/eval_<split>_progress/scenario_<index>.pkl (one
whole file: storage.write_bytes). A rerun of the same evaluation plays only the scenarios that
have no file there, with the library the finished ones left, and reports every scenario as
one uninterrupted run would; the directory is removed once the report is written.

Each file carries a fingerprint of what decides an episode (the evaluation, agent, retrieval,
model, engine and pool settings, the checkpoint), not of how fast it runs (scenarios at once,
slots, workers, mesh). Files of another evaluation in the same workdir are an error that names
them: their episodes would be mixed into this one's report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from typing import Any

from sage_jax import storage
from sage_jax.agent.library import Skill, SkillLibrary
from sage_jax.rl.episode import EpisodeRecord

# Keys that change how fast an evaluation runs, or how it is checked, not what its episodes do.
SPEED_KEYS = {
    "eval": ("max_scenarios", "max_concurrent_scenarios", "appworld_check"),
    "engine": ("num_slots",),
    "pool": ("num_workers", "log_dir", "outputs_root", "data_check_cache", "use_servers"),
    "sampler_mesh": ("tensor",),
}


def fingerprint(sections: dict[str, Any], checkpoint: dict | None) -> str:
  """A digest of `sections` (name -> mapping of keys; the config's, as plain values) and the
  checkpoint, without SPEED_KEYS."""
  kept = {name: {k: v for k, v in dict(values or {}).items()
                 if k not in SPEED_KEYS.get(name, ())}
          for name, values in sorted(sections.items())}
  text = json.dumps({"sections": kept, "checkpoint": checkpoint}, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


class Progress:
  """The finished scenarios of one evaluation (split `split`, settings `key`) in `workdir`."""

  def __init__(self, workdir: storage.PathLike, split: str, key: str):
    self.directory = storage.path(workdir) / f"eval_{split}_progress"
    self.key = key

  def finished(self, replace_other: bool = False) -> dict[int, dict]:
    """Scenario index -> {"records": [...], "skills": [...]}, from the files there. Raises
    WorkdirError when a file belongs to another evaluation, or (`replace_other`: a directory
    that only its owner evaluates in) removes them all."""
    if not self.directory.exists():
      return {}
    done = {}
    for entry in sorted(self.directory.glob("scenario_*.pkl")):
      value = pickle.loads(entry.read_bytes())
      if value["key"] != self.key and replace_other:
        logging.warning("%s holds scenarios of an evaluation with other settings or weights: "
                        "evaluating afresh", self.directory)
        self.clear()
        return {}
      if value["key"] != self.key:
        raise storage.WorkdirError(
            f"{self.directory} holds scenarios finished by an evaluation with other settings "
            f"or another checkpoint ({entry.name}); remove it to start this one afresh, or "
            "use another workdir")
      done[value["index"]] = value
    return done

  def record(self, index: int, records: list[EpisodeRecord], skills: list[Skill]) -> None:
    """Keeps scenario `index` (of the split's scenarios) as finished."""
    storage.write_bytes(self.directory / f"scenario_{index:05d}.pkl", pickle.dumps(
        {"key": self.key, "index": index, "records": records,
         "skills": [s.to_dict() for s in skills]}))

  def clear(self) -> None:
    if self.directory.exists():
      self.directory.rmtree()


def restored_library(finished: dict[int, dict], across: bool) -> SkillLibrary:
  """The library the finished scenarios left. Across scenarios (played one at a time, in
  order) it is the one the last of them saw at its end; within each scenario, each finished
  scenario's own skills."""
  if not finished:
    return SkillLibrary()
  if across:
    return SkillLibrary.from_list(finished[max(finished)]["skills"])
  return SkillLibrary.from_list(
      [s for entry in finished.values() for s in entry["skills"]])
