"""Any checkpoint as a table of tensors that reads in batches (the tools and integrations read through it)."""
