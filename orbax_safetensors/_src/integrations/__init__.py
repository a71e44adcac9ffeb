"""Framework integrations: Flax NNX models and PyTorch / Hugging Face."""
