"""Decode and verification steps as captured graphs (specdec/cuda_graphs.py).

Without a GPU the whole graph path runs on the CPU (buckets, static buffers, padding tokens
writing to the sink block, padding sequences, outputs copied out) with each replay done eagerly,
through the Triton attention kernel under the interpreter; on a GPU the same tests record and
replay real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams, SpecConfig
from specdec.cuda_graphs import EagerGraph, GraphKey, bucket
from specdec.models.llama import LlamaForCausalLM
from specdec.runner import ATTENTION_BACKEND_ENV, ModelRunner, QueryChunk
from tests.test_device import FIXED_K, PARAMS, PROMPTS, OracleDrafter
from tests.tiny import hf_greedy, tiny_model

pytestmark = pytest.mark.cuda  # selected by make gpu-check
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def triton_attention(monkeypatch) -> None:
    """The CUDA attention path, on the CPU through Triton's interpreter."""
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")


def test_buckets_are_powers_of_two_up_to_the_cap() -> None:
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(40, 48) == 48 and bucket(17, 17) == 17 and bucket(9, 17) == 16


def _runner(graphs: bool) -> ModelRunner:
    """A runner of its own model (a runner points the model's layers at its KV tensors)."""
    hf = tiny_model("llama", 0)
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64, device=DEVICE)
    return ModelRunner(
        model, 16, 4, torch.float32, cuda_graphs=graphs, max_model_len=48, max_num_seqs=8
    )


def test_a_graphed_step_equals_the_eager_step_and_writes_no_real_block() -> None:
    """Three sequences (padded to four, one padding token), then a verification of mixed
    depths: the same logits and hidden states as the eager runner, the same K/V in every block
    the sequences own; the padding token's K/V went to the sink block, past the pool's."""
    eager, graphed = _runner(False), _runner(True)
    assert graphed.k_caches[0].shape[0] == eager.k_caches[0].shape[0] + 1
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # blocks 12-15 stay free
    prompts = [list(range(10, 19)), [5, 6, 7], [40, 41, 42, 43, 44, 45]]
    steps = [
        [QueryChunk(p, 0, t, 1) for p, t in zip(prompts, tables)],  # prompts: eager in both
        [QueryChunk([50 + i], len(p), t, 1) for i, (p, t) in enumerate(zip(prompts, tables))],
        [
            QueryChunk([60, 61, 62], len(prompts[0]) + 1, tables[0], 3),
            QueryChunk([63], len(prompts[1]) + 1, tables[1], 1),
            QueryChunk([64, 65], len(prompts[2]) + 1, tables[2], 2),
        ],
    ]
    for step in steps:
        want, got = eager.forward(step), graphed.forward(step)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert graphed.graphs is not None
    assert set(graphed.graphs.graphs) == {GraphKey(4, 4, 1), GraphKey(4, 8, 4)}
    for mine, theirs in zip(graphed.k_caches + graphed.v_caches, eager.k_caches + eager.v_caches):
        torch.testing.assert_close(mine[:16], theirs, rtol=1e-5, atol=1e-5)
    # The sink took the padding tokens. (Past the first layer their K/V are garbage, even zero:
    # a padding row's attention output is whatever memory the kernel left unwritten.)
    assert graphed.k_caches[0][16].any() and graphed.v_caches[0][16].any()


def test_outputs_are_copied_out_of_the_graph() -> None:
    """A step's hidden states (which a drafter may keep) stay as they were after the next
    replay of the same graph."""
    runner = _runner(True)
    runner.forward([QueryChunk(list(range(10, 16)), 0, [0, 1], 1)])
    first = runner.forward([QueryChunk([7], 6, [0, 1], 1)])[2]
    kept = first.clone()
    runner.forward([QueryChunk([8], 7, [0, 1], 1)])
    assert torch.equal(first, kept)


def test_wide_and_prompt_steps_run_eagerly() -> None:
    graphs = _runner(True).graphs
    assert graphs is not None
    decode = QueryChunk([1], 4, [0, 1], 1)
    assert graphs.takes([decode])
    assert not graphs.takes([QueryChunk([1, 2], 0, [0], 1)])  # a prompt
    assert not graphs.takes([decode, QueryChunk([1, 2, 3], 4, [2, 3], 1)])  # a prompt chunk
    assert not graphs.takes([QueryChunk(list(range(18)), 4, [0] * 6, 18)])  # wider than 17
    assert not graphs.takes([decode] * 9)  # more sequences than max_num_seqs
    assert not graphs.takes([QueryChunk([1], 48, [0] * 13, 1)])  # past max_model_len (12 blocks)


def test_the_engine_with_graphs_gives_plain_decodings_tokens(make_llm) -> None:
    """Greedy and seeded sampled requests mixed, prompt lookup and an oracle drafter verifying
    every depth, chunked prefill and a prefix-cache hit: the tokens of the engine without
    graphs, and transformers' greedy tokens, from several graphs."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [*PROMPTS, PROMPTS[1]]  # the repeat hits the prefix cache
    options = {"block_size": 4, "max_num_batched_tokens": 24, "cuda_graphs": True}
    lookup = make_llm(speculative=FIXED_K, **options)
    for prompt, out in zip(prompts, lookup.generate(prompts, greedy)):
        assert out.token_ids == hf_greedy(lookup.hf_model, prompt, 16)
    plain = make_llm(block_size=4)
    reference = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain.generate(PROMPTS, PARAMS))}
    oracle = make_llm(
        speculative=SpecConfig(OracleDrafter(reference, 5), 5, adaptive=False), **options
    )
    assert [o.token_ids for o in oracle.generate(PROMPTS, PARAMS)] == list(reference.values())
    for llm in (lookup, oracle):
        graphs = llm.engine.runner.graphs
        assert graphs is not None and len(graphs.graphs) >= 3
        assert all(
            isinstance(g, EagerGraph) != (DEVICE == "cuda") for g, _ in graphs.graphs.values()
        )
    assert oracle.engine.verifier.stats.num_accepted_tokens > 0


def test_graphs_are_refused_off_the_cuda_path(make_llm, monkeypatch) -> None:
    monkeypatch.delenv(ATTENTION_BACKEND_ENV)
    if DEVICE == "cuda":
        pytest.skip("the CUDA path is the default here")
    with pytest.raises(ValueError, match="cuda_graphs needs the CUDA path"):
        make_llm(cuda_graphs=True)


def test_a_failed_capture_falls_back_to_eager_steps(make_llm, monkeypatch, caplog) -> None:
    """A forward that cannot be recorded (on a GPU: an op that waits on the device) costs the
    graphs, never the request: a warning, then eager steps with the same tokens."""

    def refuse(self, fn):  # noqa: ANN001, ANN202
        raise RuntimeError("operation not permitted when stream is capturing")

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = make_llm(block_size=4, cuda_graphs=True)
    monkeypatch.setattr(EagerGraph, "capture", refuse)
    if DEVICE == "cuda":
        from specdec.cuda_graphs import CudaGraph

        monkeypatch.setattr(CudaGraph, "capture", refuse)
    with caplog.at_level("WARNING", logger="specdec.runner"):
        outputs = llm.generate(PROMPTS, greedy)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(llm.hf_model, prompt, 12)
    assert llm.engine.runner.graphs is None
    assert "not permitted when stream is capturing" in caplog.text
    assert "running without CUDA graphs from now on" in caplog.text
