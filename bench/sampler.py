r"""Sampler benchmarks on the real Qwen2.5-Coder-0.5B-Instruct; prints JSON.

  python bench/sampler.py [--model=HF_DIR | --model=random:PRESET] [--batches=1,8] [--out=FILE]

On CPU everything runs in float32; on a GPU our engine samples from its bfloat16 copy (what
the sampler keeps there, `--param_dtype=auto`) and transformers runs on the GPU in bfloat16.
`--model=random:qwen2.5-0.5b` times a randomly initialised preset instead (decode time does
not depend on the weights' values; where the real checkpoint cannot be brought).

1. decode: tokens/s of our engine, transformers `generate` (torch CPU) and google-tunix
   (when importable, see bench/requirements.txt), same prompts, batch, prompt and new-token
   lengths, greedy, interleaved round by round in one process. Decode time of a system is
   t(N new tokens) - t(1 new token), so prefill and per-call overhead cancel out the same
   way for all three. EOS is disabled so that every system decodes exactly N tokens.
2. multiturn: a scripted agent conversation of --turns turns; prefilled tokens and wall
   time with cache reuse (`append`) vs re-prefilling the whole history every turn (our
   engine, and tunix, which has no other way), and whether both give the same tokens.
3. bound: the memory-bandwidth bound of decode, bytes read per step over the read bandwidth
   (the best read-only stream probed before every round, since it drifts; the copy
   bandwidth beside it), against our time per step in that round; and the time of the
   step's weight matrix-vector products alone (XLA's kernel, nothing else of the step),
   against both.
"""

from __future__ import annotations

import os

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ.get("SAGE_JAX_CACHE", os.path.expanduser("~/.cache/sage_jax")),
                 "jax_compile_cache"))

import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from sage_jax import assets  # noqa: E402
from sage_jax import multihost  # noqa: E402
from sage_jax import tokenizer as tokenizer_lib  # noqa: E402
from sage_jax.model import qwen2  # noqa: E402
from sage_jax.model.config import Qwen2Config  # noqa: E402
from sage_jax.sampler import Engine, EngineConfig, SamplingParams  # noqa: E402
from sage_jax.weights import gguf_import, hf  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "HF checkpoint directory, or random:PRESET (a "
                             "randomly initialised preset); default: the bundled real "
                             "Qwen2.5-Coder-0.5B-Instruct, converted once and cached.")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "auto", multihost.SAMPLING_DTYPES,
                                 "Dtype of our engine's weights, as `sampler_mesh.param_dtype` "
                                 "(auto: bfloat16 on accelerators, float32 on CPU).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "Batch sizes for the decode benchmark.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "New tokens per sequence.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds per system (median reported).")
_TURNS = flags.DEFINE_integer("turns", 6, "Turns of the multi-turn benchmark.")
_TURN_TOKENS = flags.DEFINE_integer("turn_tokens", 48, "Most new tokens per turn.")
_TUNIX_PATH = flags.DEFINE_string(
    "tunix_path", str(assets.cache_root() / "bench" / "tunix_site"),
    "Extra import path holding google-tunix (pip install --no-deps --target=PATH "
    "-r bench/requirements.txt); ignored when missing.")
_SYSTEMS = flags.DEFINE_list("systems", ["ours", "transformers", "tunix"],
                             "Systems to run: ours, ours_bf16 (our engine on bfloat16 weights), "
                             "transformers, tunix.")
_MULTITURN = flags.DEFINE_bool("multiturn", True, "Run the multi-turn benchmark.")
_OUT = flags.DEFINE_string("out", None, "Also write the JSON here.")

SOURCE_TEXT_FILES = ("README.md", "DESIGN.md", "sage_jax/sampler/engine.py")
SYSTEM_PROMPT = (
    "You are a coding agent that completes tasks in AppWorld by writing Python. Each reply "
    "holds one code block that calls `apis.<app>.<api>(...)`. Define reusable functions "
    "(skills) with parameters instead of hard-coded values, call them, and print what you "
    "need to see. The environment runs your code and shows you its output. When the task is "
    "done, call apis.supervisor.complete_task(answer=...). Available apps: spotify, venmo, "
    "gmail, phone, file_system, simple_note, todoist, splitwise, amazon.")
