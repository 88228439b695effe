"""The paper's metrics over task episode records: one definition for training and evaluation.

All rates are percentages (None when their denominator is empty):

- tgc: tasks whose tests all pass (Task Goal Completion).
- sgc (unit "scenario", evaluation): scenarios all of whose tasks pass (Scenario Goal
  Completion). In training a rollout walks a chain of K tasks, not a whole scenario, so the
  same share over rollout chains is reported as `chain_success` (unit "chain"), not as SGC.
- avg_steps, avg_generated_tokens: assistant turns and model tokens per task.
- skill_usage_rate: among tasks that had library skills, those that used one (ran a library
  skill successfully; `agent.skills`).
- later_skill_usage_rate: among tasks at chain positions > 0 (those that could reuse a skill
  an earlier task of their chain saved), those that used one; a task whose chain saved no
  skill counts as not using one, so this rises as a policy both saves and reuses skills.
- success_skill_usage_rate: among tasks that had library skills, those that used one and
  succeeded.
- p_success_given_use: among tasks that used a library skill, those that succeeded.
- idle_use_rate: among tasks that used a library skill, those none of whose used skills made an
  app request (`SkillEvents.idle_uses`): the uses `RewardConfig.credit_idle_uses=False` does
  not pay for, and a sign of a policy paid for skills that do nothing.
- w_use_rate / w_gen_rate: tasks for which SAGE's skill-usage / skill-generation bonus fires
  (`rl.rewards`: a later-position task that succeeded using a library skill; a task whose
  saved skill a later successful task of its chain used), whatever the reward variant, every
  use counted as the default reward does (idle ones too: see idle_use_rate).
- no_code_rate, truncation_rate: tasks with a turn that ended without code / a turn cut by a
  token limit before any code; also per chain position (`.../pos<k>`).
- env_failure_rate: tasks on which the environment failed (left out of training), on the
  last attempt; env_retry_rate: tasks played again after it failed under an earlier one.
- evaluation_refused_rate: tasks whose saved state AppWorld's evaluation refused (forged by
  the agent's code, not replayable, or too slow to evaluate): failures of the agent.

`sample_metrics` is the RL loop's per-step statistics of any episodes (AppWorld's or the
synthetic task's; fractions, not percentages), of everything the step sampled: reward (of the
episodes whose reward is known, `rl.episode.trained_on`: env_failure_rate and the loop's
num_env_failures / num_rewards_unknown count the others) and success overall and per chain
position, steps, generated tokens; `advantage_metrics` those of the episodes it trains on.
Training logs `task_metrics` of its AppWorld episodes beside them, under "rollout/": skill
and chain metrics have that one definition.

`compute_counts` is what an RL step spent, so that runs of different methods can be matched
on compute: episodes, and tokens read as context, generated and trained on.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sage_jax.rl.episode import EpisodeRecord, trained_on
from sage_jax.rl.rewards import generation_credited

UNITS = ("scenario", "chain")
# Rates also reported per chain position, as "<rate>/pos<k>": rate -> the record's flag.
PER_POSITION = {"no_code_rate": "no_code", "truncation_rate": "truncated"}


def _pct(num: float, den: float) -> float | None:
  return 100.0 * num / den if den else None


def _mean(values: Sequence[float]) -> float | None:
  return sum(values) / len(values) if values else None


def _chains(records: Sequence[EpisodeRecord]) -> list[list[EpisodeRecord]]:
  """Each rollout's walk (group, rollout), in chain order."""
  chains = collections.defaultdict(list)
  for r in records:
    chains[(r.group, r.rollout)].append(r)
  return [sorted(c, key=lambda r: r.chain_position) for c in chains.values()]


def task_metrics(records: Sequence[EpisodeRecord], *, unit: str = "scenario") -> dict:
  """The metrics above over `records`; `unit`: "scenario" (reports sgc) or "chain" (reports
  chain_success)."""
  if unit not in UNITS:
    raise ValueError(f"unit={unit!r}; expected one of {UNITS}")
  chains = _chains(records)
  completion = collections.defaultdict(list)
  for r in records:
    completion[r.scenario if unit == "scenario" else (r.group, r.rollout)].append(r.success)
  with_library = [r for r in records if r.visible_skills]
  users = [r for r in records if r.used_skill]
  later = [r for r in records if r.chain_position > 0]
  w_gen = sum(generation_credited(c, k) for c in chains for k in range(len(c)))
  out = {
      "num_tasks": len(records),
      f"num_{unit}s": len(completion),
      "tgc": _pct(sum(r.success for r in records), len(records)),
      "sgc" if unit == "scenario" else "chain_success":
          _pct(sum(all(v) for v in completion.values()), len(completion)),
      "avg_steps": _mean([r.num_steps for r in records]),
      "avg_generated_tokens": _mean([r.generated_tokens for r in records]),
      "skill_usage_rate": _pct(sum(r.used_skill for r in with_library), len(with_library)),
      "later_skill_usage_rate": _pct(sum(bool(r.used_skill) for r in later), len(later)),
      "success_skill_usage_rate": _pct(sum(r.used_skill and r.success for r in with_library),
                                       len(with_library)),
      "p_success_given_use": _pct(sum(r.success for r in users), len(users)),
      "idle_use_rate": _pct(sum(set(r.events.used) <= set(r.events.idle_uses) for r in users),
                            len(users)),
      "w_use_rate": _pct(sum(r.chain_position > 0 and r.success and r.used_skill
                             for r in records), len(records)),
      "w_gen_rate": _pct(w_gen, len(records)),
      "no_code_rate": _pct(sum(r.no_code for r in records), len(records)),
      "truncation_rate": _pct(sum(r.truncated for r in records), len(records)),
      "env_failure_rate": _pct(sum(r.env_failed for r in records), len(records)),
      "env_retry_rate": _pct(sum(bool(r.retried_errors) for r in records), len(records)),
      "evaluation_refused_rate": _pct(sum(bool(r.evaluation_refused) for r in records),
                                      len(records)),
      "avg_fraction_passed": _mean([r.fraction_passed for r in records]),
      "skills_generated": sum(len(r.events.generated) for r in records),
      "skills_updated": sum(len(r.events.updated) for r in records),
  }
  for k in sorted({r.chain_position for r in records}):
    at = [r for r in records if r.chain_position == k]
    for rate, flag in PER_POSITION.items():
      out[f"{rate}/pos{k}"] = _pct(sum(getattr(r, flag) for r in at), len(at))
  return out


