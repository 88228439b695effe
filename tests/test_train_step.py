"""The jitted train step: gradient accumulation is exact, the sharded step equals the
single-device step, nothing recompiles, chunked logprobs, bf16 compute, schedules."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sage_jax import sharding as shd
from sage_jax.model import get_preset, init_model
from sage_jax.model.logprobs import token_logprobs
from sage_jax.rl import batch as B
from sage_jax.rl import grpo
from sage_jax.train import optimizer as opt
from sage_jax.train.step import Trainer, TrainerConfig

VOCAB = 64
CFG = get_preset("tiny").replace(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2)
# lr 1 with eps 1 makes Adam's first update ~ -g / (|g| + 1): parameters after a step compare
# the gradients themselves (a tiny eps would compare only their signs).
LINEAR_ADAM = opt.OptimizerConfig(learning_rate=1.0, eps=1.0, weight_decay=0.0, max_grad_norm=0.0)
GRPO = grpo.GRPOConfig(clip_eps_high=0.28, kl_coef=0.05, entropy_coef=0.01, tis_cap=2.0,
                       loss_aggregation="seq-mean-token-mean", logprob_chunk=32)


def _records(n, seed=0, min_len=6, max_len=15):
  rng = np.random.default_rng(seed)
  recs = []
  for _ in range(n):
    length = int(rng.integers(min_len, max_len + 1))
    mask = (rng.random(length) < 0.7).astype(np.int8)
    mask[0] = 0
    lp = np.where(mask, rng.normal(size=length) * 0.3 - 4.2, 0).astype(np.float32)
    recs.append(dict(tokens=rng.integers(0, VOCAB, length), loss_mask=mask, model_logprobs=lp,
                     sampler_logprobs=lp + np.where(mask, 0.1, 0).astype(np.float32),
                     advantage=float(rng.normal())))
  return recs


def _with_ref(batch):
  rng = np.random.default_rng(5)
  return batch.replace(ref_logprobs=(batch.loss_mask * (rng.normal(size=batch.shape) * 0.3 - 4.2)
                                     ).astype(np.float32))


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_accumulating_4_micro_batches_equals_one_big_batch():
  recs = _records(8)
  big, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=128, num_micro_batches=1,
                                            length_buckets=(16,)), aggregation="seq-mean-token-mean")
  small, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=32, num_micro_batches=4,
                                              length_buckets=(16,)), aggregation="seq-mean-token-mean")
  assert big.shape == (1, 8, 16) and small.shape == (4, 2, 16)
  results = []
  for batch in (big, small):
    trainer = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(GRPO), LINEAR_ADAM)
    metrics = trainer.step(_with_ref(batch))
    results.append((jax.device_get(metrics), _leaves(trainer.params)))
  (m1, p1), (m4, p4) = results
  for k in ("loss", "grad_norm", "pg_loss", "kl", "entropy", "clip_frac", "ratio_max",
            "tis_weight"):
    np.testing.assert_allclose(m4[k], m1[k], atol=1e-5, rtol=1e-5, err_msg=k)
  for a, b in zip(p4, p1):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  assert m1["grad_norm"] > 1e-3  # the comparison is not vacuous


def test_step_loss_matches_direct_gradient():
  """The step's loss and gradient norm equal jax.grad of the whole-batch loss by hand."""
  recs = _records(4, seed=3)
  batch, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=32, num_micro_batches=2,
                                              length_buckets=(16,)))
  model = init_model(CFG, seed=2)
  graphdef, params = nnx.split(model)
  config = grpo.GRPOConfig()

  def total(p):
    m = nnx.merge(graphdef, p)
    out = 0.0
    for micro in B.micro_batches(batch):
      micro = jax.tree.map(jnp.asarray, micro)
      lp, _ = token_logprobs(m, micro.tokens, micro.positions, micro.segment_ids, micro.targets)
      out = out + grpo.batch_loss(config, lp, micro)[0]
    return out

  loss, grads = jax.jit(jax.value_and_grad(total))(params)
  trainer = Trainer(model, grpo.make_loss_fn(config), LINEAR_ADAM)
  metrics = trainer.step(batch)
  assert float(metrics["loss"]) == pytest.approx(float(loss), abs=1e-6)
  assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)


