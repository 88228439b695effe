"""Episode records -> packed batches: the shift, packing, bucketing, and exact agreement of the
trainer's logprobs with the sampler's on the sampler's own multi-turn tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.model import get_preset, init_model
from sage_jax.rl import batch as B
from sage_jax.rl import grpo
from sage_jax.sampler import Engine, EngineConfig, SamplingParams
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.step import Trainer

VOCAB = 64
CFG = get_preset("tiny").replace(vocab_size=VOCAB)


def _records(lengths, seed=0):
  rng = np.random.default_rng(seed)
  recs = []
  for n in lengths:
    mask = (rng.random(n) < 0.6).astype(np.int8)
    mask[0] = 0
    recs.append(dict(tokens=rng.integers(0, VOCAB, n).astype(np.int32), loss_mask=mask,
                     model_logprobs=np.where(mask, rng.normal(size=n) - 3, 0).astype(np.float32),
                     sampler_logprobs=np.where(mask, -1.0, 0).astype(np.float32),
                     advantage=float(rng.normal())))
  return recs


def test_shift_and_fields_per_sequence():
  recs = _records([7, 5, 12, 3])
  batch, info = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=32, num_micro_batches=2,
                                                 length_buckets=(8, 16)))
  assert batch.shape == (2, 2, 16)  # 11 positions need T=16; 2 rows of 16 per micro-batch
  for rec, p in zip(recs, info.placements):
    n = len(rec["tokens"])
    assert p.length == n - 1
    sl = (p.micro, p.row, slice(p.offset, p.offset + p.length))
    np.testing.assert_array_equal(batch.tokens[sl], rec["tokens"][:-1])
    np.testing.assert_array_equal(batch.targets[sl], rec["tokens"][1:])
    np.testing.assert_array_equal(batch.positions[sl], np.arange(n - 1))
    np.testing.assert_array_equal(batch.loss_mask[sl], rec["loss_mask"][1:])
    np.testing.assert_allclose(batch.old_logprobs[sl], rec["model_logprobs"][1:])
    np.testing.assert_allclose(batch.advantages[sl], rec["advantage"] * rec["loss_mask"][1:])
    assert len(set(batch.segment_ids[sl].tolist())) == 1 and batch.segment_ids[sl][0] > 0
  assert info.real_positions == 6 + 4 + 11 + 2
  assert batch.weights.sum() == pytest.approx(1.0)
  assert (batch.segment_ids > 0).sum() == info.real_positions
  assert ((batch.segment_ids == 0) <= (batch.loss_mask == 0)).all()


def test_packing_and_buckets():
  recs = _records([30, 10, 10, 9, 8, 20])
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=1, length_buckets=(32, 64))
  batch, info = B.make_batch(recs, cfg)
  # 29 + 19 + 9 + 9 + 8 + 7 = 81 positions fit in no single micro-batch (2 rows of 32 or 1 of
  # 64): more micro-batches. FFD makes 3 rows of 32 (2 micro-batches of 2 rows) or 2 rows of 64
  # (2 of 1 row): the same 128 positions, so the shorter rows win.
  assert batch.shape == (2, 2, 32)
  assert info.padding_fraction == pytest.approx(1 - 81 / 128)
  unpacked, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=64, num_micro_batches=1,
                                                 length_buckets=(32, 64), pack=False))
  # One sequence per row: 6 rows, 3 micro-batches of 2, rounded up to a power of two.
  assert unpacked.shape == (4, 2, 32)
  assert not unpacked.segment_ids[3].any()
  fits, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2,
                                             length_buckets=(16, 32, 64)))
  assert fits.shape == (2, 2, 32)  # the smallest bucket that holds the longest sequence
  with pytest.raises(ValueError, match="needs 69 positions .* largest length bucket 64"):
    B.make_batch(_records([70]), cfg)
  # Every process stops, and one whose own sequences fit says that another's did not.
  with pytest.raises(ValueError, match="sequence of another process .* longest needs 9"):
    B.make_batch(_records([10]), cfg, allgather=lambda x: np.stack([x, np.full_like(x, -1)]))
  rows = B.BatchConfig(micro_batch_tokens=40, length_buckets=(16,), row_multiple=4)
  assert rows.rows_per_micro_batch(16) == 4


def test_rows_stay_within_the_micro_batch_budget():
  buckets = (1024, 2048, 4096, 8192, 16384)
  config = B.BatchConfig(micro_batch_tokens=2048, num_micro_batches=1, length_buckets=buckets)
  # Eight 1200-token episodes would all fit one 16384-token row in one micro-batch, at ~8x the
  # attention and activations of the 2048-token budget: instead, one per 2048-token row, one
  # row per micro-batch.
  batch, info = B.make_batch(_records([1201] * 8), config)
  assert batch.shape == (8, 1, 2048)
  assert sorted(p.micro for p in info.placements) == list(range(8))
  # Five need 5 micro-batches, rounded up to 8 (few compiled variants); the padding ones are
  # empty.
  batch, info = B.make_batch(_records([1201] * 5), config)
  assert batch.shape == (8, 1, 2048)
  assert not batch.segment_ids[5:].any() and batch.weights.sum() == pytest.approx(1.0)
  assert info.total_positions == 5 * 2048  # the padding micro-batches are not computed
  # A sequence longer than the budget gets the shortest bucket that holds it, not longer.
  batch, _ = B.make_batch(_records([3001, 500, 500]), config)
  assert batch.shape == (1, 1, 4096)
  batch, _ = B.make_batch(_records([3001] * 3),
                          B.BatchConfig(micro_batch_tokens=2048, num_micro_batches=2,
                                        length_buckets=buckets))
  assert batch.shape == (4, 1, 4096)
  # Rows rounded up to the data-parallel multiple count against the budget too: two rows of
  # 4096 would be 8192 tokens a micro-batch.
  batch, _ = B.make_batch(_records([1501] * 4),
                          B.BatchConfig(micro_batch_tokens=4096, row_multiple=2,
                                        length_buckets=buckets))
  assert batch.shape == (2, 2, 2048)


def test_micro_batch_split_and_mini_batches():
  recs = _records([5, 6, 7, 8, 9])
  batch, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=8, num_micro_batches=5,
                                              length_buckets=(8,)))
  micros = B.micro_batches(batch)
  assert len(micros) == 5 and micros[0].shape == (1, 8)
  restacked = B.stack_micro_batches(micros)
  np.testing.assert_array_equal(restacked.tokens, batch.tokens)
  parts = B.split_mini_batches(recs, 2, np.random.default_rng(0))
  assert sorted(len(p) for p in parts) == [2, 3]
  assert sorted(id(r) for p in parts for r in p) == sorted(id(r) for r in recs)


@pytest.mark.parametrize("aggregation", B.AGGREGATIONS)
def test_weights_of_a_batch_split_over_processes(aggregation):
  """Each process packs its part of the batch; the weights are those of the whole batch,
  in every aggregation mode, including with a sequence that holds no masked token (verl and
  tunix count only sequences with one in the sequence means)."""
  import threading
  recs = _records([9, 6, 7, 12, 5])
  recs[2]["loss_mask"] = np.zeros_like(recs[2]["loss_mask"])
  config = B.BatchConfig(micro_batch_tokens=64, length_buckets=(16,))
  norm = 10.0 if aggregation == "seq-mean-token-sum-norm" else None
  whole, info = B.make_batch(recs, config, aggregation=aggregation, norm_constant=norm)
  assert info.num_sequences == 5

  parts = [recs[:2], recs[2:]]
  barrier, shared, out = threading.Barrier(2), {}, {}

  def allgather(x, rank):
    shared[rank] = np.asarray(x)
    barrier.wait()
    every = np.stack([shared[0], shared[1]])
    barrier.wait()
    return every

  def run(rank):
    out[rank] = B.make_batch(parts[rank], config, aggregation=aggregation, norm_constant=norm,
                             allgather=lambda x: allgather(x, rank))

  threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for rank in (0, 1):
    batch, part_info = out[rank]
    assert part_info.num_sequences == 5
    first = 0 if rank == 0 else 2
    for k, weights in enumerate(B.gather(batch.weights, part_info)):
      np.testing.assert_allclose(weights, B.gather(whole.weights, info)[first + k], rtol=1e-6)
  if aggregation in ("token-mean", "seq-mean-token-mean"):
    # Means over the 4 sequences that hold masked tokens: the weights sum to 1.
    assert float(whole.weights.sum()) == pytest.approx(1.0, rel=1e-6)


def test_record_validation():
  bad = dict(tokens=[1, 2, 3], loss_mask=[1, 0, 1], advantage=1.0)
  with pytest.raises(ValueError, match="token 0"):
    B.make_batch([bad])
  with pytest.raises(ValueError, match="no advantage"):
    B.make_batch([dict(tokens=[1, 2], loss_mask=[0, 1])])
  with pytest.raises(ValueError, match="entries"):
    B.make_batch([dict(tokens=[1, 2], loss_mask=[0, 1, 1], advantage=0.0)])

  class Episode:  # attribute access works as well as mapping keys
    tokens = np.array([3, 4, 5])
    loss_mask = np.array([0, 1, 1], np.int8)
    advantage = 0.5
  batch, _ = B.make_batch([Episode()], B.BatchConfig(length_buckets=(4,)))
  assert batch.advantages.sum() == pytest.approx(1.0)


def test_packed_logprobs_equal_per_sequence_forward():
  model = init_model(CFG, seed=1)
  recs = _records([9, 14, 5, 21, 6], seed=2)
  batch, info = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2,
                                                 length_buckets=(32,)))
  trainer = Trainer(model, grpo.make_loss_fn(grpo.GRPOConfig()), OptimizerConfig())
  got = B.gather(trainer.logprobs(batch), info)
  # Reference: each sequence alone in its own row (right padding cannot affect a causal model).
  padded = np.zeros((len(recs), 32), np.int32)
  for i, rec in enumerate(recs):
    padded[i, :len(rec["tokens"])] = rec["tokens"]
  logits, _ = jax.jit(lambda t: model(t, jnp.broadcast_to(jnp.arange(32), t.shape)))(padded)
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  for i, (rec, lp) in enumerate(zip(recs, got)):
    n = len(rec["tokens"])
    # Token k's logprob comes from the logits at position k - 1.
    want = logp[i, np.arange(n - 1), rec["tokens"][1:]] * rec["loss_mask"][1:]
    np.testing.assert_allclose(lp, want, atol=2e-5, rtol=0)


def test_trainer_logprobs_equal_sampler_logprobs_multi_turn():
  """The rollout's model_logprobs are pi_old: on the same tokens the trainer reproduces them."""
  model = init_model(CFG, seed=4)
  engine = Engine(model, EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8, 16),
                                      min_attend=32, steps_per_call=4, max_top_k=8),
                  eos_ids=[VOCAB - 1])
  rng = np.random.default_rng(0)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
  records = []
  for k in range(3):
    prompt = rng.integers(0, VOCAB - 1, 5 + k).tolist()
    tokens, mask, lps, slps = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [0.0] * len(prompt)
    seq = engine.start(prompt, sampling, seed=k)
    for turn in range(3):
      (res,) = engine.run()
      tokens += res.tokens
      mask += [1] * len(res.tokens)
      lps += res.model_logprobs.tolist()
      slps += res.sample_logprobs.tolist()
      if turn < 2:
        obs = rng.integers(0, VOCAB - 1, 3).tolist()  # an observation, appended as ids
        tokens += obs
        mask += [0] * len(obs)
        lps += [0.0] * len(obs)
        slps += [0.0] * len(obs)
        engine.append(seq, obs)
    engine.free(seq)
    records.append(dict(tokens=np.asarray(tokens), loss_mask=np.asarray(mask),
                        model_logprobs=np.asarray(lps, np.float32),
                        sampler_logprobs=np.asarray(slps, np.float32), advantage=1.0))
  batch, info = B.make_batch(records, B.BatchConfig(micro_batch_tokens=64,
                                                    length_buckets=(64,)))
  trainer = Trainer(model, grpo.make_loss_fn(grpo.GRPOConfig()), OptimizerConfig())
  got = trainer.logprobs(batch)
  np.testing.assert_allclose(got, batch.old_logprobs, atol=2e-5, rtol=0)
  assert info.loss_tokens >= 9
