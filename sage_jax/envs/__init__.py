"""Environments the agent acts in. Host-side only: no JAX state, no model."""
