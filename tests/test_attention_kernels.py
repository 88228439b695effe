"""Training attention kernels against the XLA path on CPU.

Splash attention runs here in Pallas interpret mode (the TPU kernel's own code, interpreted),
forward and backward. cuDNN cannot run without an NVIDIA GPU: on CPU the test runs the very
`jax.nn.dot_product_attention` call the cuDNN path makes with implementation="xla", which
checks its masks and layouts but not the cuDNN kernel itself; on a GPU the model with the
cuDNN kernel is checked against the XLA path, forward and backward.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.model import attention_kernels as ak
from sage_jax.model import get_preset, init_model

CFG = get_preset("tiny").replace(vocab_size=64)


def _rows(t=200):
  """Two rows: one packed with three sequences and padding (segment 0), one whole."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (2, t)))
  seg = np.ones((2, t), np.int32)
  seg[0, 70:150], seg[0, 150:190], seg[0, 190:] = 2, 3, 0
  pos = np.concatenate([np.arange(70), np.arange(80), np.arange(40), np.zeros(t - 190, int)])
  positions = jnp.asarray(np.stack([pos, np.arange(t)]))
  return tokens, positions, jnp.asarray(seg)


def _loss_and_grads(model, tokens, positions, segments):
  from flax import nnx  # noqa: PLC0415

  def loss(m):
    logits, _ = m(tokens, positions, segment_ids=segments)
    return jnp.sum(jnp.where(segments[..., None] > 0, logits, 0.0) ** 2) * 1e-3, logits

  (value, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return value, logits, grads


def test_splash_in_interpret_mode_equals_xla_forward_and_backward():
  tokens, positions, segments = _rows()
  ref = _loss_and_grads(init_model(CFG.replace(attention_impl="xla")), tokens, positions,
                        segments)
  out = _loss_and_grads(init_model(CFG.replace(attention_impl="splash")), tokens, positions,
                        segments)
  valid = np.asarray(segments)[..., None] > 0
  np.testing.assert_allclose(np.where(valid, out[1], 0), np.where(valid, ref[1], 0),
                             atol=2e-5)
  for a, b in zip(jax.tree.leaves(out[2]), jax.tree.leaves(ref[2])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def test_cudnn_call_with_xla_equals_the_model_path():
  rng = np.random.default_rng(1)
  b, t, kv, g, d = 2, 40, 2, 3, 16
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((b, t, kv, g, d), (b, t, kv, d), (b, t, kv, d)))
  seg = jnp.asarray(np.repeat([[1, 2], [1, 1]], [25, 15], axis=1).astype(np.int32))
  out = ak._cudnn(q, k, v, seg, implementation="xla")
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * d ** -0.5
  allowed = jnp.tril(jnp.ones((t, t), bool)) & (seg[:, :, None] == seg[:, None, :])
  probs = jax.nn.softmax(jnp.where(allowed[:, None, None], scores, -1e30), -1)
  np.testing.assert_allclose(np.asarray(out),
                             np.asarray(jnp.einsum("bkgts,bskd->btkgd", probs, v)), atol=1e-5)


def test_auto_picks_by_platform_and_cudnn_falls_back_where_it_does_not_apply():
  assert ak.resolve("auto", "gpu") == "cudnn" and ak.resolve("auto", "tpu") == "splash"
  assert ak.resolve("auto", "cpu") == "xla" and ak.resolve("splash", "cpu") == "splash"
  assert ak.cudnn_unsupported(jnp.bfloat16, 128) is None
  assert "float16 or bfloat16" in ak.cudnn_unsupported(jnp.float32, 64)
  assert "head_dim" in ak.cudnn_unsupported(jnp.bfloat16, 256)
  assert ak.kernel_for("auto", jnp.float32, 64) == "xla"  # on CPU, and on GPU for float32
  with pytest.raises(ValueError, match="attention_impl='cudnn'.*float32"):
    ak.kernel_for("cudnn", jnp.float32, 64)
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    CFG.replace(attention_impl="flash")


def test_splash_under_a_mesh_runs_per_shard_and_equals_xla():
  from sage_jax import sharding as shd  # noqa: PLC0415

  mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
  tokens, positions, segments = _rows()
  tokens, positions, segments = (jnp.tile(x, (2, 1)) for x in (tokens, positions, segments))
  outs = []
  for impl in ("xla", "splash"):
    model = shd.create_sharded(lambda: init_model(CFG.replace(attention_impl=impl)), mesh)
    with shd.use_rules(mesh):
      logits = jax.jit(lambda t, p, s: model(t, p, segment_ids=s)[0])(tokens, positions,
                                                                       segments)
    outs.append(np.asarray(logits))
  valid = np.asarray(segments)[..., None] > 0
  np.testing.assert_allclose(np.where(valid, outs[1], 0), np.where(valid, outs[0], 0),
                             atol=2e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs an NVIDIA GPU")
def test_cudnn_kernel_on_gpu_equals_xla_forward_and_backward():
  """bfloat16 through cuDNN against bfloat16 through XLA, each against float32 XLA: cuDNN's
  error must be of the same size as XLA's own bfloat16 error (the row is long enough for
  several kernel tiles, packed with padding)."""
  from flax import nnx  # noqa: PLC0415

  cfg = CFG.replace(vocab_size=64, head_dim=64)
  tokens, positions, segments = _rows(t=320)
  results = {}
  for name, impl, dtype in (("ref", "xla", "float32"), ("xla", "xla", "bfloat16"),
                            ("cudnn", "cudnn", "bfloat16")):
    model = init_model(cfg.replace(attention_impl=impl, dtype=dtype))
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, t, p, s: _loss_and_grads(nnx.merge(graphdef, st), t, p, s))
    if impl == "cudnn":
      targets = set(re.findall(r"__cudnn\$fmha\w*", fn.lower(state, tokens, positions,
                                                            segments).as_text()))
      assert any(t.endswith("Backward") for t in targets) and len(targets) >= 2, (
          f"the cuDNN path did not lower to cuDNN's fused attention, forward and backward: "
          f"{targets}")
    results[name] = fn(state, tokens, positions, segments)
  valid = np.asarray(segments)[..., None] > 0

  def error(name):
    logits = np.where(valid, np.asarray(results[name][1], np.float32), 0)
    ref_logits = np.where(valid, np.asarray(results["ref"][1], np.float32), 0)
    grads = [np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
             / (np.linalg.norm(np.asarray(b, np.float32)) + 1e-12)
             for a, b in zip(jax.tree.leaves(results[name][2]),
                             jax.tree.leaves(results["ref"][2]))]
    return np.abs(logits - ref_logits).max(), max(grads)

  (xla_logits, xla_grads), (cudnn_logits, cudnn_grads) = error("xla"), error("cudnn")
  assert cudnn_logits <= 2 * xla_logits + 1e-3, (cudnn_logits, xla_logits)
  assert cudnn_grads <= 2 * xla_grads + 1e-3, (cudnn_grads, xla_grads)
