"""The sampler engine on tiny random models: exactness against a training-style forward and
transformers' logits processors, multi-turn cache reuse, continuous batching, stop conditions,
no recompilation, sharding."""

import asyncio
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from sage_jax import sharding as shd
from sage_jax.model.config import Qwen2Config
from sage_jax.model.qwen2 import init_model
from sage_jax.sampler import AsyncEngine, Engine, EngineConfig, SamplingParams
from sage_jax.sampler.sampling import sample

CFG = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# Small buckets so that prompts longer than 32 tokens are prefilled in several chunks.
ENGINE = EngineConfig(num_slots=4, max_len=128, prefill_buckets=(8, 32), min_attend=32,
                      steps_per_call=4, max_top_k=64)
NO_EOS = ()  # Turns end on their budget.
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def tiny_model(seed=0):
  """A random 2-layer model whose weights are scaled up from the 0.02 init, so that its
  outputs depend on the context instead of repeating one token."""
  graphdef, state = nnx.split(init_model(CFG, seed))
  return nnx.merge(graphdef, jax.tree.map(lambda x: x * 10 if x.ndim > 1 else x, state))


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def _prompts(lengths, seed=0):
  rng = np.random.RandomState(seed)
  return [list(map(int, rng.randint(1, CFG.vocab_size, n))) for n in lengths]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids):
  logits, _ = nnx.merge(graphdef, state)(ids, jnp.arange(ids.shape[1])[None])
  return logits


def _forward_logits(model, ids):
  """Training-style forward (no cache) over `ids`, padded at the end to one fixed length
  (causal, so padding changes nothing before it): float64 logits at every position."""
  padded = np.zeros((1, ENGINE.max_len), np.int32)
  padded[0, :len(ids)] = ids
  logits = _forward(*nnx.split(model), jnp.asarray(padded))
  return np.asarray(logits[0, :len(ids)], np.float64)


def _forward_logprobs(model, ids):
  logits = _forward_logits(model, ids)
  return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


class CompileCounter:
  """Counts XLA compilations (persistent-cache hits included) while active."""

  def __init__(self):
    self.names = []

  def _listener(self, event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      self.names.append(kwargs.get("fun_name"))

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


def _filtered_reference(logits, temperature, top_k, top_p):
  """Sort-based (HF order) log-probs of the sampling distribution; -inf where filtered."""
  scaled = logits / temperature
  order = np.argsort(-scaled, kind="stable")
  keep = np.ones_like(scaled, bool)
  if top_k:
    keep[order[top_k:]] = False
  probs = np.exp(scaled - scaled.max())
  probs = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
  if top_p < 1:
    cum = np.cumsum(probs[order])
    size = int(np.searchsorted(cum, top_p * cum[-1])) + 1  # smallest prefix reaching top_p
    nucleus = np.zeros_like(keep)
    nucleus[order[:size]] = True
    keep &= nucleus
  kept = np.where(keep, scaled, -np.inf)
  return kept - np.logaddexp.reduce(kept[keep])


def _transformers_scores(logits, history, params):
  """transformers' processed scores of `logits` [vocab] after the ids `history`: the processors
  its `generate` builds for `params`, in its order (`_get_logits_processor`): the repetition
  penalty, then, when sampling, temperature, top-k, top-p, min-p."""
  processors = transformers.LogitsProcessorList()
  if params.repetition_penalty != 1:
    processors.append(transformers.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
  if params.temperature > 0:
    processors.append(transformers.TemperatureLogitsWarper(params.temperature))
    if params.top_k:
      processors.append(transformers.TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
      processors.append(transformers.TopPLogitsWarper(params.top_p))
    if params.min_p:
      processors.append(transformers.MinPLogitsWarper(params.min_p))
  scores = processors(torch.tensor([history]), torch.tensor(np.asarray(logits, np.float32)[None]))
  return scores[0].double().numpy()


def _check_turn_against_transformers(model, history, turn, params):
  """Each token of `turn` (after the ids `history`) is transformers' choice (greedy) or has
  positive probability under its processed scores, with the sampling logprob those scores
  give it; the model logprob is the unmodified model's."""
  logits = _forward_logits(model, history + turn.tokens)[len(history) - 1:-1]
  for i, token in enumerate(turn.tokens):
    model_lp = logits[i] - np.logaddexp.reduce(logits[i])
    np.testing.assert_allclose(turn.model_logprobs[i], model_lp[token], atol=2e-5)
    scores = _transformers_scores(logits[i], history + turn.tokens[:i], params)
    if params.temperature == 0:
      assert token == scores.argmax()
      continue
    sample_lp = scores - np.logaddexp.reduce(scores)
    assert np.isfinite(sample_lp[token]), "sampled a token transformers' processors removed"
    np.testing.assert_allclose(turn.sample_logprobs[i], sample_lp[token], atol=5e-5)


# --- Exactness ------------------------------------------------------------------------------


def test_greedy_and_model_logprobs_equal_training_forward(model):
  # More prompts than slots; lengths cover a single token, a padded chunk, several chunks.
  prompts = _prompts([1, 5, 45, 17, 70])
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  results = engine.generate(prompts, GREEDY)
  for prompt, r in zip(prompts, results):
    assert (r.finish_reason, len(r.tokens), r.length) == ("max_new_tokens", 20, len(prompt) + 20)
    assert r.prefilled_tokens == len(prompt)
    logprobs = _forward_logprobs(model, prompt + r.tokens)[len(prompt) - 1:-1]
    np.testing.assert_array_equal(r.tokens, logprobs.argmax(-1))
    np.testing.assert_allclose(r.model_logprobs, logprobs[np.arange(20), r.tokens], atol=2e-5)
    np.testing.assert_array_equal(r.sample_logprobs, 0.0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 0.9),
                                                     (1.3, 0, 0.5), (0.8, 5, 1.0)])
def test_sampled_tokens_and_both_logprobs(model, temperature, top_k, top_p):
  prompts = _prompts([9, 33], seed=1)
  params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16)
  results = Engine(model, ENGINE, eos_ids=NO_EOS).generate(prompts, params, seeds=[3, 4])
  for prompt, r in zip(prompts, results):
    logits = _forward_logits(model, prompt + r.tokens)[len(prompt) - 1:-1]
    for i, token in enumerate(r.tokens):
      model_lp = logits[i] - np.logaddexp.reduce(logits[i])
      np.testing.assert_allclose(r.model_logprobs[i], model_lp[token], atol=2e-5)
      sample_lp = _filtered_reference(logits[i], temperature, top_k, top_p)
      assert np.isfinite(sample_lp[token]), "sampled a token outside the filtered set"
      np.testing.assert_allclose(r.sample_logprobs[i], sample_lp[token], atol=2e-5)