def test_sharded_step_equals_single_device():
  assert jax.device_count() == 8
  recs = _records(12, seed=1)
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(16,),
                      row_multiple=4)
  batches = [_with_ref(B.make_batch(recs[i::2], cfg)[0]) for i in range(2)]
  optim = opt.OptimizerConfig(learning_rate=1e-2, eps=1.0, weight_decay=0.01, max_grad_norm=0.5,
                              warmup_steps=1)
  single = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(GRPO), optim)
  mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
  sharded = Trainer(shd.create_sharded(lambda: init_model(CFG, seed=0), mesh),
                    grpo.make_loss_fn(GRPO), optim, mesh=mesh)
  for batch in batches:
    m1 = jax.device_get(single.step(batch))
    m8 = jax.device_get(sharded.step(batch))
    for k in m1:
      np.testing.assert_allclose(m8[k], m1[k], atol=1e-5, rtol=1e-5, err_msg=k)
  q = sharded.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
  assert len(q.addressable_shards) == 8 and q.sharding.spec == jax.sharding.PartitionSpec(
      "tensor", None, "fsdp")
  mu = sharded.state.opt_state[1][0].mu["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
  assert mu.sharding == q.sharding  # Adam moments are sharded like their parameters
  for a, b in zip(_leaves(sharded.state), _leaves(single.state)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  assert int(sharded.state.step) == 2


def test_no_recompile_after_warmup_and_donation():
  trainer = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(grpo.GRPOConfig()),
                    opt.OptimizerConfig(learning_rate=1e-3))
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(16, 32))
  first = B.make_batch(_records(5, seed=0), cfg)[0]
  assert first.shape == (2, 4, 16)
  old_arrays = jax.tree.leaves(trainer.state)
  trainer.step(first)
  assert trainer.num_compiled == 1
  # Without adapters everything is trained: the whole previous state was donated, not copied.
  assert all(a.is_deleted() for a in old_arrays)
  for seed in range(1, 4):  # other data, same bucket: no new compilation
    trainer.step(B.make_batch(_records(6, seed=seed), cfg)[0])
  assert trainer.num_compiled == 1
  long = B.make_batch(_records(3, seed=9, min_len=20, max_len=30), cfg)[0]
  assert long.shape == (2, 2, 32)
  trainer.step(long)
  assert trainer.num_compiled == 2  # one variant per length bucket, and only one
  trainer.step(first)
  assert trainer.num_compiled == 2
  assert trainer.step_count == 6


def test_the_model_trains_in_place_without_a_second_copy():
  import gc
  model = init_model(CFG, seed=0)
  arrays = lambda: jax.tree.leaves(nnx.state(model))
  param_bytes = sum(x.nbytes for x in arrays())
  gc.collect()
  before = sum(x.nbytes for x in jax.live_arrays())
  trainer = Trainer(model, grpo.make_loss_fn(grpo.GRPOConfig()), LINEAR_ADAM)
  gc.collect()
  added = sum(x.nbytes for x in jax.live_arrays()) - before
  # Adam's two moments; the parameters are the model's own arrays, not a copy of them.
  assert 2 * param_bytes <= added < 2.5 * param_bytes, (added, param_bytes)
  assert all(a is b for a, b in zip(arrays(), jax.tree.leaves(trainer.params)))
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(16,))
  trainer.step(B.make_batch(_records(5, seed=0), cfg)[0])
  # After the (donating) step the model holds the new parameters.
  assert all(a is b and not a.is_deleted()
             for a, b in zip(arrays(), jax.tree.leaves(trainer.params)))


