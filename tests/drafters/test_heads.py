"""Medusa and EAGLE heads: training, saving and resuming, refusal of foreign heads, and exact
output (greedy equal to plain decoding, sampling law unchanged) across step shapes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import chi2_contingency

from specdec import SamplingParams, SpecConfig
from specdec.attention import AttentionMetadata
from specdec.drafters.eagle import EagleHead
from specdec.drafters.heads import WEIGHTS_FILE
from specdec.drafters.registry import UNCHECKED_CUDA_ENV
from specdec.drafters.train_heads import TrainConfig, train
from specdec.models.linear import (
    PackedLinear,
    RowLinear,
    batch_invariant_by_default,
    can_prepack,
)
from specdec.runner import ATTENTION_BACKEND_ENV
from specdec.sequence import Sequence
from specdec.verifier import draft_tokens
from tests.tiny import byte_tokenizer, tiny_model

KINDS = ["medusa", "eagle"]
TOPICS = ["the sea", "a clock", "bread", "winter", "a river", "music", "a garden", "trains"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    records = [
        {"prompt": f"Tell me about {t}, part {i}.", "max_tokens": 24}
        for t in TOPICS
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def tiny_config(kind: str, out: Path, data: Path, **overrides) -> TrainConfig:
    options = dict(
        max_train_tokens=100_000,
        max_new_tokens=32,
        max_steps=40,
        batch_tokens=1024,
        lr=1e-2,
        draft_vocab_size=200,
        held_out=4,
        save_every=10,
    )
    return TrainConfig(kind, out, data=data, **{**options, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prompts_file) -> dict[str, Path]:
    """Heads of each kind for the tiny llama of ``make_llm()`` (seed 0), trained briefly."""
    from specdec import LLM

    llm = LLM(tiny_model("llama", 0), tokenizer=byte_tokenizer())
    out = {}
    for kind in KINDS:
        out[kind] = train(tiny_config(kind, tmp_path_factory.mktemp(kind), prompts_file), llm)
    return out


def log(directory: Path) -> list[dict]:
    lines = (directory / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_the_held_out_loss(trained, kind):
    records = log(trained[kind])
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert records[-1]["held_out_loss"] < 0.9 * records[0]["held_out_loss"]
    assert records[-1]["held_out_accuracy"][0] > 0.3  # first draft position, top-1


def test_resume_continues_from_the_latest_checkpoint_and_gives_the_same_heads(
    make_llm, tmp_path, prompts_file
):
    llm = make_llm()
    # float32 here: the fixture's heads train under the default ("auto": bf16 on most CPUs)
    options = dict(max_steps=10, save_every=5, mixed_precision="no")
    whole = train(tiny_config("eagle", tmp_path / "whole", prompts_file, **options), llm)
    # An interrupted run: the corpus and the step-5 checkpoint of the same run, nothing more.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "corpus.json").write_text((whole / "corpus.json").read_text())
    checkpoint = whole / "checkpoints" / "step-000005"
    (resumed / "checkpoints" / checkpoint.name).mkdir()
    for file in checkpoint.iterdir():
        (resumed / "checkpoints" / checkpoint.name / file.name).write_bytes(file.read_bytes())
    train(tiny_config("eagle", resumed, prompts_file, **options), llm)
    assert [r["step"] for r in log(resumed)] == [10]  # steps 6..10 only
    a, b = load_file(str(whole / WEIGHTS_FILE)), load_file(str(resumed / WEIGHTS_FILE))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_eagle_paged_forward_equals_the_training_forward(make_llm):
    llm = make_llm()
    model = llm.engine.runner.model
    head = EagleHead(model.config)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    head.eval().requires_grad_(False)
    n, bs = 11, 4
    shape = (4, bs, model.config.num_kv_heads, model.config.head_dim)
    attn = head.layer.self_attn
    attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    embeds, features = torch.randn(n, 64), torch.randn(n, 64)
    cos, sin = model.rope.cos[:n], model.rope.sin[:n]
    expected = head.forward_train(embeds[None], features[None], cos, sin)[0]
    # The first 7 rows as one chunk, then 4 more reading them from the cache.
    meta = AttentionMetadata.build([7], [7], [[0, 1, 2]], torch.arange(7), bs, False)
    first = head(embeds[:7], features[:7], (cos[:7], sin[:7]), meta)
    meta = AttentionMetadata.build([4], [11], [[0, 1, 2]], torch.arange(7, 11), bs, False)
    rest = head(embeds[7:], features[7:], (cos[7:], sin[7:]), meta)
    torch.testing.assert_close(torch.cat([first, rest]), expected, rtol=1e-4, atol=1e-4)


def chat_prompt(text: str) -> list[int]:
    """A prompt as the training corpus has them: our byte tokenizer's chat template."""
    turn = [{"role": "user", "content": text}]
    rendered = byte_tokenizer().apply_chat_template(
        turn, add_generation_prompt=True, tokenize=False
    )
    return byte_tokenizer().encode(rendered, add_special_tokens=False)