@pytest.mark.parametrize("temperature,top_k,top_p,candidates", [
    (1.0, 0, 1.0, 8), (0.5, 3, 1.0, 8), (1.0, 0, 0.7, 8),
    (1.0, 0, 0.95, 2),  # nucleus larger than the candidates: the bisection path
    (1.0, 4, 0.6, 8)])
def test_sample_frequencies_follow_the_filtered_distribution(temperature, top_k, top_p,
                                                             candidates):
  rows = 20000
  logits = np.log(np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05], np.float32))
  expected = np.exp(_filtered_reference(logits.astype(np.float64), temperature, top_k, top_p))
  batch = lambda x, dtype: jnp.full((rows,), x, dtype)
  tokens, sample_lp, _ = jax.jit(sample, static_argnames="candidates")(
      jnp.tile(logits, (rows, 1)), batch(temperature, jnp.float32), batch(top_p, jnp.float32),
      batch(top_k, jnp.int32), jnp.arange(rows, dtype=jnp.uint32), batch(5, jnp.int32),
      min_p=batch(0.0, jnp.float32), repetition_penalty=batch(1.0, jnp.float32),
      seen=jnp.zeros((rows, len(logits)), bool), candidates=candidates)
  freq = np.bincount(np.asarray(tokens), minlength=len(logits)) / rows
  np.testing.assert_allclose(freq, expected, atol=0.012)
  np.testing.assert_allclose(np.asarray(sample_lp), np.log(expected[np.asarray(tokens)]),
                             atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,penalty", [
    (1.0, 0, 1.0, 0.3, 1.0), (0.7, 5, 1.0, 0.2, 1.5), (1.0, 0, 0.8, 0.1, 2.0),
    (1.3, 0, 1.0, 0.0, 3.0), (0.0, 0, 1.0, 0.5, 3.0)])
def test_penalty_and_min_p_sample_from_transformers_processed_scores(temperature, top_k, top_p,
                                                                    min_p, penalty):
  """Frequencies and sampling logprobs follow transformers' processed scores (greedy: their
  argmax); removed tokens are never drawn; model logprobs stay the unprocessed model's."""
  rows = 20000
  logits = np.log(np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05], np.float32)) + 2
  seen_ids = [0, 2, 5]  # two positive logits, one negative
  params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=penalty)
  scores = _transformers_scores(logits, seen_ids, params)
  seen = np.zeros((rows, len(logits)), bool)
  seen[:, seen_ids] = True
  batch = lambda x, dtype: jnp.full((rows,), x, dtype)
  tokens, sample_lp, model_lp = jax.jit(sample, static_argnames="candidates")(
      jnp.tile(logits, (rows, 1)), batch(temperature, jnp.float32), batch(top_p, jnp.float32),
      batch(top_k, jnp.int32), jnp.arange(rows, dtype=jnp.uint32), batch(5, jnp.int32),
      min_p=batch(min_p, jnp.float32), repetition_penalty=batch(penalty, jnp.float32),
      seen=jnp.asarray(seen), candidates=8)
  tokens = np.asarray(tokens)
  np.testing.assert_allclose(np.asarray(model_lp),
                             (logits - np.logaddexp.reduce(logits))[tokens], atol=1e-6)
  if temperature == 0:
    assert (tokens == scores.argmax()).all() and scores.argmax() != logits.argmax()
    return
  expected = np.exp(scores - np.logaddexp.reduce(scores))
  freq = np.bincount(tokens, minlength=len(logits)) / rows
  assert (freq[expected == 0] == 0).all()
  assert (expected == 0).any() == bool(top_k or top_p < 1 or min_p)
  np.testing.assert_allclose(freq, expected, atol=0.012)
  np.testing.assert_allclose(np.asarray(sample_lp), np.log(expected[tokens]), atol=1e-5)