def compute_counts(episodes: Sequence[Any]) -> dict[str, float]:
  """Counts of this process's `episodes` (anything with the `rl.batch` fields `tokens` and
  `loss_mask`), to be summed over processes:

  - compute/episodes: task episodes (a SAGE step: chains x G x K; a GRPO step: chains x G),
    and the attempts played again after the environment failed under them
    (`EpisodeRecord.retried_errors`).
  - compute/prompt_tokens: tokens the model read but did not generate (system prompt, task,
    observations, library), i.e. prefilled; those of retried attempts too.
  - compute/generated_tokens: tokens the model sampled (`generated_tokens` where episodes
    carry it, else their loss tokens); those of retried attempts too.
  - compute/trained_tokens: loss tokens of the episodes that enter the update
    (`rl.episode.trained_on`).
  """
  played = generated = prompt = trained = 0
  for e in episodes:
    loss_tokens = int(np.sum(np.asarray(e.loss_mask) > 0))
    made = getattr(e, "generated_tokens", None)
    made = loss_tokens if made is None else int(made)
    retried_made = getattr(e, "retried_generated_tokens", 0)
    played += 1 + len(getattr(e, "retried_errors", ()))
    generated += made + retried_made
    prompt += len(e.tokens) - made + getattr(e, "retried_tokens", 0) - retried_made
    if trained_on(e):
      trained += loss_tokens
  return {"compute/episodes": float(played), "compute/prompt_tokens": float(prompt),
          "compute/generated_tokens": float(generated),
          "compute/trained_tokens": float(trained)}


def field(episode: Any, name: str) -> Any:
  """An episode's field, whether the episode is a record or a mapping (None if absent)."""
  if isinstance(episode, Mapping):
    return episode.get(name)
  return getattr(episode, name, None)


def _mean_std(prefix: str, values: Sequence[float], out: dict) -> None:
  arr = np.asarray(values, np.float64)
  out[f"{prefix}/mean"] = float(arr.mean())
  out[f"{prefix}/std"] = float(arr.std())


def by_position(values: Sequence[Any], positions: Sequence[Any]) -> dict[int, list]:
  """`values` grouped by chain position, in position order ({} without positions)."""
  if not all(p is not None for p in positions):
    return {}
  at = collections.defaultdict(list)
  for v, p in zip(values, positions):
    at[int(p)].append(v)
  return dict(sorted(at.items()))


def sample_metrics(episodes: Sequence[Any]) -> dict[str, float]:
  """Per-step statistics of episodes, from whichever fields they carry: `episodes`;
  reward/mean|std, also per chain position (reward/pos<k>/...), of the episodes whose reward
  is known (`rl.episode.trained_on`: the environment failed neither under them nor under a
  later task their reward hangs on); success (the share of episodes that succeeded), also
  per position; steps/mean; generated_tokens/mean|total (from the loss mask when not
  recorded)."""
  out: dict[str, float] = {"episodes": float(len(episodes))}
  if not episodes:
    return out
  get = lambda name: [field(e, name) for e in episodes]
  positions, successes = get("chain_position"), get("success")
  known = [e for e in episodes if trained_on(e)]
  rewards = [field(e, "reward") for e in known]
  if known and all(r is not None for r in rewards):
    _mean_std("reward", rewards, out)
    for p, values in by_position(rewards, [field(e, "chain_position") for e in known]).items():
      _mean_std(f"reward/pos{p}", values, out)
  if all(s is not None for s in successes):
    out["success"] = float(np.mean([bool(s) for s in successes]))
    for p, values in by_position([bool(s) for s in successes], positions).items():
      out[f"success/pos{p}"] = float(np.mean(values))
  steps = get("num_steps")
  if all(s is not None for s in steps):
    out["steps/mean"] = float(np.mean(steps))
  generated = get("generated_tokens")
  if not all(g is not None for g in generated):
    generated = [int(np.sum(np.asarray(field(e, "loss_mask")))) for e in episodes]
  out["generated_tokens/mean"] = float(np.mean(generated))
  out["generated_tokens/total"] = float(np.sum(generated))
  return out


def advantage_metrics(episodes: Sequence[Any]) -> dict[str, float]:
  """advantage/abs_mean and zero_frac of the episodes the update trains on
  (`rl.episode.trained_on`; the others' advantage is 0 but none of the update's), when they
  carry one."""
  adv = [field(e, "advantage") for e in episodes if trained_on(e)]
  if not adv or any(a is None for a in adv):
    return {}
  adv = np.asarray(adv, np.float64)
  return {"advantage/abs_mean": float(np.abs(adv).mean()),
          "advantage/zero_frac": float(np.mean(adv == 0))}