OBSERVATIONS = (
    "Output:\n```\n[{'name': 'show_playlist_library', 'description': 'Search or show a list "
    "of playlists of this user.'}, {'name': 'show_playlist', 'description': 'Get detailed "
    "information about a specific playlist.'}, {'name': 'show_song', 'description': 'Get "
    "details of a specific song.'}]\n```",
    "Output:\n```\n{'access_token': 'eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.c3BvdGlmeQ', "
    "'token_type': 'Bearer'}\n```",
    "Output:\n```\n[{'playlist_id': 31, 'title': 'Morning Run', 'song_ids': [12, 45, 7, 88]},"
    " {'playlist_id': 32, 'title': 'Focus', 'song_ids': [3, 9, 41]}, {'playlist_id': 40, "
    "'title': 'Road Trip 2023', 'song_ids': [5, 6, 71, 72, 90, 13]}]\n```",
    "Execution failed. Traceback:\n  File \"<cell>\", line 4, in get_longest\n    song = "
    "apis.spotify.show_song(song_id=s)\nTypeError: show_song() missing 1 required keyword "
    "argument: 'access_token'",
    "Output:\n```\n{'song_id': 71, 'title': 'Highway Lights', 'duration': 412, 'artist': "
    "'The Late Shift', 'play_count': 1893}\n```",
    "Output:\n```\nSkill saved: get_longest_song(playlist_title, access_token)\n```",
)
TASK = ("Find the longest song in my Spotify playlist 'Road Trip 2023' and tell me its "
        "title. My Spotify password is in the supervisor's account passwords.")


def _median(xs):
  return statistics.median(xs)


# --- Machine ------------------------------------------------------------------------------


class Bandwidth:
  """Memory bandwidth in GB/s over 1 GiB buffers: `copy` (bytes read plus written, as STREAM
  counts them: numpy's on CPU, an XLA copy in device memory on accelerators) and `read` (a
  read-only stream, as a decode step's weights are: the best of an XLA sum, an XLA
  matrix-vector product over the buffer as 4096-wide rows, and on CPU also numpy sums over
  the host buffer's shares on `threads` threads and BLAS's matrix-vector product; which one
  reads fastest differs between CPUs, BENCHMARKS.md). On CPU a copy counts
  more bytes than cores can read: its stores bypass the caches, so they do not compete with
  the reads for each core's outstanding misses (BENCHMARKS.md). Both drift by 30% or more
  within minutes on a shared machine, so the decode benchmark probes them before every
  round."""

  def __init__(self, gib: float = 1.0):
    import jax.numpy as jnp
    n = int(gib * (1 << 30)) // 4
    self.on_host = jax.default_backend() == "cpu"
    if self.on_host:
      self.src, self.dst = np.ones(n, np.float32), np.empty(n, np.float32)
    self.device = jnp.ones(n, jnp.float32)
    self.sum = jax.jit(lambda x: x.sum())
    self.sum(self.device).block_until_ready()
    self.plus_one = jax.jit(lambda x: x + 1)
    self.plus_one(self.device).block_until_ready()
    self.rows_times_ones = jax.jit(lambda x: x.reshape(-1, 4096) @ jnp.ones(4096, x.dtype))
    self.rows_times_ones(self.device).block_until_ready()

  def copy(self, threads: int, repeats: int = 3) -> float:
    if not self.on_host:
      return self._best_gb_s(self.plus_one, 2 * self.device.nbytes, repeats)
    return self._host_gb_s(lambda a, b: np.copyto(self.dst[a:b], self.src[a:b]),
                           2 * self.src.nbytes, threads, repeats)

  def read(self, threads: int, repeats: int = 3) -> float:
    best = max(self._best_gb_s(fn, self.device.nbytes, repeats)
               for fn in (self.sum, self.rows_times_ones))
    if self.on_host:
      best = max(best, self._host_gb_s(lambda a, b: self.src[a:b].sum(), self.src.nbytes,
                                       threads, repeats))
      rows, ones = self.src.reshape(-1, 4096), np.ones(4096, np.float32)
      best = max(best, self._host_gb_s(lambda a, b: rows @ ones, self.src.nbytes, 1, repeats))
    return best

  def _host_gb_s(self, part, nbytes: int, threads: int, repeats: int) -> float:
    """The best GB/s of `repeats` passes of `part(start, stop)` over the host buffer's
    `threads` shares, one thread each (numpy releases the GIL), moving `nbytes` a pass."""
    n = self.src.size
    bounds = [(p[0], p[-1] + 1) for p in np.array_split(np.arange(n), threads)]
    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      for _ in range(repeats):
        start = time.perf_counter()
        list(pool.map(lambda b: part(*b), bounds))
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best

  def _best_gb_s(self, fn, nbytes: int, repeats: int) -> float:
    """The best GB/s of `repeats` calls of the jitted `fn` on the device buffer, moving
    `nbytes` each."""
    best = 0.0
    for _ in range(repeats):
      start = time.perf_counter()
      fn(self.device).block_until_ready()
      best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def machine_info() -> dict:
  return {
      "cpu_count": os.cpu_count(), "platform": platform.platform(),
      "load_average": os.getloadavg(), "jax": jax.__version__,
      "devices": [str(d) for d in jax.devices()],
  }


