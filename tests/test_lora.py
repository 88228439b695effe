"""LoRA adapters: a fresh adapter changes nothing, merging equals running unmerged, and a GRPO
step (single device and sharded over 8) trains the adapters only, with the base bit-identical
and optimiser moments for the adapters alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from sage_jax import sharding as shd
from sage_jax.model import get_preset, init_model
from sage_jax.model import fused_projections, lora
from sage_jax.rl import batch as B
from sage_jax.rl import grpo
from sage_jax.train import optimizer as opt
from sage_jax.train import rl_loop
from sage_jax.train.state import split_trainable
from sage_jax.train.step import Trainer

VOCAB = 64
CFG = get_preset("tiny").replace(vocab_size=VOCAB)
LORA = lora.LoraConfig(rank=4, alpha=8.0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 9)))
POSITIONS = jnp.broadcast_to(jnp.arange(9), (2, 9))


def _randomise_b(model, seed=1):
  """B starts at zero; give it values so the adapters do something."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, lora.LoraParam)):
    if path[-1] == "b":
      var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.05, jnp.float32))


def _merged(model):
  """The model's parameters with its adapters merged in (those of the model without them)."""
  return lora.fold_adapters(nnx.state(model, nnx.Param), model.config.lora.scale)


def _adapted(seed=0, targets=lora.PROJECTIONS, cfg=CFG):
  return lora.add_adapters(init_model(cfg, seed=seed), lora.LoraConfig(4, 8.0, targets))


def test_fresh_adapters_change_nothing_and_count_rank_times_in_plus_out():
  base, _ = init_model(CFG, seed=0)(TOKENS, POSITIONS)
  model = _adapted()
  out, _ = model(TOKENS, POSITIONS)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(base))
  e, i, q, kv = CFG.hidden_size, CFG.intermediate_size, 4 * 16, 2 * 16
  per_layer = LORA.rank * (2 * (e + q) + 2 * (e + kv) + 3 * (e + i))  # q, o; k, v; MLP
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, lora.LoraParam)))
  assert count == per_layer * CFG.num_hidden_layers
  assert model.config.lora == LORA


def test_targets_pick_projections():
  model = _adapted(targets=("q_proj", "down_proj"))
  attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
  assert attn.q_proj.lora is not None and mlp.down_proj.lora is not None
  assert attn.k_proj.lora is None and mlp.up_proj.lora is None and attn.o_proj.lora is None


def test_merged_state_equals_unmerged_forward():
  model = _adapted()
  _randomise_b(model)
  unmerged, _ = model(TOKENS, POSITIONS)
  base, _ = init_model(CFG, seed=0)(TOKENS, POSITIONS)
  assert np.abs(np.asarray(unmerged) - np.asarray(base)).max() > 0.1
  plain = init_model(CFG, seed=5)
  nnx.update(plain, _merged(model))
  merged, _ = plain(TOKENS, POSITIONS)
  np.testing.assert_allclose(np.asarray(merged), np.asarray(unmerged), atol=2e-5, rtol=1e-5)


def test_bad_configs_are_named():
  with pytest.raises(ValueError, match="rank"):
    lora.LoraConfig(rank=-1)
  with pytest.raises(ValueError, match="targets"):
    lora.LoraConfig(rank=4, targets=("qkv",))
  with pytest.raises(ValueError, match="already has"):
    lora.add_adapters(_adapted(), LORA)


def _records(n, seed=0):
  rng = np.random.default_rng(seed)
  recs = []
  for _ in range(n):
    length = int(rng.integers(6, 16))
    mask = (rng.random(length) < 0.7).astype(np.int8)
    mask[0] = 0
    lp = np.where(mask, rng.normal(size=length) * 0.3 - 4.2, 0).astype(np.float32)
    recs.append(dict(tokens=rng.integers(0, VOCAB, length), loss_mask=mask, model_logprobs=lp,
                     sampler_logprobs=lp, advantage=float(rng.normal())))
  return recs


def _flat(state):
  return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


