"""Checkpoints and faults: what a committed checkpoint is, stops (preemption), a full volume, divergence."""
