"""Exports a training run's checkpoint to Hugging Face format.

  python -m sage_jax.export --workdir=RUN [--step=N] [--stage=rl|sft] [--dtype=D] \
      [--overwrite] --out=HF_DIR

Restores the latest (or given) checkpoint of RUN with the config saved beside it, writes
config.json, generation_config.json, sharded safetensors and the tokenizer files
(`transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)` loads them; a LoRA run's
adapters merged in, and also in PEFT's format under HF_DIR/lora_adapter), plus the run's
resolved config (sage_jax_config.json) and a model card (README.md) with the training
summary. A run from an HF directory (model.spec) ships that directory's own tokenizer files
(chat template, special tokens, model_max_length) and generation_config.json values, so the
export loads like the source, when its tokenizer encodes text to the ids the run trained with
(`hf.export_tokenizer_dir`); otherwise, and for other runs, the run's tokenizer. The weights
are in the dtype of the HF checkpoint the run started from (its config.json's: bfloat16 for
the Qwen2.5 releases, whatever the run's param_dtype), else (a random init, a .gguf file, the
bundled model) in the run's param_dtype; --dtype overrides both. RUN and HF_DIR may be remote
(gs://...): the files are written locally, then uploaded (`sage_jax.storage`). HF_DIR is
replaced only if it is missing, empty or a previous export of the same checkpoint (its
sage_jax_export.json records the run, stage and step; --overwrite replaces an export of
another), and never when it is or contains RUN or the source model (`hf.check_export_target`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import jax
import ml_collections
from absl import app, flags

from sage_jax import multihost, run_checkpoint, run_config, storage
from sage_jax.weights import hf, loader
from sage_jax.weights.peft_adapter import write_peft_adapter

# Where a LoRA run's adapters go, in PEFT's format, beside the merged weights.
ADAPTER_DIR = "lora_adapter"


def export_of(workdir: str | os.PathLike, stage: str | None, step: int) -> dict:
  """What an export of checkpoint `stage` `step` of the run in `workdir` is of (stage None: the
  run's starting weights), as its `hf.EXPORT_MARKER` records it."""
  return {"run": os.fspath(storage.path(workdir)), "stage": stage, "step": int(step)}


def _described(of) -> str:
  if not isinstance(of, dict) or "run" not in of:
    return "no recorded run (an export of another kind, or by an earlier version)"
  return f"run {of['run']}, " + (f"{of['stage']} step {of['step']}" if of["stage"]
                                 else "its starting weights")


def _check_previous(out: str, of: Mapping) -> None:
  """Fails when `out` holds an export of other weights than `of` (`export_of`), as its marker
  records (an export that records nothing counts as other weights): replacing it would lose,
  say, a run's final model to another run's checkpoint."""
  marker = storage.read_json(storage.path(out) / hf.EXPORT_MARKER)
  previous = marker.get("of") if isinstance(marker, dict) else None
  if marker is not None and previous != of:
    raise hf.ExportError(
        f"{out} holds the export of {_described(previous)}, and this one is of "
        f"{_described(of)}: exporting there would replace it; choose another --out, or pass "
        "--overwrite to replace it")


def check_target(out: str, keep: Sequence[str] = (), of: Mapping | None = None,
                 remedy: str = hf.CHOOSE_ANOTHER) -> None:
  """`hf.check_export_target` on every process, failing on all when it fails on any: a local
  `out` may exist on one host only, and a host that stopped alone would leave the others
  waiting in the gathers. With `of`, a previous export at `out` must be of the same weights
  (`_check_previous`)."""
  try:
    hf.check_export_target(out, keep, remedy)
    if of is not None:
      _check_previous(out, of)
    refused = None
  except hf.ExportError as e:
    refused = e
  if multihost.any_process(refused is not None):
    raise refused or hf.ExportError(f"{out}: refused as the export directory on another host")


def source_dtype(base_model: str) -> str | None:
  """The dtype of the weights a run started from, `base_model` (its model.spec): what an HF
  directory's config.json states; None for no spec, a directory without config.json, and GGUF
  weights (a .gguf file, the bundled model), quantised with no dtype to return to."""
  if (not base_model or base_model == loader.BUNDLED_0P5B
      or not os.path.isfile(os.path.join(base_model, "config.json"))):
    return None
  return hf.stated_dtype(base_model)


def write_model(model, out: str, tokenizer_dir: str | os.PathLike, *,
                base_model: str = "", dtype: str | None = None,
                text_files: Mapping[str, str] | None = None, of: dict | None = None,
                overwrite: bool = False) -> None:
  """The HF directory of `model`, whose ids are `tokenizer_dir`'s, in `dtype` (default: the
  dtype `base_model` is stored in, `source_dtype` as process 0 reads it, else the model's
  param_dtype: float32 master weights trained from a bfloat16 release export as bfloat16, as
  the release ships), with the tokenizer and generation settings of `base_model`, the spec the
  run loaded, where it is an HF directory whose tokenizer encodes as `tokenizer_dir`'s
  (`hf.write_hf`), else `tokenizer_dir`; with LoRA, the adapters merged in and also alone
  under `out/lora_adapter` in PEFT's format, naming `base_model` as others load it
  (`loader.release`); `text_files` (name -> text) beside them. `of` (`export_of`): the weights
  the export is of, which its marker records; a previous export at `out` of others is
  refused, unless `overwrite`. Every file is written before the directory takes `out`'s place
  (`hf.export_dir`), so an interrupted export never looks complete. Every process calls it
  (the gathers are collective); process 0 writes."""
  # A remote `out` is replaced by the staged copy, unseen by export_dir.
  check_target(out, of=None if overwrite else of)
  dtype = dtype or multihost.from_lead(lambda: source_dtype(base_model))
  writer = jax.process_index() == 0
  with (storage.staged_dir(out, writer=writer) as local,
        hf.export_dir(local, writer=writer, of=of) as directory):
    hf.write_hf(model, directory, dtype=dtype, tokenizer_dir=os.fspath(tokenizer_dir),
                source_dir=base_model or None)
    if model.config.lora.enabled:
      base = loader.release(base_model)
      write_peft_adapter(model, directory and os.path.join(directory, ADAPTER_DIR),
                         base_model=base.name, base_revision=base.revision)
    for name, text in (text_files or {}).items() if directory is not None else ():
      with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        f.write(text)


def export(workdir: str, out: str, step: int | None = None, stage: str = "rl",
           dtype: str | None = None, overwrite: bool = False) -> dict:
  """Writes the checkpoint's model to `out` (in `dtype`, default `write_model`'s) with
  the run's config (sage_jax_config.json) and a model card (README.md); returns what was
  exported. A previous export at `out` of another run, stage or step is replaced only with
  `overwrite`."""
  config = run_checkpoint.read_config(workdir)
  # Checked before the restore, which can take minutes for a large model.
  check_target(out, keep=[p for p in (workdir, config.model.spec) if p])
  step = run_checkpoint.checkpoint_step(workdir, stage, step)
  of = export_of(workdir, stage, step)
  check_target(out, of=None if overwrite else of)
  run = run_config.resolve(config)
  # write_model gathers each tensor and process 0 writes.
  model, step = run_checkpoint.restore_model(workdir, run, step, stage)
  summary = storage.read_json(storage.path(workdir) / "summary.json") or {}
  write_model(model, out, run_checkpoint.tokenizer_dir(workdir, run),
              base_model=config.model.spec, dtype=dtype,
              text_files=run_files(config, stage, step, summary), of=of, overwrite=overwrite)
  return {"out": out, "stage": stage, "step": step}


def run_files(config: ml_collections.ConfigDict, stage: str | None, step: int,
              summary: dict) -> dict[str, str]:
  """The text files an export of a run holds beside the model: the run's resolved config
  and a model card (of checkpoint `stage` `step`; stage None: no stage trained)."""
  return {"sage_jax_config.json": json.dumps(config.to_dict(), indent=2),
          "README.md": model_card(config, stage, step, summary)}


def model_card(config: ml_collections.ConfigDict, stage: str | None, step: int,
               summary: dict) -> str:
  """The README.md of an export of checkpoint `stage` `step`, with `summary`'s before/after
  table only where it evaluated those weights (its "weights"): the pipeline's evaluations
  are of its final weights, not of an earlier checkpoint exported from the run."""
  method = ("GRPO baseline (single-task rollouts)" if config.grpo.single_task
            else f"SAGE, reward '{config.reward.variant}', chain length "
                 f"{config.grpo.chain_length}")
  base = (loader.release(config.model.spec) if config.model.spec
          else f"random-init preset {config.model.preset}")
  lines = [
      "---", "library_name: transformers", "tags: [sage, grpo, appworld, qwen2]", "---", "",
      "# Tool-using agent trained with sage_jax", "",
      f"- Base model: {base}",
      f"- Method: {method}; group size {config.grpo.group_size}",
      f"- Checkpoint: {stage} step {step}" if stage else
      "- Checkpoint: none (the base model's weights, untrained)",
      f"- Data: {config.pipeline.data} (train split '{config.pipeline.train_split}')", "",
  ]
  evaluated = summary.get("weights") if summary.get("table") else None
  if evaluated and (evaluated["stage"], evaluated["step"]) == (stage, step):
    lines += ["## Dev evaluation (before / after training)", "", summary["table"], ""]
  elif evaluated:
    of = (f"{evaluated['stage']} step {evaluated['step']}" if evaluated["stage"]
          else "the base model's weights")
    lines += [f"The run's dev evaluation (summary.json) is of another checkpoint ({of}), "
              "not of this one.", ""]
  lines += ["The full resolved training config is in `sage_jax_config.json`.", ""]
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  multihost.initialize()
  try:
    result = export(flags.FLAGS.workdir, flags.FLAGS.out, flags.FLAGS.step, flags.FLAGS.stage,
                    flags.FLAGS.dtype, flags.FLAGS.overwrite)
  # Not a run, a config.json that is not JSON, no such step, a bad --out.
  except (FileNotFoundError, storage.WorkdirError, hf.ExportError) as e:
    raise app.UsageError(str(e)) from e
  multihost.finish()
  if multihost.is_lead():
    print(json.dumps(result))


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("out", None, "Directory to write the HF model to.", required=True)
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_enum("stage", "rl", list(run_checkpoint.STAGE_DIRS), "Which stage's checkpoints.")
  flags.DEFINE_enum("dtype", None, list(hf.NP_DTYPES), "Dtype of the exported weights "
                    "(default: the source checkpoint's, else the run's param_dtype).")
  flags.DEFINE_bool("overwrite", False, "Replace a previous export at --out of another run, "
                    "stage or step (never a directory that is not an export).")
  app.run(main)