PROMPTS = [chat_prompt("Tell me about the sea."), chat_prompt("a clock, please"), [7] * 30]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_equals_plain_decoding(make_llm, trained, kind, dtype):
    exact = {"batch_invariant": True} if dtype == "bfloat16" else {}  # on every CPU
    plain = make_llm(dtype=dtype, **exact)
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = make_llm(
        dtype=dtype, **exact, speculative=SpecConfig(kind, 4, adaptive=False, heads=trained[kind])
    )
    for batch in ([PROMPTS[0]], PROMPTS):  # single, then batched
        outputs = spec.generate(batch, GREEDY)
        assert [o.token_ids for o in outputs] == reference[: len(batch)]
    stats = spec.engine.verifier.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_on_the_cpu_run_the_targets_fast_linears(make_llm, trained, kind, dtype):
    """Through ``F.linear`` an EAGLE draft step cost a sixth of a target step; on the row kernels
    (float32, and bfloat16 packed in pairs with AVX-512) or oneDNN-packed weights (bfloat16
    elsewhere) it costs half that, and computes the same."""
    spec = make_llm(dtype=dtype, speculative=SpecConfig(kind, 4, heads=trained[kind]))
    drafter = spec.engine.drafter
    heads = drafter.head if kind == "eagle" else drafter.heads
    vocab = drafter.vocab if kind == "eagle" else drafter.head
    pairs = dtype == "bfloat16" and batch_invariant_by_default(torch.bfloat16)
    fast = RowLinear if dtype == "float32" or pairs else PackedLinear
    if fast is PackedLinear and not can_prepack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 on this CPU")
    linears = [
        m for m in heads.modules() if isinstance(m, (torch.nn.Linear, RowLinear, PackedLinear))
    ]
    assert linears and all(isinstance(m, fast) for m in [*linears, vocab.linear[0]])
    assert not pairs or all(m.packed is not None for m in [*linears, vocab.linear[0]])
    hidden = torch.randn(3, vocab.weight.shape[1]).to(vocab.weight.dtype)
    expected = (hidden.float() @ vocab.weight.float().T).float()
    torch.testing.assert_close(vocab.logits(hidden), expected, rtol=2e-2, atol=2e-2)


