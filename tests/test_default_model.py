"""The embedded default model (SmolLM2-135M-Instruct): greedy output equals transformers'."""

import copy
import json
import re

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.loader import default_model_dir
from specdec.models.linear import batch_invariant_by_default

pytestmark = pytest.mark.integration

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog does not react.",
    "List three prime numbers.",
    "Explain what a hash table is in one sentence.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' greedy continuation of each chat-templated question, one at a time."""
    llm = LLM(num_kv_blocks=64)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = []
    for ids in prompts:
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(out[0, len(ids) :].tolist())
    return prompts, outputs


def truncated_draft(hf_model, num_layers: int = 2):
    """A draft for tests: the target's first layers, with its embeddings and head."""
    draft = copy.deepcopy(hf_model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.config.num_hidden_layers = num_layers
    return draft


PROMPT_LOOKUP = {"drafter": "prompt_lookup", "num_speculative_tokens": 6}  # adaptive depth
# The adaptive policy drafts only where its timings say drafts pay, which depends on the CPU: a
# config that must be seen drafting fixes k.
FIXED_LOOKUP = {**PROMPT_LOOKUP, "adaptive": False}
CONFIGS = {
    "batched": {},
    "chunked-prefill": {"max_num_batched_tokens": 20, "block_size": 8},
    "preemption": {"num_kv_blocks": 9, "block_size": 16},
    "prompt-lookup-chunked": {"max_num_batched_tokens": 24, "speculative": FIXED_LOOKUP},
    "prompt-lookup-preemption": {"num_kv_blocks": 9, "speculative": PROMPT_LOOKUP},
    "draft-model-preemption": {"num_kv_blocks": 8, "speculative": "draft"},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(hf_model, reference, name):
    prompts, expected = reference
    options = dict(CONFIGS[name])
    if options.get("speculative") == "draft":
        options["speculative"] = {
            "drafter": "draft_model",
            "num_speculative_tokens": 3,
            "adaptive": False,
            "draft_model": truncated_draft(hf_model),
        }
    llm = LLM(**options)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    preemptions = 0
    for _ in range(2):  # the second pass runs on prefix-cache hits
        outputs = llm.generate(prompts, params)
        assert [o.token_ids for o in outputs] == expected
        assert llm.engine.num_free_blocks == llm.engine.num_blocks
        preemptions += sum(o.metrics.num_preemptions for o in outputs)
    assert preemptions > 0 or "num_kv_blocks" not in options
    assert all(o.metrics.num_cached_tokens > 0 for o in outputs)
    if isinstance(options.get("speculative"), dict) and not options["speculative"].get(
        "adaptive", True
    ):
        assert llm.engine.verifier.stats.num_draft_tokens > 0


def test_embeddings_are_transformers_last_states(hf_model):
    """The default model's embeddings (float32, last-token pooling): transformers' final-norm
    state at each prompt's last token, scaled to unit length, for prompts embedded together."""
    llm = LLM(num_kv_blocks=64, max_num_batched_tokens=32)
    outputs = llm.embed(QUESTIONS)
    for question, out in zip(QUESTIONS, outputs, strict=True):
        with torch.no_grad():
            ids = torch.tensor([out.prompt_token_ids])
            state = hf_model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        expected = torch.nn.functional.normalize(state, dim=0)
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding), expected, atol=2e-5, rtol=1e-4
        )
        assert out.prompt == question


