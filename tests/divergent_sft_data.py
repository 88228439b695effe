"""`python -m <module> [flags]` whose process 1 reads the SFT data's examples in reverse order
(as on a host whose copy of the file was written in another order: the same examples, which
each step's batch picks by index), every other process as usual.

  python tests/divergent_sft_data.py sage_jax.train --config=... --workdir=...
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sage_jax.sft import data  # noqa: E402

_load_examples = data.load_examples


def _reversed(*args, **kwargs):
  return _load_examples(*args, **kwargs)[::-1]


if __name__ == "__main__":
  module = sys.argv.pop(1)
  if os.environ.get("JAX_PROCESS_ID") == "1":
    data.load_examples = _reversed
  runpy.run_module(module, run_name="__main__", alter_sys=True)
