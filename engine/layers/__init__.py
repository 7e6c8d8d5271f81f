"""Layers shared by the model files of ``engine/models/``: norms, gated
activations, the linear methods of projections and output heads (over the
packed bfloat16 weights and the GGUF 4-bit ones), and the
attention metadata and PyTorch attention path for the features the paged
kernels lack (sliding window, logit soft-capping). Each chooses its kernel
once, for the weights as they are, not per call."""
