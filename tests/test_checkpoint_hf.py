"""HF safetensors import/export: round trips, transformers reload, and bad input."""

import json
import os
import warnings

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

import jax.numpy as jnp

from sage_jax.model.config import Qwen2Config, get_preset
from sage_jax.weights import hf, loader
from tests.hf_reference import hf_logits, tiny_hf_model


def _flat(model):
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _logits(model, tokens):
  out, _ = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
  return np.asarray(out)


@pytest.mark.parametrize("tied", [True, False])
def test_export_reloads_in_transformers_with_same_logits(tmp_path, tied):
  tiny_hf_model(str(tmp_path / "src"), tied=tied)
  model = hf.load_hf(str(tmp_path / "src"))
  # Small shards so the index and multi-file path is exercised.
  files = hf.save_hf(model, str(tmp_path / "out"), max_shard_bytes=100_000)
  assert len(files) > 1
  index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
  assert set(index["weight_map"].values()) == set(files)
  assert ("lm_head.weight" in index["weight_map"]) == (not tied)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no missing / unexpected weight warnings
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), attn_implementation="eager",
        output_loading_info=True)
  reloaded, info = reloaded
  assert not any(info.values()), info
  assert reloaded.config.tie_word_embeddings == tied
  tokens = np.random.RandomState(0).randint(0, 512, (2, 16))
  np.testing.assert_allclose(hf_logits(reloaded, tokens), _logits(model, tokens), atol=1e-4)


def test_a_tied_config_with_a_head_of_its_own_loads_untied_as_transformers_does(tmp_path):
  """Training that untied the head may leave tie_word_embeddings true beside an lm_head.weight
  of other values: transformers then uses that head, and so does the loader (and its export
  says untied); a stored head equal to the embeddings keeps the model tied."""
  tiny_hf_model(str(tmp_path / "src"), tied=True)
  weights = tmp_path / "src" / "model.safetensors"
  embed = load_file(str(weights))["model.embed_tokens.weight"]
  _rewrite(weights, lambda t: t.update({"lm_head.weight": embed.copy()}))
  assert hf.load_hf(str(tmp_path / "src")).config.tie_word_embeddings
  other = embed + 0.05 * np.random.RandomState(1).standard_normal(embed.shape).astype(embed.dtype)
  _rewrite(weights, lambda t: t.update({"lm_head.weight": other}))
  model = hf.load_hf(str(tmp_path / "src"))
  assert not model.config.tie_word_embeddings
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "src"), attn_implementation="eager")
  np.testing.assert_array_equal(reference.lm_head.weight.detach().numpy(), other)
  tokens = np.random.RandomState(0).randint(0, 512, (2, 16))
  np.testing.assert_allclose(hf_logits(reference, tokens), _logits(model, tokens), atol=1e-4)
  hf.save_hf(model, str(tmp_path / "out"))
  assert not json.load(open(tmp_path / "out" / "config.json"))["tie_word_embeddings"]


