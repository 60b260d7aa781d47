"""The model: where it comes from and what it may load, its memory plan, the recipe (SFTConfig, attention, optimizer, sharding)."""
