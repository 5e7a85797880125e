"""Parallel training beyond data parallel, for numpy and cupy models."""
