"""Reward functions shared by recipes: small pure functions of (task, completion)."""