def test_no_draw_picks_a_token_the_filters_removed():
  """At every u in (0, 1], u = 1 included (a uniform draw of exactly 0), the token drawn has
  positive probability, however the cumulative sums round: a Qwen-wide row whose few kept
  tokens lie anywhere in it, the last ones far from its end."""
  from sage_jax.sampler.sampling import _inverse_cdf  # noqa: PLC0415
  rng = np.random.default_rng(0)
  rows, vocab = 256, 151936
  probs = np.zeros((rows, vocab), np.float32)
  for row in probs:
    kept = rng.choice(vocab - 200, size=int(rng.integers(2, 300)), replace=False)
    row[kept] = rng.random(len(kept))
    row /= row.sum()
  draw = jax.jit(_inverse_cdf)
  for u in (np.ones(rows), rng.random(rows), 1 - rng.random(rows) * 1e-6):
    tokens = np.asarray(draw(jnp.asarray(probs), jnp.asarray(u, jnp.float32)))
    assert (probs[np.arange(rows), tokens] > 0).all()


def test_greedy_on_a_diverged_row_stays_in_the_vocabulary():
  logits = jnp.asarray([[0.0, 2.0, np.nan, 5.0, np.nan], [1.0, 3.0, 3.0, 0.0, -1.0]])
  tokens, _, _ = sample(logits, jnp.zeros(2), jnp.ones(2), jnp.zeros(2, jnp.int32),
                        jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32), min_p=jnp.zeros(2),
                        repetition_penalty=jnp.ones(2), seen=jnp.zeros(logits.shape, bool),
                        candidates=4)
  assert np.asarray(tokens).tolist() == np.asarray(jnp.argmax(logits, -1)).tolist() == [2, 1]


def test_a_tiny_temperature_samples_the_argmax_with_a_finite_logprob():
  """Near-greedy temperatures draw the most likely token with sampling logprob ~0, as the
  limit T -> 0 does, down to T = 1e-18 (logits / T far past float32's exact integers)."""
  rows, vocab = 4, 300
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)) * 3, jnp.float32)
  batch = lambda x, dtype: jnp.full((rows,), x, dtype)
  for temperature in (1e-6, 1e-10, 1e-14, 1e-18):
    tokens, sample_lp, _ = sample(
        logits, batch(temperature, jnp.float32), batch(1.0, jnp.float32), batch(0, jnp.int32),
        jnp.arange(rows, dtype=jnp.uint32), batch(3, jnp.int32), min_p=batch(0.0, jnp.float32),
        repetition_penalty=batch(1.0, jnp.float32), seen=jnp.zeros((rows, vocab), bool),
        candidates=8)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jnp.argmax(logits, -1)))
    np.testing.assert_allclose(np.asarray(sample_lp), 0.0, atol=1e-5)


def test_seeded_sampling_is_independent_of_slot_and_batch(model):
  a, b, c = _prompts([12, 30, 7], seed=2)
  params = SamplingParams(temperature=1.0, max_new_tokens=12)
  alone = Engine(model, ENGINE, eos_ids=NO_EOS).generate([a], params, seeds=[11])[0]
  crowd = Engine(model, ENGINE, eos_ids=NO_EOS).generate([b, c, a, a], params,
                                                          seeds=[1, 2, 11, 12])
  assert crowd[2].tokens == alone.tokens
  np.testing.assert_allclose(crowd[2].model_logprobs, alone.model_logprobs, atol=1e-6)
  assert crowd[3].tokens != alone.tokens  # Another seed, another sample.


# --- Multi-turn and continuous batching ---------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=1.3, max_new_tokens=20),
    SamplingParams(temperature=1.0, repetition_penalty=2.0, max_new_tokens=20),
    SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                   max_new_tokens=20),
    SamplingParams(temperature=1.2, min_p=0.2, max_new_tokens=20)])
