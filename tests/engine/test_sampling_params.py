"""``SamplingParams`` as a script ported from vLLM builds it: vLLM's fields it takes, the ones it refuses saying
what to use instead, and a wrong type refused at construction with a ``ValueError`` naming the field (a user
trial's ``structured_outputs={...}`` failed later with AttributeError, ``stop=5`` was a bare TypeError,
``ignore_eos="no"`` read as True, and ``extra_args``, ``guided_decoding`` and ``logits_processors`` were
"unexpected keyword argument")."""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.core_messages import params_from_wire, params_to_wire
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                                  "spaces_between_special_tokens", "detokenize"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_a_flag_must_be_a_bool(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be a bool"):
        SamplingParams(**{name: value})
    assert getattr(SamplingParams(**{name: True}), name) is True


@pytest.mark.parametrize("spec", [{"json": {"type": "object"}}, '{"type": "object"}', 5])
def test_structured_outputs_must_be_its_params_class(spec):
    with pytest.raises(ValueError, match=f"^structured_outputs must be a StructuredOutputsParams .* got "
                                         f"{type(spec).__name__}"):
        SamplingParams(structured_outputs=spec)
    assert SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})).structured_outputs


def test_stop_is_a_string_or_a_list_of_strings():
    with pytest.raises(ValueError, match="^stop must be a string or a list of strings, got int 5"):
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="^stop_token_ids must be a list of token ids, got int 2"):
        SamplingParams(stop_token_ids=2)
    with pytest.raises(ValueError, match="^stop must be non-empty strings"):
        SamplingParams(stop=["a", 5])
    assert SamplingParams(stop="a").stop == ["a"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop_token_ids=(2,)).stop_token_ids == [2]


def test_detokenize_false_refuses_stop_strings_as_vllm_does():
    with pytest.raises(ValueError, match=r"^stop strings are only supported when detokenize is True\. Set "
                                         r"detokenize=True to use stop\.$"):
        SamplingParams(detokenize=False, stop="x")
    assert SamplingParams(detokenize=False, stop_token_ids=[2]).detokenize is False


def test_extra_args_are_kept_as_vllm_keeps_them_and_cross_to_the_core():
    params = SamplingParams(extra_args={"my_plugin": {"k": [1, 2]}})
    assert params.extra_args == {"my_plugin": {"k": [1, 2]}} and SamplingParams().extra_args is None
    assert params_from_wire(params_to_wire(params)) == params
    with pytest.raises(ValueError, match="^extra_args must be a dict or None, got list"):
        SamplingParams(extra_args=["x"])


def test_guided_decoding_is_refused_naming_structured_outputs():
    with pytest.raises(ValueError, match=r"^guided_decoding is not supported: .*structured_outputs="
                                         r"StructuredOutputsParams\("):
        SamplingParams(guided_decoding={"json": {"type": "object"}})
    assert SamplingParams(guided_decoding=None) == SamplingParams()


def test_per_request_logits_processors_are_refused_saying_why():
    with pytest.raises(ValueError, match="^logits_processors are not supported: .*callable.*logit_bias"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    assert SamplingParams(logits_processors=[]) == SamplingParams(logits_processors=None) == SamplingParams()
    params = SamplingParams(logits_processors=None)
    assert params.logits_processors is None and params.guided_decoding is None   # vLLM's attributes, read
    assert dataclasses.replace(params, n=2).n == 2


def test_output_kind_takes_vllms_values_and_crosses_to_the_core():
    assert SamplingParams().output_kind is RequestOutputKind.DELTA   # what this engine's streams carry
    for kind in RequestOutputKind:
        params = SamplingParams(output_kind=kind)
        assert params_from_wire(params_to_wire(params)).output_kind is kind
        assert SamplingParams(output_kind=int(kind)).output_kind is kind   # an IntEnum, as vLLM's
    for bad in ("delta", 3, None, True):
        with pytest.raises(ValueError, match=r"^output_kind must be a RequestOutputKind \(CUMULATIVE, DELTA or "
                                             r"FINAL_ONLY\)"):
            SamplingParams(output_kind=bad)
