"""The worker: what runs the model for a scheduled step and turns its logits into tokens.

``model_runner`` (a ``SchedulerOutput`` to the model's input tensors and attention metadata), ``sampler``
(logits to tokens and logprobs), ``structured_outputs`` with ``grammar_compiler``, ``grammar_check`` and
``json_schema_subset`` (grammar bitmasks for constrained decoding), ``device`` (device, dtype and thread
resolution).
"""
