"""Supervised fine-tuning on expert trajectories with the RL stage's train state, step,
checkpoints and metrics.

The loss is the negative log-likelihood of the assistant tokens (the examples' loss mask),
normalised over the whole batch (`loss_aggregation`, token-mean by default), accumulated over
micro-batches by the same jitted step as GRPO. Step s trains on the sequences at positions
[s * batch_size, (s + 1) * batch_size) of an endless stream of epochs, each epoch a
permutation of the examples drawn from (seed, epoch): the data order is a function of the
step, so a resumed run sees exactly the batches the straight run would have.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sage_jax import multihost
from sage_jax import sharding as shd
from sage_jax.model.logprobs import token_logprobs
from sage_jax.model.qwen2 import Qwen2
from sage_jax.rl import batch as batch_lib
from sage_jax.rl.batch import Aggregation, TrainBatch
from sage_jax.train.checkpoint import Checkpointer
from sage_jax.train.loop import Evaluate, LoopResult, SyncParams, run_steps
from sage_jax.train.metrics import MetricsConfig, scalars
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.step import Trainer, TrainerConfig


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """total_steps: optimiser updates (0: `num_epochs` passes over the data, rounded up to
  whole batches: the last batch is completed from the next pass's order, so at most
  batch_size - 1 examples more). num_epochs: used when total_steps is 0. batch_size: sequences
  per update. loss_aggregation: "token-mean" (every assistant token of the batch weighs the
  same) or "seq-mean-token-mean".
  eval_every: evaluation every this many steps (0 = never). save_every: a checkpoint every
  this many steps (0 = the run's `checkpoint.save_every`; SFT steps are often far shorter
  than RL steps). seed: data order. logprob_chunk: tokens per chunk of the logits
  computation (0 = all at once)."""

  total_steps: int = 0
  num_epochs: int = 1
  batch_size: int = 16
  loss_aggregation: Aggregation = "token-mean"
  eval_every: int = 0
  save_every: int = 0
  seed: int = 0
  logprob_chunk: int = 2048

  def __post_init__(self):
    if (self.batch_size < 1 or self.total_steps < 0 or self.num_epochs < 1
        or self.save_every < 0 or self.eval_every < 0 or self.logprob_chunk < 0):
      raise ValueError(f"{self}: batch_size and num_epochs must be >= 1, total_steps, "
                       "save_every, eval_every and logprob_chunk >= 0")
    if self.loss_aggregation not in ("token-mean", "seq-mean-token-mean"):
      raise ValueError(f"loss_aggregation={self.loss_aggregation!r}; SFT uses token-mean or "
                       "seq-mean-token-mean")

  def steps_for(self, num_examples: int) -> int:
    if self.total_steps:
      return self.total_steps
    return -(-self.num_epochs * num_examples // self.batch_size)


def nll_loss_fn(logprob_chunk: int = 0) -> Callable[[Qwen2, TrainBatch], tuple[jax.Array, dict]]:
  """The train step's SFT loss for one micro-batch: sum(weights * -log p(target))."""

  def loss_fn(model: Qwen2, batch: TrainBatch):
    logprobs, entropy = token_logprobs(model, batch.tokens, batch.positions, batch.segment_ids,
                                       batch.targets, chunk=logprob_chunk)
    mask = batch.loss_mask
    nll = jnp.where(mask > 0, -logprobs, 0.0)
    stats = {"nll": nll, "entropy": jnp.where(mask > 0, jax.lax.stop_gradient(entropy), 0.0),
             "token_prob": jnp.where(mask > 0, jnp.exp(jax.lax.stop_gradient(logprobs)), 0.0)}
    return jnp.sum(batch.weights * nll), {k: jnp.sum(v) for k, v in stats.items()}

  return loss_fn


def sft_trainer(model: Qwen2, config: SFTConfig = SFTConfig(),
                optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-5),
                trainer_config: TrainerConfig = TrainerConfig(), *, mesh: Mesh | None = None,
                rules: shd.ShardingRules = shd.ShardingRules()) -> Trainer:
  """A Trainer whose loss is the SFT negative log-likelihood."""
  return Trainer(model, nll_loss_fn(config.logprob_chunk), optimizer, trainer_config, mesh=mesh,
                 rules=rules, logprob_chunk=config.logprob_chunk)


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> list[int]:
  """Example indices of step `step`: consecutive positions of per-epoch permutations."""
  out = []
  for pos in range(step * batch_size, (step + 1) * batch_size):
    epoch, i = divmod(pos, num_examples)
    perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
    out.append(int(perm[i]))
  return out


def sft_batch(examples: Sequence[Any], batch_config: batch_lib.BatchConfig,
              aggregation: str = "token-mean"):
  """This process's rows of the packed TrainBatch of SFT examples (anything with `tokens`
  and `loss_mask`): every process passes the same examples and packs its own share."""
  own = list(examples)[multihost.share(len(examples))]
  return batch_lib.make_batch(own, batch_config, aggregation=aggregation,
                              need_advantage=False, allgather=multihost.allgather)


def evaluate_nll(trainer: Trainer, examples: Sequence[Any], batch_config: batch_lib.BatchConfig,
                 batch_size: int = 16) -> dict[str, float]:
  """Token-mean NLL of `examples` (assistant tokens) under the current parameters."""
  total_nll, total_tokens = 0.0, 0.0
  for i in range(0, len(examples), batch_size):
    batch, _ = sft_batch(examples[i:i + batch_size], batch_config)
    logprobs = trainer.logprobs(batch)
    total_nll -= float(np.sum(logprobs * batch.loss_mask))
    total_tokens += float(np.sum(batch.loss_mask))
  total_nll, total_tokens = multihost.allgather(np.asarray([total_nll, total_tokens])).sum(0)
  return {"nll": float(total_nll / max(total_tokens, 1.0)), "tokens": float(total_tokens)}


def run_sft(trainer: Trainer, examples: Sequence[Any], *, config: SFTConfig = SFTConfig(),
            batch_config: batch_lib.BatchConfig = batch_lib.BatchConfig(),
            evaluate: Evaluate | None = None, sync_params: SyncParams | None = None,
            checkpointer: Checkpointer | None = None, metrics: MetricsConfig = MetricsConfig(),
            on_step: Callable[[int, dict], None] | None = None) -> LoopResult:
  """SFT for `config.steps_for(len(examples))` updates (resuming from the latest checkpoint
  when there is one); same signals, checkpoints and metrics as the RL loop."""
  if not examples:
    raise ValueError("run_sft needs at least one example")
  examples = list(examples)

  def one_step(step: int, seed: int) -> dict[str, float]:
    del seed  # the data order comes from config.seed and the step
    t0 = time.perf_counter()
    picked = [examples[i] for i in batch_indices(step, config.batch_size, len(examples),
                                                  config.seed)]
    batch, info = sft_batch(picked, batch_config, config.loss_aggregation)
    values = scalars(jax.device_get(trainer.step(batch)))
    dt = time.perf_counter() - t0
    values.update({
        "epoch": (step + 1) * config.batch_size / len(examples),
        "batch/padding_fraction": info.padding_fraction,
        "batch/real_positions": float(info.real_positions),
        "tokens_per_s": info.real_positions / max(dt, 1e-9),
    })
    return values

  return run_steps(trainer, one_step, total_steps=config.steps_for(len(examples)),
                   seed=config.seed, eval_every=config.eval_every, evaluate=evaluate,
                   sync_params=sync_params, checkpointer=checkpointer, metrics=metrics,
                   description="sft", meta={"loop": "sft"}, on_step=on_step)
