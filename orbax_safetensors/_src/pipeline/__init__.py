"""Save and restore: host copies, write orchestration, reads, placement, standalone files."""
