import pytest

from specdec import EngineConfig, SamplingParams
from specdec.config import MIN_SAMPLING_TEMPERATURE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -5}, "max_tokens must be at least 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": None}, r"top_p must be a number in \(0, 1\], got None"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\]"),
        ({"min_p": "0.1"}, r"min_p must be a number in \[0, 1\], got '0.1'"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative"),
        ({"stop_token_ids": 5}, "stop and stop_token_ids must be lists"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-45, 1e-320])
def test_temperatures_below_the_floor_decode_greedily(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE).is_greedy


def test_sampling_params_defaults_and_single_stop_string():
    params = SamplingParams(stop="\n")
    assert params.stop == ["\n"]
    vllm_defaults = SamplingParams(stop=None, stop_token_ids=None)  # vLLM's defaults are None
    assert vllm_defaults.stop == [] and vllm_defaults.stop_token_ids == []
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop == ["a", "b"]
    assert params.max_tokens == 16 and not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"num_kv_blocks": 0},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_model_len": 1},
        {"kv_cache_memory_gb": 0},
    ],
)
def test_engine_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        EngineConfig(**kwargs)
