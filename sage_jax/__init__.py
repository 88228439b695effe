"""sage_jax: SAGE (Skill Augmented GRPO for self-Evolution) on AppWorld in JAX/Flax."""
