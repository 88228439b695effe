r"""How likely a run's checkpoints find its expert (gold) trajectories; prints JSON.

  python bench/gold_likelihood.py --run=DIR [--checkpoints=sft:,rl:8,rl:12] [--temperature=T]

For every checkpoint named (`<stage>:<step>`, stage `sft` or `rl`; an empty step is the
stage's last), the probability the policy gives each trajectory of the run's
`expert_trajectories.jsonl`: its assistant tokens under softmax(logits / T), as a sequence
(exp of the summed log-probabilities) and per token (mean negative log-probability).
Watching the SFT data's likelihood across RL steps shows whether an update on a few sampled
episodes moves the policy away from what SFT taught it (interference), task by task.

With --gold_updates=N, the first checkpoint also takes N GRPO updates (the run's GRPO and
optimizer config, learning rate --gold_lr, pi_old recomputed) on the trajectories of
--gold_scenarios, each with advantage +1, as if the policy had sampled them and they alone
had succeeded; the likelihoods after each update show whether the update raises the
likelihood of what it trains on.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from sage_jax import run_checkpoint, run_config
from sage_jax.envs import appworld
from sage_jax.model.logprobs import token_logprobs
from sage_jax.sft import data, expert
from sage_jax.tokenizer import Tokenizer
from sage_jax.train import rl_loop

_RUN = flags.DEFINE_string("run", None, "A training run's workdir.")
_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["sft:", "rl:"],
                                 "<stage>:<step> of each checkpoint (empty step: the last).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "The policy's sampling temperature.")
_GOLD_UPDATES = flags.DEFINE_integer("gold_updates", 0, "GRPO updates on gold trajectories.")
_GOLD_LR = flags.DEFINE_float("gold_lr", 3e-4, "Their learning rate.")
_GOLD_SCENARIOS = flags.DEFINE_list("gold_scenarios", [], "Scenarios whose trajectories they "
                                    "train on (default: all).")


def likelihoods(model, examples, temperature: float) -> dict[str, dict[str, float]]:
  out = {}
  for ex in examples:
    tokens = jnp.asarray(ex.tokens[None, :-1])
    logprobs, _ = token_logprobs(model, tokens, jnp.arange(tokens.shape[1])[None],
                                 jnp.ones_like(tokens), jnp.asarray(ex.tokens[None, 1:]),
                                 temperature=temperature)
    mine = np.asarray(logprobs[0])[ex.loss_mask[1:].astype(bool)]
    out[ex.id] = {"sequence_prob": float(np.exp(mine.sum())),
                  "token_nll": float(-mine.mean())}
  return out


def gold_updates(run, model, examples) -> list[dict]:
  """GRPO updates of `model` on the chosen gold trajectories, each with advantage +1 (a
  mapping is a record to `rl.batch`; pi_old is recomputed, so no logprobs are given)."""
  chosen = [e for e in examples if not _GOLD_SCENARIOS.value
            or appworld.scenario_id(expert.task_of_id(e.id)) in _GOLD_SCENARIOS.value]
  grpo_config = dataclasses.replace(run.grpo, temperature=_TEMPERATURE.value,
                                    recompute_old_logprobs=True)
  optimizer = dataclasses.replace(run.optimizer, learning_rate=_GOLD_LR.value)
  trainer = rl_loop.grpo_trainer(model, grpo_config, optimizer.for_updates(
      _GOLD_UPDATES.value * grpo_config.num_mini_batches), run.trainer)
  records = [{"tokens": e.tokens, "loss_mask": e.loss_mask, "advantage": 1.0} for e in chosen]
  out = []
  for update in range(1, _GOLD_UPDATES.value + 1):
    metrics = rl_loop.grpo_update(trainer, records, grpo_config, run.batch)
    out.append({"update": update, "grad_norm": metrics["grad_norm"], "trajectories": likelihoods(
        trainer.model(), examples, _TEMPERATURE.value)})
  return out


def main(argv) -> None:
  del argv
  if not _RUN.value:
    raise app.UsageError("--run is required")
  run = run_config.resolve(run_checkpoint.read_config(_RUN.value))
  tokenizer = Tokenizer(run_checkpoint.tokenizer_dir(_RUN.value, run))
  examples = data.load_examples(f"{_RUN.value}/expert_trajectories.jsonl", tokenizer)
  report = {"bench": "gold_likelihood", "run": _RUN.value, "temperature": _TEMPERATURE.value,
            "checkpoints": []}
  first = None
  for name in _CHECKPOINTS.value:
    stage, _, step = name.partition(":")
    model, step = run_checkpoint.restore_model(_RUN.value, run, int(step) if step else None,
                                               stage=stage)
    first = first or model
    report["checkpoints"].append({"stage": stage, "step": step, "trajectories": likelihoods(
        model, examples, _TEMPERATURE.value)})
  if _GOLD_UPDATES.value:  # the updates donate `first`'s arrays: it is not read afterwards
    report["gold_updates"] = gold_updates(run, first, examples)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
