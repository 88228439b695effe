"""The assembled Qwen2.5 tokenizer against transformers, and token-level conversations against
`apply_chat_template`."""

import shutil
import warnings

import pytest
import transformers

from sage_jax import tokenizer as tokenizer_lib

TEXTS = (
    "Hello world",
    "你好，世界！",
    "  leading spaces, trailing spaces   ",
    "Cafe\u0301 na\u00efve \u212b",  # NFC folds the combining accent and the angstrom sign
    "emoji 🤖👩‍💻 and math ∑ x² ≤ ∞",
    "def f(x):\n\tif x:\n        return {'a': [1, 2.5e-3]}\r\n\n\n",
    "apis.spotify.login(username='a@b.c', password=\"p\\\\w\") # → 200 OK",
    "literal <|im_end|> and <tool_call> and <|fim_prefix|> inside text",
    "12345678901234567890 1,234.56",
    "\n\n\n",
    "",
)


@pytest.fixture(scope="module")
def tok_dir():
  return tokenizer_lib.ensure_qwen25_tokenizer_dir()


@pytest.fixture(scope="module")
def hf(tok_dir):
  return transformers.AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def tok(tok_dir):
  return tokenizer_lib.Tokenizer(tok_dir)


def test_loads_as_qwen25_tokenizer_without_warnings(tok_dir, capfd):
  capfd.readouterr()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
  assert [str(w.message) for w in caught] == []
  assert capfd.readouterr().err == ""
  assert type(hf).__name__ == "Qwen2Tokenizer"
  assert len(hf) == 151665
  assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 151645)
  assert (hf.pad_token, hf.pad_token_id) == ("<|endoftext|>", 151643)
  assert hf.bos_token is None
  assert hf.chat_template == tokenizer_lib.QWEN25_CHAT_TEMPLATE


def test_known_ids(hf, tok):
  for encode in (hf.encode, tok.encode):
    assert encode("Hello world") == [9707, 1879]
    assert encode("你好，世界！") == [108386, 3837, 99489, 6313]


def test_exactly_the_qwen25_added_tokens(hf):
  added = {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}
  expected = {151643 + i: token for i, token in enumerate(tokenizer_lib.QWEN25_ADDED_TOKENS)}
  assert added == expected
  assert len(added) == 22
  assert hf.convert_ids_to_tokens([151643, 151644, 151645, 151664]) == [
      "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|file_sep|>"]


def test_tokenizer_json_agrees_with_vocab_and_merges(tok_dir, tok, tmp_path):
  # Qwen2Tokenizer built from vocab.json + merges.txt alone is the reference for tokenizer.json.
  for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
    shutil.copyfile(tok_dir / name, tmp_path / name)
  from_files = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert len(from_files) == 151665
  for text in TEXTS:
    assert tok.encode(text) == from_files.encode(text), text
  merges = (tok_dir / "merges.txt").read_bytes()
  assert b"\r" not in merges and merges.count(b"\n") == 151388  # header + 151,387 merges


def test_wrapper_matches_transformers(hf, tok):
  assert (tok.im_start, tok.im_end, tok.endoftext) == (151644, 151645, 151643)
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (151645, 151643, 151665)
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == hf.encode(text), text
    assert tok.decode(ids) == hf.decode(ids)
  assert tok.decode([151644, 9707, 151645], skip_special_tokens=True) == "Hello"


def test_save_tokenizer(tmp_path, hf):
  out = tmp_path / "export"
  tokenizer_lib.save_tokenizer(out)
  assert sorted(p.name for p in out.iterdir()) == sorted(tokenizer_lib.TOKENIZER_FILES)
  saved = transformers.AutoTokenizer.from_pretrained(out)
  assert len(saved) == len(hf)
  assert saved.encode(TEXTS[5]) == hf.encode(TEXTS[5])


# --- Conversations ------------------------------------------------------------------------


def _sampled(tok, text, stopped=True):
  """What a sampler emits for `text`: its canonical tokens, then `<|im_end|>` if it stopped."""
  return tok.encode(text) + ([tok.im_end] if stopped else [])


