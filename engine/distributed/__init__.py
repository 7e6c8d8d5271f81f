"""Tensor parallelism's parts below the model: what each rank holds (``shard_plan``) and the process group
with its collectives (``parallel_state``: torch.distributed, gloo on CPU, NCCL on CUDA, ``env://``)."""
