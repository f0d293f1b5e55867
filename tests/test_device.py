"""The CUDA path of the engine: on a GPU when torch sees one; without, its Triton parts (the
paged-attention kernel for decodes and verifications, verification in one kernel launch) run in
the CPU engine under Triton's interpreter, and must give the CPU path's tokens."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters import DrafterBase
from specdec.drafters.registry import UNCHECKED_CUDA_ENV, check_drafter_device
from specdec.engine_config import EngineConfig, resolve_device
from specdec.runner import ATTENTION_BACKEND_ENV
from specdec.sequence import Sequence
from specdec.verifier import Verifier
from tests.tiny import byte_tokenizer, hf_greedy, tiny_model

pytestmark = pytest.mark.cuda  # selected by make gpu-check
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
    list(range(10, 40)) * 2,
    [7] * 13,
    [200, 17, 33],
    list(range(60, 100)),
]
PARAMS = [  # greedy and sampled rows mixed, every logits processor, an early EOS masked
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=5, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.2, min_p=0.05, seed=7, max_tokens=24, min_tokens=20),
    SamplingParams(temperature=0, max_tokens=24, min_tokens=10),
]
FIXED_K = {"drafter": "prompt_lookup", "num_speculative_tokens": 4, "adaptive": False}


class OracleDrafter(DrafterBase):
    """Drafts plain decoding's own continuation, with every third step's last draft made wrong:
    long accepted chains, rejections at every depth, bonus tokens."""

    name = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int):
        self.reference, self.k, self.steps = reference, k, 0

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step=None) -> None:
        self.steps += 1
        for seq, k in zip(seqs, num_drafts):
            future = self.reference[tuple(seq.prompt_token_ids)][seq.num_output_tokens :]
            drafts = future[: min(k, self.k, 1 + self.steps % (self.k + 1))]
            if drafts and self.steps % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % 256
            seq.spec_token_ids = drafts


def test_verification_backends_emit_identical_tokens(make_llm) -> None:
    """The walk and the one-launch kernel, fed the same keyed noise, emit the same tokens for
    greedy and sampled rows mixed: plain decoding's, whatever was drafted."""
    plain = make_llm(block_size=4)
    reference = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain.generate(PROMPTS, PARAMS))}
    emitted = {}
    for backend in ("torch", "triton"):
        drafter = OracleDrafter(reference, k=5)
        llm = make_llm(speculative=SpecConfig(drafter, 5, adaptive=False), block_size=4)
        llm.engine.verifier = Verifier(backend)
        emitted[backend] = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        stats = llm.engine.verifier.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert len(stats.drafted_per_position) == 5  # every depth verified
    assert emitted["torch"] == emitted["triton"] == [reference[tuple(p)] for p in PROMPTS]