def test_a_greedy_draft_is_the_argmax_over_the_draft_vocabulary(make_llm, trained):
    """The shortcut for plain greedy rows drafts what the target's rule over the full vocabulary
    drafts; a row with something to constrain (here a logit bias) takes the full rule."""
    spec = make_llm(speculative=SpecConfig("eagle", 4, heads=trained["eagle"]))
    vocab = spec.engine.drafter.vocab
    torch.manual_seed(0)
    hidden = torch.randn(6, vocab.weight.shape[1])
    seqs = [Sequence(i, [5, 6, 7], 3, GREEDY) for i in range(6)]
    full = draft_tokens(vocab._full(vocab.logits(hidden)), seqs)
    assert vocab.draft(hidden, seqs) == full
    favoured = next(t for t in vocab.draft_vocab.tolist() if t != full[0])
    biased = SamplingParams(temperature=0, max_tokens=8, logit_bias={favoured: 100.0})
    assert vocab.draft(hidden[:2], [Sequence(9, [5, 6, 7], 3, biased), seqs[1]]) == [
        favoured,
        full[1],
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_the_adaptive_policy_prices_medusa_as_one_forward_and_eagle_as_one_per_depth(
    make_llm, trained, kind
):
    spec = make_llm(speculative=SpecConfig(kind, 4, heads=trained[kind]))
    assert spec.engine.policy.drafts_in_one_pass is (kind == "medusa")
    plain = make_llm()
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == reference


def test_eagle_is_exact_with_chunked_prefill_prefix_hits_and_preemption(make_llm, trained):
    plain = make_llm()
    long_prompts = [PROMPTS[0] * 6, PROMPTS[0] * 6 + PROMPTS[1], PROMPTS[1] * 5]
    reference = [o.token_ids for o in plain.generate(long_prompts, GREEDY)]
    spec = make_llm(
        speculative=SpecConfig("eagle", 4, adaptive=False, heads=trained["eagle"]),
        block_size=4,
        num_kv_blocks=110,
        max_num_batched_tokens=32,
    )
    for _ in range(2):  # the second time, prompts hit the prefix cache
        outputs = spec.generate(long_prompts, GREEDY)
        assert [o.token_ids for o in outputs] == reference
    assert spec.engine.verifier.stats.num_accepted_tokens > 0
    assert sum(o.metrics.num_cached_tokens for o in outputs) > 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0


def test_eagle_runs_nothing_while_it_drafts_nothing_then_catches_up(make_llm, trained):
    """A sequence the policy gives no drafts (a busy engine) costs the head no forward: its
    rows wait, counted as its catch-up tokens, and run in one forward when it drafts again."""
    plain = make_llm()
    prompt = PROMPTS[0]
    reference = plain.generate([prompt], GREEDY)[0].token_ids
    spec = make_llm(speculative=SpecConfig("eagle", 4, adaptive=False, heads=trained["eagle"]))
    drafter, policy = spec.engine.drafter, spec.engine.policy
    forwards: list[int] = []  # rows per head forward
    run = drafter._forward
    drafter._forward = lambda rows, features: forwards.append(len(features)) or run(rows, features)
    steps, backlog = [0], []
    given = policy.num_drafts

    def num_drafts(seqs, *args):
        steps[0] += 1
        if steps[0] <= 6:  # no drafts for six steps: the prompt, then five decodes
            first, queue = drafter.queued.get(seqs[0].seq_id, (0, []))
            backlog.append((first, sum(len(f) for f in queue)))
            assert drafter.catch_up_tokens(seqs[0]) == 1  # never run: its prompt is not priced
            return [0] * len(seqs)
        return given(seqs, *args)

    policy.num_drafts = num_drafts
    assert spec.generate([prompt], GREEDY)[0].token_ids == reference
    n = len(prompt)  # rows 0 .. the newest token, queued from the step before
    assert backlog == [(0, 0)] + [(0, n + i) for i in range(1, 6)]
    assert forwards[0] == n + 7  # the first forward, at the 7th step: every row so far
    assert spec.engine.verifier.stats.num_accepted_tokens > 0
    assert not drafter.queued and not drafter.written  # forgotten when finished


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_continuations_follow_the_plain_law(make_llm, trained, kind):
    """Two-sample chi-square on 4 sampled tokens, with and without the heads drafting."""
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    options = {"max_num_seqs": 512, "max_num_batched_tokens": 16384}
    plain = make_llm(**options)
    spec = make_llm(**options, speculative=SpecConfig(kind, 3, adaptive=False, heads=trained[kind]))
    samples = []
    for llm, seed in ((plain, 1), (spec, 2)):
        torch.manual_seed(seed)
        samples.append([tuple(o.token_ids) for o in llm.generate([prompt] * 2000, params)])
    stats = spec.engine.verifier.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    a, b = samples
    outcomes = sorted(set(a) | set(b))
    table = np.array([[a.count(o) for o in outcomes], [b.count(o) for o in outcomes]])
    table = table[:, table.sum(axis=0) >= 10]
    assert chi2_contingency(table).pvalue > 1e-4
    assert Counter(a) != Counter(b)  # two independent runs, not one replayed


def test_training_can_start_from_trained_heads(make_llm, tmp_path, trained, prompts_file):
    """init_from: the run starts from the given heads (at a learning rate of 0 it ends there
    too); heads of another kind or shape are refused."""
    llm = make_llm()
    corpus = (trained["eagle"] / "corpus.json").read_text()
    options = dict(max_steps=1, save_every=1, lr=0.0, init_from=trained["eagle"])
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "corpus.json").write_text(corpus)
    again = train(tiny_config("eagle", tmp_path / "again", prompts_file, **options), llm)
    a, b = load_file(str(trained["eagle"] / WEIGHTS_FILE)), load_file(str(again / WEIGHTS_FILE))
    for name in a.keys() - {"draft_vocab"}:
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(ValueError, match="holds eagle heads, not medusa heads"):
        train(tiny_config("medusa", tmp_path / "kind", prompts_file, **options), llm)
    options["init_from"] = trained["medusa"]
    with pytest.raises(ValueError, match="medusa heads in .* do not fit this run"):
        train(tiny_config("medusa", tmp_path / "shape", prompts_file, num_heads=2, **options), llm)