# --- Prompts ------------------------------------------------------------------------------


def bench_prompts(tok: tokenizer_lib.Tokenizer, count: int, length: int) -> list[list[int]]:
  """`count` distinct `length`-token windows of repository text that survive a decode ->
  encode round trip, so that string-based samplers see exactly the same ids."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ids = []
  for name in SOURCE_TEXT_FILES:
    path = os.path.join(root, name)
    if os.path.exists(path):
      with open(path) as f:
        ids += tok.encode(f.read())
  prompts, start = [], 0
  while len(prompts) < count and start + length <= len(ids):
    window = ids[start:start + length]
    if tok.encode(tok.decode(window)) == window:
      prompts.append(window)
      start += 3 * length
    else:
      start += 1
  if len(prompts) < count:
    raise RuntimeError(f"found only {len(prompts)} round-trip-stable prompts of {length} tokens")
  return prompts


# --- Systems ------------------------------------------------------------------------------


class Ours:
  """Our engine on the sampler's copy of the weights (`--param_dtype`); it computes in
  bfloat16 on accelerators (as the GPU and TPU configs' `model.dtype`), else in the
  checkpoint's dtype."""

  name = "ours"

  def __init__(self, model_dir: str, param_dtype: str | None = None):
    compute = None if jax.default_backend() == "cpu" else "bfloat16"
    model = hf.load_hf(model_dir, dtype=compute)
    self.model = multihost.WeightSync(model, multihost.SamplerMeshConfig(
        param_dtype=param_dtype or _PARAM_DTYPE.value)).sampling_model(model)
    self.engines = {}

  def setup(self, batch: int, max_len: int, prompt_len: int):
    config = EngineConfig(num_slots=batch, max_len=max_len, prefill_buckets=(prompt_len,),
                          min_attend=max_len)
    engine = Engine(self.model, config, eos_ids=())
    start = time.perf_counter()
    engine.warmup()
    self.engines[batch] = engine
    return time.perf_counter() - start

  def generate(self, prompts, new_tokens):
    engine = self.engines[len(prompts)]
    results = engine.generate(prompts, SamplingParams(temperature=0.0,
                                                      max_new_tokens=new_tokens))
    return [r.tokens for r in results]


class OursBfloat16(Ours):
  """Our engine on a bfloat16 copy of the weights, as the sampler keeps with
  `sampler_mesh.param_dtype="bfloat16"`: half the bytes per decode step."""

  name = "ours_bf16"

  def __init__(self, model_dir: str):
    super().__init__(model_dir, param_dtype="bfloat16")


class Transformers:
  """transformers' `generate`: float32 on CPU, bfloat16 on a CUDA GPU."""

  name = "transformers"

  def __init__(self, model_dir: str):
    import torch
    import transformers
    self.torch = torch
    self.device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype).to(self.device).eval()
    self.model.generation_config.eos_token_id = None  # Decode exactly N tokens.

  def setup(self, batch, max_len, prompt_len):
    return 0.0

  def generate(self, prompts, new_tokens):
    ids = self.torch.tensor(prompts, device=self.device)
    with self.torch.no_grad():
      out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()  # .tolist() waits for the device


