"""The compact tokenizer: Qwen2.5's BPE cut to a corpus, still complete and still Qwen2.5's on it."""

import json
import unicodedata
import uuid

import pytest
from transformers import AutoTokenizer

from sage_jax import storage
from sage_jax.agent import prompts
from sage_jax.compact_tokenizer import FILES, is_complete, write_compact_tokenizer
from sage_jax.tokenizer import IM_END, QWEN25_ADDED_TOKENS, Conversation, Tokenizer
from tests import fake_gcs

SOLUTION = '''def count_library_songs_by_genre(genre):
    passwords = {item["account_name"]: item["password"] for item in apis.supervisor.show_account_passwords()}
    page_index = 0
    while True:
        page = apis.spotify.show_song_library(access_token=token, page_index=page_index)
        if not page:
            break
        page_index += 1
    return page_index
'''
CORPUS = [prompts.system_prompt(None), "Task: How many songs in my Spotify library are rock?",
          f"I write the skill for this task.\n\n```python\n{SOLUTION}```"]


@pytest.fixture(scope="module")
def compact_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("compact")
  texts = [f"<|im_start|>{role}\n{text}<|im_end|>\n"
           for role, text in zip(("system", "user", "assistant"), CORPUS)]
  return write_compact_tokenizer(out, texts=texts)


@pytest.fixture(scope="module")
def full():
  return Tokenizer()


@pytest.fixture(scope="module")
def compact(compact_dir):
  return Tokenizer(compact_dir)


def test_small_and_dense(compact, compact_dir, full):
  spec = json.loads((compact_dir / "tokenizer.json").read_text())
  vocab = spec["model"]["vocab"]
  assert 256 < len(vocab) < 2000 < full.vocab_size
  assert sorted(vocab.values()) == list(range(len(vocab)))
  added = [t["id"] for t in spec["added_tokens"]]
  assert added == list(range(len(vocab), len(vocab) + len(QWEN25_ADDED_TOKENS)))
  assert compact.vocab_size == len(vocab) + len(QWEN25_ADDED_TOKENS)
  assert compact.decode([compact.eos_id]) == IM_END


@pytest.mark.parametrize("text", CORPUS + [SOLUTION.replace("rock", "jazz")])
def test_corpus_tokenizes_exactly_as_qwen25(text, full, compact):
  pieces = lambda tok: [tok.id_to_token(i) for i in tok.encode(text)]
  assert pieces(compact) == pieces(full)


@pytest.mark.parametrize("text", ["Héllo wörld 🤖, ZQXJ 987654321 ~/déjà/vu.txt\t\r\n",
                                  "".join(chr(c) for c in range(32, 1200, 7))])
def test_any_text_decodes_as_with_qwen25(text, full, compact):
  """Text round-trips up to Qwen2.5's NFC normalisation, which both apply."""
  ids = compact.encode(text)
  assert compact.decode(ids) == full.decode(full.encode(text)) == unicodedata.normalize("NFC", text)
  assert len(ids) >= len(full.encode(text))  # dropped merges fall back to shorter pieces


def test_loads_in_transformers_with_the_chat_template(compact_dir, compact):
  hf = AutoTokenizer.from_pretrained(str(compact_dir))
  messages = [{"role": "system", "content": CORPUS[0]}, {"role": "user", "content": CORPUS[1]}]
  ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  conversation = Conversation(compact, CORPUS[0])
  conversation.add_user(CORPUS[1])
  assert hf(ids, add_special_tokens=False)["input_ids"] == conversation.start_assistant()
  assert hf.eos_token_id == compact.eos_id and hf.pad_token_id == compact.pad_id


def test_sft_examples_tokenize_exactly_as_qwen25_from_their_own_ids(full, tmp_path):
  """Built from the ids the SFT data reads (each turn encoded apart, as the pipeline builds
  it): replies that open with whitespace keep Qwen2.5's pieces, which a vocabulary built from
  whole conversations (where the header's newline joins the reply's) can miss."""
  from sage_jax.sft import data as sft_data  # noqa: PLC0415

  trajectories = [sft_data.Trajectory(f"t{i}", (
      {"role": "system", "content": "You solve tasks."}, {"role": "user", "content": "Go."},
      {"role": "assistant", "content": reply})) for i, reply in enumerate(
          ["\n\n\n\n\n\nY", "\n  \n  Z", "  x = 1\n"])]
  ids = [t for trajectory in trajectories for t in sft_data.tokenize(trajectory, full).tokens]
  compact = Tokenizer(write_compact_tokenizer(tmp_path / "compact", ids=ids))
  for trajectory in trajectories:
    pieces = lambda tok: [tok.id_to_token(int(i))
                          for i in sft_data.tokenize(trajectory, tok).tokens]
    assert pieces(compact) == pieces(full), trajectory.id


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_directory_missing_a_file_is_not_a_tokenizer(where, tmp_path, request):
  """A write cut short between files leaves a directory that is not taken up as written."""
  root = str(tmp_path)
  if where == "gcs":
    bucket = f"unit-{uuid.uuid4().hex[:8]}"
    fake_gcs.create_bucket(request.getfixturevalue("gcs_url"), bucket)
    root = f"gs://{bucket}/run"
  out = write_compact_tokenizer(f"{root}/tokenizer", texts=CORPUS[1:2])
  assert out == storage.path(f"{root}/tokenizer") and is_complete(out)
  assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
  for name in FILES:
    text = (out / name).read_text()
    (out / name).unlink()
    assert not is_complete(out), name
    storage.write_text(out / name, text)
