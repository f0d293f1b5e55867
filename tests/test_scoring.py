"""``LLM.score`` (:mod:`specdec.scoring`): the cosine similarity of two texts' embeddings, one
text against many or pair by pair, equal to the cosine of transformers' pooled final states;
bad pairings refused before anything runs."""

import math

import pytest
import torch

from specdec.pooling import PoolingParams
from specdec.scoring import cosine_similarity, pair_scores, score_pairs
from tests.test_embeddings import reference

QUERY = [5, 6, 7, 8, 9, 10]
DOCUMENTS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11], list(range(20, 60)), [3]]


def expected_score(hf_model, a: list[int], b: list[int], pooling_type: str = "last") -> float:  # noqa: ANN001
    u, v = reference(hf_model, a, pooling_type), reference(hf_model, b, pooling_type)
    return torch.nn.functional.cosine_similarity(u.double(), v.double(), dim=0).item()


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_one_query_against_documents_is_the_cosine_of_transformers_states(make_llm, pooling_type):
    llm = make_llm(block_size=4, pooling_type=pooling_type)
    outputs = llm.score(QUERY, DOCUMENTS)
    assert len(outputs) == len(DOCUMENTS)
    for out, document in zip(outputs, DOCUMENTS, strict=True):
        expected = expected_score(llm.hf_model, QUERY, document, pooling_type)
        assert out.outputs.score == pytest.approx(expected, abs=1e-5)
        assert out.prompt_token_ids == QUERY + document
    assert outputs[0].outputs.score == pytest.approx(1.0, abs=1e-12)  # the same text
    # the query ran once: every pair names the same first request
    assert len({out.request_id.split("_")[0] for out in outputs}) == 1
    assert len({out.request_id for out in outputs}) == len(DOCUMENTS)


def test_lists_of_equal_length_pair_by_position(make_llm):
    llm = make_llm(block_size=4)
    firsts, seconds = DOCUMENTS[:3], DOCUMENTS[1:]
    outputs = llm.score(firsts, seconds)
    for out, a, b in zip(outputs, firsts, seconds, strict=True):
        assert out.outputs.score == pytest.approx(expected_score(llm.hf_model, a, b), abs=1e-5)
    swapped = llm.score(seconds, firsts)  # the cosine is symmetric
    for one, other in zip(outputs, swapped, strict=True):
        assert one.outputs.score == pytest.approx(other.outputs.score, abs=1e-12)


def test_text_prompts_truncation_and_pooling_params(make_llm):
    llm = make_llm(block_size=4)
    text = llm.score("hello there", ["hello there", "general kenobi"])
    ids = llm.score({"prompt_token_ids": llm.encode("hello there")}, [llm.encode("general kenobi")])
    assert text[1].outputs.score == pytest.approx(ids[0].outputs.score, abs=1e-12)
    truncated = llm.score(DOCUMENTS[2], [DOCUMENTS[2][-7:]], truncate_prompt_tokens=7)[0]
    assert truncated.outputs.score == pytest.approx(1.0, abs=1e-12)
    assert len(truncated.prompt_token_ids) == 14
    raw = llm.score(QUERY, DOCUMENTS[1:3], pooling_params=PoolingParams(normalize=False))
    unit = llm.score(QUERY, DOCUMENTS[1:3])
    for a, b in zip(raw, unit, strict=True):  # the cosine does not depend on the vectors' length
        assert a.outputs.score == pytest.approx(b.outputs.score, abs=1e-6)


def test_scoring_beside_generation_changes_no_token(make_llm):
    from tests.test_embeddings import GREEDY

    plain = make_llm(block_size=4).generate([QUERY, DOCUMENTS[2]], GREEDY)
    llm = make_llm(block_size=4, max_num_batched_tokens=16)
    stream = llm.stream(QUERY, GREEDY)
    first = next(stream)
    scores = llm.score(QUERY, DOCUMENTS)  # steps the stream's request along with its own
    rest = list(stream)
    assert first.token_ids + [t for d in rest for t in d.token_ids] == plain[0].token_ids
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    ("data_1", "data_2", "message"),
    [
        ([], ["a"], "data_1 is empty"),
        ("a", [], "data_2 is empty"),
        (["a", "b"], ["a", "b", "c"], "data_1 has 2 texts and data_2 3"),
    ],
)
def test_bad_pairings_are_refused_before_anything_runs(make_llm, data_1, data_2, message):
    llm = make_llm()
    with pytest.raises(ValueError, match=message):
        llm.score(data_1, data_2)
    assert not llm.engine.has_unfinished()


def test_a_bad_prompt_leaves_nothing_on_the_engine(make_llm):
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        llm.score("hello", ["a", [5] * 80])
    assert not llm.engine.has_unfinished()


def test_pairing_and_cosine_arithmetic():
    assert score_pairs(1, 3) == [0, 0, 0] and score_pairs(3, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="query has 2 texts and documents 3"):
        score_pairs(2, 3, ("query", "documents"))
    assert cosine_similarity([1, 0], [0, 2]) == 0.0
    assert cosine_similarity([1, 1], [2, 2]) == pytest.approx(1.0, abs=1e-15)
    assert cosine_similarity([0, 0], [1, 2]) == 0.0  # a zero vector has no direction
    assert pair_scores([[1, 0]], [[1, 0], [-1, 0], [1, 1]]) == pytest.approx(
        [1.0, -1.0, 1 / math.sqrt(2)]
    )