def test_a_preset_pointed_at_weights_loads_them_if_they_have_its_shapes(tmp_path):
  """A model section with both: spec's weights, checked against the preset's architecture
  before they load; the plan reads the preset alone (no checkpoint needed at hand)."""
  tiny_hf_model(str(tmp_path / "src"), vocab=151936, tied=True)  # the "tiny" preset's shapes
  both = loader.ModelSpec(spec=str(tmp_path / "src"), preset="tiny")
  loaded, reference = _flat(loader.build_model(both)), _flat(hf.load_hf(str(tmp_path / "src")))
  assert loaded.keys() == reference.keys()
  for path, value in reference.items():
    np.testing.assert_array_equal(loaded[path], value)
  assert loader.architecture(both) == get_preset("tiny")
  with pytest.raises(ValueError, match=r"does not have the architecture of "
                                       r"model.preset='tiny-untied': tie_word_embeddings=True "
                                       r"\(the preset's: False\)"):
    loader.build_model(loader.ModelSpec(spec=str(tmp_path / "src"), preset="tiny-untied"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_import_export_import_is_bit_exact(tmp_path, dtype):
  tiny_hf_model(str(tmp_path / "src"), dtype=dtype, tied=False)
  first = hf.load_hf(str(tmp_path / "src"))
  assert first.config.param_dtype == str(dtype).removeprefix("torch.")
  hf.save_hf(first, str(tmp_path / "out"))
  second = hf.load_hf(str(tmp_path / "out"))
  a, b = _flat(first), _flat(second)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k
  # And the exported bytes equal the source file's tensors.
  src = load_file(str(tmp_path / "src" / "model.safetensors"))
  out = {}
  for f in os.listdir(tmp_path / "out"):
    if f.endswith(".safetensors"):
      out.update(load_file(str(tmp_path / "out" / f)))
  assert src.keys() == out.keys()
  for k in src:
    assert np.array_equal(src[k].view(np.uint8), out[k].view(np.uint8)), k


@pytest.fixture
def src(tmp_path):
  d = tmp_path / "src"
  tiny_hf_model(str(d), tied=False)
  hf.save_hf(hf.load_hf(str(d)), str(tmp_path / "sharded"), max_shard_bytes=100_000)
  return tmp_path


def _rewrite(path, edit):
  tensors = load_file(str(path))
  edit(tensors)
  save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_shard_names_the_file(src):
  d = src / "sharded"
  victim = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[1]
  os.remove(d / victim)
  with pytest.raises(hf.CheckpointError, match=victim):
    hf.load_hf(str(d))


def test_wrong_shape_names_file_and_tensor(src):
  f = src / "src" / "model.safetensors"
  name = "model.layers.1.mlp.up_proj.weight"
  _rewrite(f, lambda t: t.__setitem__(name, t[name][:-1]))
  with pytest.raises(hf.CheckpointError, match=rf"model.safetensors.*{name}.*shape"):
    hf.load_hf(str(src / "src"))


def test_integer_weights_are_refused_not_cast(src):
  f = src / "src" / "model.safetensors"
  name = "model.layers.0.self_attn.q_proj.weight"
  _rewrite(f, lambda t: t.__setitem__(name, t[name].astype(np.int32)))
  with pytest.raises(hf.CheckpointError, match=rf"{name}' is int32, expected floating-point"):
    hf.load_hf(str(src / "src"))


def test_a_tensor_without_a_numpy_type_is_named(src):
  """An 8-bit float tensor (an FP8 release's weights) has no numpy type to read it as."""
  from safetensors import torch as st_torch  # noqa: PLC0415
  path = str(src / "src" / "model.safetensors")
  name = "model.layers.0.mlp.down_proj.weight"
  tensors = st_torch.load_file(path)
  tensors[name] = tensors[name].to(torch.float8_e4m3fn)
  st_torch.save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=rf"model.safetensors: tensor '{name}' \(F8_E4M3\) "
                     "cannot be read as an array .*expected floating-point weights"):
    hf.load_hf(str(src / "src"))


def test_unknown_tensor_names_it(src):
  f = src / "src" / "model.safetensors"
  _rewrite(f, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32)))
  with pytest.raises(hf.CheckpointError, match="unknown tensor 'model.layers.0.mlp.extra.weight'"):
    hf.load_hf(str(src / "src"))


def test_config_not_matching_weights(src):
  cfg_path = src / "src" / "config.json"
  cfg = json.load(open(cfg_path))
  cfg["num_hidden_layers"] = 3
  json.dump(cfg, open(cfg_path, "w"))
  with pytest.raises(hf.CheckpointError, match=r"src lacks .*model.layers.2"):
    hf.load_hf(str(src / "src"))
  cfg["num_hidden_layers"] = 1
  json.dump(cfg, open(cfg_path, "w"))
  with pytest.raises(hf.CheckpointError, match="model.safetensors.*model.layers.1.*does not fit"):
    hf.load_hf(str(src / "src"))


def test_index_listing_absent_tensor(src):
  d = src / "sharded"
  index = json.load(open(d / "model.safetensors.index.json"))
  index["weight_map"]["model.layers.0.mlp.ghost.weight"] = index["weight_map"]["model.norm.weight"]
  json.dump(index, open(d / "model.safetensors.index.json", "w"))
  with pytest.raises(hf.CheckpointError, match="ghost"):
    hf.load_hf(str(d))


def test_export_is_atomic(src, monkeypatch):
  model = hf.load_hf(str(src / "src"))
  out = src / "out"
  hf.save_hf(model, str(out))
  before = sorted(os.listdir(out))

  def broken(*a, **k):
    raise OSError("disk full")

  monkeypatch.setattr(hf, "save_file", broken)
  with pytest.raises(OSError):
    hf.save_hf(model, str(out))
  assert sorted(os.listdir(out)) == before  # the previous export is untouched


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_damaged_safetensors_names_the_file(src, damage):
  d = src / "sharded"
  victim = d / sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[1]
  data = victim.read_bytes()
  victim.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
  with pytest.raises(hf.CheckpointError, match=f"{victim}: not a readable safetensors file"):
    hf.load_hf(str(d))


def _edit_config(model_dir, **changes):
  path = model_dir / "config.json"
  json.dump({**json.load(open(path)), **changes}, open(path, "w"))