def test_mean_pooled_scores_rank_the_answer_first(hf_model):
    """``LLM.score`` on the default model (mean pooling): the cosines of transformers' mean
    final-norm states, and each question's answer ranked first among five documents."""
    questions = [
        "What is the capital of France?",
        "How do plants make food?",
        "Who wrote Romeo and Juliet?",
        "What is the boiling point of water?",
        "How many legs does a spider have?",
    ]
    answers = [
        "Paris is the capital and largest city of France.",
        "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
        "William Shakespeare wrote the tragedy Romeo and Juliet around 1595.",
        "At sea level, water boils at 100 degrees Celsius.",
        "Spiders are arachnids and have eight legs.",
    ]
    llm = LLM(num_kv_blocks=64, pooling_type="mean")

    def mean_state(text: str) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([llm.encode(text)])
            return hf_model(ids, output_hidden_states=True).hidden_states[-1][0].mean(dim=0)

    for i, question in enumerate(questions):
        scores = [o.outputs.score for o in llm.score(question, answers)]
        assert max(range(len(answers)), key=lambda j: scores[j]) == i, scores
        expected = torch.nn.functional.cosine_similarity(
            mean_state(question), mean_state(answers[i]), dim=0
        )
        assert scores[i] == pytest.approx(expected.item(), abs=1e-4)


