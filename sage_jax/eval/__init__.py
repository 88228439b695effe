"""Evaluation helpers: metrics over episode records, AppWorld's own scoring, reports."""