def test_empty_micro_batches_are_skipped_exactly():
  recs = _records(3, seed=4)
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=4, length_buckets=(16,))
  batch = B.make_batch(recs, cfg)[0]
  assert (batch.loss_mask.reshape(4, -1).sum(1) == 0).sum() == 3  # 3 micro-batches are padding
  out = []
  for skip in (True, False):
    trainer = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(grpo.GRPOConfig()),
                      LINEAR_ADAM, config=TrainerConfig(skip_empty_micro_batches=skip))
    lp = trainer.logprobs(batch)
    out.append((jax.device_get(trainer.step(batch)), _leaves(trainer.params), lp))
  assert np.abs(out[0][2]).sum() > 0
  np.testing.assert_allclose(out[0][2], out[1][2], atol=1e-6)
  for k in out[0][0]:
    np.testing.assert_allclose(out[0][0][k], out[1][0][k], atol=1e-6, err_msg=k)
  for a, b in zip(out[0][1], out[1][1]):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_non_finite_step_changes_nothing_but_the_step_count():
  """A batch whose loss is NaN (here an advantage of NaN, which the batch builder would refuse,
  put in by hand) leaves the parameters and optimiser state as they were; the next finite
  batch trains as it would have, at the learning rate of the optimiser's first update (the
  warm-up counts updates applied, and so does the logged rate)."""
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(16,))
  warmup = dataclasses.replace(LINEAR_ADAM, warmup_steps=4)
  batch = B.make_batch(_records(4, seed=6), cfg)[0]
  poisoned = batch.replace(advantages=np.where(batch.loss_mask > 0, np.nan, 0.0).astype(
      np.float32))
  trainer = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(grpo.GRPOConfig()), warmup)
  before = _leaves(trainer.state.params) + _leaves(trainer.state.opt_state)
  skipped = jax.device_get(trainer.step(poisoned))
  assert skipped["nonfinite_skipped"] == 1.0 and not np.isfinite(skipped["loss"])
  after = _leaves(trainer.state.params) + _leaves(trainer.state.opt_state)
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)
  assert trainer.step_count == 1
  good = jax.device_get(trainer.step(batch))
  assert good["nonfinite_skipped"] == 0.0
  fresh = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(grpo.GRPOConfig()), warmup)
  first = jax.device_get(fresh.step(batch))
  assert skipped["learning_rate"] == good["learning_rate"] == first["learning_rate"] == 0.25
  for a, b in zip(_leaves(fresh.state.params), _leaves(trainer.state.params)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_ids_outside_the_vocabulary_are_refused_before_the_step():
  """On device such an id's embedding is NaN, which attention spreads over its whole row."""
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(16,))
  batch = B.make_batch(_records(4, seed=6), cfg)[0]
  trainer = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(grpo.GRPOConfig()), LINEAR_ADAM)
  tokens = batch.tokens.copy()
  tokens[0, 0, 3] = VOCAB + 7
  with pytest.raises(ValueError, match=f"tokens hold ids outside .*\\[0, {VOCAB}\\): \\[71\\]"):
    trainer.step(batch.replace(tokens=tokens))
  assert trainer.step_count == 0