@pytest.mark.parametrize("field,value,problem", [
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     r"rope_scaling=.*'yarn'.*default RoPE only.*remove rope_scaling from config.json and set "
     r"max_position_embeddings to 32768"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
     r"rope_parameters=.*'linear'.*default RoPE only.*rope_type 'default' and rope_theta"),
    ("use_sliding_window", True,
     r"use_sliding_window=True with a window of 4 tokens on layers \[1\]: .*full attention "
     r"only. Set use_sliding_window to false"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_parameters=.*'yarn'.*default RoPE only"),  # one set per layer type
    ("hidden_act", "gelu", r"hidden_act='gelu': .*'silu' only"),
    ("attention_dropout", 0.1, r"attention_dropout=0.1: .*no dropout"),
    ("quantization_config", {"quant_method": "awq", "bits": 4},
     r"quantization_config \(quant_method='awq'\): .*quantised.*full-precision release"),
])
def test_settings_the_model_does_not_implement_are_refused(src, field, value, problem):
  if field == "use_sliding_window":  # a window from layer 1 on (transformers' reading)
    _edit_config(src / "src", layer_types=None, max_window_layers=1, sliding_window=4)
  _edit_config(src / "src", **{field: value})
  with pytest.raises(hf.CheckpointError, match=rf"src/config.json: {problem}"):
    hf.load_hf(str(src / "src"))


@pytest.mark.parametrize("window", [
    {"max_window_layers": 28, "layer_types": None},  # Qwen2.5 3B-72B: no layer from 28 on
    {"max_window_layers": 0, "sliding_window": None, "layer_types": None},  # no window size
    {"max_window_layers": 0, "layer_types": ["full_attention"] * 2},  # transformers 5's list
])
def test_a_sliding_window_flag_that_windows_no_layer_loads(src, window):
  """As transformers reads it: with use_sliding_window on, the window applies only to the
  layers layer_types marks, or else to those from max_window_layers on."""
  expected = _flat(hf.load_hf(str(src / "src")))
  assert json.load(open(src / "src" / "config.json"))["num_hidden_layers"] == 2
  _edit_config(src / "src", **{"use_sliding_window": True, "sliding_window": 4, **window})
  loaded = _flat(hf.load_hf(str(src / "src")))
  assert loaded.keys() == expected.keys()
  for path, value in expected.items():
    np.testing.assert_array_equal(loaded[path], value)


# Sliding-window settings of a 2-layer model, each read by transformers and by the loader.
WINDOW_SETTINGS = [
    {"use_sliding_window": True, "sliding_window": None},  # null: no window
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    {"use_sliding_window": True, "max_window_layers": 1},  # absent: transformers' 4096
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 8,
     "layer_types": ["full_attention", "sliding_attention"]},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
     "layer_types": ["full_attention"] * 2},
    # Layers marked sliding without a window: transformers builds the model, then cannot run it.
    {"use_sliding_window": False, "sliding_window": 8,
     "layer_types": ["full_attention", "sliding_attention"]},
    {"use_sliding_window": True, "sliding_window": None,
     "layer_types": ["sliding_attention"] * 2},
]


@pytest.mark.parametrize("window", WINDOW_SETTINGS)
def test_sliding_window_settings_are_read_as_transformers_reads_them(window):
  """The config loads exactly where transformers runs every layer with full attention; a
  window on some layer is refused naming the layers and the window transformers uses."""
  shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
  theirs = transformers.Qwen2Config(**shape, **window)
  sliding = [i for i, kind in enumerate(theirs.layer_types) if kind == "sliding_attention"]
  ours = {"model_type": "qwen2", **shape, **window}
  if not sliding:
    assert Qwen2Config.from_hf(ours).num_hidden_layers == 2
  elif theirs.sliding_window is not None:
    with pytest.raises(hf.CheckpointError, match=rf"window of {theirs.sliding_window} tokens on "
                                                 rf"layers \[{', '.join(map(str, sliding))}\]"):
      Qwen2Config.from_hf(ours)
  else:
    model = transformers.Qwen2ForCausalLM(theirs).eval()
    with pytest.raises(TypeError), torch.no_grad():
      model(torch.zeros((1, 4), dtype=torch.long))
    with pytest.raises(hf.CheckpointError, match=rf"layer_types marks layers "
                                                 rf"\[{', '.join(map(str, sliding))}\] "
                                                 "'sliding_attention' without a window"):
      Qwen2Config.from_hf(ours)


@pytest.mark.parametrize("rope_scaling", [None, {"type": "default"}, {"rope_type": "default"}])
def test_default_rope_scaling_loads(src, rope_scaling):
  expected = _flat(hf.load_hf(str(src / "src")))
  _edit_config(src / "src", rope_scaling=rope_scaling)
  assert _flat(hf.load_hf(str(src / "src"))).keys() == expected.keys()


