"""What an episode returns: its start, its evaluation, its one result record; TGC and SGC."""

import dataclasses

from sage_jax.envs.appworld import dataset


@dataclasses.dataclass(frozen=True)
class EpisodeStart:
  """What the agent's first prompt is built from."""
  task_id: str
  instruction: str
  supervisor: dict[str, str]  # first_name, last_name, email, phone_number
  app_descriptions: dict[str, str]  # app name -> description (the api_docs app's listing)
  datetime: str  # the task's frozen clock, ISO format
  library_output: str | None = None  # AppWorld's output of the installed skill library
  library_ok: bool | None = None  # None when no library was installed


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """AppWorld's evaluation of the world's current state."""
  success: bool  # all tests pass
  num_passed: int
  num_failed: int
  failed_requirements: tuple[str, ...] = ()
  error: str | None = None  # set when the episode ended on an environment fault
  # Set when the saved state was not scored because of what the episode's code wrote (a
  # forged state, one that does not replay, or one whose evaluation outlived
  # evaluation_timeout_s): a failure of the agent, counted as such, never an environment
  # fault (which would leave the episode out of training).
  refused: str | None = None

  @property
  def num_tests(self) -> int:
    return self.num_passed + self.num_failed

  @property
  def fraction_passed(self) -> float:
    return self.num_passed / self.num_tests if self.num_tests else 0.0


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
  """The one record every started episode yields, even when its worker died."""
  task_id: str
  experiment: str
  evaluation: Evaluation | None  # None when the episode ended on an environment fault
  # Interaction steps: every execute() the episode sent to its worker while live counts once,
  # whatever came of it (ran, failed, blocked by AppWorld's guards, timed out, killed, or
  # ended the episode on a fault). The library install is not one; executions answered
  # after the episode ended are not either.
  num_steps: int
  task_completed: bool  # the agent called apis.supervisor.complete_task
  error: str | None = None  # the environment fault that ended the episode, if any

  @property
  def success(self) -> bool:
    return self.error is None and self.evaluation is not None and self.evaluation.success

  @property
  def fraction_passed(self) -> float:
    return self.evaluation.fraction_passed if self.error is None and self.evaluation else 0.0


def _last_per_task(results: list[EpisodeResult]) -> list[EpisodeResult]:
  """One result per task, as AppWorld scores them: a task given several (an attempt the
  environment failed under and its retry, say) counts by the last."""
  if not results:
    raise ValueError("No results to score.")
  return list({r.task_id: r for r in results}.values())


def task_goal_completion(results: list[EpisodeResult]) -> float:
  """TGC in percent: share of tasks whose tests all pass."""
  results = _last_per_task(results)
  return 100.0 * sum(r.success for r in results) / len(results)


def scenario_goal_completion(results: list[EpisodeResult]) -> float:
  """SGC in percent: share of scenarios all of whose tasks pass."""
  passed = {}
  for r in _last_per_task(results):
    key = dataset.scenario_id(r.task_id)
    passed[key] = passed.get(key, True) and r.success
  return 100.0 * sum(passed.values()) / len(passed)
