"""HF weights I/O: safetensors and GGUF import, HF export, PEFT adapters (orbax train-state
checkpoints are `sage_jax.train.checkpoint`)."""
