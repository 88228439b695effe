"""The paper's metrics (`rl.metrics`) on hand-built records: every rate against its
definition."""

import dataclasses
import types

import numpy as np
import pytest

from sage_jax.rl import metrics
from tests.test_rewards import rec


def test_task_metrics_definitions():
  # Rollout 0: task 1 writes f, task 2 uses it and succeeds (both bonuses fire).
  # Rollout 1: task 1 succeeds, task 2 uses f but fails; one of its turns was cut.
  # Rollout 2: task 1 ends without code, task 2's environment failed.
  # Rollout 1's f asked nothing of the apps (an idle use).
  r = [rec(0, True, generated=["f"], rollout=0), rec(1, True, used=["f"], rollout=0),
       rec(0, True, generated=["f"], rollout=1),
       rec(1, False, used=["f"], idle=["f"], rollout=1),
       rec(0, False, no_code=1, rollout=2), rec(1, False, rollout=2)]
  r[3].truncated_turns = 1
  r[5].errors = ["worker exited"]
  r[4].evaluation_refused = "the saved state is not what AppWorld writes"
  r[5].visible_skills = ("f",)
  m = metrics.task_metrics(r, unit="chain")
  assert m["num_tasks"] == 6 and m["num_chains"] == 3 and "sgc" not in m
  assert m["tgc"] == pytest.approx(300 / 6) and m["chain_success"] == pytest.approx(100 / 3)
  # Tasks with library skills: r1, r3, r5; used: r1, r3; used and succeeded: r1.
  assert m["skill_usage_rate"] == pytest.approx(200 / 3)
  assert m["success_skill_usage_rate"] == pytest.approx(100 / 3)
  # Later-position tasks: r1, r3, r5; used a skill: r1, r3 (r5 saw one and did not use it).
  assert m["later_skill_usage_rate"] == pytest.approx(200 / 3)
  assert m["p_success_given_use"] == 50.0
  assert m["idle_use_rate"] == 50.0  # of r1 and r3
  assert m["w_use_rate"] == m["w_gen_rate"] == pytest.approx(100 / 6)  # r1 and r0
  assert m["no_code_rate"] == m["truncation_rate"] == pytest.approx(100 / 6)
  assert m["no_code_rate/pos0"] == pytest.approx(100 / 3) and m["no_code_rate/pos1"] == 0.0
  assert m["truncation_rate/pos1"] == pytest.approx(100 / 3)
  assert m["env_failure_rate"] == m["evaluation_refused_rate"] == pytest.approx(100 / 6)
  by_scenario = metrics.task_metrics(r)  # all six tasks are of scenario "s"
  assert by_scenario["num_scenarios"] == 1 and by_scenario["sgc"] == 0.0
  assert metrics.task_metrics([], unit="chain")["tgc"] is None
  with pytest.raises(ValueError, match="unit"):
    metrics.task_metrics(r, unit="group")


def test_compute_counts_of_a_step():
  """Episodes, context (prefilled) tokens, generated tokens and the loss tokens of those that
  are trained on: an episode whose environment failed is counted as run, not as trained."""
  def episode(k, prompt, generated, **kw):
    r = rec(k, True, **kw)
    mask = np.array([0] * prompt + [1] * generated, np.int8)
    return dataclasses.replace(r, tokens=np.zeros(len(mask), np.int32), loss_mask=mask,
                               sampler_logprobs=np.zeros(len(mask), np.float32),
                               model_logprobs=np.zeros(len(mask), np.float32),
                               generated_tokens=generated)

  failed = episode(1, 30, 7)
  failed.errors = ["worker exited"]
  counts = metrics.compute_counts([episode(0, 20, 5), episode(1, 25, 6), failed])
  assert counts == {"compute/episodes": 3.0, "compute/prompt_tokens": 75.0,
                    "compute/generated_tokens": 18.0, "compute/trained_tokens": 11.0}
  # Attempts played again after an environment failure spent compute too, trained or not.
  retried = dataclasses.replace(episode(0, 20, 5), retried_errors=["worker exited"] * 2,
                                retried_tokens=40, retried_generated_tokens=9)
  assert metrics.compute_counts([retried]) == {
      "compute/episodes": 3.0, "compute/prompt_tokens": 51.0,
      "compute/generated_tokens": 14.0, "compute/trained_tokens": 5.0}
  # Episodes without a generated_tokens field (e.g. a synthetic task's) count loss tokens.
  plain = types.SimpleNamespace(tokens=np.zeros(6), loss_mask=np.array([0, 0, 1, 1, 1, 0]))
  assert metrics.compute_counts([plain]) == {
      "compute/episodes": 1.0, "compute/prompt_tokens": 3.0,
      "compute/generated_tokens": 3.0, "compute/trained_tokens": 3.0}