def test_turns_sample_as_transformers_processes_the_whole_history(model, params):
  """Over two turns, the second after appended ids, every token follows transformers'
  processors given the whole history so far (prompt, sampled and appended ids)."""
  prompt, obs = _prompts([20, 9], seed=14)
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  seq = engine.start(prompt, params, seed=1)
  first = engine.run()[0]
  engine.append(seq, obs)
  second = engine.run()[0]
  _check_turn_against_transformers(model, prompt, first, params)
  _check_turn_against_transformers(model, prompt + first.tokens + obs, second, params)
  if params.repetition_penalty != 1:  # The penalty matters here.
    plain = dataclasses.replace(params, repetition_penalty=1.0)
    assert engine.generate([prompt], plain, seeds=[1])[0].tokens != first.tokens


def test_sequences_started_without_a_seed_sample_apart(model):
  """Two sequences of one prompt started without seeds sample different tokens (each is
  seeded with its id); a seed given again samples the same ones."""
  (prompt,) = _prompts([12], seed=16)
  params = SamplingParams(temperature=1.0, max_new_tokens=12)
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  first, second = engine.start(prompt, params), engine.start(prompt, params)
  turns = {t.seq_id: t.tokens for t in engine.run()}
  assert turns[first] != turns[second]
  again = engine.start(prompt, params, seed=second)
  assert engine.run()[0].tokens == turns[second]
  assert again != second


def test_a_sequence_taking_over_a_slot_holds_only_its_own_ids(model):
  """Sequences that take over slots (one-token prompts, a prompt prefilled over several steps
  while other slots decode) are penalised for their own ids only."""
  prompts = _prompts([40, 1, 12, 70, 1, 3, 75], seed=15)
  params = [SamplingParams(temperature=0.0 if i == 2 else 1.0, repetition_penalty=1.5,
                          max_new_tokens=n) for i, n in enumerate([12, 5, 20, 6, 9, 14, 3])]
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  results = engine.generate(prompts, params)
  assert engine.stats.prefill_calls > 8  # the last prompt came in chunks
  for prompt, sp, result in zip(prompts, params, results):
    _check_turn_against_transformers(model, prompt, result, sp)



def test_multi_turn_cache_reuse_equals_reprefill(model):
  """Six turns; each turn's tokens and logprobs equal a fresh start on the whole history,
  while only the new tokens are prefilled."""
  prompt, *observations = _prompts([30, 5, 40, 3, 12, 1], seed=3)
  params = SamplingParams(temperature=1.0, max_new_tokens=6)
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  seq = engine.start(prompt, params, seed=5)
  turns = [engine.run()[0]]
  for obs in observations:
    engine.append(seq, obs)
    turns.append(engine.run()[0])

  history, reprefilled = list(prompt), []
  for i, turn in enumerate(turns):
    fresh = engine.generate([history], params, seeds=[5])[0]
    assert fresh.tokens == turn.tokens
    np.testing.assert_allclose(fresh.model_logprobs, turn.model_logprobs, atol=1e-5)
    np.testing.assert_allclose(fresh.sample_logprobs, turn.sample_logprobs, atol=1e-5)
    assert turn.length == len(history) + len(turn.tokens)
    reprefilled.append(fresh.prefilled_tokens)
    history += turn.tokens + (observations[i] if i < len(observations) else [])
  # Reuse ingests the prompt, then each observation plus the last sampled token.
  assert [t.prefilled_tokens for t in turns] == [30] + [len(o) + 1 for o in observations]
  assert reprefilled == [30, 41, 87, 96, 114, 121]


def test_a_prompt_that_a_slot_holds_is_copied_not_prefilled(model):
  """A GRPO group: five sequences from one prompt (several prefill chunks long) and one other,
  on 4 slots. The group's later members copy the first one's cache rows, from a slot that still
  decodes or from one whose sequence was freed, and each sequence samples the tokens and both
  logprobs that it samples alone (the repetition penalty reads its presence row)."""
  prompt, other = _prompts([45, 20], seed=21)
  params = SamplingParams(temperature=1.0, repetition_penalty=1.5, max_new_tokens=10)
  prompts, seeds = [prompt, other, prompt, prompt, prompt, prompt], [1, 2, 3, 4, 5, 6]
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  results = engine.generate(prompts, params, seeds=seeds)
  assert engine.stats.prefill_copied_tokens == 4 * (len(prompt) - 1)
  assert engine.stats.prefill_tokens == len(prompt) - 1 + len(other) - 1
  for p, seed, result in zip(prompts, seeds, results):
    alone = Engine(model, ENGINE, eos_ids=NO_EOS).generate([p], params, seeds=[seed])[0]
    assert result.tokens == alone.tokens
    np.testing.assert_array_equal(result.model_logprobs, alone.model_logprobs)
    np.testing.assert_array_equal(result.sample_logprobs, alone.sample_logprobs)
    assert result.prefilled_tokens == len(p)