class Tunix:
  name = "tunix"

  def __init__(self, model_dir: str):
    import jax.numpy as jnp
    import transformers
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.qwen2 import model as tunix_model
    from tunix.models.qwen2 import params as tunix_params
    self.sampler_lib = tunix_sampler
    # The same model as ours: tunix's 0.5B preset ties the output layer to the embeddings,
    # while this checkpoint has its own (the GGUF quantises it separately).
    tied = Qwen2Config.from_hf(model_dir).tie_word_embeddings
    cfg = dataclasses.replace(tunix_model.ModelConfig.qwen2p5_0p5b(), dtype=jnp.float32,
                              param_dtype=jnp.float32, use_tied_embedding=tied)
    self.model = tunix_params.create_model_from_safe_tensors(model_dir, cfg, mesh=None,
                                                             dtype=jnp.float32)
    self.hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    self.samplers = {}

  def setup(self, batch, max_len, prompt_len):
    self.samplers[batch] = (self.sampler_lib.Sampler(
        self.model, self.hf_tok, self.sampler_lib.CacheConfig(max_len, 24, 2, 64)), prompt_len)
    return 0.0

  def generate(self, prompts, new_tokens):
    sampler, prompt_len = self.samplers[len(prompts)]
    out = sampler([self.hf_tok.decode(p) for p in prompts], max_generation_steps=new_tokens,
                  max_prompt_length=prompt_len, temperature=0.0, eos_tokens=[-1])
    return [list(map(int, t))[:new_tokens] for t in out.tokens]


def load_systems(model_dir: str) -> tuple[list, dict]:
  systems, skipped = [], {}
  for name in _SYSTEMS.value:
    if name == "tunix" and os.path.isdir(_TUNIX_PATH.value):
      sys.path.append(_TUNIX_PATH.value)
    try:
      systems.append({"ours": Ours, "ours_bf16": OursBfloat16, "transformers": Transformers,
                      "tunix": Tunix}[name](model_dir))
    except ImportError as error:
      skipped[name] = f"not importable: {error}"
  return systems, skipped


# --- Benchmarks ---------------------------------------------------------------------------


def decode_benchmark(systems, prompts_all, batch: int, probe=None) -> dict:
  """`probe()`, when given, runs before every round; its results are listed per round."""
  prompts = prompts_all[:batch]
  n, p = _NEW_TOKENS.value, _PROMPT_LEN.value
  max_len = 1 << (p + n - 1).bit_length()
  setup = {s.name: s.setup(batch, max_len, p) for s in systems}
  outputs = {}
  for s in systems:  # Untimed: compiles and caches.
    outputs[s.name] = s.generate(prompts, n)
    s.generate(prompts, 1)
  rounds = {s.name: [] for s in systems}
  probes = []
  for _ in range(_ROUNDS.value):
    if probe is not None:
      probes.append(probe())
    for s in systems:
      start = time.perf_counter()
      s.generate(prompts, n)
      full = time.perf_counter() - start
      start = time.perf_counter()
      s.generate(prompts, 1)
      one = time.perf_counter() - start
      rounds[s.name].append(batch * (n - 1) / (full - one))
  tok_s = {name: _median(r) for name, r in rounds.items()}
  result = {
      "batch": batch, "prompt_len": p, "new_tokens": n,
      "decode_tok_s": tok_s, "rounds_tok_s": rounds, "probes": probes, "warmup_s": setup,
      "ms_per_step": {name: 1000 * batch / t for name, t in tok_s.items()},
      "greedy_equal_to_ours": {
          name: out == outputs["ours"] for name, out in outputs.items() if name != "ours"},
  }
  if "ours" in tok_s:
    result["ours_over"] = {name: tok_s["ours"] / t for name, t in tok_s.items()
                           if name != "ours"}
  return result


