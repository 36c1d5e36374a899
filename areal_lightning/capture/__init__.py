"""Capture: what a checkpoint holds (RNG states, loader positions, HF weights from any strategy)."""