@pytest.fixture
def no_compilation_cache():
  """This step's 8-device executable, read back from JAX's persistent compilation cache,
  deadlocks in XLA:CPU's all-reduce rendezvous (devices wait in different all-reduces);
  compiled afresh it runs. The cache stays on for every other test."""
  # JAX decides once per process whether the cache is used: reset that decision both ways.
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", True)
  compilation_cache.reset_cache()


@pytest.mark.parametrize("sharded", [False, True], ids=["1-device", "8-devices"])
def test_grpo_step_moves_only_the_adapters(sharded, no_compilation_cache):
  # The frozen base in bfloat16, the adapters in float32.
  model = _adapted(cfg=CFG.replace(param_dtype="bfloat16"))
  _randomise_b(model)
  mesh = None
  if sharded:
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
    shd.place(model, mesh)
  before = _flat(nnx.state(model))
  optim = opt.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.01)
  trainer = Trainer(model, grpo.make_loss_fn(grpo.GRPOConfig()), optim, mesh=mesh)
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(16,),
                      row_multiple=4)
  for seed in range(2):
    metrics = trainer.step(B.make_batch(_records(8, seed), cfg)[0])
    assert float(metrics["grad_norm"]) > 0
  after = _flat(trainer.params)
  assert after.keys() == before.keys()
  moved = {p for p in after if not np.array_equal(after[p], before[p])}
  adapters = {p for p in after if "lora" in p}
  assert moved == adapters and len(adapters) == 2 * 7 * CFG.num_hidden_layers
  assert {after[p].dtype for p in adapters} == {np.dtype(np.float32)}
  assert after[("layers", 0, "mlp", "up_proj", "kernel")].dtype == jnp.bfloat16
  moments = jax.tree.leaves(trainer.state.opt_state)
  adapter_numbers = sum(after[p].size for p in adapters)
  # mu and nu for the adapters, plus scalar counters; nothing for the base.
  assert sum(x.size for x in moments) - adapter_numbers * 2 < 8


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_a_lora_step_under_remat_is_the_step_without_it(remat):
  """The real-size LoRA presets rematerialise every layer (qwen2.5-32b-lora): the adapters'
  gradients flow through the rematerialised layers, the frozen base stays where it was."""
  cfg = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2, length_buckets=(16,),
                      row_multiple=4)
  batch = B.make_batch(_records(8, 0), cfg)[0]
  params = []
  for mode in ("none", remat):
    model = _adapted(cfg=CFG.replace(remat=mode))
    _randomise_b(model)
    trainer = Trainer(model, grpo.make_loss_fn(grpo.GRPOConfig()),
                      opt.OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
    assert float(trainer.step(batch)["grad_norm"]) > 0
    params.append(_flat(trainer.params))
  plain, rematted = params
  for path, value in plain.items():
    np.testing.assert_allclose(rematted[path], value, rtol=1e-5, atol=1e-6, err_msg=str(path))


def _two_kl_updates(make_reference):
  """Two GRPO updates with KL of a fresh adapted model against `make_reference(params)`:
  (trainer, reference, params before, the updates' KL, the arrays of the state before:
  its frozen base, and the rest)."""
  config = grpo.GRPOConfig(kl_coef=0.1)
  batch_config = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=2,
                               length_buckets=(16,), row_multiple=4)
  model = _adapted(cfg=CFG.replace(param_dtype="bfloat16"))
  _randomise_b(model)
  trainer = rl_loop.grpo_trainer(
      model, config, opt.OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
  # Of a copy: an array on the CPU keeps the NumPy view it gave, which it cannot be donated with.
  before = _flat(jax.tree.map(jnp.copy, trainer.params))
  reference = make_reference(trainer.params)
  trainable, base = split_trainable(trainer.params)
  arrays = jax.tree.leaves(base), jax.tree.leaves(trainer.state.replace(params=trainable))
  kls = [rl_loop.grpo_update(trainer, _records(8, seed), config, batch_config,
                             reference_params=reference)["kl"] for seed in range(2)]
  return trainer, reference, before, kls, arrays


def test_the_kl_reference_shares_the_frozen_base_and_gives_the_kl_of_a_full_copy():
  """Only the adapters change in training, so the KL reference copies them alone and shares
  the frozen base with the trainer: a step donates what it updates (adapters, moments) and
  only reads the base, which stays the very same arrays. The KL is that of a full copy."""
  trainer, reference, before, kls, (base_before, updated) = _two_kl_updates(rl_loop.frozen_copy)
  assert all(x.is_deleted() for x in updated)
  ref_adapters, ref_base = split_trainable(reference)
  ref_base, base = jax.tree.leaves(ref_base), jax.tree.leaves(split_trainable(trainer.params)[1])
  assert len(ref_base) == len(base) == len(base_before) > 0
  assert all(r is b is b0 and not r.is_deleted()
             for r, b, b0 in zip(ref_base, base, base_before))
  # The reference holds the parameters the updates started from; only its adapters differ
  # from the trainer's now.
  assert all(np.array_equal(v, before[p]) for p, v in _flat(reference).items())
  moved = {p for p, v in _flat(trainer.params).items() if not np.array_equal(v, before[p])}
  assert moved == set(_flat(ref_adapters)) == {p for p in before if "lora" in p}
  _, _, _, full_kls, _ = _two_kl_updates(lambda params: jax.tree.map(jnp.copy, params))
  assert kls[1] > 0 and kls == full_kls


def test_model_section_adds_adapters_on_the_mesh_and_names_bad_keys():
  from sage_jax.weights import loader  # noqa: PLC0415

  mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
  spec = loader.ModelSpec(preset="tiny", lora_rank=8, lora_alpha=16.0,
                          lora_targets=("q_proj", "up_proj"))
  model = loader.build_model(spec, mesh=mesh)
  assert model.config.lora == lora.LoraConfig(8, 16.0, ("q_proj", "up_proj"))
  b = model.layers[1].mlp.up_proj.lora.b[...]
  assert b.shape == (CFG.intermediate_size, 8) and len(b.sharding.device_set) == 8
  assert model.layers[1].mlp.down_proj.lora is None
  with pytest.raises(ValueError, match="targets"):
    loader.ModelSpec(preset="tiny", lora_rank=8, lora_targets=("mlp",))
  # The keys a user types are named; adapter settings without a rank are not ignored.
  with pytest.raises(ValueError, match=r"lora_rank=-2; expected 0 \(off\)"):
    loader.ModelSpec(preset="tiny", lora_rank=-2)
  for settings in ({"lora_alpha": 64.0}, {"lora_targets": ("q_proj",)}):
    with pytest.raises(ValueError, match="with lora_rank=0, which adds no adapters"):
      loader.ModelSpec(preset="tiny", **settings)


def test_sampler_runs_unmerged_adapters_like_the_merged_model():
  from sage_jax.sampler import Engine, EngineConfig, SamplingParams  # noqa: PLC0415

  def scaled(model):  # larger weights, so greedy outputs depend on the context
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 10 if x.ndim > 1 else x, state))

  adapted = lora.add_adapters(scaled(init_model(CFG, seed=0)), LORA)
  _randomise_b(adapted)
  plain = init_model(CFG, seed=5)
  nnx.update(plain, _merged(adapted))
  engine_config = EngineConfig(num_slots=2, max_len=64, prefill_buckets=(8, 32), min_attend=32,
                               steps_per_call=4, max_top_k=16)
  prompts = [list(range(1, 12)), [5, 9, 2]]
  greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
  got = Engine(adapted, engine_config, eos_ids=()).generate(prompts, greedy)
  want = Engine(plain, engine_config, eos_ids=()).generate(prompts, greedy)
  for g, w in zip(got, want):
    assert g.tokens == w.tokens
    np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, atol=1e-4)