def multiturn_benchmark(systems, tok) -> dict:
  """Scripted agent conversation: cache reuse (append) vs re-prefill each turn."""
  ours = next(s for s in systems if s.name == "ours")
  config = EngineConfig(num_slots=1, max_len=2048, prefill_buckets=(64, 256), min_attend=256)
  engine = Engine(ours.model, config, eos_ids=(tok.eos_id, tok.pad_id))
  sampling = SamplingParams(temperature=0.0, max_new_tokens=_TURN_TOKENS.value)

  def reuse():
    conversation = tokenizer_lib.Conversation(tok, SYSTEM_PROMPT)
    conversation.add_user(TASK)
    seq = engine.start(conversation.start_assistant(), sampling)
    turns = []
    for i in range(_TURNS.value):
      (turn,) = engine.run()
      turns.append(turn)
      if i + 1 < _TURNS.value:
        conversation.add_assistant_tokens(turn.tokens)
        conversation.end_assistant()
        conversation.add_tool(OBSERVATIONS[i % len(OBSERVATIONS)])
        ids = conversation.start_assistant()
        engine.append(seq, ids[turn.length:])
    engine.free(seq)
    return turns, conversation

  # The baseline on an engine of its own: the reuse runs leave their first prompt in the slot,
  # which an engine copies instead of prefilling again.
  baseline = Engine(ours.model, config, eos_ids=(tok.eos_id, tok.pad_id))

  def reprefill(histories):
    return [baseline.generate([h], sampling)[0] for h in histories]

  start = time.perf_counter()
  engine.warmup()
  warmup_s = time.perf_counter() - start
  baseline.warmup()  # the same programs: nothing compiles again
  reuse()  # Untimed once more: host-side first-call costs.
  start = time.perf_counter()
  turns, conversation = reuse()
  reuse_s = time.perf_counter() - start
  # The history before each turn, as the re-prefill baseline sees it.
  histories, ids = [], conversation.ids
  for t in turns:
    histories.append(ids[:t.length - len(t.tokens)])
  start = time.perf_counter()
  fresh = reprefill(histories)
  reprefill_s = time.perf_counter() - start
  result = {
      "turns": len(turns), "final_length": turns[-1].length,
      "generated_tokens": [len(t.tokens) for t in turns],
      "reuse": {"prefilled_tokens": [t.prefilled_tokens for t in turns],
                "prefilled_total": sum(t.prefilled_tokens for t in turns),
                "wall_s": reuse_s},
      "reprefill": {"prefilled_tokens": [t.prefilled_tokens for t in fresh],
                    "prefilled_total": sum(t.prefilled_tokens for t in fresh),
                    "wall_s": reprefill_s},
      "same_tokens": [a.tokens == b.tokens for a, b in zip(turns, fresh)],
      "max_model_logprob_diff": max(
          float(np.abs(a.model_logprobs - b.model_logprobs).max(initial=0))
          for a, b in zip(turns, fresh)),
      "warmup_s": warmup_s,
  }
  result["prefill_ratio"] = (result["reuse"]["prefilled_total"]
                             / result["reprefill"]["prefilled_total"])
  result["speedup"] = reprefill_s / reuse_s
  tunix = next((s for s in systems if s.name == "tunix"), None)
  if tunix is not None:
    longest = max(len(h) for h in histories)
    tunix.setup(1, 2048, 1 << (longest - 1).bit_length())
    run = lambda: [tunix.generate([h], _TURN_TOKENS.value) for h in histories]
    run()  # Untimed: compiles.
    start = time.perf_counter()
    run()
    result["tunix_reprefill_wall_s"] = time.perf_counter() - start
    result["ours_reuse_over_tunix"] = result["tunix_reprefill_wall_s"] / reuse_s
  return result


def decode_matrices(model) -> list:
  """What a decode step reads of the weights: every projection matrix and the LM head, in the
  model's dtype (the embedding table is read one row per sequence)."""
  matrices = [m.kernel[...].reshape(-1, math.prod(m.kernel.shape[-m.n_in:]))
              for _, m in nnx.iter_graph(model) if isinstance(m, qwen2.Linear)]
  return matrices + [model.head_weight()]


