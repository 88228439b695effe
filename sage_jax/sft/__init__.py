"""Supervised fine-tuning on expert trajectories: the JSONL format and tokenisation (`data`),
a tensorflow-datasets builder (`tfds_builder`), the SFT loop (`loop`) and the expert-trajectory
command (`expert`). Import the submodules directly."""