@pytest.mark.cuda  # selected by make gpu-check
@pytest.mark.parametrize("kind", KINDS)
def test_heads_are_exact_on_the_cuda_path(make_llm, trained, kind, monkeypatch):
    """On a GPU where there is one (the heads are let through though not yet checked there);
    without, the CUDA path in the CPU engine: the Triton attention kernel, which the EAGLE
    head's own attention takes too. Greedy and seeded output are plain decoding's."""
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    monkeypatch.setenv(UNCHECKED_CUDA_ENV, "1")
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=40), GREEDY]
    reference = [o.token_ids for o in make_llm(block_size=4).generate(PROMPTS, params)]
    options = SpecConfig(kind, 4, adaptive=False, heads=trained[kind])
    spec = make_llm(block_size=4, speculative=options)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == reference
    stats = spec.engine.verifier.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert spec.engine.runner.triton_attention
    assert getattr(spec.engine.drafter, "triton_attention", True)  # EAGLE's attention too


@pytest.mark.parametrize("kind", KINDS)
def test_heads_for_another_model_are_refused(make_llm, trained, kind):
    with pytest.raises(ValueError, match="built for a model with hidden size 64"):
        make_llm(
            model_overrides={"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1},
            speculative=SpecConfig(kind, heads=trained[kind]),
        )
    with pytest.raises(ValueError, match=f"holds {kind} heads, not"):
        other = "eagle" if kind == "medusa" else "medusa"
        make_llm(speculative=SpecConfig(other, heads=trained[kind]))


def test_a_directory_without_heads_is_refused(make_llm, tmp_path):
    with pytest.raises(ValueError, match="holds no eagle heads.*specdec train-heads"):
        make_llm(speculative=SpecConfig("eagle", heads=tmp_path))


def test_the_runner_keeps_every_token_hidden_state_only_when_asked(make_llm, trained):
    """EAGLE asks for the hidden state of every query token; Medusa and prompt lookup do not,
    and get none."""
    seen = {}
    for kind in ("eagle", "medusa", "prompt_lookup"):
        options = {} if kind == "prompt_lookup" else {"heads": trained[kind]}
        llm = make_llm(speculative=SpecConfig(kind, 2, adaptive=False, **options))
        run = llm.engine.runner.run

        def recording(out, keep_token_hidden_states=False, kind=kind, run=run):  # noqa: ANN001, ANN202
            res = run(out, keep_token_hidden_states)
            seen.setdefault(kind, []).append(res.token_hidden_states)
            return res

        llm.engine.runner.run = recording
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))
    assert all(h is not None for h in seen["eagle"])
    assert seen["eagle"][0].shape == (len(PROMPTS[0]), 64)  # the prefill: every prompt token
    assert all(h is None for h in seen["medusa"] + seen["prompt_lookup"])


def test_a_bad_mixed_precision_is_refused(prompts_file, tmp_path):
    with pytest.raises(ValueError, match="mixed_precision must be 'auto', 'bf16' or 'no'"):
        tiny_config("eagle", tmp_path, prompts_file, mixed_precision="fp8")
    assert tiny_config("eagle", tmp_path, prompts_file, mixed_precision="no").precision() == "no"


def test_eagle_copies_its_own_kv_of_a_cached_partial_block(make_llm, trained):
    """A continuation takes the earlier request's partial block as a copy: the head's K/V
    there is copied too (it reads its own cache at positions the target computed), and the
    output is plain decoding's."""
    spec = make_llm(
        speculative=SpecConfig("eagle", 4, adaptive=False, heads=trained["eagle"]), block_size=4
    )
    first = spec.generate([PROMPTS[0]], GREEDY)[0]
    copies: list[tuple[int, int]] = []
    copy = spec.engine.drafter.copy_blocks
    spec.engine.drafter.copy_blocks = lambda pairs: copies.extend(pairs) or copy(pairs)
    attn = spec.engine.drafter.head.layer.self_attn
    snapshot = attn.k_cache.clone()
    continued = PROMPTS[0] + first.token_ids
    out = spec.generate([continued], GREEDY)[0]
    assert out.metrics.num_cached_tokens == len(continued) - 1 and len(copies) == 1
    (source, target), kept = copies[0], (len(continued) - 1) % 4
    assert kept and torch.equal(attn.k_cache[target, :kept], snapshot[source, :kept])
    assert out.token_ids == make_llm().generate([continued], GREEDY)[0].token_ids
