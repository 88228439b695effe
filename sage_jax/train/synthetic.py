"""A small synthetic task with a checkable reward, for the learning test and CPU demos.

Each prompt is `[BOS, x_1, .., x_n]` (random symbols); the right answer is a fixed function of
the prompt followed by EOS: the prompt reversed (`task="reverse"`) or one fixed string
(`task="fixed"`). The reward checks the sampled answer against the right one (EOS included):
partial credit for the share of answer positions it gets right (`reward="positional"`) or
the share of the answer's prefix it matches (`reward="prefix"`), plus a bonus for the exact
answer; 1.0 only for the exact answer, near 0 for a random policy. Sampling goes through the project's `Engine`; records are
what the AppWorld rollout produces (tokens, loss mask, sampler and model logprobs), with
`group`, `chain_position` (0), `reward`, `success` and `advantage`, so the real advantage
code (`rl.advantages`) and the RL loop run on them unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

from sage_jax.rl import advantages as advantages_lib
from sage_jax.sampler import Engine, SamplingParams


@dataclasses.dataclass(frozen=True)
class SyntheticTaskConfig:
  """vocab_size: the model's vocabulary (the last id is EOS, the one before BOS).
  task: "reverse" (answer = the prompt's symbols reversed) or "fixed" (answer = `target`).
  prompt_symbols: symbols per prompt. num_symbols: prompts draw from ids [0, num_symbols).
  target: the fixed answer. num_prompts / group_size: groups and rollouts per group per step.
  max_new_tokens / temperature: sampling. eval_prompts: greedy prompts for `evaluate`.
  reward: "positional" (right answer positions / answer length) or "prefix" (matching prefix
  / answer length). exact_bonus: weight of the exact answer; the reward is
  (1 - exact_bonus) * partial credit + exact_bonus * [exact answer]. answer_eos: the answer
  ends with EOS (the turn must stop by itself); False: the answer is just the symbols and the
  turn is cut at their length."""

  vocab_size: int = 16
  task: Literal["reverse", "fixed"] = "fixed"
  prompt_symbols: int = 2
  num_symbols: int = 4
  target: tuple[int, ...] = (3, 1, 4)
  num_prompts: int = 8
  group_size: int = 16
  max_new_tokens: int = 5
  temperature: float = 1.0
  eval_prompts: int = 16
  reward: Literal["positional", "prefix"] = "positional"
  exact_bonus: float = 0.5
  answer_eos: bool = False

  def __post_init__(self):
    if self.num_symbols > self.vocab_size - 2:
      raise ValueError("num_symbols must leave room for BOS and EOS in the vocabulary")
    if self.task not in ("reverse", "fixed"):
      raise ValueError(f"task={self.task!r}; expected reverse or fixed")
    if self.reward not in ("positional", "prefix"):
      raise ValueError(f"reward={self.reward!r}; expected positional or prefix")


@dataclasses.dataclass
class SyntheticEpisode:
  tokens: np.ndarray
  loss_mask: np.ndarray
  sampler_logprobs: np.ndarray
  model_logprobs: np.ndarray
  group: int
  rollout: int
  chain_position: int = 0
  reward: float = 0.0
  success: bool = False
  advantage: float = 0.0


class SyntheticTask:
  """Rollout, score and evaluate callables of the RL loop for the synthetic task."""

  def __init__(self, engine: Engine, config: SyntheticTaskConfig = SyntheticTaskConfig(),
               advantage: advantages_lib.AdvantageConfig = advantages_lib.AdvantageConfig()):
    self.engine, self.config, self.advantage = engine, config, advantage
    self.eos = config.vocab_size - 1
    self.bos = config.vocab_size - 2

  def answer(self, prompt: Sequence[int]) -> list[int]:
    answer = list(self.config.target) if self.config.task == "fixed" else list(prompt[1:])[::-1]
    return answer + [self.eos] if self.config.answer_eos else answer

  @property
  def max_new_tokens(self) -> int:
    if self.config.answer_eos:
      return self.config.max_new_tokens
    return len(self.config.target) if self.config.task == "fixed" else self.config.prompt_symbols

  def reward(self, prompt: Sequence[int], generated: Sequence[int]) -> float:
    want = self.answer(prompt)
    hits = [a == b for a, b in zip(want, generated)]
    if self.config.reward == "prefix":
      hits = hits[:hits.index(False)] if False in hits else hits
    exact = list(generated) == want
    return (1 - self.config.exact_bonus) * sum(hits) / len(want) + self.config.exact_bonus * exact

  def prompts(self, rng: np.random.Generator, n: int) -> list[list[int]]:
    c = self.config
    return [[self.bos] + rng.integers(0, c.num_symbols, c.prompt_symbols).tolist()
            for _ in range(n)]

  def rollout(self, step: int, seed: int) -> list[SyntheticEpisode]:
    del step
    c = self.config
    rng = np.random.default_rng(seed)
    prompts = self.prompts(rng, c.num_prompts)
    flat = [p for p in prompts for _ in range(c.group_size)]
    sampling = SamplingParams(temperature=c.temperature, max_new_tokens=self.max_new_tokens)
    seeds = rng.integers(0, 2**31 - 1, len(flat)).tolist()
    results = self.engine.generate(flat, sampling, seeds)
    episodes = []
    for i, (prompt, res) in enumerate(zip(flat, results)):
      n = len(res.tokens)
      zeros = np.zeros(len(prompt), np.float32)
      r = self.reward(prompt, res.tokens)
      episodes.append(SyntheticEpisode(
          tokens=np.asarray(prompt + res.tokens, np.int32),
          loss_mask=np.concatenate([np.zeros(len(prompt), np.int8), np.ones(n, np.int8)]),
          sampler_logprobs=np.concatenate([zeros, res.sample_logprobs]),
          model_logprobs=np.concatenate([zeros, res.model_logprobs]),
          group=i // c.group_size, rollout=i % c.group_size, reward=r, success=r == 1.0))
    return episodes

  def score(self, episodes: Sequence[SyntheticEpisode]) -> dict[str, float]:
    stats = advantages_lib.assign_advantages(episodes, self.advantage)
    return {"advantage/constant_groups": stats.constant_fraction}

  def evaluate(self, step: int) -> dict[str, float]:
    """Greedy mean reward and exact-answer rate on fixed prompts."""
    del step
    prompts = self.prompts(np.random.default_rng(12345), self.config.eval_prompts)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
    results = self.engine.generate(prompts, sampling)
    rewards = [self.reward(p, r.tokens) for p, r in zip(prompts, results)]
    return {"reward": float(np.mean(rewards)), "success": float(np.mean(np.equal(rewards, 1)))}


# --- A CPU demo of the whole RL machinery --------------------------------------------------


def run_demo(workdir: str, *, steps: int = 60, seed: int = 0, learning_rate: float = 3e-3,
             save_every: int = 10, eval_every: int = 20, progress: bool = True,
             task: SyntheticTaskConfig = SyntheticTaskConfig()):
  """GRPO on the synthetic task with checkpoints (`workdir/checkpoints`, resumed when present),
  metrics (`workdir/metrics.jsonl`, TensorBoard) and dev evaluation; returns the LoopResult
  and the trainer."""
  import os

  from sage_jax.model import get_preset, init_model
  from sage_jax.rl import batch as batch_lib
  from sage_jax.rl import grpo
  from sage_jax.sampler import EngineConfig
  from sage_jax.train import checkpoint, rl_loop
  from sage_jax.train.metrics import MetricsConfig
  from sage_jax.train.optimizer import OptimizerConfig

  model = init_model(get_preset("tiny").replace(vocab_size=task.vocab_size), seed=seed)
  engine = Engine(model, EngineConfig(num_slots=task.num_prompts * task.group_size, max_len=16,
                                      prefill_buckets=(8,), min_attend=16, steps_per_call=4,
                                      max_top_k=4), eos_ids=[task.vocab_size - 1])
  synthetic = SyntheticTask(engine, task)
  config = grpo.GRPOConfig()
  optimizer = OptimizerConfig(learning_rate=learning_rate, weight_decay=0.0)
  trainer = rl_loop.grpo_trainer(model, config, optimizer)
  loop = rl_loop.RLLoopConfig(total_steps=steps, eval_every=eval_every, seed=seed)
  saver = checkpoint.Checkpointer(
      checkpoint.CheckpointConfig(directory=os.path.join(workdir, "checkpoints"),
                                  save_every=save_every, best_metric="dev/reward"),
      run_config={"task": task, "grpo": config, "optimizer": optimizer, "loop": loop})
  try:
    result = rl_loop.run_rl(
        trainer, rollout=synthetic.rollout, score=synthetic.score,
        evaluate=synthetic.evaluate, sync_params=engine.update_params, config=loop,
        grpo_config=config,
        batch_config=batch_lib.BatchConfig(micro_batch_tokens=1024, num_micro_batches=2,
                                           length_buckets=(8, 16)),
        checkpointer=saver,
        metrics=MetricsConfig(log_dir=workdir, progress=progress,
                              progress_keys=("reward/mean", "loss", "entropy", "grad_norm")))
  finally:
    saver.close()
  return result, trainer


def main(argv) -> None:
  del argv
  import json

  from absl import flags, logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  f = flags.FLAGS
  result, _ = run_demo(f.workdir, steps=f.steps, seed=f.seed, learning_rate=f.learning_rate,
                       save_every=f.save_every)
  last = result.history[-1] if result.history else {}
  print(json.dumps({"start_step": result.start_step, "end_step": result.end_step,
                    "preempted": result.preempted,
                    "reward": last.get("reward/mean"), "dev_reward": last.get("dev/reward")}))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("workdir", None, "Checkpoints and metrics go here (resumed if present).")
  flags.DEFINE_integer("steps", 60, "RL steps.")
  flags.DEFINE_integer("seed", 0, "Model init, data and sampling seed.")
  flags.DEFINE_float("learning_rate", 3e-3, "AdamW learning rate.")
  flags.DEFINE_integer("save_every", 10, "Checkpoint every this many steps.")
  flags.mark_flag_as_required("workdir")
  app.run(main)
