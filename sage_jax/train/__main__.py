"""`python -m sage_jax.train --config=configs/sage.py:<preset> --workdir=DIR` runs the whole
pipeline (SFT, RL, evaluations, export): the same command as `python -m sage_jax.pipeline`."""

from absl import flags

from sage_jax import config_file, pipeline

if __name__ == "__main__":
  pipeline.define_flags()
  flags.adopt_module_key_flags(pipeline)  # --help lists them
  config_file.run(pipeline.main)