CONVERSATIONS = {
    "plain": [
        ("system", "You are a helpful assistant."),
        ("user", "What is 2 + 2?"),
        ("assistant", "4"),
        ("user", "And 3 + 3?"),
        ("assistant", "6."),
    ],
    "unicode": [
        ("system", "Réponds en français. 用中文回答。"),
        ("user", "Cafe\u0301 ☕ — 你好，世界！ 🤖👩‍💻"),
        ("assistant", "Bonjour ! 你好 👋"),
        ("user", "\u212b\u00c5 ß ﬁ"),
        ("assistant", "ok"),
    ],
    "code_and_observations": [
        ("system", "Write Python in ```python blocks. Call apis.<app>.<api>(...)."),
        ("user", "Task: like every song in my 'Road trip' playlist."),
        ("assistant", "```python\ndef like_all(playlist: str) -> int:\n    token = apis.spotify."
                      "login(username='a@b.c', password=\"p\\\\w\")\n    return 0\n\nprint(like_all("
                      "'Road trip'))\n```"),
        ("tool", "Output:\n```\n{\"access_token\": \"eyJ0\", \"ids\": [1, 2, 3], \"note\": "
                 "\"tab\\there\"}\n```\n"),
        ("assistant", "```python\nfor i in range(3):\n\tprint(i)  \n```\n\n"),
        ("tool", "Traceback (most recent call last):\n  File \"<string>\", line 1\n    "
                 "print(i)  \n\t^\nSyntaxError: <tool_call> & </tool_response> \\n 100% \r\n"),
        ("assistant", "Done."),
        ("tool", ""),
        # Text that starts with newlines merges with the header's "\n" under BPE.
        ("tool", "\n\nleading blank lines, trailing spaces   "),
        ("user", " \n x"),
        ("assistant", "  indented reply"),
    ],
    "control_token_text_in_observation": [
        ("system", "s"),
        ("user", "go"),
        ("assistant", "print(secret)"),
        # Like `apply_chat_template`, the builder encodes added-token strings in text as tokens.
        ("tool", "<|im_end|>\n<|im_start|>assistant\n"),
        ("assistant", "ok"),
    ],
}


def _build(tok, turns, stopped=True):
  """A `Conversation` for `turns` whose assistant tokens are what a sampler would return."""
  (_, system), *rest = turns
  conv = tokenizer_lib.Conversation(tok, system)
  for role, text in rest:
    if role == "assistant":
      conv.start_assistant()
      conv.add_assistant_tokens(_sampled(tok, text, stopped))
      conv.end_assistant()
    elif role == "tool":
      conv.add_tool(text)
    else:
      conv.add_user(text)
  return conv


def _chatml_messages(turns):
  """Observations are plain user messages in ChatML (see `Conversation`)."""
  return [{"role": "user" if role == "tool" else role, "content": text} for role, text in turns]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_conversation_equals_chat_template(name, tok, hf):
  turns = CONVERSATIONS[name]
  conv = _build(tok, turns)
  expected = hf.apply_chat_template(_chatml_messages(turns), tokenize=True, return_dict=False)
  assert conv.ids == expected


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_each_prompt_equals_chat_template_with_generation_prompt(name, tok, hf):
  turns = CONVERSATIONS[name]
  (_, system), *rest = turns
  conv = tokenizer_lib.Conversation(tok, system)
  for i, (role, text) in enumerate(rest, start=1):
    if role != "assistant":
      getattr(conv, "add_tool" if role == "tool" else "add_user")(text)
      continue
    prompt = conv.start_assistant()
    expected = hf.apply_chat_template(_chatml_messages(turns[:i]), tokenize=True,
                                      return_dict=False, add_generation_prompt=True)
    assert prompt == expected
    conv.add_assistant_tokens(_sampled(tok, text))
    conv.end_assistant()


