import pytest

from specdec import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -5}, "max_tokens must be at least 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_single_stop_string():
    params = SamplingParams(stop="\n")
    assert params.stop == ["\n"]
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
