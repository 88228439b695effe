"""SFT: the expert-trajectory format, tokenisation through the rollout conversation builder,
the tfds builder (array_record, no TensorFlow), and SFT driving the loss near zero."""

import json
import re
import sys
import tempfile

import numpy as np
import pytest

from sage_jax.model import get_preset, init_model
from sage_jax.rl import batch as B
from sage_jax.sft import data as sft_data
from sage_jax.sft import loop as sft_loop
from sage_jax.tokenizer import Conversation, Tokenizer
from sage_jax.train.metrics import MetricsConfig
from sage_jax.train.optimizer import OptimizerConfig

SYSTEM = "You are a coding agent. Write Python in ```python``` blocks; define skills as functions."


def _trajectory(i):
  return {
      "id": f"scenario{i}_1",
      "messages": [
          {"role": "system", "content": SYSTEM},
          {"role": "user", "content": f"Task {i}: send {i} dollars to Bob."},
          {"role": "assistant", "content": "I look up Bob.\n\n```python\nprint(apis.venmo.search_users(query='Bob'))\n```"},
          {"role": "tool", "content": f"[{{\"id\": {i}, \"name\": \"Bob\"}}]"},
          {"role": "assistant", "content": f"```python\ndef pay(user_id, amount):\n    return apis.venmo.create_transaction(receiver_id=user_id, amount=amount)\n\n\npay({i}, {i})\napis.supervisor.complete_task()\n```"},
          {"role": "tool", "content": "Execution successful."},
      ],
      "metadata": {"task_id": f"scenario{i}_1", "source": "test"},
  }


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer()


@pytest.fixture()
def jsonl(tmp_path):
  path = tmp_path / "expert.jsonl"
  path.write_text("\n".join(json.dumps(_trajectory(i)) for i in range(4)) + "\n")
  return path


def test_format_validation(tmp_path):
  good = _trajectory(0)
  assert sft_data.validate(good).id == "scenario0_1"
  cases = [
      ({**good, "id": ""}, "'id'"),
      ({**good, "messages": []}, "'messages'"),
      ({**good, "messages": good["messages"][1:]}, "system prompt is the first"),
      ({**good, "messages": [good["messages"][0], {"role": "bot", "content": "x"}]}, "role 'bot'"),
      ({**good, "messages": good["messages"][:2]}, "no assistant message"),
      ({**good, "messages": [{"role": "system", "content": 3}] + good["messages"][1:]}, "string"),
      # The agent's order: system, the task, then assistant turns each answered.
      ({**good, "messages": [good["messages"][0], *good["messages"][2:]]},
       r"message 1 \(assistant\) comes where the task"),
      ({**good, "messages": [*good["messages"][:2], {"role": "tool", "content": "x"},
                             *good["messages"][2:]]},
       r"message 2 \(tool\) follows a user message"),
      ({**good, "messages": [*good["messages"][:3], *good["messages"][2:]]},
       r"message 3 \(assistant\) follows another assistant"),
  ]
  for raw, match in cases:
    with pytest.raises(sft_data.FormatError, match=match):
      sft_data.validate(raw)
  path = tmp_path / "dup.jsonl"
  path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
  with pytest.raises(sft_data.FormatError, match="duplicate id"):
    sft_data.read_jsonl(path)
  path.write_text("{not json\n")
  with pytest.raises(sft_data.FormatError, match=":1: not JSON"):
    sft_data.read_jsonl(path)


def test_special_token_texts_in_content(tmp_path, tokenizer):
  """The tokenizer encodes the text of a special token as that token: a ChatML delimiter in
  any message, or `<|endoftext|>` in the model's own, is a format error naming the file, line
  and trajectory; other special-token texts stay inside their turn and load."""

  def with_contents(contents):
    raw = _trajectory(0)
    for index, content in contents.items():
      raw["messages"][index]["content"] = content
    return json.dumps(raw) + "\n"

  path = tmp_path / "expert.jsonl"
  for index, text, token in [(2, "<|im_end|>", tokenizer.im_end),
                             (4, "<|endoftext|>", tokenizer.endoftext),
                             (3, "<|im_start|>", tokenizer.im_start),
                             (1, "<|im_end|>", tokenizer.im_end)]:
    content = f"print('{text}')"
    assert token in tokenizer.encode(content)
    path.write_text(json.dumps(_trajectory(1)) + "\n" + with_contents({index: content}))
    where = rf"expert.jsonl:2 \(scenario0_1\): message {index} .*{re.escape(text)}"
    with pytest.raises(sft_data.FormatError, match=where):
      sft_data.load_examples(path, tokenizer)
  split_literal = "print('<|im' '_end|>')"
  path.write_text(with_contents({3: "<|endoftext|> <|box_start|>", 4: split_literal}))
  (example,) = sft_data.load_examples(path, tokenizer)
  box_start = tokenizer.encode("<|box_start|>")
  assert len(box_start) == 1 and box_start[0] in example.tokens[example.loss_mask == 0]
  last_turn = tokenizer.encode(split_literal) + [tokenizer.im_end]
  assert example.tokens[example.loss_mask == 1][-len(last_turn):].tolist() == last_turn