def test_null_settings_read_as_unset_as_transformers_reads_them(src):
  """`"num_key_value_heads": null` is multi-head attention (transformers' reading); a null
  size the model cannot do without is named."""
  heads = json.load(open(src / "src" / "config.json"))["num_attention_heads"]
  _edit_config(src / "src", num_key_value_heads=None, rms_norm_eps=None)
  cfg = Qwen2Config.from_hf(str(src / "src"))
  assert (cfg.num_key_value_heads, cfg.rms_norm_eps) == (heads, 1e-6)
  _edit_config(src / "src", hidden_size=None)
  with pytest.raises(hf.CheckpointError, match=r"missing \(or null\) keys \['hidden_size'\]"):
    hf.load_hf(str(src / "src"))


@pytest.mark.parametrize("damage,problem", [
    ("no_config", r"src/config.json: not found"),
    ("no_weight_map", r"sharded/model.safetensors.index.json: no weight_map"),
    ("bad_index_json", r"sharded/model.safetensors.index.json: not valid JSON"),
])
def test_bad_checkpoint_files_raise_checkpoint_error(src, damage, problem):
  d = src / ("src" if damage == "no_config" else "sharded")
  if damage == "no_config":
    os.remove(d / "config.json")
  else:
    (d / "model.safetensors.index.json").write_text(
        '{"metadata": {}}' if damage == "no_weight_map" else '{"weight_map": {')
  with pytest.raises(hf.CheckpointError, match=problem):
    hf.load_hf(str(d))


def test_config_json_states_the_dtype_under_both_names(src):
  hf.save_hf(hf.load_hf(str(src / "src")), str(src / "out"), dtype="bfloat16")
  config = json.load(open(src / "out" / "config.json"))
  assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_generation_config_stops_at_both_turn_ends_and_keeps_the_sources_values(src):
  """The source's values but its token ids, which name tokens of a vocabulary (its
  tokenizer's) that is not exported: the ids are those of the tokenizer exported."""
  _edit_config(src / "src", bos_token_id=151643, eos_token_id=151643)  # a base model's
  values = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "repetition_penalty": 1.05, "max_new_tokens": 512, "transformers_version": "4.37.0"}
  json.dump({**values, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 4},
            open(src / "src" / "generation_config.json", "w"))
  hf.save_hf(hf.load_hf(str(src / "src")), str(src / "out"), source_dir=str(src / "src"))
  assert json.load(open(src / "out" / "generation_config.json")) == {
      "bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
      **values}
  assert json.load(open(src / "out" / "config.json"))["eos_token_id"] == 151643


def test_null_special_token_ids_stay_null_through_import_and_export(src):
  """transformers 5 writes null bos/eos ids for a config built without them, and reads an
  absent one as null: an export keeps them so, not Qwen2.5's ids, which lie outside a small
  vocabulary (transformers warns about those)."""
  source = json.load(open(src / "src" / "config.json"))
  assert (source["bos_token_id"], source["eos_token_id"]) == (None, None)
  hf.save_hf(hf.load_hf(str(src / "src")), str(src / "out"))
  for directory in ("src", "out"):
    config = transformers.AutoConfig.from_pretrained(str(src / directory))
    assert (config.bos_token_id, config.eos_token_id) == (None, None), directory
  del source["bos_token_id"], source["eos_token_id"]
  cfg = Qwen2Config.from_hf(source)
  assert (cfg.bos_token_id, cfg.eos_token_id) == (None, None)
  generation = json.load(open(src / "out" / "generation_config.json"))
  assert "bos_token_id" not in generation and None not in generation["eos_token_id"]


def test_compact_vocabulary_exports_its_own_token_ids(tmp_path):
  from sage_jax import compact_tokenizer  # noqa: PLC0415
  from sage_jax.tokenizer import Tokenizer  # noqa: PLC0415
  from sage_jax.weights import loader  # noqa: PLC0415

  tok_dir = str(compact_tokenizer.write_compact_tokenizer(tmp_path / "tokenizer",
                                                          texts=["def f(x): return x"]))
  tok = Tokenizer(tok_dir)
  model = loader.build_model(loader.ModelSpec(preset="tiny", vocabulary="compact"),
                             vocab_size=tok.vocab_size)
  hf.save_hf(model, str(tmp_path / "out"), tokenizer_dir=tok_dir)
  config = json.load(open(tmp_path / "out" / "config.json"))
  generation = json.load(open(tmp_path / "out" / "generation_config.json"))
  assert config["vocab_size"] == tok.vocab_size
  assert (config["bos_token_id"], config["eos_token_id"]) == (tok.endoftext, tok.im_end)
  assert generation == {"bos_token_id": tok.endoftext, "eos_token_id": [tok.im_end, tok.endoftext],
                        "pad_token_id": tok.endoftext}
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.im_end, tok.endoftext)
