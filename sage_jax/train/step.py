"""One jitted train step: gradient accumulation over micro-batches, clipping, AdamW.

`train_step(state, batch) -> (state, metrics)` is a pure function of a `TrainState` and a
`TrainBatch` [M, R, T]. It scans the M micro-batches, summing the gradients of each one's
weighted loss (the weights already normalise over the whole batch, so the sum is the gradient
of the batch loss), skips micro-batches without a loss token (padding to the fixed M costs
nothing) and runs only the forward pass (for the statistics) of those whose loss has no
gradient (a GRPO micro-batch whose advantages are all 0), then applies the optimiser once.
What the step updates (trainable parameters, optimiser state, step, RNG: the whole state
without LoRA) is donated; a frozen base is only read, so its arrays outlive the step and can
be shared (the KL reference). Shardings are pinned, so after the first call per row length
nothing compiles again. A step whose loss or gradient is not finite changes nothing but the
step count (metric `nonfinite_skipped`).

A loss function is `loss_fn(model, micro_batch) -> (loss, stats)`: `loss` the micro-batch's
weighted loss sum, `stats` a dict of scalars: sums over loss tokens (the step divides them by
the batch's loss tokens), maxima under keys "max/...", and already-normalised sums under
"weighted/...".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from sage_jax import multihost
from sage_jax import sharding as shd
from sage_jax.model.logprobs import token_logprobs
from sage_jax.model.qwen2 import Qwen2
from sage_jax.rl.batch import TrainBatch
from sage_jax.train.optimizer import OptimizerConfig, make_optimizer
from sage_jax.train.state import (TrainState, abstract_train_state, create_train_state,
                                  merge_trainable, split_trainable, state_shardings)

LossFn = Callable[[Qwen2, TrainBatch], tuple[jax.Array, dict[str, jax.Array]]]
# The positions of a micro-batch whose loss has a gradient (default: its loss positions).
GradientMask = Callable[[TrainBatch], jax.Array]
BATCH_AXES = (None, "act_batch", None)  # [micro, rows, positions]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """seed: the train state's RNG seed (split every step for the loss; the losses here draw
  nothing from it: no dropout). skip_empty_micro_batches: do not compute micro-batches
  without loss tokens (in the step and in `Trainer.logprobs`), and only the forward pass of
  those without a gradient position (both exact: they contribute no gradient; the second still
  gives its statistics). The logits' chunk belongs to the loss (grpo.logprob_chunk,
  sft.logprob_chunk), which `Trainer` is given with it."""

  seed: int = 0
  skip_empty_micro_batches: bool = True


def _reduce_stats(stats_list: dict[str, jax.Array], total_tokens: jax.Array) -> dict:
  out = {}
  for k, v in stats_list.items():
    if k.startswith("max/"):
      name = k[4:]
      if name.startswith("neg_"):
        out[name[4:] + "_min"] = -v
      else:
        out[name + "_max"] = v
    elif k.startswith("weighted/"):
      out[k[9:]] = v
    else:
      out[k] = v / jnp.maximum(total_tokens, 1.0)
  return out


def _combine(acc: dict, new: dict) -> dict:
  return {k: (jnp.maximum(acc[k], v) if k.startswith("max/") else acc[k] + v)
          for k, v in new.items()}


def applied_updates(opt_state: optax.OptState) -> jax.Array:
  """How many updates the optimiser has applied: the count its learning-rate schedule reads,
  which a skipped (non-finite) step does not advance, unlike `TrainState.step`."""
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
  counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
  if len(counts) != 1:
    raise ValueError(f"expected one learning-rate schedule in the optimiser, found {len(counts)}")
  return counts[0]


def make_train_step(graphdef: nnx.GraphDef, loss_fn: LossFn, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, *, mesh: Mesh | None = None,
                    rules: shd.ShardingRules = shd.ShardingRules(),
                    param_shardings: Any = None, skip_empty_micro_batches: bool = True,
                    gradient_mask: GradientMask | None = None):
  """The pure (un-jitted) train step `(state, frozen, batch) -> (state, metrics)`: `state`
  holds only the trainable part of the parameters (`state.split_trainable`), which is
  differentiated and updated; `frozen` is the rest (a LoRA base; empty without adapters),
  read and not returned, so that the jitted step neither donates nor copies it.
  `param_shardings`: those of the trainable part. `gradient_mask`: see `GradientMask` (with
  skip_empty_micro_batches)."""

  def rules_ctx():
    return contextlib.nullcontext() if mesh is None else shd.use_rules(mesh, rules)

  # Jitted so that its one trace serves both uses below (the shapes of its outputs, and the
  # scan body); inside the step it is inlined like any other code.
  @jax.jit
  def micro_grads(params, micro: TrainBatch):
    trainable, frozen = split_trainable(params)

    def objective(p):
      return loss_fn(nnx.merge(graphdef, merge_trainable(p, frozen)), micro)

    (loss, stats), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    grads = jax.tree.map(lambda g: g.astype(_F32), grads)
    if param_shardings is not None:
      grads = jax.lax.with_sharding_constraint(grads, param_shardings)
    return loss, stats, grads

  def train_step(state: TrainState, frozen: nnx.State, batch: TrainBatch):
    with rules_ctx():
      trainable = state.params
      params = merge_trainable(trainable, frozen)
      first = jax.tree.map(lambda x: x[0], batch)
      loss_shape, stats_shape, grads_shape = jax.eval_shape(micro_grads, params, first)
      zeros = lambda s: jnp.zeros(s.shape, s.dtype)
      empty_stats = {k: (jnp.full(s.shape, -jnp.inf, s.dtype) if k.startswith("max/")
                         else zeros(s)) for k, s in stats_shape.items()}
      empty = (zeros(loss_shape), empty_stats, jax.tree.map(zeros, grads_shape))

      def body(carry, micro):
        if skip_empty_micro_batches:
          has_loss = jnp.any(micro.loss_mask > 0)
          has_grad = has_loss if gradient_mask is None else jnp.any(gradient_mask(micro) > 0)
          branch = jnp.where(has_grad, 2, jnp.where(has_loss, 1, 0))
          out = jax.lax.switch(branch, [lambda p, m: empty,
                                        lambda p, m: (*loss_fn(nnx.merge(graphdef, p), m),
                                                      empty[2]),
                                        micro_grads], params, micro)
        else:
          out = micro_grads(params, micro)
        loss, stats, grads = out
        acc_loss, acc_stats, acc_grads = carry
        return (acc_loss + loss, _combine(acc_stats, stats),
                jax.tree.map(jnp.add, acc_grads, grads)), None

      (loss, stats, grads), _ = jax.lax.scan(body, empty, batch)
      grad_norm = optax.tree.norm(grads)
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
      updates, opt_state = tx.update(grads, state.opt_state, trainable)
      new_params = optax.apply_updates(trainable, updates)
      # A non-finite loss or gradient (a diverged batch) would spread NaN into every weight
      # and every later checkpoint: the step leaves the parameters and optimiser state as
      # they were, and says so.
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
      new_params, opt_state = keep(new_params, trainable), keep(opt_state, state.opt_state)
      total_tokens = jnp.sum(batch.loss_mask)
      metrics = {"loss": loss, "grad_norm": grad_norm,
                 # The rate this update applied: the schedule at the count before it.
                 "learning_rate": schedule(applied_updates(opt_state) - finite.astype(jnp.int32)),
                 "loss_tokens": total_tokens, "nonfinite_skipped": 1.0 - finite.astype(_F32),
                 **_reduce_stats(stats, total_tokens)}
      rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[1])
      new_state = TrainState(params=new_params, opt_state=opt_state, step=state.step + 1,
                             rng=rng)
      return new_state, metrics

  return train_step


def _split_state(state: TrainState) -> tuple[TrainState, nnx.State]:
  """(what a step updates, the frozen params it only reads): the step's two state inputs."""
  trainable, frozen = split_trainable(state.params)
  return state.replace(params=trainable), frozen