def test_tokenisation_matches_the_rollout_conversation(jsonl, tokenizer, tmp_path):
  trajectories = sft_data.read_jsonl(jsonl)
  assert len(trajectories) == 4 and trajectories[0].metadata["source"] == "test"
  example = sft_data.tokenize(trajectories[0], tokenizer)
  # The rollout builds the same conversation turn by turn; sampled ids are the assistant's.
  m = trajectories[0].messages
  conv = Conversation(tokenizer, m[0]["content"])
  conv.add_user(m[1]["content"])
  conv.start_assistant()
  conv.add_assistant_tokens(tokenizer.encode(m[2]["content"]) + [tokenizer.eos_id])
  conv.end_assistant()
  conv.add_tool(m[3]["content"])
  conv.start_assistant()
  conv.add_assistant_tokens(tokenizer.encode(m[4]["content"]) + [tokenizer.eos_id])
  conv.end_assistant()  # the final tool turn carries no loss and is dropped
  np.testing.assert_array_equal(example.tokens, conv.ids)
  np.testing.assert_array_equal(example.loss_mask, conv.loss_mask)
  # Loss exactly on the assistant contents and the <|im_end|> closing each of them.
  trained = example.tokens[example.loss_mask == 1].tolist()
  want = (tokenizer.encode(m[2]["content"]) + [tokenizer.im_end]
          + tokenizer.encode(m[4]["content"]) + [tokenizer.im_end])
  assert trained == want
  # Round trip: the messages come back from the ids and turns.
  back = sft_data.messages_from_ids(conv.ids, conv.turns, tokenizer)
  assert back == list(m[:5])
  out = tmp_path / "copy.jsonl"
  assert sft_data.write_jsonl(out, trajectories) == 4
  assert sft_data.read_jsonl(out) == trajectories
  with pytest.raises(sft_data.FormatError, match="exceed 50 tokens"):
    sft_data.load_examples(jsonl, tokenizer, max_len=50)


def test_tfds_builder_without_tensorflow(jsonl, tokenizer, tmp_path, monkeypatch):
  """Builds and reads with no TensorFlow, leaving no temporary directory behind (TFDS made
  an empty /tmp/tmp*tfds for each dataset it prepared)."""
  from sage_jax.sft import tfds_builder
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  tfds_builder.prepare(str(jsonl.parent), str(tmp_path / "tfds"))
  examples = tfds_builder.load_examples(str(tmp_path / "tfds"))
  assert not list(temp.iterdir())
  want = {t.id: sft_data.tokenize(t, tokenizer) for t in sft_data.read_jsonl(jsonl)}
  assert sorted(e.id for e in examples) == sorted(want)
  for e in examples:
    np.testing.assert_array_equal(e.tokens, want[e.id].tokens)
    np.testing.assert_array_equal(e.loss_mask, want[e.id].loss_mask)
  assert "tensorflow" not in sys.modules


def test_tfds_prepare_rebuilds_when_the_jsonl_changed(jsonl, tmp_path):
  """A build is reused only for the very files it was built from: edited or added JSONL
  files are rebuilt, not silently trained on as their old version."""
  from sage_jax.sft import tfds_builder
  data_dir = tmp_path / "tfds"

  def built_files():
    return {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}

  def prepared_ids():
    tfds_builder.prepare(str(jsonl.parent), str(data_dir))
    return sorted(e.id for e in tfds_builder.load_examples(str(data_dir)))

  assert prepared_ids() == [f"scenario{i}_1" for i in range(4)]
  first_build = built_files()
  assert prepared_ids() == [f"scenario{i}_1" for i in range(4)]
  assert built_files() == first_build
  jsonl.write_text(json.dumps(_trajectory(7)) + "\n")
  assert prepared_ids() == ["scenario7_1"]
  (jsonl.parent / "more.jsonl").write_text(json.dumps(_trajectory(8)) + "\n")
  assert prepared_ids() == ["scenario7_1", "scenario8_1"]


def test_batch_order_is_a_function_of_the_step():
  seen = [sft_loop.batch_indices(s, 3, 7, seed=1) for s in range(7)]
  flat = sum(seen, [])
  for epoch in range(3):  # every epoch is a permutation of the examples
    assert sorted(flat[epoch * 7:(epoch + 1) * 7]) == list(range(7))
  assert sft_loop.batch_indices(4, 3, 7, seed=1) == seen[4]
  assert sft_loop.batch_indices(4, 3, 7, seed=2) != seen[4]


def test_sft_drives_the_loss_near_zero(jsonl, tokenizer, tmp_path):
  """A handful of real tokenised trajectories, their ids mapped onto a compact vocabulary so a
  tiny model trains in seconds (the mapping is a bijection: the sequences are unchanged).
  What remains after 40 steps (~0.045 nats per token) is the per-trajectory number the model
  must copy from the context into `pay(i, i)`."""
  examples = sft_data.load_examples(jsonl, tokenizer)
  used = sorted({int(t) for e in examples for t in e.tokens})
  remap = {t: i for i, t in enumerate(used)}
  compact = [sft_data.SFTExample(e.id, np.asarray([remap[int(t)] for t in e.tokens], np.int32),
                                 e.loss_mask) for e in examples]
  cfg = get_preset("tiny").replace(vocab_size=len(used))
  config = sft_loop.SFTConfig(total_steps=40, batch_size=4)
  trainer = sft_loop.sft_trainer(init_model(cfg, seed=0), config,
                                 OptimizerConfig(learning_rate=1e-2, warmup_steps=5,
                                                 weight_decay=0.0))
  batch_config = B.BatchConfig(micro_batch_tokens=512, num_micro_batches=2,
                               length_buckets=(128, 256))
  before = sft_loop.evaluate_nll(trainer, compact, batch_config)["nll"]
  result = sft_loop.run_sft(trainer, compact, config=config, batch_config=batch_config,
                            metrics=MetricsConfig(log_dir=str(tmp_path / "log"),
                                                  progress=False))
  after = sft_loop.evaluate_nll(trainer, compact, batch_config)["nll"]
  assert before > 3.0
  assert after < 0.1, (before, after)
  assert result.end_step == 40 and result.history[-1]["nll"] < 0.1
  assert result.history[-1]["token_prob"] > 0.93