def matvec_timer(matrices):
  """A batch-1 decode step's weight products alone: each matrix times one vector through the
  model's own `project`, in one jitted call. Returns a function timing it (ms, best of
  `repeats`): what XLA's matrix-vector kernel allows, with nothing else of the step in the
  way."""
  import jax.numpy as jnp

  @jax.jit
  def products(matrices):
    total = jnp.zeros((), jnp.float32)
    for w in matrices:  # each product waits for the last, as a layer's do
      x = jnp.full((1, w.shape[1]), 1e-3, w.dtype) + total
      total = total + qwen2.project(x, w)[0, 0].astype(jnp.float32)
    return total

  products(matrices).block_until_ready()

  def best_ms(repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      products(matrices).block_until_ready()
      times.append(time.perf_counter() - start)
    return 1000 * min(times)

  return best_ms


def cache_bytes_per_sequence(model, length: int) -> int:
  """Bytes of KV cache one sequence's decode step reads over `length` positions (the
  benchmark's engines attend over the whole cache)."""
  cfg = model.config
  itemsize = np.dtype(cfg.jnp_dtype).itemsize
  return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * length * itemsize


def bound(decode: list[dict], weight_bytes: int, cache_bytes: int) -> dict:
  """Per round, the bound (bytes a step reads over the read bandwidth probed just before)
  against our step time and the matrix-vector floor; medians over rounds. A step reads the
  weights once and each sequence's KV cache. `ours_fraction_of_copy_bound` takes the copy
  bandwidth instead (read plus written bytes; more than a read-only stream reaches on CPU)."""
  result = {"weight_bytes_per_step": weight_bytes, "cache_bytes_per_sequence": cache_bytes}
  for d in decode:
    if "ours" not in d["rounds_tok_s"] or not d["probes"]:
      continue
    step = weight_bytes + d["batch"] * cache_bytes
    ours_ms = [1000 * d["batch"] / t for t in d["rounds_tok_s"]["ours"]]
    bound_ms = [1000 * step / (1e9 * p["read_gb_s"]) for p in d["probes"]]
    copy_ms = [1000 * step / (1e9 * p["copy_gb_s"]) for p in d["probes"]]
    matvec = [p["matvec_ms"] for p in d["probes"]]
    result[d["batch"]] = {
        "bytes_per_step": step,
        "bound_ms_per_step": _median(bound_ms), "ours_ms_per_step": _median(ours_ms),
        "matvec_ms_per_step": _median(matvec),
        "ours_fraction_of_bound": _median([b / o for b, o in zip(bound_ms, ours_ms)]),
        "matvec_fraction_of_bound": _median([b / m for b, m in zip(bound_ms, matvec)]),
        "ours_over_matvec": _median([m / o for m, o in zip(matvec, ours_ms)]),
        "ours_fraction_of_copy_bound": _median([b / o for b, o in zip(copy_ms, ours_ms)]),
    }
  return result


def random_checkpoint(preset: str) -> str:
  """A randomly initialised `preset`, written as an HF checkpoint (float32) that every
  system loads."""
  import tempfile

  from sage_jax.model import get_preset, init_model
  out = os.path.join(tempfile.mkdtemp(prefix="sampler_bench_"), preset)
  hf.save_hf(init_model(get_preset(preset), seed=0), out, dtype="float32",
             tokenizer_dir=str(tokenizer_lib.ensure_qwen25_tokenizer_dir()))
  return out


def main(argv):
  del argv
  if _MODEL.value and _MODEL.value.startswith("random:"):
    model_dir = random_checkpoint(_MODEL.value.removeprefix("random:"))
  else:
    model_dir = _MODEL.value or str(gguf_import.qwen25_coder_0p5b_hf_dir())
  report = {"machine": machine_info(), "model": _MODEL.value or model_dir,
            "param_dtype": _PARAM_DTYPE.value}
  tok = tokenizer_lib.Tokenizer()
  systems, report["skipped"] = load_systems(model_dir)
  ours = next((s for s in systems if s.name == "ours"), None)
  probe = None
  if ours is not None:
    matrices = decode_matrices(ours.model)
    report["ours_dtypes"] = {"weights": str(matrices[0].dtype),
                             "compute": ours.model.config.dtype}
    bandwidth, matvec = Bandwidth(), matvec_timer(matrices)
    cores = len(os.sched_getaffinity(0))
    probe = lambda: {"copy_gb_s": bandwidth.copy(cores), "read_gb_s": bandwidth.read(cores),
                     "matvec_ms": matvec()}
  prompts = bench_prompts(tok, max(map(int, _BATCHES.value)), _PROMPT_LEN.value)
  report["decode"] = [decode_benchmark(systems, prompts, int(b), probe) for b in _BATCHES.value]
  if _MULTITURN.value and ours is not None:
    report["multiturn"] = multiturn_benchmark(systems, tok)
  if ours is not None:
    n = _PROMPT_LEN.value + _NEW_TOKENS.value
    report["bound"] = bound(report["decode"], sum(m.nbytes for m in matrices),
                            cache_bytes_per_sequence(ours.model, 1 << (n - 1).bit_length()))
  report["machine"]["load_average_end"] = os.getloadavg()
  text = json.dumps(report, indent=2)
  print(text)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
