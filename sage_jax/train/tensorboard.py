"""TensorBoard event files of scalars, written directly: the `Event` and `Summary` protos'
few fields a scalar needs, in TFRecord framing. tensorboardX's SummaryWriter imports torch
(seconds at every start) for arrays that scalars never are."""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from typing import Mapping

import google_crc32c

FILE_VERSION = "brain.Event:2"
SESSION_START = 1  # SessionLog.START: TensorBoard hides earlier files' events from its step on


def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1  # negative int64s as two's complement, as protobuf encodes them
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
  return _varint(number << 3 | wire_type) + payload


def _length_delimited(number: int, body: bytes) -> bytes:
  """A string, bytes or sub-message field."""
  return _field(number, 2, _varint(len(body)) + body)


def _event(step: int, *, file_version: str = "", summary: bytes = b"",
           session_status: int = 0) -> bytes:
  """An `Event` proto: wall_time = 1, step = 2, file_version = 3, summary = 5,
  session_log = 7 (its status = 1)."""
  out = _field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, _varint(step))
  if file_version:
    out += _length_delimited(3, file_version.encode())
  if summary:
    out += _length_delimited(5, summary)
  if session_status:
    out += _length_delimited(7, _field(1, 0, _varint(session_status)))
  return out


def _float32(value: float) -> bytes:
  """`value` as a float32 (beyond its range: infinity of that sign, as a cast gives)."""
  try:
    return struct.pack("<f", value)
  except OverflowError:
    return struct.pack("<f", math.copysign(math.inf, value))


def _scalars(values: Mapping[str, float]) -> bytes:
  """A `Summary` proto: one value (= 1) per scalar, its tag = 1 and simple_value = 2 (float)."""
  return b"".join(
      _length_delimited(1, _length_delimited(1, tag.encode()) + _field(2, 5, _float32(v)))
      for tag, v in values.items())


def _masked_crc(data: bytes) -> bytes:
  crc = google_crc32c.value(data)
  return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class ScalarWriter:
  """One event file in `log_dir`, each step written through to disk (a mirror that copies the
  directory after a step copies the whole step). `purge_step`: from that step on, TensorBoard
  hides what earlier files of the directory hold (a resumed run redoes those steps)."""

  def __init__(self, log_dir: str, purge_step: int | None = None):
    os.makedirs(log_dir, exist_ok=True)
    # events.out.tfevents.<seconds>.<host>.<nanoseconds>: two files made in one second stay
    # apart and sort in the order they were made, the order TensorBoard reads them in.
    now = time.time_ns()
    name = (f"events.out.tfevents.{now // 10**9}.{socket.gethostname()}."
            f"{now % 10**9:09d}")
    self.path = os.path.join(log_dir, name)
    self._file = open(self.path, "wb")
    self._write(_event(0, file_version=FILE_VERSION))
    if purge_step is not None:
      self._write(_event(purge_step, session_status=SESSION_START))
    self._flush()

  def _write(self, record: bytes) -> None:
    length = struct.pack("<Q", len(record))
    self._file.write(length + _masked_crc(length) + record + _masked_crc(record))

  def _flush(self) -> None:
    self._file.flush()
    os.fsync(self._file.fileno())

  def write(self, step: int, values: Mapping[str, float]) -> None:
    """The scalars of one step, as one event."""
    self._write(_event(int(step), summary=_scalars(values)))
    self._flush()

  def close(self) -> None:
    self._file.close()
