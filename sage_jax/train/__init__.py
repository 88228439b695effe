"""Training machinery shared by GRPO and SFT: train state, optimiser, jitted step,
checkpoints, metrics, and the RL loop. Import the submodules directly."""