def test_a_short_prompt_that_a_slot_holds_whole_is_copied(model):
  """A whole prompt is copied however short (shorter than the smallest prefill chunk)."""
  (prompt,) = _prompts([5], seed=23)
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  first, second = engine.generate([prompt, prompt], GREEDY, seeds=[1, 2])
  assert engine.stats.prefill_copied_tokens == engine.stats.prefill_tokens == len(prompt) - 1
  assert first.tokens == second.tokens


def test_a_prompt_copies_the_longest_prefix_that_a_slot_holds(model):
  """Agent prompts share their system prompt: a first turn copies the longest prefix of its
  prompt that any slot holds (a decoding slot's, a freed one's), when it is at least the
  smallest prefill chunk, and prefills only the rest; each sequence samples the tokens and
  both logprobs that it samples alone (the repetition penalty reads its presence row)."""
  system, a, b, c = _prompts([40, 13, 30, 9], seed=22)
  assert b[0] != a[0] and c[0] != a[5] and c[0] != system[6]  # no longer shared prefixes
  prompts = [system + a, system + b, system + a[:5] + c, system[:6] + c, system + a + c]
  params = SamplingParams(temperature=1.0, repetition_penalty=1.5, max_new_tokens=10)
  seeds = [1, 2, 3, 4, 5]
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  results = engine.generate(prompts, params, seeds=seeds)
  # system (40); system + a[:5] (45); none (6 < 8, the smallest chunk); all of system + a
  # but its last token, which the first sequence held (52).
  copied = 40 + 45 + 52
  assert engine.stats.prefill_copied_tokens == copied
  assert engine.stats.prefill_tokens == sum(len(p) - 1 for p in prompts) - copied
  for p, seed, result in zip(prompts, seeds, results):
    alone = Engine(model, ENGINE, eos_ids=NO_EOS).generate([p], params, seeds=[seed])[0]
    assert result.tokens == alone.tokens
    np.testing.assert_allclose(result.model_logprobs, alone.model_logprobs, atol=1e-5)
    np.testing.assert_allclose(result.sample_logprobs, alone.sample_logprobs, atol=1e-5)
    assert result.prefilled_tokens == len(p)


def test_continuous_batching_beats_static_batching(model):
  prompts = _prompts([10, 4, 20, 8, 6, 15, 3, 9], seed=4)
  budgets = [30, 2, 3, 25, 2, 4, 3, 2]
  params = [SamplingParams(temperature=1.0, max_new_tokens=n) for n in budgets]

  continuous = Engine(model, ENGINE, eos_ids=NO_EOS)
  cont = continuous.generate(prompts, params)
  static = Engine(model, ENGINE, eos_ids=NO_EOS)  # Each batch waits for its slowest.
  stat = static.generate(prompts[:4], params[:4]) + static.generate(prompts[4:], params[4:],
                                                                    seeds=range(4, 8))
  for i in range(8):
    assert cont[i].tokens == stat[i].tokens and len(cont[i].tokens) == budgets[i]
  assert continuous.stats.decode_steps < static.stats.decode_steps
  assert continuous.stats.decode_steps <= 36  # ~ the longest sequence, in blocks of 4


# --- Stop conditions ------------------------------------------------------------------------


def _detok(ids):
  return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("penalty", [1.0, 3.0])