def test_the_engine_verifies_with_the_kernel_where_asked(make_llm, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_VERIFY_BACKEND", "triton")
    assert make_llm().engine.verifier.backend == "triton"
    monkeypatch.setenv("SPECDEC_VERIFY_BACKEND", "cuda")
    with pytest.raises(ValueError, match="unknown verification backend 'cuda'"):
        make_llm()


def test_triton_paged_attention_in_the_engine(make_llm, monkeypatch) -> None:
    """Decodes and verifications through the Triton kernel beside SDPA prompts, chunked
    prefill and a prefix-cache hit: greedy output still that of transformers. Every call is
    told the longest query, so that no layer reads it back from the device (a sync)."""
    import specdec.attention

    calls = []
    kernel = specdec.attention.paged_attention_triton

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        assert isinstance(args[7], int)  # max_q_len
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(specdec.attention, "paged_attention_triton", counted)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    llm = make_llm(  # invariant mode attends on the C++ kernel, never Triton
        speculative=FIXED_K, block_size=4, max_num_batched_tokens=24, batch_invariant=False
    )
    prompts = [*PROMPTS, PROMPTS[1]]  # the repeat hits the prefix cache
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(llm.hf_model, prompt, 16)
    assert llm.engine.runner.triton_attention and calls
    assert max(calls) > 1 and llm.engine.verifier.stats.num_draft_tokens > 0


def test_drafters_not_yet_checked_on_a_gpu_are_refused_there(monkeypatch) -> None:
    cuda = torch.device("cuda")
    check_drafter_device("prompt_lookup", cuda)
    check_drafter_device("eagle", torch.device("cpu"))
    monkeypatch.delenv(UNCHECKED_CUDA_ENV, raising=False)
    for drafter in ("eagle", "medusa", "draft_model"):
        with pytest.raises(ValueError, match=f"'{drafter}' has not yet been checked on a GPU"):
            check_drafter_device(drafter, cuda)
    monkeypatch.setenv(UNCHECKED_CUDA_ENV, "1")
    check_drafter_device("eagle", cuda)
    with pytest.raises(ValueError, match="'quantized_self' runs on the CPU only"):
        check_drafter_device("quantized_self", cuda)


def test_device_names_are_checked() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this torch sees no CUDA GPU"):
            EngineConfig(device="cuda")


@needs_cuda
def test_the_engine_runs_on_cuda() -> None:
    """Weights, KV and verification on the GPU; float32 greedy with and without speculation is
    transformers' greedy, and a seeded request gives the same tokens with speculation."""
    model = tiny_model("llama", 0)
    plain = LLM(model, tokenizer=byte_tokenizer(), device="cuda", block_size=4)
    del plain  # the pool took 90% of the device; dropped, the next engine gets its memory
    plain = LLM(model, tokenizer=byte_tokenizer(), device="cuda", block_size=4, num_kv_blocks=512)
    spec = LLM(model, tokenizer=byte_tokenizer(), device="cuda", block_size=4, speculative=FIXED_K)
    assert spec.engine.runner.k_caches[0].is_cuda and spec.engine.verifier.backend == "triton"
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for llm in (plain, spec):
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, greedy)):
            assert out.token_ids == hf_greedy(model, prompt, 16)
    sampled = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    assert [o.token_ids for o in spec.generate(PROMPTS, PARAMS)] == sampled
    assert spec.engine.num_free_blocks == spec.engine.num_blocks


@needs_cuda
def test_cuda_refuses_cpu_only_modes() -> None:
    model = tiny_model("llama", 0)
    with pytest.raises(ValueError, match="batch_invariant=True is a CPU mode"):
        LLM(model, tokenizer=byte_tokenizer(), device="cuda", batch_invariant=True)
    with pytest.raises(ValueError, match="runs on the CPU kernels only"):
        LLM(model, tokenizer=byte_tokenizer(), device="cuda", quantization="int8")


def test_kv_pool_counts_memory_torch_only_caches(monkeypatch) -> None:
    """Memory a dropped engine's pool left in torch's cache is free for the next engine: the
    pool is sized after that cache is handed back (seen on an H200: without it, the second
    engine of a process found no room). Simulated, so it runs without a GPU."""
    from specdec import engine as engine_module

    gib, cached = 2**30, {"bytes": 120 * 2**30}  # a dead engine's pool, still in torch's cache
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: cached.update(bytes=0)
    )  # hands the cache back to the driver
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (140 * gib - cached["bytes"], 140 * gib)
    )
    config = EngineConfig(device="cpu", gpu_memory_utilization=0.9)
    blocks = engine_module.cuda_kv_blocks(torch.device("cuda"), config, block_bytes=gib)
    assert blocks == int(140 * 0.9) - 1  # 90% of the device, less the activations' 1 GiB
    config = EngineConfig(device="cpu", gpu_memory_utilization=0.1)
    cached["bytes"] = 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gib, 140 * gib))
    with pytest.raises(ValueError, match="no room for a KV cache on cuda: 100.0 of 140.0 GiB"):
        engine_module.cuda_kv_blocks(torch.device("cuda"), config, block_bytes=gib)
