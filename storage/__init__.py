"""Checkpoint reading, repack, the expert store, readers and the block cache."""
