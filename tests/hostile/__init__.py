"""A corpus of forged and damaged checkpoints, generated in code (see :mod:`.corpus`)."""