def test_cli_generate_prints_completions():
    result = CliRunner().invoke(main, ["generate", "--max-tokens", "12", "What is 2+2?"])
    assert result.exit_code == 0, result.output
    assert "### What is 2+2?" in result.output and "finish_reason=" in result.output
    args = ["generate", "--raw", "--max-tokens", "3", "--logprobs", "2", "--repetition-penalty"]
    result = CliRunner().invoke(main, [*args, "1.2", "The capital of France is"])
    assert result.exit_code == 0, result.output
    assert re.search(
        r"' Paris' -0\.2\d\d \(rank 1\)  \[' Paris' -0\.2\d\d, ' the' -2", result.output
    )
    args = ["generate", "--raw", "--max-tokens", "3", "--prompt-logprobs", "0", "--logprobs", "0"]
    result = CliRunner().invoke(main, [*args, "The capital of France is"])
    assert result.exit_code == 0, result.output
    assert re.search(
        r"prompt: log-likelihood -\d+\.\d{3} over 4 tokens\n  ' capital' -", result.output
    )
    assert "output:\n  ' Paris' -0.2" in result.output
    args = ["generate", "--choice", "yes", "--choice", "no", "Is water wet? Answer yes or no."]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert re.search(r"\n(yes|no)\n\[2 tokens, finish_reason=stop\]", result.output)
    args = ["generate", "--regex", r"[0-9]{4}", "--max-tokens", "8", "In what year did WW2 end?"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert re.search(r"\n[0-9]{4}\n\[\d tokens, finish_reason=stop\]", result.output)


def test_cli_generate_searches_beams(hf_model):
    args = ["generate", "--raw", "--beam-width", "3", "--max-tokens", "6"]
    result = CliRunner().invoke(main, [*args, "The capital of France is"])
    assert result.exit_code == 0, result.output
    pattern = r"\[(\d)\] (.*?)\n    \[(\d+) tokens, logprob sum (-[\d.]+)"
    lines = re.findall(pattern, result.output, flags=re.S)  # a beam's text may hold new lines
    assert [int(rank) for rank, *_ in lines] == [1, 2, 3]
    scores = [float(total) / int(n) for _, _, n, total in lines]  # length_penalty 1
    assert scores == sorted(scores, reverse=True)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    expected = hf_model.generate(
        torch.tensor([ids]), num_beams=3, num_return_sequences=3, max_new_tokens=6,
        do_sample=False, early_stopping=False,
    )  # fmt: skip
    texts = tokenizer.batch_decode(expected[:, len(ids) :], skip_special_tokens=True)
    assert [text for _, text, *_ in lines] == [t.strip() for t in texts]
    refused = CliRunner().invoke(
        main, ["generate", "--beam-width", "2", "--temperature", "0.7", "Hi"]
    )
    assert refused.exit_code != 0 and "--beam-width ranks beams" in refused.output


def test_cli_generate_follows_a_json_schema_from_a_file(tmp_path):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    args = ["generate", "--json-schema", f"@{tmp_path / 'schema.json'}", "--max-tokens", "30"]
    result = CliRunner().invoke(main, [*args, "Name the capital of France as JSON."])
    assert result.exit_code == 0, result.output
    text = result.output.split("\n")[1]
    assert isinstance(json.loads(text)["city"], str), result.output
    args = ["generate", "--json-schema", '{"type": "integer", "multipleOf": 2}', "hi"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "keyword 'multipleOf' is not supported" in result.output


def test_cli_generate_follows_a_grammar_from_a_file(tmp_path):
    (tmp_path / "answer.gbnf").write_text(
        'root ::= answer "."  # one word\nanswer ::= "Yes" | "No"'
    )
    args = ["generate", "--grammar", f"@{tmp_path / 'answer.gbnf'}", "--max-tokens", "8"]
    result = CliRunner().invoke(main, [*args, "Is Paris in France? Answer yes or no."])
    assert result.exit_code == 0, result.output
    assert result.output.split("\n")[1] in ("Yes.", "No."), result.output
    result = CliRunner().invoke(main, ["generate", "--grammar", "root ::= nothing", "hi"])
    assert result.exit_code != 0 and "rule 'nothing' is used but not defined" in result.output


def test_cli_generate_writes_a_tool_call_a_structural_tag_asks_for(tmp_path):
    """A tool call as Llama's custom format writes it: the structural tag opens it at once
    (at_least_one), stops after it, and its arguments follow the function's schema."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = {"begin": "<function=get_weather>", "end": "</function>",
           "content": {"type": "json_schema", "json_schema": city}}  # fmt: skip
    spec = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "tags": [tag],
        "at_least_one": True, "stop_after_first": True}}  # fmt: skip
    (tmp_path / "tag.json").write_text(json.dumps(spec))
    args = ["generate", "--structural-tag", f"@{tmp_path / 'tag.json'}", "--max-tokens", "40"]
    result = CliRunner().invoke(main, [*args, "What is the weather in Paris?"])
    assert result.exit_code == 0, result.output
    text = result.stdout.split("\n")[1]
    assert text.startswith("<function=get_weather>") and text.endswith("</function>"), text
    arguments = json.loads(text.removeprefix("<function=get_weather>").removesuffix("</function>"))
    assert isinstance(arguments["city"], str), text
    result = CliRunner().invoke(main, ["generate", "--structural-tag", '{"format": {}}', "hi"])
    assert result.exit_code != 0 and 'structural_tag.format: must be an object with a "type"' in (
        result.output
    )


def test_cli_reports_bad_input_cleanly(tmp_path):
    result = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert result.exit_code != 0 and "Error:" in result.output and "nope" in result.output
    result = CliRunner().invoke(main, ["generate", "--max-tokens", "0", "hi"])
    assert result.exit_code != 0 and "max_tokens must be at least 1" in result.output
    result = CliRunner().invoke(main, ["generate", "--presence-penalty", "3", "hi"])
    assert result.exit_code != 0 and "presence_penalty must be a number in [-2, 2]" in result.output
    result = CliRunner().invoke(main, ["generate", "--choice", "", "hi"])
    assert result.exit_code != 0 and "choice must be a non-empty list of non-empty" in result.output


@pytest.mark.skipif(
    not batch_invariant_by_default(torch.bfloat16),
    reason="bf16 is batch-invariant by default only with AVX-512 (scalar kernels without it)",
)
def test_bf16_speculation_is_exact(hf_model):
    """bfloat16 greedy with prompt lookup gives plain decoding's tokens, alone and batched.

    bf16 rounding flips near-tied argmaxes as soon as a row's bits depend on the step around
    it; before the batch-invariant kernels most of these prompts diverged within 80 tokens.
    """
    from specdec.eval.questions import by_category, read_questions

    groups = by_category(read_questions(), 2)
    records = [q for c in ("summarization", "rag", "code_editing") for q in groups[c]]
    plain = LLM(dtype="bfloat16", num_kv_blocks=256)
    prompts = [plain.apply_chat_template(q.conversation()) for q in records]
    params = SamplingParams(temperature=0, max_tokens=64)
    expected = [plain.generate([p], params)[0].token_ids for p in prompts]
    spec = LLM(
        dtype="bfloat16",
        num_kv_blocks=256,
        max_num_batched_tokens=160,  # prefill chunks share steps with verifications
        speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 8},
    )
    assert [spec.generate([p], params)[0].token_ids for p in prompts] == expected
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.verifier.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_the_shipped_heads_draft_for_the_default_model_and_change_no_token(kind):
    """``SpecConfig(kind)`` with no ``heads=`` loads the heads shipped in the package; on our
    chat questions their first drafts are accepted far above chance (one in 4,096 draft
    tokens), and greedy output equals plain decoding's."""
    from specdec import SpecConfig
    from specdec.drafters.heads import default_heads

    if not (default_heads(kind) / "config.json").is_file():
        pytest.fail(f"no {kind} heads shipped at {default_heads(kind)}")
    params = SamplingParams(temperature=0, max_tokens=32)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    plain = [o.token_ids for o in LLM().chat(conversations, params)]
    spec = LLM(speculative=SpecConfig(kind, 4, adaptive=False))
    assert [o.token_ids for o in spec.chat(conversations, params)] == plain
    stats = spec.engine.verifier.stats
    assert stats.acceptance_per_position[0] > 0.1, stats


@pytest.mark.skipif(
    not batch_invariant_by_default(torch.bfloat16),
    reason="batch-invariant by default only with AVX-512 or AVX2 (scalar kernels without)",
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculation_keeps_every_output_of_mixed_requests(dtype: str):
    """One batch of requests that ask for everything at once (logprobs, raw logits, prompt
    logprobs, seeded sampling with top-k/p, penalties, logit bias, stop strings, JSON schema,
    choice, regex), on long and short prompts, through chunked prefill, a prefix-cache hit and
    preemption: with `quantized_self` (prompt lookup first) every token, text, finish reason,
    logprob and logit equals plain decoding's, bit for bit."""
    from specdec import SpecConfig
    from specdec.eval.questions import by_category, read_questions

    groups = by_category(read_questions(), 1)
    long = [groups[c][0].turns[0] for c in ("summarization", "code_editing", "rag")]
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    requests = [
        (long[0], SamplingParams(max_tokens=40, temperature=0, logprobs=3)),
        (long[1], SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, logprobs=1)),
        (
            long[2],
            SamplingParams(max_tokens=40, temperature=0, return_logits=True, frequency_penalty=0.5),
        ),
        (
            long[0],
            SamplingParams(
                max_tokens=30,
                temperature=1.0,
                top_k=20,
                seed=11,
                stop=["\n\n"],
                presence_penalty=0.4,
                logit_bias={13: 2.0},
            ),
        ),
        (
            "Name a famous painter, as JSON.",
            SamplingParams(max_tokens=30, seed=5, json_schema=schema),
        ),
        (
            "Say hello in French.",
            SamplingParams(max_tokens=20, seed=3, choice=["Bonjour", "Salut"]),
        ),
        (
            "Write a short poem about rain.",
            SamplingParams(
                max_tokens=40,
                temperature=0,
                prompt_logprobs=2,
                min_tokens=10,
                repetition_penalty=1.2,
            ),
        ),
        ("Give a phone number.", SamplingParams(max_tokens=20, seed=9, regex=r"[0-9]{3}-[0-9]{4}")),
    ]
    options = {"dtype": dtype, "num_kv_blocks": 110, "max_num_batched_tokens": 200}

    def run(llm: LLM) -> list:
        prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t, _ in requests]
        outputs = llm.generate(prompts, [p for _, p in requests])
        assert sum(o.metrics.num_preemptions for o in outputs) > 0  # the pool is too small
        assert sum(o.metrics.num_cached_tokens for o in outputs) > 0  # long[0] twice
        return [
            (o.token_ids, o.text, o.finish_reason, repr(o.logprobs), repr(o.prompt_logprobs),
             None if o.logits is None else o.logits.view(torch.int16).tolist())
            for o in outputs
        ]  # fmt: skip

    plain = run(LLM(**options))
    spec = LLM(**options, speculative=SpecConfig("quantized_self", lookup_first=2))
    assert run(spec) == plain
    assert spec.engine.verifier.stats.num_accepted_tokens > 0