def test_micro_batches_without_a_gradient_run_forward_only_exactly():
  """Micro-batches whose advantages are all 0 (no KL, no entropy term; or all <= 0 with the
  negative side off) skip the backward pass:
  the step's metrics and parameters equal the fully computed step's, at a step with such
  micro-batches beside one with a gradient and at a step with none (Adam's momentum moves
  the parameters there); with KL on every micro-batch has a gradient."""
  recs = _records(8, seed=6)
  for r, advantage in zip(recs, [0, 0, 0, -0.5, 0.8, -1.2, 0, 0.3]):
    r["advantage"] = advantage
  cfg = B.BatchConfig(micro_batch_tokens=32, num_micro_batches=4, length_buckets=(16,))
  mixed = B.make_batch(recs, cfg)[0]
  zero = mixed.replace(advantages=np.zeros_like(mixed.advantages))
  # Micro-batches of positive advantages only, of negative (and 0) only, of 0 only, padding.
  signs = [set(np.sign(m[m != 0]).tolist()) for m in mixed.advantages]
  assert sorted(map(sorted, signs)) == [[], [], [-1.0], [1.0]]
  for config in (grpo.GRPOConfig(), grpo.GRPOConfig(negative_weight=0.0),
                 grpo.GRPOConfig(kl_coef=0.1)):
    out = []
    for skip in (True, False):
      trainer = Trainer(init_model(CFG, seed=0), grpo.make_loss_fn(config), LINEAR_ADAM,
                        config=TrainerConfig(skip_empty_micro_batches=skip),
                        gradient_mask=grpo.gradient_mask(config))
      steps = [jax.device_get(trainer.step(_with_ref(b))) for b in (mixed, zero)]
      out.append((steps, _leaves(trainer.params)))
    assert out[0][0][0]["grad_norm"] > 0
    assert (out[0][0][1]["grad_norm"] == 0) == (not config.use_kl)
    for got, want in zip(out[0][0], out[1][0]):
      for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(out[0][1], out[1][1]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  gradient = grpo.gradient_mask(grpo.GRPOConfig())(mixed)
  positive = grpo.gradient_mask(grpo.GRPOConfig(negative_weight=0.0))(mixed)
  assert positive.sum() < gradient.sum() < mixed.loss_mask.sum()
  assert (grpo.gradient_mask(grpo.GRPOConfig(kl_coef=0.1))(mixed) == mixed.loss_mask).all()


def _one_micro_batch():
  """A model and one [4, 16] micro-batch of 4 records: (model, micro, token_logprobs args)."""
  model = init_model(CFG, seed=3)
  batch = B.make_batch(_records(4, seed=2), B.BatchConfig(micro_batch_tokens=64,
                                                          length_buckets=(16,)))[0]
  micro = jax.tree.map(jnp.asarray, B.micro_batches(batch)[0])
  return model, micro, (micro.tokens, micro.positions, micro.segment_ids, micro.targets)


def test_chunked_logprobs_equal_full():
  model, micro, args = _one_micro_batch()
  graphdef, params = nnx.split(model)

  @jax.jit
  def both(p):
    def f(p, chunk):
      lp, ent = token_logprobs(nnx.merge(graphdef, p), *args, chunk=chunk)
      return jnp.sum(lp * micro.loss_mask), (lp, ent)
    return [jax.grad(f, has_aux=True)(p, chunk) for chunk in (0, 16, 20)]

  assert micro.tokens.shape == (4, 16)  # chunks of 16 tokens: 4 positions of each row;
  outputs = both(params)  # of 20 tokens: 5 positions, the last chunk padded
  (g_full, full) = outputs[0]
  for g_chunk, chunked in outputs[1:]:
    for a, b in zip(full, chunked):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_logprobs_at_a_temperature_are_of_the_scaled_logits():
  model, micro, args = _one_micro_batch()
  hidden, _ = model.hidden_states(micro.tokens, micro.positions, segment_ids=micro.segment_ids)
  logits = jnp.einsum("rte,ve->rtv", hidden, model.head_weight())
  for temperature in (0.6, 1.7):
    log_p = jax.nn.log_softmax(logits / temperature, axis=-1)
    want = jnp.take_along_axis(log_p, micro.targets[..., None], axis=-1)[..., 0]
    want_entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    for chunk in (0, 20):
      lp, ent = token_logprobs(model, *args, chunk=chunk, temperature=temperature)
      np.testing.assert_allclose(lp, want, atol=1e-5)
      np.testing.assert_allclose(ent, want_entropy, atol=1e-5)
  assert not np.allclose(token_logprobs(model, *args, temperature=0.6)[0],
                         token_logprobs(model, *args)[0], atol=1e-3)


def test_bfloat16_logprobs_at_a_temperature_are_the_samplers():
  """With bfloat16 activations the float32 logits are divided by the temperature, as the
  sampler divides them (sampling.sample), not the hidden states scaled in bfloat16."""
  _, micro, args = _one_micro_batch()
  model = init_model(CFG.replace(dtype="bfloat16"), seed=3)
  hidden, _ = model.hidden_states(micro.tokens, micro.positions, segment_ids=micro.segment_ids)
  assert hidden.dtype == jnp.bfloat16
  logits = jnp.einsum("rte,ve->rtv", hidden, model.head_weight().astype(hidden.dtype),
                      preferred_element_type=jnp.float32)
  log_p = jax.nn.log_softmax(logits / jnp.float32(0.7), axis=-1)
  want = jnp.take_along_axis(log_p, micro.targets[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(token_logprobs(model, *args, temperature=0.7)[0], want,
                             rtol=1e-6, atol=1e-6)


def test_a_sampling_temperature_trains_that_policy_with_pi_old_recomputed():
  """Rollouts sampled at T train softmax(logits / T): pi_old is the trainer's own at T (the
  sampler's model logprobs, at temperature 1, are not used), so one update is on-policy."""
  from sage_jax.train import rl_loop  # noqa: PLC0415

  records = _records(6, seed=4)  # their model_logprobs are not this model's
  config = B.BatchConfig(micro_batch_tokens=64, length_buckets=(16,))
  tuned = grpo.GRPOConfig(temperature=0.6, logprob_chunk=0)
  assert tuned.recomputes_old_logprobs and not grpo.GRPOConfig().recomputes_old_logprobs
  runs = {}
  for temperature in (1.0, 0.6):
    g = grpo.GRPOConfig(temperature=temperature, logprob_chunk=0)
    trainer = rl_loop.grpo_trainer(init_model(CFG, seed=3), g, LINEAR_ADAM)
    batch = B.make_batch(records, config)[0]
    before = trainer.logprobs(batch)  # the trainer's logprobs at the temperature, pre-update
    mean_before = float(before.sum() / batch.loss_mask.sum())
    runs[temperature] = (rl_loop.grpo_update(trainer, records, g, config), mean_before)
  (at_one, lp_one), (at_t, lp_t) = runs[1.0], runs[0.6]
  # The loss's pi_theta is the policy at the temperature...
  assert at_t["logprob"] == pytest.approx(lp_t, abs=1e-5)
  assert at_one["logprob"] == pytest.approx(lp_one, abs=1e-5) and abs(lp_t - lp_one) > 0.01
  # ... and so is pi_old: the update starts on-policy (ratio 1), where temperature 1 used the
  # records' sampler logprobs (not this model's).
  assert at_t["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and at_t["clip_frac"] == 0.0
  assert abs(at_one["ratio_mean"] - 1.0) > 0.1


def test_gspo_by_its_ratio_level_alone_trains_the_papers_objective():
  """`ratio_level="sequence"` with the default aggregation ("auto") is GSPO's objective, in
  which every sequence weighs the same whatever its length: the mean over sequences of
  max(-A_i s_i, -A_i clip(s_i)), s_i the exp of the sequence's mean token log-ratio. An
  explicit token-mean still weighs each sequence by its tokens."""
  from sage_jax.train import rl_loop  # noqa: PLC0415

  records = _records(6, seed=7, min_len=3, max_len=15)  # model_logprobs not this model's
  config = B.BatchConfig(micro_batch_tokens=64, length_buckets=(16,))
  batch = B.make_batch(records, config)[0]
  losses, per_sequence = {}, []
  for aggregation in ("auto", "token-mean"):
    g = grpo.GRPOConfig(ratio_level="sequence", loss_aggregation=aggregation, logprob_chunk=0)
    trainer = rl_loop.grpo_trainer(init_model(CFG, seed=3), g, LINEAR_ADAM)
    new = trainer.logprobs(batch)  # pi_theta before the update
    losses[aggregation] = rl_loop.grpo_update(trainer, records, g, config)["loss"]
  rows = lambda x: np.asarray(x).reshape(-1, batch.tokens.shape[-1])  # [micro, rows, T]
  mask, segments, new, old = (rows(batch.loss_mask) > 0, rows(batch.segment_ids), rows(new),
                              rows(batch.old_logprobs))
  for row, segment in {(r, segments[r, t]) for r, t in zip(*np.nonzero(mask))}:
    tokens = mask[row] & (segments[row] == segment)
    s = np.exp(np.mean(new[row][tokens] - old[row][tokens]))
    a = float(rows(batch.advantages)[row][tokens][0])
    per_sequence.append((max(-a * s, -a * np.clip(s, 0.8, 1.2)), int(tokens.sum())))
  assert len(per_sequence) == len(records)
  assert len({n for _, n in per_sequence}) > 1  # lengths differ: the two weighings differ
  loss, tokens = np.asarray(per_sequence).T
  assert losses["auto"] == pytest.approx(loss.mean(), rel=1e-4)
  assert losses["token-mean"] == pytest.approx((loss * tokens).sum() / tokens.sum(), rel=1e-4)
  assert abs(loss.mean() - (loss * tokens).sum() / tokens.sum()) > 1e-2
  assert grpo.GRPOConfig().aggregation == "token-mean"  # GRPO's own: every token the same
  assert grpo.GRPOConfig(ratio_level="sequence-token").aggregation == "seq-mean-token-mean"


def test_a_step_of_several_updates_reports_extremes_of_them_all():
  """With several mini-batches, a step's metrics combine its updates': maxima as the largest,
  minima as the smallest, counts as totals, the rest as means over the updates."""
  from sage_jax.train import rl_loop  # noqa: PLC0415
  from sage_jax.train.metrics import scalars  # noqa: PLC0415

  records = _records(4, seed=6)
  for r in records[:2]:  # pi_old far below pi_theta: far larger ratios in the first update
    r["model_logprobs"] = np.where(r["loss_mask"], r["model_logprobs"] - 3.0, 0).astype(np.float32)
  g = grpo.GRPOConfig(num_mini_batches=2, shuffle_mini_batches=False, logprob_chunk=0)
  trainer = rl_loop.grpo_trainer(init_model(CFG, seed=3), g, opt.OptimizerConfig(
      learning_rate=1e-4))
  updates, step = [], trainer.step
  trainer.step = lambda batch: updates.append(scalars(jax.device_get(step(batch)))) or updates[-1]
  out = rl_loop.grpo_update(trainer, records, g, B.BatchConfig(micro_batch_tokens=64,
                                                               length_buckets=(16,)))
  assert out["updates"] == len(updates) == 2
  first, second = updates
  assert first["ratio_max"] > 5 * second["ratio_max"]
  assert first["ratio_min"] > 5 * second["ratio_min"]
  assert out["ratio_max"] == first["ratio_max"] and out["ratio_min"] == second["ratio_min"]
  assert out["loss_tokens"] == sum(int(r["loss_mask"].sum()) for r in records)
  assert out["nonfinite_skipped"] == 0.0
  for name in ("loss", "grad_norm", "ratio_mean", "clip_frac", "learning_rate"):
    assert out[name] == pytest.approx((first[name] + second[name]) / 2)


def test_bf16_compute_with_fp32_master_weights():
  model = init_model(CFG.replace(dtype="bfloat16", remat="full"), seed=0)
  trainer = Trainer(model, grpo.make_loss_fn(grpo.GRPOConfig()),
                    opt.OptimizerConfig(learning_rate=1e-3))
  batch = B.make_batch(_records(4), B.BatchConfig(micro_batch_tokens=64,
                                                  length_buckets=(16,)))[0]
  metrics = jax.device_get(trainer.step(batch))
  assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.params))
  mu = trainer.state.opt_state[1][0].mu
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(mu))


def test_schedules():
  s = opt.make_schedule(opt.OptimizerConfig(learning_rate=1.0, warmup_steps=4))
  assert [float(s(i)) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
  s = opt.make_schedule(opt.OptimizerConfig(learning_rate=2.0, warmup_steps=2,
                                            schedule="cosine", decay_steps=10,
                                            end_lr_ratio=0.1))
  assert float(s(1)) == 2.0
  assert float(s(2)) == pytest.approx(2.0)
  assert float(s(7)) == pytest.approx(0.2 + 1.8 * 0.5 * (1 + np.cos(np.pi * 5 / 10)), rel=1e-5)
  assert float(s(12)) == pytest.approx(0.2)
  s = opt.make_schedule(opt.OptimizerConfig(learning_rate=1.0, schedule="linear",
                                            decay_steps=4))
  assert [float(s(i)) for i in (0, 2, 4, 9)] == [1.0, 0.5, 0.0, 0.0]
  with pytest.raises(ValueError, match="needs the stage's number of updates"):
    opt.make_schedule(opt.OptimizerConfig(schedule="cosine"))
  with pytest.raises(ValueError, match="never decays"):  # the schedule was left at constant
    opt.OptimizerConfig(decay_steps=1000)
  with pytest.raises(ValueError, match="both set the warmup"):
    opt.OptimizerConfig(warmup_steps=2, warmup_ratio=0.1)


def test_a_schedule_sized_by_its_stage():
  """warmup_ratio and a decay to the last update (decay_steps 0) take the stage's length: a
  tenth of 40 updates warm up, and the cosine reaches its end at update 39."""
  config = opt.OptimizerConfig(learning_rate=1.0, warmup_ratio=0.1, schedule="cosine",
                               end_lr_ratio=0.1)
  sized = config.for_updates(40)
  assert (sized.warmup_steps, sized.decay_steps, sized.warmup_ratio) == (4, 36, 0.0)
  s = opt.make_schedule(sized)
  assert [float(s(i)) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
  assert float(s(39)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 35 / 36)))
  assert float(s(40)) == pytest.approx(0.1)
  assert config.never_peaks(40) is None
  # Fixed warmup steps longer than the stage: named, with how far the learning rate gets.
  short = opt.OptimizerConfig(learning_rate=1e-5, warmup_steps=20)
  assert short.for_updates(8) == short
  assert "its 8 updates end inside its 20-update warmup: the learning rate reaches 0.4 of" in (
      short.never_peaks(8))


def test_weight_decay_mask_and_clipping():
  model = init_model(CFG, seed=0)
  _, params = nnx.split(model)
  q_proj = params["layers"][0]["self_attn"]["q_proj"]
  q_proj["bias"] = jax.tree.map(jnp.ones_like, q_proj["bias"])  # a loaded bias is not zero
  tx, _ = opt.make_optimizer(opt.OptimizerConfig(learning_rate=0.1, weight_decay=0.5,
                                                 weight_decay_mask="matrices", max_grad_norm=1.0))
  updates, _ = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p))(
      params)
  norm_update = updates["norm"]["weight"][...]
  kernel_update = updates["layers"][0]["mlp"]["up_proj"]["kernel"][...]
  assert float(jnp.abs(norm_update).max()) == 0.0  # 1-D: no decay
  bias_update = updates["layers"][0]["self_attn"]["q_proj"]["bias"][...]
  assert bias_update.ndim == 2 and float(jnp.abs(bias_update).max()) == 0.0  # per head: no decay
  np.testing.assert_allclose(np.asarray(kernel_update),
                             -0.1 * 0.5 * np.asarray(params["layers"][0]["mlp"]["up_proj"]
                                                     ["kernel"][...]), rtol=1e-6)
  big = jax.tree.map(lambda p: jnp.full_like(p, 100.0), params)
  clip = optax.clip_by_global_norm(1.0)
  norm = jax.jit(lambda g: optax.tree.norm(clip.update(g, clip.init(g))[0]))(big)
  assert float(norm) == pytest.approx(1.0, rel=1e-5)


def test_blocked_attention_step_equals_dense_and_plans_less_memory():
  cfg = B.BatchConfig(micro_batch_tokens=512, num_micro_batches=2, length_buckets=(256,))
  batch = B.make_batch(_records(4, seed=3, min_len=180, max_len=250), cfg)[0]
  assert batch.shape == (2, 2, 256)
  states, temp = [], {}
  for block in (0, 32):
    model = init_model(CFG.replace(attention_block=block), seed=0)
    trainer = Trainer(model, grpo.make_loss_fn(GRPO), LINEAR_ADAM)
    temp[block] = trainer.step_temp_bytes(batch)
    assert trainer.num_compiled == 0  # planning compiled a copy, not the step's cache
    trainer.step(batch)
    states.append(_leaves(trainer.state))
  for a, b in zip(*states):
    np.testing.assert_allclose(a, b, atol=2e-5)
  assert temp[32] < temp[0] / 2, temp
