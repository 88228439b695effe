r"""The first turns of a rollout batch through the sampler engine; prints JSON.

  python bench/first_turns.py [--preset=qwen2.5-0.5b] [--tasks=8] [--group=4] [--rounds=3]

The prompts are the agent's own first prompts (system prompt with an empty skill library,
then the task message, in the chat template) of the first --tasks tasks of the mini world's
train split, each --group times (a GRPO group), submitted in group order to one engine as
`rl.rollout.collect` submits them. Every sequence samples --new_tokens tokens (EOS off).
Reports, per round, the wall time of the batch on a fresh engine (compiled beforehand), the
prompt tokens prefilled and those copied from a slot that held them; the median round. The
model is a randomly initialised preset: its time does not depend on the weights' values.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sage_jax.agent import prompts as prompts_lib  # noqa: E402
from sage_jax.envs import appworld  # noqa: E402
from sage_jax.model import get_preset, init_model  # noqa: E402
from sage_jax.sampler import Engine, EngineConfig, SamplingParams  # noqa: E402
from sage_jax.tokenizer import Conversation, Tokenizer  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "qwen2.5-0.5b", "Model preset (random weights).")
_TASKS = flags.DEFINE_integer("tasks", 8, "Tasks of the mini world's train split.")
_GROUP = flags.DEFINE_integer("group", 4, "Rollouts per task (GRPO group size).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Engine slots.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 16, "Tokens sampled per sequence.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds (median reported).")


def first_prompts(tok: Tokenizer, count: int) -> list[list[int]]:
  """The agent's first prompt of each of the first `count` train tasks."""
  root = appworld.ensure_mini_world()
  docs = os.path.join(root, "data", "api_docs", "standard")
  apps = sorted(os.path.splitext(f)[0] for f in os.listdir(docs))  # the names the prompt lists
  out = []
  for task_id in appworld.read_split(root, "train")[:count]:
    with open(os.path.join(root, "data", "tasks", task_id, "specs.json")) as f:
      specs = json.load(f)
    conv = Conversation(tok, prompts_lib.system_prompt(()))
    conv.add_user(prompts_lib.task_message(specs["instruction"], specs["supervisor"],
                                           specs["datetime"], dict.fromkeys(apps, "")))
    out.append(conv.start_assistant())
  return out


def main(argv) -> None:
  del argv
  tok = Tokenizer()
  tasks = first_prompts(tok, _TASKS.value)
  batch = [p for p in tasks for _ in range(_GROUP.value)]
  model = init_model(get_preset(_PRESET.value), seed=0)
  config = EngineConfig(num_slots=_SLOTS.value, max_len=2048)
  params = SamplingParams(temperature=1.0, max_new_tokens=_NEW_TOKENS.value)
  Engine(model, config, eos_ids=()).warmup()
  rounds = []
  for _ in range(_ROUNDS.value):
    engine = Engine(model, config, eos_ids=())
    start = time.perf_counter()
    engine.generate(batch, params, seeds=range(len(batch)))
    rounds.append({"seconds": round(time.perf_counter() - start, 3),
                   "prefill_tokens": engine.stats.prefill_tokens,
                   "copied_tokens": engine.stats.prefill_copied_tokens,
                   "prefill_calls": engine.stats.prefill_calls})
  print(json.dumps({
      "command": "python bench/first_turns.py " + " ".join(sys.argv[1:]),
      "machine": f"{os.cpu_count()}-core CPU, {platform.processor() or platform.machine()}",
      "preset": _PRESET.value, "sequences": len(batch),
      "prompt_tokens": [len(p) for p in tasks],
      "median_seconds": statistics.median(r["seconds"] for r in rounds),
      "rounds": rounds, "load_average_1m": os.getloadavg()[0]}, indent=2))


if __name__ == "__main__":
  app.run(main)
