"""Which library skills a new task sees, compared as the SAGE paper compares them: at
evaluation, on one trained run, under each of the four retrieval strategies. No training:
each arm is `python -m sage_jax.evaluate --run=RUN_DIR --step=N` with the strategy set.

  python launch/sweep.py --sweep=configs/sweeps/retrieval.py:RUN_DIR[:STEP] \\
      --workdir_root=ROOT --dry_run

STEP defaults to the run's latest RL checkpoint when the sweep is expanded, so that every arm
evaluates the same one.
"""

from orbax.checkpoint import path as ocp_path

from sage_jax import storage

STRATEGIES = ("same_scenario", "query_ngram", "query_embedding", "skill_embedding")
CHECKPOINTS = "checkpoints"  # the RL checkpoints under a run's workdir


def checkpoint_step(run_dir: str, step: str) -> int:
  """`step`, or (empty) the run's latest, of its finished RL checkpoints (a local directory or
  a bucket's: there, orbax writes a step in place and marks it finished last, so a save
  under way is not one). A named step is checked where the run has checkpoints here."""
  directory = storage.path(run_dir) / CHECKPOINTS
  steps = sorted(int(p.name) for p in directory.iterdir()
                 if p.name.isdigit() and ocp_path.step.is_path_finalized(p)
                 ) if directory.is_dir() else []
  if step:  # checked where the run's checkpoints can be seen from here
    if steps and int(step) not in steps:
      raise ValueError(f"{directory}: no finished checkpoint step {step}; its steps: {steps}")
    return int(step)
  if not steps:
    raise ValueError(f"{directory}: no checkpoint to evaluate; train the run first, or name "
                     "a step (retrieval.py:RUN_DIR:STEP)")
  return steps[-1]


def get_sweep(run_dir: str = "", step: str = ""):
  if not run_dir:
    raise ValueError("the retrieval sweep evaluates a trained run: "
                     "--sweep=configs/sweeps/retrieval.py:RUN_DIR[:STEP]")
  recorded = storage.read_json(storage.path(run_dir) / "config.json") or {}
  if (recorded.get("agent") or {}).get("use_library") is False:
    raise ValueError(f"{run_dir}: its agent keeps no skill library (agent.use_library=False), "
                     "so every retrieval strategy would evaluate alike")
  return {
      "config": "configs/eval.py:run",
      "module": "sage_jax.evaluate",
      "flags": {"run": run_dir, "step": checkpoint_step(run_dir, step)},
      "axes": [{s: {"retrieval.strategy": s} for s in STRATEGIES}],
  }
