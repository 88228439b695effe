"""Optax AdamW with warmup + constant / cosine / linear schedules and global-norm clipping."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax

Schedule = Literal["constant", "cosine", "linear"]
WeightDecayMask = Literal["all", "matrices"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW and its learning-rate schedule.

  learning_rate: peak learning rate (after warmup).
  schedule: "constant", "cosine" or "linear" decay after warmup.
  warmup_steps: linear warmup from 0 to the peak over this many updates.
  warmup_ratio: the warmup as a fraction of the stage's updates instead (an epoch-counted
    SFT's length is known only once its data is).
  decay_steps: length of the cosine / linear decay after warmup; 0: to the stage's last update.
  end_lr_ratio: final learning rate of a decay as a fraction of the peak.
  b1, b2, eps: Adam moments.
  weight_decay: decoupled weight decay (AdamW).
  weight_decay_mask: "all" parameters, or "matrices" only (no biases, norms).
  max_grad_norm: clip gradients to this global norm before the update (0 = off).
  """

  learning_rate: float = 1e-6
  schedule: Schedule = "constant"
  warmup_steps: int = 0
  warmup_ratio: float = 0.0
  decay_steps: int = 0
  end_lr_ratio: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.01
  weight_decay_mask: WeightDecayMask = "all"
  max_grad_norm: float = 1.0

  def __post_init__(self):
    if self.learning_rate < 0 or self.warmup_steps < 0 or self.decay_steps < 0:
      raise ValueError(f"{self}: learning_rate, warmup_steps and decay_steps must be >= 0")
    if self.schedule not in ("constant", "cosine", "linear"):
      raise ValueError(f"schedule={self.schedule!r}; expected constant, cosine or linear")
    if not 0 <= self.warmup_ratio < 1:
      raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
    if self.warmup_steps and self.warmup_ratio:
      raise ValueError(f"warmup_steps={self.warmup_steps} and warmup_ratio={self.warmup_ratio} "
                       "both set the warmup: set one of them")
    if self.schedule == "constant" and (self.decay_steps or self.end_lr_ratio):
      raise ValueError(f"schedule='constant' never decays: decay_steps={self.decay_steps} and "
                       f"end_lr_ratio={self.end_lr_ratio} would do nothing; set schedule to "
                       "'cosine' or 'linear', or leave them 0")
    if self.weight_decay_mask not in ("all", "matrices"):
      raise ValueError(f"weight_decay_mask={self.weight_decay_mask!r}; expected all or matrices")
    if self.max_grad_norm < 0:
      raise ValueError(f"max_grad_norm={self.max_grad_norm} must be >= 0")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.eps > 0 and self.weight_decay >= 0
            and 0 <= self.end_lr_ratio <= 1):
      raise ValueError(f"b1={self.b1} and b2={self.b2} must be in [0, 1), eps={self.eps} > 0, "
                       f"weight_decay={self.weight_decay} >= 0, end_lr_ratio="
                       f"{self.end_lr_ratio} in [0, 1]")

  def for_updates(self, total_updates: int) -> OptimizerConfig:
    """This config for a stage of `total_updates` optimiser updates: `warmup_ratio` of them
    warm up, and a decay of decay_steps 0 ends at the last one."""
    warmup = self.warmup_steps or round(self.warmup_ratio * total_updates)
    decay = self.decay_steps
    if self.schedule != "constant" and not decay:
      decay = max(1, total_updates - warmup)
    return dataclasses.replace(self, warmup_steps=warmup, warmup_ratio=0.0, decay_steps=decay)

  def never_peaks(self, total_updates: int) -> str | None:
    """Why a stage of `total_updates` updates would end before this schedule reaches its peak
    learning rate (None when it does not)."""
    warmup = self.for_updates(total_updates).warmup_steps
    if warmup <= total_updates:
      return None
    return (f"its {total_updates} updates end inside its {warmup}-update warmup: the learning "
            f"rate reaches {total_updates / warmup:.2g} of learning_rate={self.learning_rate} "
            "at most; set warmup_ratio (a fraction of the updates) or fewer warmup_steps")


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
  """Learning rate as a function of the update count (0-based)."""
  if config.warmup_ratio or (config.schedule != "constant" and not config.decay_steps):
    raise ValueError(f"{config}: a warmup_ratio, or a decay to the last update (decay_steps 0), "
                     "needs the stage's number of updates: OptimizerConfig.for_updates")
  peak = config.learning_rate
  if config.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif config.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, config.decay_steps, alpha=config.end_lr_ratio)
  else:
    after = optax.linear_schedule(peak, peak * config.end_lr_ratio, config.decay_steps)
  if not config.warmup_steps:
    return after
  # Step 0 already trains at peak / warmup_steps: no wasted update at learning rate 0.
  warmup = lambda step: peak * jnp.minimum(step + 1, config.warmup_steps) / config.warmup_steps
  return optax.join_schedules([warmup, after], [config.warmup_steps])


def _matrices(params):
  """The weight matrices: not norms, and not biases, which q/k/v keep per head ([heads, dim])."""
  def is_matrix(path, p):
    return p.ndim >= 2 and not any(getattr(k, "key", getattr(k, "name", None)) == "bias"
                                   for k in path)
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(config: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(clip -> AdamW, the schedule) from the config."""
  schedule = make_schedule(config)
  mask = _matrices if config.weight_decay_mask == "matrices" else None
  parts = []
  if config.max_grad_norm:
    parts.append(optax.clip_by_global_norm(config.max_grad_norm))
  parts.append(optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                           weight_decay=config.weight_decay, mask=mask))
  return optax.chain(*parts), schedule