def test_a_sampling_copy_holds_the_adapters_merged_and_a_shared_one_keeps_them():
  from sage_jax import multihost  # noqa: PLC0415
  from sage_jax.sampler import Engine, EngineConfig, SamplingParams  # noqa: PLC0415

  adapted = lora.add_adapters(init_model(CFG, seed=0), LORA)
  graphdef, state = nnx.split(adapted)  # larger weights: greedy outputs depend on the context
  adapted = nnx.merge(graphdef, jax.tree.map(lambda x: x * 10 if x.ndim > 1 else x, state))
  _randomise_b(adapted)
  # Same dtype, sharding and process: the sampler shares the arrays, adapters unmerged and
  # projections separate.
  adapted = shd.place(adapted, multihost.WeightSync(adapted).mesh)
  shared = multihost.WeightSync(adapted)
  model = shared.sampling_model(adapted)
  assert not shared.folds_adapters and not shared.fuses
  assert model.layers[0].self_attn.q_proj.lora is not None
  assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)),
                                    jax.tree.leaves(nnx.state(adapted))))
  # merge_lora="always" makes a merged copy there too (fused, as every copy is by default);
  # so does fuse_projections="always"; merge_lora="never" keeps a copy's adapters.
  for always in (multihost.SamplerMeshConfig(merge_lora="always"),
                 multihost.SamplerMeshConfig(fuse_projections="always")):
    copying = multihost.WeightSync(adapted, always)
    assert copying.folds_adapters and copying.fuses, always
  never = multihost.WeightSync(adapted, multihost.SamplerMeshConfig(param_dtype="bfloat16",
                                                                    merge_lora="never"))
  model = never.sampling_model(adapted)
  assert not never.folds_adapters and model.layers[0].self_attn.q_proj.lora is not None
  assert model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
  # A bfloat16 copy holds the merged kernels (summed in float32, rounded once), no adapters,
  # and the projections fused.
  bf16 = multihost.SamplerMeshConfig(param_dtype="bfloat16")
  copying = multihost.WeightSync(adapted, bf16)
  model = copying.sampling_model(adapted)
  assert copying.folds_adapters and not jax.tree.leaves(nnx.state(model, lora.LoraParam))
  assert copying.fuses and model.config.fused_projections

  def merged_bf16():
    plain = init_model(CFG, seed=5)
    nnx.update(plain, jax.tree.map(lambda x: x.astype(jnp.bfloat16), _merged(adapted)))
    return plain

  merged = fused_projections.fuse(nnx.state(merged_bf16()), CFG)
  for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model)),
                                    nnx.to_flat_state(merged)):
    assert got.get_value().dtype == jnp.bfloat16, path
    np.testing.assert_allclose(np.asarray(got.get_value(), np.float32),
                               np.asarray(want.get_value(), np.float32), rtol=2 ** -8,
                               err_msg=str(path))
  # The engine samples from it, and a weight sync after an update carries the new adapters.
  engine_config = EngineConfig(num_slots=2, max_len=64, prefill_buckets=(8, 32), min_attend=32,
                               steps_per_call=4, max_top_k=16)
  prompts = [list(range(1, 12)), [5, 9, 2]]
  greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
  engine = Engine(model, engine_config, eos_ids=())
  for _ in range(2):
    got = engine.generate(prompts, greedy)
    want = Engine(merged_bf16(), engine_config, eos_ids=()).generate(prompts, greedy)
    for g, w in zip(got, want):
      assert g.tokens == w.tokens
      np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, atol=0.05)
    _randomise_b(adapted, seed=2)
    engine.update_params(copying(nnx.state(adapted)))


def test_a_copy_resharded_from_the_training_mesh_holds_the_adapters_merged():
  from sage_jax import multihost  # noqa: PLC0415
  from sage_jax.weights import loader  # noqa: PLC0415

  mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
  adapted = loader.build_model(loader.ModelSpec(preset="tiny", lora_rank=4, lora_alpha=8.0),
                               mesh=mesh)
  _randomise_b(adapted)
  sync = multihost.WeightSync(adapted, multihost.SamplerMeshConfig(tensor=2))
  assert sync.folds_adapters and sync.fuses
  model = sync.sampling_model(adapted)
  kernel = model.layers[0].mlp.gate_up_proj.kernel[...]
  assert kernel.sharding.mesh.devices.tolist() == sync.mesh.devices.tolist()
  # Tensor parallelism splits the fused kernels as it splits the separate ones: MLP columns,
  # and whole KV-head groups (each with its query heads).
  assert kernel.sharding.spec[:2] == (None, "tensor")
  assert model.layers[0].self_attn.qkv_proj.kernel[...].sharding.spec[0] == "tensor"
  out, _ = model(TOKENS, POSITIONS)
  want, _ = adapted(TOKENS, POSITIONS)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=1e-5)