def test_stop_string_mid_block_then_append_continues_exactly(model, penalty):
  prompt, obs = _prompts([14, 6], seed=5)
  engine = Engine(model, ENGINE, eos_ids=NO_EOS, detokenize=_detok)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=20, repetition_penalty=penalty)
  free_run = engine.generate([prompt], greedy)[0].tokens
  cut = next(i for i in range(5, 19)  # ends mid-block: the block carries on past it
             if (i + 1) % 4 and _detok(free_run[i - 1:i + 1]) not in _detok(free_run[:i]))
  stop = _detok(free_run[cut - 1:cut + 1])  # spans two tokens, completes at index `cut`
  params = dataclasses.replace(greedy, stop_strings=("never", stop))
  seq = engine.start(prompt, params)
  turn = engine.run()[0]
  assert (turn.finish_reason, turn.tokens) == ("stop_string", free_run[:cut + 1])
  assert turn.decode_steps >= cut + 1 and turn.length == len(prompt) + cut + 1
  # The tokens generated after the stop string are gone from the sequence, from its presence
  # row too (the ids the block ingested past the cut, unless the sequence holds them).
  row = set(np.flatnonzero(np.asarray(engine._presence[engine._seqs[seq].slot])))
  held = set(prompt + turn.tokens)
  assert set(prompt + turn.tokens[:-1]) <= row <= held
  # Blocks of 4 steps: the one that sampled token `cut` ingested those up to index 4b + 2.
  assert set(free_run[cut + 1:4 * (cut // 4) + 3]) - held, "no id to take back here"
  engine.append(seq, obs)
  second = engine.run()[0]
  fresh = engine.generate([prompt + turn.tokens + obs], params)[0]
  assert second.tokens == fresh.tokens
  np.testing.assert_allclose(second.model_logprobs, fresh.model_logprobs, atol=1e-5)


def test_eos_ends_the_turn(model):
  (prompt,) = _prompts([11], seed=6)
  free_run = Engine(model, ENGINE, eos_ids=NO_EOS).generate([prompt], GREEDY)[0].tokens
  eos = free_run[6]
  first = free_run.index(eos)
  turn = Engine(model, ENGINE, eos_ids=(eos,)).generate([prompt], GREEDY)[0]
  assert (turn.finish_reason, turn.tokens) == ("eos", free_run[:first + 1])


def test_context_full_is_an_outcome_not_a_crash(model):
  prompt, obs = _prompts([10, 3], seed=7)
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  params = SamplingParams(temperature=0.0, max_new_tokens=50, max_context=15)
  seq = engine.start(prompt, params)
  turn = engine.run()[0]
  assert (turn.finish_reason, len(turn.tokens), turn.length) == ("context_full", 5, 15)
  engine.append(seq, obs)
  again = engine.run()[0]
  assert (again.finish_reason, again.tokens, again.prefilled_tokens) == ("context_full", [], 0)
  too_long = engine.start(_prompts([15])[0], params)
  assert engine.run()[0].finish_reason == "context_full"
  engine.append(too_long, obs)
  assert engine.run()[0].finish_reason == "context_full"
  engine.free(too_long)
  # The whole cache: a prompt of max_len - 1 tokens still gets one token.
  (last,) = engine.generate(_prompts([127]), SamplingParams(temperature=0, max_new_tokens=9))
  assert (last.finish_reason, len(last.tokens)) == ("context_full", 1)
  with pytest.raises(ValueError, match="max_context"):
    engine.start(prompt, SamplingParams(max_context=129))


def test_requests_are_checked(model):
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  with pytest.raises(ValueError, match="top_k"):
    engine.start([1, 2], SamplingParams(top_k=65))
  with pytest.raises(ValueError, match="detokenize"):
    engine.start([1, 2], SamplingParams(stop_strings=("x",)))
  with pytest.raises(ValueError, match="outside"):
    engine.start([1, CFG.vocab_size], GREEDY)
  with pytest.raises(ValueError, match="empty"):
    engine.start([], GREEDY)
  seq = engine.start([1, 2], GREEDY)
  with pytest.raises(ValueError, match="still in a turn"):
    engine.append(seq, [3])
  engine.free(seq)
  with pytest.raises(KeyError, match="unknown sequence"):
    engine.append(seq, [3])
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  for temperature in (-0.5, float("nan"), float("inf")):  # NaN would sample token 0 forever
    with pytest.raises(ValueError, match="temperature=.* must be a finite number >= 0"):
      SamplingParams(temperature=temperature)
  for min_p in (-0.1, 1.5, float("nan")):
    with pytest.raises(ValueError, match=r"min_p=.* must be in \[0, 1\]"):
      SamplingParams(min_p=min_p)
  for penalty in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="repetition_penalty=.* must be a finite number > 0"):
      SamplingParams(repetition_penalty=penalty)


# --- Compilation, parameters, async driver, sharding ---------------------------------------


def test_no_compilation_after_warmup(model):
  # A decode block length of its own, so that this warm-up certainly compiles something.
  config = dataclasses.replace(ENGINE, steps_per_call=3)
  engine = Engine(model, config, eos_ids=NO_EOS, detokenize=_detok)
  with CompileCounter() as warmup:
    engine.warmup()
  assert len(warmup.names) >= len(config.attend_buckets)
  prompts = _prompts([1, 3, 8, 9, 31, 33, 64, 100], seed=8)
  with CompileCounter() as compiles:
    engine.generate(prompts, SamplingParams(temperature=0.9, top_k=7, top_p=0.8,
                                            max_new_tokens=10))
    engine.generate(prompts[:3], SamplingParams(temperature=0.0, max_new_tokens=3,
                                                stop_strings=("<1>",)))
    engine.generate(prompts[2:5], SamplingParams(temperature=0.0, repetition_penalty=1.2,
                                                 max_new_tokens=5))
    engine.generate(prompts[:2], SamplingParams(temperature=1.0, min_p=0.1,
                                                repetition_penalty=1.2, max_new_tokens=5))
    seq = engine.start(prompts[4], GREEDY)
    engine.run()
    for obs in _prompts([2, 40, 5], seed=9):
      engine.append(seq, obs)
      engine.run()
  assert compiles.names == []


def test_update_params_switches_models_without_recompiling(model):
  prompts = _prompts([6, 21], seed=10)
  other = tiny_model(seed=1)
  expected = Engine(other, ENGINE, eos_ids=NO_EOS).generate(prompts, GREEDY)
  engine = Engine(model, ENGINE, eos_ids=NO_EOS)
  before = engine.generate(prompts, GREEDY)
  with CompileCounter() as compiles:
    engine.update_params(other)
    after = engine.generate(prompts, GREEDY)
  assert compiles.names == []
  assert [r.tokens for r in after] == [r.tokens for r in expected]
  assert [r.tokens for r in after] != [r.tokens for r in before]
  with pytest.raises(ValueError, match="do not match"):
    engine.update_params(init_model(CFG.replace(intermediate_size=64)))


def test_async_driver_overlaps_conversations(model):
  """Six 3-turn conversations on 4 slots, with environment delays, equal running each
  conversation alone."""
  starts = _prompts([12, 5, 30, 8, 17, 3], seed=11)
  observations = _prompts([4, 9, 2, 6, 3, 11], seed=12)
  params = SamplingParams(temperature=1.0, max_new_tokens=5)

  async def conversation(engine, i):
    turn = await engine.start(starts[i], params, seed=i)
    turns = [turn.tokens]
    for _ in range(2):
      await asyncio.sleep(0.01 * (i % 3))  # The environment.
      turn = await engine.append(turn.seq_id, observations[i], params)
      turns.append(turn.tokens)
    await engine.free(turn.seq_id)
    return turns

  async def all_conversations():
    async with AsyncEngine(Engine(model, ENGINE, eos_ids=NO_EOS)) as engine:
      results = await asyncio.gather(*(conversation(engine, i) for i in range(6)))
      with pytest.raises(KeyError, match="unknown sequence"):
        await engine.append(12345, [1])
      return results

  got = asyncio.run(all_conversations())
  alone = Engine(model, ENGINE, eos_ids=NO_EOS)
  for i in range(6):
    seq = alone.start(starts[i], params, seed=i)
    want = [alone.run()[0].tokens]
    for _ in range(2):
      alone.append(seq, observations[i], params)
      want.append(alone.run()[0].tokens)
    alone.free(seq)
    assert got[i] == want


def _block_until(condition):
  """Waits (blocking the event loop, if any) for the engine thread to make `condition` true."""
  deadline = time.monotonic() + 60
  while not condition():
    assert time.monotonic() < deadline
    time.sleep(0.002)


def test_cancelled_starts_and_freed_turns_release_their_slots(model):
  """A caller cancelled in `start` (a TaskGroup's sibling failed) never learns its sequence's
  id: the driver frees it, whether it waited for a slot, was decoding, or had just come back.
  Freeing a sequence cancels the caller of its turn in flight. One slot: a leak would leave
  every later start waiting for good."""
  engine = Engine(model, dataclasses.replace(ENGINE, num_slots=1), eos_ids=NO_EOS)
  prompt = _prompts([5], seed=14)[0]
  short = SamplingParams(temperature=1.0, max_new_tokens=2)
  long = SamplingParams(temperature=1.0, max_new_tokens=100)

  async def one_turn(driver):  # only possible if the slot is free
    turn = await asyncio.wait_for(driver.start(prompt, short), 30)
    await driver.free(turn.seq_id)

  async def cancelled(driver, task):
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
      await task
    await one_turn(driver)
    assert (engine._seqs, engine._slots, driver._pending) == ({}, [None], {})

  async def scenarios():
    async with AsyncEngine(engine) as driver:
      await one_turn(driver)  # compiles what the turns below run
      held = await driver.start(prompt, short)  # idle, in the slot
      waiting = asyncio.create_task(driver.start(prompt, long))
      await asyncio.sleep(0)
      _block_until(lambda: engine._waiting)
      waiting.cancel()
      with pytest.raises(asyncio.CancelledError):
        await waiting
      await driver.free(held.seq_id)
      await one_turn(driver)
      assert (engine._seqs, engine._slots, driver._pending) == ({}, [None], {})

      decoding = asyncio.create_task(driver.start(prompt, long))
      await asyncio.sleep(0)
      _block_until(lambda: any(s.phase == "decode" for s in list(engine._seqs.values())))
      await cancelled(driver, decoding)

      for result_set in (False, True):  # the turn is back, not yet handed to its caller
        back = asyncio.create_task(driver.start(prompt, short))
        await asyncio.sleep(0)
        _block_until(lambda: any(s.phase == "idle" for s in list(engine._seqs.values()))
                    and not driver._pending)
        time.sleep(0.1)  # the thread hands the turn to the loop
        if result_set:  # the turn reaches its future: the task still wakes up cancelled
          await asyncio.sleep(0)
        await cancelled(driver, back)

      turn = await driver.start(prompt, short)
      appending = asyncio.create_task(driver.append(turn.seq_id, prompt, long))
      await asyncio.sleep(0)
      _block_until(lambda: engine._seqs[turn.seq_id].phase == "decode")
      await driver.free(turn.seq_id)
      with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(appending, 30)
      await one_turn(driver)
      assert (engine._seqs, engine._slots, driver._pending) == ({}, [None], {})

  asyncio.run(scenarios())


def test_a_turn_whose_event_loop_closed_leaves_the_engine_usable(model):
  """The trainer runs each step's rollouts under their own `asyncio.run`, on one engine: a
  step that raised leaves turns in flight whose loop is gone. The engine thread frees such a
  first turn's sequence (nobody learns its id), and lets the next step use the slots."""
  engine = Engine(model, dataclasses.replace(ENGINE, num_slots=2), eos_ids=NO_EOS)
  prompt = _prompts([5], seed=15)[0]
  long = SamplingParams(temperature=1.0, max_new_tokens=100)

  async def failing_step(driver):
    owned = await driver.start(prompt, SamplingParams(max_new_tokens=2))
    asyncio.create_task(driver.append(owned.seq_id, prompt, long))
    asyncio.create_task(driver.start(prompt, long))
    await asyncio.sleep(0)
    _block_until(lambda: sum(s.phase == "decode" for s in list(engine._seqs.values())) == 2)
    return owned.seq_id  # asyncio.run cancels both turns' callers and closes the loop

  async def next_step(driver, owned):
    await driver.free(owned)
    turn = await asyncio.wait_for(driver.start(prompt, long), 30)
    await driver.free(turn.seq_id)

  driver = AsyncEngine(engine)
  try:
    owned = asyncio.run(failing_step(driver))
    _block_until(lambda: not driver._pending)  # the turns ended, or the cancelled start's
    time.sleep(0.1)  # was freed; the thread is done handing them back
    asyncio.run(next_step(driver, owned))
  finally:
    driver.close()
  assert (engine._seqs, engine._slots, driver._pending) == ({}, [None, None], {})


def test_sharded_engine_matches_single_device(model):
  assert jax.device_count() == 8, "conftest sets 8 simulated CPU devices"
  mesh = shd.make_mesh(shd.MeshConfig(data=4, fsdp=1, tensor=2))
  prompts = _prompts([5, 40, 17, 9, 2], seed=13)
  prompts.append(prompts[1])  # copied from the slot that holds it, on another device
  # Some penalised: presence rows are sharded with the cache's.
  params = [dataclasses.replace(GREEDY, repetition_penalty=1.0 + i % 2) for i in range(6)]
  single = Engine(model, ENGINE, eos_ids=NO_EOS).generate(prompts, params)
  sharded_engine = Engine(model, ENGINE, eos_ids=NO_EOS, mesh=mesh)
  sharded = sharded_engine.generate(prompts, params)
  assert sharded_engine.stats.prefill_copied_tokens == len(prompts[1]) - 1
  spec = sharded_engine._cache.k[0].sharding.spec
  assert tuple(spec)[:3] == ("data", None, "tensor")
  assert tuple(sharded_engine._presence.sharding.spec)[:1] == ("data",)
  for a, b in zip(single, sharded):
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, atol=1e-5)


def test_generate_command_prints_the_completion(tmp_path):
  import subprocess
  import sys

  from sage_jax import tokenizer as tokenizer_lib
  from sage_jax.weights import hf
  from sage_jax.model.config import get_preset
  model = init_model(get_preset("tiny"), seed=3)
  hf.save_hf(model, str(tmp_path / "tiny"),
             tokenizer_dir=tokenizer_lib.ensure_qwen25_tokenizer_dir())
  tok = tokenizer_lib.Tokenizer()
  ids = tok.encode("def add(a, b):")
  (want,) = Engine(model, EngineConfig(num_slots=1, max_len=32, prefill_buckets=(8,),
                                       min_attend=32), eos_ids=(tok.eos_id, tok.pad_id)
                   ).generate([ids], SamplingParams(temperature=0.0, max_new_tokens=6))
  out = subprocess.run(
      [sys.executable, "-m", "sage_jax.generate", f"--model={tmp_path / 'tiny'}",
       "--prompt=def add(a, b):", "--nochat", "--max_new_tokens=6", "--temperature=0"],
      capture_output=True, text=True, timeout=300, check=True)
  assert out.stdout == tok.decode(want.tokens) + "\n"


def test_a_model_configured_for_remat_samples_like_one_without(model):
  """Remat applies to training only; sampling under a cache runs the plain layers."""
  rematted = tiny_model()
  rematted.config = rematted.config.replace(remat="full")
  prompts = _prompts([5, 9])
  outputs = []
  for m in (model, rematted):
    engine = Engine(m, ENGINE, eos_ids=NO_EOS)
    outputs.append([r.tokens for r in engine.generate(prompts, GREEDY)])
  assert outputs[0] == outputs[1]
