"""Exactness across step shapes, in bfloat16: a position's logits never depend on its step.

Speculative decoding gives plain decoding's tokens only if the target computes every position's
logits with the same bits however the step around it was composed: decoded alone, verified
among 0..k drafts, beside other sequences of other depths, in a prompt chunk beside decodes, in
a prefill cut anywhere, after a prefix-cache hit or a preemption. bf16 rounding turns a one-ulp
difference into a flipped near-tie within a few dozen tokens, so these tests compare bits, not
just tokens.

* :func:`test_logits_do_not_depend_on_the_step` composes random steps on the default model
  with prompts of 20 to 2,000 tokens, and compares every row with the same position in a lone
  prefill.
* :func:`test_engine_logits_and_tokens_equal_plain_decoding` runs the engine with a drafter
  forced through every depth 0..k (right and wrong drafts) on a random model of the default
  model's widths, many sequences at once, chunked
  prefill, prefix caching on and off and preemption, and checks that every logits row the
  verifier reads for an accepted position has plain decoding's bits and that the tokens match.
* :func:`test_invariance_holds_without_amx` repeats the first on oneDNN's AVX512-BF16 code path
  (``ONEDNN_MAX_CPU_ISA``), the CPUs on which oneDNN's bf16 GEMM changes a row's bits with the
  row count: the linears must not depend on it.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest
import torch

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters import DrafterBase
from specdec.kernels import cpu_ops
from specdec.models.linear import batch_invariant_by_default
from specdec.runner import ModelRunner, QueryChunk
from specdec.sequence import Sequence

pytestmark = pytest.mark.skipif(
    not (batch_invariant_by_default(torch.bfloat16) and cpu_ops.enabled()),
    reason="batch-invariant bf16 at vector speed needs the CPU kernels (AVX-512, or AVX2 and FMA)",
)
BLOCK = 16
WIDE = {  # the default model's widths, with 2 layers and a small vocabulary
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 512,
    "max_position_embeddings": 2304,
    "initializer_range": 0.05,
}


def default_runner(num_blocks: int, quantization: str | None = None) -> ModelRunner:
    """The default model's runner in bf16: its trained weights and activations round in ways
    random weights rarely do (oneDNN's row differences vanished on random models)."""
    llm = LLM(
        dtype="bfloat16", num_kv_blocks=num_blocks, block_size=BLOCK, quantization=quantization
    )
    assert llm.engine.runner.model.batch_invariant
    return llm.engine.runner


def check_random_steps(num_steps: int, seed: int = 0, quantization: str | None = None) -> None:
    """Prefill each prompt alone, then run ``num_steps`` random steps that recompute windows of
    prompts: lone one-token decodes, several prompts at once with 1 to 9 rows each, and prompt
    chunks beside them. Every row must equal the lone prefill's row, bit for bit."""
    rng = random.Random(seed)
    lengths = [20, 75, 300, 700, 2000]
    tables, first = [], 0
    for n in lengths:
        tables.append(list(range(first, first + -(-n // BLOCK))))
        first += len(tables[-1])
    runner = default_runner(first, quantization)
    vocab = runner.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    reference = [runner.forward([QueryChunk(p, 0, t, len(p))])[0] for p, t in zip(prompts, tables)]
    for step in range(num_steps):
        order = rng.sample(range(len(prompts)), rng.randint(1, len(prompts)))
        if step % 3 == 0:  # a lone decode: oneDNN runs one row by another kernel than many
            order = order[:1]
        wide = rng.choice(order) if step % 3 == 1 else None  # a prompt chunk beside the rest
        windows = []
        for i in order:
            n = rng.randint(18, 300) if i == wide else rng.randint(1, 9) if step % 3 else 1
            n = min(n, lengths[i])
            start = rng.randrange(lengths[i] - n + 1)
            windows.append((i, start, start + n))
        chunks = [QueryChunk(prompts[i][a:b], a, tables[i], b - a) for i, a, b in windows]
        rows = runner.forward(chunks)[0].split([b - a for _, a, b in windows])
        for (i, a, b), got in zip(windows, rows):
            assert torch.equal(got, reference[i][a:b]), f"step {step}: prompt {i} [{a}, {b})"


@pytest.mark.integration
@pytest.mark.parametrize("quantization", [None, "int4", "w4a8"])
def test_logits_do_not_depend_on_the_step(quantization: str | None) -> None:
    check_random_steps(40 if quantization is None else 20, quantization=quantization)


@pytest.mark.integration
@pytest.mark.skipif(
    " avx512_bf16" not in cpu_ops.cpu_flags(),
    reason="the oneDNN code path it caps to needs AVX512-BF16, which this CPU lacks",
)
def test_invariance_holds_without_amx() -> None:
    """oneDNN capped at AVX512-BF16 (no AMX), where its bf16 GEMM gives a row other bits in a
    one-row call than in a call of several rows: before the row kernel took every invariant
    linear, this failed."""
    code = "from tests.test_exactness import check_random_steps; check_random_steps(12)"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


class ForcedDepthDrafter(DrafterBase):
    """Drafts ``0..k`` tokens per sequence and step, at random: plain decoding's continuation,
    sometimes corrupted at a random position, so every depth and every rejection point runs."""

    name = "forced_depth"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int, seed: int):
        self.reference, self.k, self.rng = reference, k, random.Random(seed)

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step=None) -> None:  # noqa: ANN001
        for seq, limit in zip(seqs, num_drafts):
            future = self.reference[tuple(seq.prompt_token_ids)][seq.num_output_tokens :]
            drafts = future[: self.rng.randint(0, min(limit, self.k))]
            if drafts and self.rng.random() < 0.3:
                j = self.rng.randrange(len(drafts))
                drafts[j] = (drafts[j] + 1) % 256
            seq.spec_token_ids = drafts


def record_logits(llm: LLM) -> dict[tuple[tuple[int, ...], int], str]:
    """Hash, per (prompt, position), the logits row the verifier reads for the token after that
    position, for every row whose context was real tokens (accepted drafts and the bonus row)."""
    seen: dict[tuple[tuple[int, ...], int], str] = {}
    verify = llm.engine.verifier.verify

    def recording(out, res):  # noqa: ANN001, ANN202
        verification = verify(out, res)
        emitted = verification.emitted
        rows = res.logits.split(res.num_logit_rows)
        for i, logits in zip(res.sample_indices, rows):
            seq = out.seqs[i]
            for j in range(len(emitted[i])):  # rows 0..accepted: their contexts were all right
                digest = hashlib.sha1(logits[j].numpy().tobytes()).hexdigest()
                seen[(tuple(seq.prompt_token_ids), seq.num_tokens - 1 + j)] = digest
        return verification

    llm.engine.verifier.verify = recording  # type: ignore[method-assign]
    return seen


def engine_prompts(rng: random.Random) -> list[list[int]]:
    """Random byte prompts of 20 to 2,000 tokens, a few sharing a long prefix (cache hits)."""
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (20, 37, 150, 600, 2000)]
    shared = [rng.randrange(256) for _ in range(300)]
    prompts += [shared + [rng.randrange(256) for _ in range(n)] for n in (5, 40)]
    return prompts


@pytest.mark.parametrize(
    "options",
    [
        {"enable_prefix_caching": True, "max_num_batched_tokens": 64},
        {"enable_prefix_caching": False, "max_num_batched_tokens": 300},
        {"enable_prefix_caching": True, "max_num_batched_tokens": 128, "num_kv_blocks": 140},
        {"enable_prefix_caching": True, "max_num_batched_tokens": 64, "quantization": "int4"},
        {"enable_prefix_caching": True, "max_num_batched_tokens": 64, "quantization": "w4a8"},
    ],
    ids=["chunked-prefix-cache", "no-prefix-cache", "preemption", "int4-chunked", "w4a8-chunked"],
)
def test_engine_logits_and_tokens_equal_plain_decoding(options: dict, make_llm) -> None:  # noqa: ANN001
    model = {**WIDE, "vocab_size": 300}  # the default model's widths, the byte tokenizer
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = engine_prompts(random.Random(1))
    quantization = options.get("quantization")
    plain = make_llm(
        dtype="bfloat16", model_overrides=model, block_size=BLOCK, quantization=quantization
    )
    plain_logits = record_logits(plain)
    reference = {tuple(p): plain.generate([p], params)[0].token_ids for p in prompts}
    for k in (1, 8):
        drafter = SpecConfig(ForcedDepthDrafter(reference, k, seed=k), k, adaptive=False)
        spec = make_llm(
            dtype="bfloat16",
            model_overrides=model,
            block_size=BLOCK,
            speculative=drafter,
            **options,
        )
        spec_logits = record_logits(spec)
        outputs = spec.generate(prompts, params)
        assert [o.token_ids for o in outputs] == [reference[tuple(p)] for p in prompts]
        assert spec_logits.keys() <= plain_logits.keys()
        differ = [key[1] for key in spec_logits if spec_logits[key] != plain_logits[key]]
        assert not differ, f"k={k}: logits differ at positions {differ[:10]}"
        stats = spec.engine.verifier.stats
        assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
        if "num_kv_blocks" in options:
            assert sum(o.metrics.num_preemptions for o in outputs) > 0
