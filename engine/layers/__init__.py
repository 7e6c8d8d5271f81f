"""Layers shared by the model files of ``engine/models/``: norms, gated
activations, and the attention metadata and PyTorch attention path for the
features the paged kernels lack (sliding window, logit soft-capping)."""