class Trainer:
  """Owns the train state of one model and the jitted step over it.

  The model trains in place: the state holds the model's own arrays (no second copy of the
  parameters), and every new state (a step, a restored checkpoint) becomes the model's.
  `trainer.state.params` is the current nnx.State on device in its sharding: a sampler in the
  same process takes it as it is (`Engine.update_params`), with no host copy. The step
  donates what it updates (all of the previous state without LoRA; with it, everything but
  the frozen base, whose arrays stay the same from step to step), so arrays of it taken from
  the model or the trainer before a step are gone after it: hand the new params to the
  sampler after every `step` (as the loops do), and copy what must outlive a step
  (`rl_loop.frozen_copy`).
  """

  def __init__(self, model: Qwen2, loss_fn: LossFn,
               optimizer: OptimizerConfig = OptimizerConfig(),
               config: TrainerConfig = TrainerConfig(), *, mesh: Mesh | None = None,
               rules: shd.ShardingRules = shd.ShardingRules(), logprob_chunk: int = 2048,
               logprob_temperature: float = 1.0, gradient_mask: GradientMask | None = None):
    self.config = config
    self.logprob_chunk = logprob_chunk
    self.logprob_temperature = logprob_temperature
    self.model_config = model.config
    self._model = model
    self._state: TrainState | None = None
    self.mesh, self.rules = mesh, rules
    self.graphdef, params = nnx.split(model)
    self.tx, self.schedule = make_optimizer(optimizer)
    self.shardings = None if mesh is None else state_shardings(params, self.tx, mesh, rules)
    self.state = create_train_state(params, self.tx, seed=config.seed, shardings=self.shardings)
    step = make_train_step(
        self.graphdef, loss_fn, self.tx, self.schedule, mesh=mesh, rules=rules,
        param_shardings=None if mesh is None else split_trainable(self.shardings.params)[0],
        skip_empty_micro_batches=config.skip_empty_micro_batches, gradient_mask=gradient_mask)
    sh = None if self.shardings is None else _split_state(self.shardings)
    self._step = jax.jit(step, donate_argnums=0,
                         in_shardings=None if sh is None else (*sh, None),
                         out_shardings=None if sh is None else (sh[0], None))
    self._logprobs = jax.jit(self._logprobs_impl)

  # --- State ------------------------------------------------------------------------------

  @property
  def state(self) -> TrainState | None:
    return self._state

  @state.setter
  def state(self, state: TrainState | None) -> None:
    self._state = state
    if state is not None:
      nnx.update(self._model, state.params)

  @property
  def params(self) -> nnx.State:
    return self.state.params

  @property
  def step_count(self) -> int:
    return int(self.state.step)

  def model(self) -> Qwen2:
    """The model being trained, holding the current parameters."""
    return self._model

  def abstract_state(self) -> TrainState:
    return abstract_train_state(self.state.params, self.tx, seed=self.config.seed,
                                shardings=self.shardings)

  def release_state(self) -> TrainState:
    """Drops the current state and returns its abstract form, for a checkpoint to be restored
    into, so that the fresh optimiser state and the restored one never live together: holding
    both doubled a resumed run's peak memory (the Adam moments alone are twice the
    parameters). The model keeps its parameters until the restored state replaces them.
    Until a state is assigned again the trainer has none."""
    abstract = self.abstract_state()
    self.state = None
    return abstract

  # --- Device -----------------------------------------------------------------------------

  def place_batch(self, batch: TrainBatch) -> TrainBatch:
    """Puts a host batch on device, rows split over the data-parallel mesh axes.

    With several processes, `batch` is this process's rows of the global batch
    (`rl.batch.make_batch(..., allgather=multihost.allgather)`), and the result is the
    global batch they make together. Token ids outside the model's vocabulary are refused:
    on device an embedding lookup of one gives NaN, which the attention spreads over its row.
    """
    for name in ("tokens", "targets"):
      if not isinstance(ids := getattr(batch, name), jax.Array):
        self.model_config.check_token_ids(ids, f"batch {name}")
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, batch)
    processes = jax.process_count()

    def place(x):
      if isinstance(x, jax.Array):
        return x
      shape = (x.shape[0], x.shape[1] * processes, *x.shape[2:])
      sharding = shd.named_sharding(BATCH_AXES, shape, self.mesh, self.rules)
      split = sharding.spec[1] if len(sharding.spec) > 1 else None
      axes = (split,) if isinstance(split, str) else tuple(split or ())
      if processes > 1 and math.prod(self.mesh.shape[a] for a in axes) % processes:
        raise ValueError(
            f"a batch of {shape[1]} rows does not split over the mesh's batch axes "
            f"(data x fsdp = {self.mesh.shape['data'] * self.mesh.shape['fsdp']}) across "
            f"{processes} processes: make BatchConfig.row_multiple a multiple of data x fsdp")
      return multihost.make_global(x, sharding)

    return jax.tree.map(place, batch)

  def step(self, batch: TrainBatch) -> dict[str, jax.Array]:
    """One optimiser update on `batch` (host or device); returns device scalars."""
    updated, frozen = _split_state(self.state)
    updated, metrics = self._step(updated, frozen, self.place_batch(batch))
    self.state = updated.replace(params=merge_trainable(updated.params, frozen))
    return metrics

  def _logprobs_impl(self, params, batch: TrainBatch):
    ctx = contextlib.nullcontext() if self.mesh is None else shd.use_rules(self.mesh, self.rules)
    with ctx:
      def compute(micro):
        model = nnx.merge(self.graphdef, params)
        lp, _ = token_logprobs(model, micro.tokens, micro.positions, micro.segment_ids,
                               micro.targets, chunk=self.logprob_chunk,
                               temperature=self.logprob_temperature)
        return jnp.where(micro.loss_mask > 0, lp, 0.0)

      def one(micro):  # padding micro-batches (see rl.batch) are not computed
        if not self.config.skip_empty_micro_batches:
          return compute(micro)
        return jax.lax.cond(jnp.any(micro.loss_mask > 0), compute,
                            lambda m: jnp.zeros(m.loss_mask.shape, _F32), micro)
      return jax.lax.map(one, batch)

  def logprobs(self, batch: TrainBatch, params: nnx.State | None = None) -> np.ndarray:
    """log pi(target) for every masked position of `batch` [M, R, T] (0 elsewhere) under
    `params` (default: the current ones), e.g. pi_old recomputed or a frozen reference.
    With several processes: this process's rows, as `place_batch` took them."""
    params = self.state.params if params is None else params
    return multihost.local_part(self._logprobs(params, self.place_batch(batch)))

  def step_temp_bytes(self, batch: TrainBatch) -> int:
    """Bytes of temporaries XLA plans for one step on `batch`'s shapes (activations, logits,
    attention scores; not the state or the batch). Compiles, does not run."""
    lowered = self._step.lower(*_split_state(self.abstract_state()), self.place_batch(batch))
    return lowered.compile().memory_analysis().temp_size_in_bytes

  @property
  def num_compiled(self) -> int:
    """Compiled variants of the train step (a recompilation probe for tests)."""
    return self._step._cache_size()
