"""Default sampling parameters from the model's generation config (vLLM's ``--generation-config``,
:mod:`specdec.generation_defaults`): read from ``generation_config.json`` or an in-memory model,
ignored with ``"vllm"``, overridden field by field, used by ``generate`` and the server wherever a
request leaves a field unset, and refused with the reason when they cannot be used."""

import json
import pathlib

import pytest

from specdec import LLM, BeamSearchParams, SamplingParams
from specdec.generation_defaults import sampling_defaults
from tests.tiny import byte_tokenizer, tiny_model

GENERATION = {
    "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
    "max_new_tokens": 7, "do_sample": True, "bos_token_id": 1,
}  # fmt: skip
DEFAULTS = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "max_tokens": 7,
}


def save_model(directory: pathlib.Path, generation: dict | None = GENERATION) -> pathlib.Path:
    tiny_model("llama").save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return save_model(tmp_path_factory.mktemp("with_generation_config"))


def test_the_models_sampling_fields_are_the_defaults(model_dir):
    llm = LLM(str(model_dir), num_kv_blocks=64, seed=3)
    assert llm.sampling_defaults == DEFAULTS
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.9, 20)
    assert (defaults.repetition_penalty, defaults.max_tokens) == (1.1, 7)
    prompts = ["hello", "The sea is"]
    implicit = llm.generate(prompts)  # unseeded requests draw from the engine's seeded generator
    explicit = LLM(str(model_dir), num_kv_blocks=64, seed=3).generate(
        prompts, SamplingParams(**DEFAULTS)
    )
    assert [o.token_ids for o in implicit] == [o.token_ids for o in explicit]
    assert all(len(o.token_ids) <= 7 for o in implicit)
    neutral = LLM(str(model_dir), num_kv_blocks=64, seed=3, generation_config="vllm")
    assert neutral.sampling_defaults == {}
    assert neutral.get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_a_directory_an_override_and_an_in_memory_model(model_dir, tmp_path):
    plain = save_model(tmp_path / "plain", generation=None)
    assert LLM(str(plain), num_kv_blocks=64).sampling_defaults == {}
    taken = LLM(str(plain), num_kv_blocks=64, generation_config=str(model_dir))
    assert taken.sampling_defaults == DEFAULTS
    overridden = LLM(
        str(model_dir), num_kv_blocks=64,
        override_generation_config={"temperature": 0.2, "max_new_tokens": 3},
    )  # fmt: skip
    assert overridden.sampling_defaults == {**DEFAULTS, "temperature": 0.2, "max_tokens": 3}
    model = tiny_model("llama")
    model.generation_config.temperature = 0.5
    assert LLM(model, tokenizer=byte_tokenizer(), num_kv_blocks=64).sampling_defaults == {
        "temperature": 0.5
    }


def test_only_what_the_config_sets_counts():
    """As vLLM reads it: the fields the config sets (``to_diff_dict``; transformers 5 leaves
    every sampling field unset by default), without do_sample."""
    import transformers

    assert sampling_defaults("auto", transformers.GenerationConfig(do_sample=True)) == {}
    config = transformers.GenerationConfig(top_k=50, max_new_tokens=9)
    assert sampling_defaults("auto", config) == {"top_k": 50, "max_tokens": 9}
    assert sampling_defaults("vllm", config) == {}
    assert sampling_defaults("auto", None) == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"generation_config": "no/such/dir"}, "or a directory holding generation_config.json"),
        ({"override_generation_config": {"temprature": 0.5}}, "'temprature' not sampling"),
        ({"override_generation_config": {"temperature": -1}}, "temperature"),
        ({"override_generation_config": {"top_p": 2}}, "generation config's sampling defaults"),
    ],
)
def test_bad_generation_configs_are_refused_with_the_reason(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), num_kv_blocks=64, **kwargs)


def test_the_server_takes_them_for_unset_fields(model_dir):
    from specdec.serving import BackgroundServer, ServerConfig, build_app

    llm = LLM(str(model_dir), num_kv_blocks=64)
    offline = LLM(str(model_dir), num_kv_blocks=64)
    server = BackgroundServer(build_app(llm, ServerConfig(served_model_name="m"))).start()
    try:
        import httpx

        body = {"prompt": "hello", "seed": 5, "max_tokens": 20, "ignore_eos": True}
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
        expected = offline.generate(
            "hello", SamplingParams(**{**DEFAULTS, "seed": 5, "ignore_eos": True})
        )[0]
        assert got["choices"][0]["text"] == expected.text
        assert got["usage"]["completion_tokens"] == 7  # max_new_tokens caps what was asked
        greedy = {**body, "temperature": 0, "top_k": 0, "repetition_penalty": 1.0}
        got = httpx.post(server.url + "/v1/completions", json=greedy, timeout=30).json()
        plain = offline.generate(
            "hello", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
        )
        assert got["choices"][0]["text"] == plain[0].text
        beams = {"prompt": "The sea", "max_tokens": 7, "n": 3, "use_beam_search": True}
        got = httpx.post(server.url + "/v1/completions", json=beams, timeout=30).json()
        texts = [c["text"] for c in got["choices"]]
        hot = offline.beam_search("The sea", BeamSearchParams(3, 7, temperature=0.6))
        assert texts == [b.text for b in hot[0].sequences]
        cold = offline.beam_search("The sea", BeamSearchParams(3, 7))
        assert texts != [b.text for b in cold[0].sequences]  # the default temperature counts
    finally:
        server.stop()
