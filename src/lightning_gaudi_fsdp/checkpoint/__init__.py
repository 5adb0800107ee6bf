"""Checkpoint formats (full, sharded, local), atomic commits and offline conversion."""