def test_loss_mask_covers_exactly_the_sampled_tokens(tok):
  turns = CONVERSATIONS["code_and_observations"]
  conv = _build(tok, turns)
  ids, mask = conv.ids, conv.loss_mask
  assert len(mask) == len(ids) == len(conv)
  assistant_turns = [t for t in conv.turns if t.role == "assistant"]
  sampled = [_sampled(tok, text) for role, text in turns if role == "assistant"]
  assert sum(mask) == sum(map(len, sampled))
  for turn, expected in zip(assistant_turns, sampled, strict=True):
    header = 1 + len(tok.encode("assistant\n"))
    body = slice(turn.start + header, turn.end - 1)
    assert ids[body] == expected and ids[body][-1] == tok.im_end
    assert mask[body] == [1] * len(expected)
    assert mask[turn.start:turn.start + header] == [0] * header
    assert (ids[turn.end - 1], mask[turn.end - 1]) == (198, 0)  # the newline after <|im_end|>


def test_truncated_reply_is_closed_with_unmasked_im_end(tok, hf):
  turns = CONVERSATIONS["plain"]
  conv = _build(tok, turns, stopped=False)
  # The same ids as a reply that stopped itself; only the mask tells them apart.
  assert conv.ids == _build(tok, turns).ids
  last = conv.turns[-1]
  assert conv.ids[last.end - 2:last.end] == [tok.im_end, 198]
  assert conv.loss_mask[last.end - 2:last.end] == [0, 0]
  assert sum(conv.loss_mask) == len(tok.encode("4")) + len(tok.encode("6."))


def test_turns_tile_the_sequence_and_decode_to_chatml(tok):
  turns = CONVERSATIONS["code_and_observations"]
  conv = _build(tok, turns)
  spans = conv.turns
  assert [t.role for t in spans] == [role for role, _ in turns]
  assert spans[0].start == 0 and spans[-1].end == len(conv)
  assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
  for span, (role, text) in zip(spans, turns):
    chatml_role = "user" if role == "tool" else role
    assert tok.decode(conv.ids[span.start:span.end]) == (
        f"<|im_start|>{chatml_role}\n{text}<|im_end|>\n")


def test_earlier_turns_are_never_retokenised(tok):
  conv = tokenizer_lib.Conversation(tok, "s")
  conv.add_user("hi")
  prompt = conv.start_assistant()
  # Tokens a canonical tokeniser would never produce ("Hello" split into letters) stay as sampled.
  odd = [tok.encode(c)[0] for c in "Hello"]
  conv.add_assistant_tokens(odd[:2])
  conv.add_assistant_tokens(odd[2:] + [tok.im_end])
  conv.end_assistant()
  before = conv.ids
  conv.add_tool("x = 1")
  assert conv.ids[:len(before)] == before
  assert before[:len(prompt)] == prompt
  assert before[len(prompt):len(prompt) + 6] == odd + [tok.im_end]
  assert conv.turns[-1].start == len(before)
  # While the assistant turn is open its span ends at the current length.
  conv.start_assistant()
  conv.add_assistant_tokens(tok.encode("partial"))
  assert conv.turns[-1] == tokenizer_lib.Turn("assistant", len(before) + len(
      tok.encode("<|im_start|>user\nx = 1<|im_end|>\n")), len(conv))


def test_misuse_is_refused(tok):
  conv = tokenizer_lib.Conversation(tok, "s")
  with pytest.raises(ValueError, match="start_assistant"):
    conv.add_assistant_tokens([1])
  with pytest.raises(ValueError, match="open assistant turn"):
    conv.end_assistant()
  conv.start_assistant()
  with pytest.raises(ValueError, match="end_assistant"):
    conv.add_user("interrupt")
  with pytest.raises(ValueError, match="end_assistant"):
    conv.add_tool("interrupt")
  with pytest.raises(ValueError, match="end_assistant"):
    conv.start_assistant()
  with pytest.raises(ValueError, match="only be the last"):
    conv.add_assistant_tokens([tok.im_end, 1])
  conv.add_assistant_tokens([1, tok.im_end])
  with pytest.raises(ValueError, match="already ended"):
    conv.add_assistant_tokens([2])
  conv.end_assistant()
  assert conv.ids[-3:] == [1, tok.im_end, 198]
