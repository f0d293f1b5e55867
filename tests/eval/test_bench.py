"""specdec bench: the Spec-Bench reader, a tiny model's run end to end, the recommendation, and a
greedy mismatch failing the run."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdec.cli import main
from specdec.eval.bench import BenchConfig, run_bench
from specdec.eval.bench.load import arrival_times, break_even, paying_summary, run_in_process
from specdec.eval.bench.offline import run_offline
from specdec.eval.bench.quant import bytes_bound
from specdec.eval.bench.recommend import recommend
from specdec.eval.bench.report import offline_markdown
from specdec.eval.bench.systems import PLAIN, EngineSystem
from specdec.eval.questions import CATEGORIES, DEFAULT_DATASET, by_category, read_questions
from specdec.kernels import cpu_ops
from tests.tiny import byte_tokenizer, tiny_model

RECORDS = [  # Spec-Bench's own shape: extra fields, a category we do not ship, two turns
    {"question_id": 81, "category": "writing", "turns": ["Write a note.", "Now shorten it."]},
    {"question_id": 82, "category": "qa", "turns": ["Why is the sky blue?"], "reference": []},
    {"question_id": 83, "category": "rag", "turns": ["a b c d e f a b c d e f a b"]},
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_a_spec_bench_file_with_an_unknown_category_and_two_turns_is_read(tmp_path):
    questions = read_questions(write_jsonl(tmp_path / "question.jsonl", RECORDS))
    assert [q.question_id for q in questions] == [81, 82, 83]
    assert questions[0].turns == ("Write a note.", "Now shorten it.")
    assert questions[0].category == "writing" and questions[0].max_tokens is None
    groups = by_category(questions)
    assert list(groups) == ["qa", "rag", "writing"]  # shipped categories first, in our order


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question_id": 1, "category": "qa", "turns": []}, "'turns' must be a non-empty list"),
        ({"question_id": 1, "category": "qa", "turns": ["", "x"]}, "every turn must be"),
        ({"question_id": 1, "turns": ["x"]}, "'category' must be"),
        ({"category": "qa", "turns": ["x"]}, "'question_id' is missing"),
        ({"question_id": 1, "category": "qa", "turns": ["x"], "max_tokens": 0}, "'max_tokens'"),
    ],
)
def test_a_bad_record_is_refused_with_its_number(tmp_path, record, message):
    good = {"question_id": 0, "category": "qa", "turns": ["fine"]}
    path = write_jsonl(tmp_path / "q.jsonl", [good, record])
    with pytest.raises(ValueError, match=message) as info:
        read_questions(path)
    assert "record 2" in str(info.value)


def test_without_datasets_the_file_is_read_line_by_line(tmp_path, monkeypatch):
    """A bare GPU image may lack ``datasets``: the questions read the same without it."""
    path = write_jsonl(tmp_path / "question.jsonl", RECORDS)
    with_datasets = read_questions(path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    assert read_questions(path) == with_datasets
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match="not JSON lines"):
        read_questions(path)


def test_a_missing_dataset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no dataset at"):
        read_questions(tmp_path / "nope.jsonl")


def test_the_shipped_dataset_has_20_questions_in_each_category_and_multi_turn_chat():
    groups = by_category(read_questions(DEFAULT_DATASET))
    assert tuple(groups) == CATEGORIES
    assert all(len(qs) >= 20 for qs in groups.values())
    assert all(len(q.turns) >= 2 for q in groups["mt_bench"])


def tiny_config(tmp_path: Path, **overrides) -> BenchConfig:
    options = dict(
        model=tiny_model("llama", 0),
        tokenizer=byte_tokenizer(),
        dataset=write_jsonl(tmp_path / "question.jsonl", RECORDS),
        drafters=("prompt_lookup",),
        adaptive=False,  # a tiny model's steps are too cheap for drafts to pay
        max_new_tokens=12,
        modes=("offline", "load", "kernels"),
        peers=False,
        rates=(20.0, 400.0),
        requests_per_rate=4,
        load_max_tokens=6,
        kernel_shape=(4, 2, 64),
        out=tmp_path / "out",
        engine_options={"num_kv_blocks": 64},
    )
    return BenchConfig(**{**options, **overrides})


def test_a_tiny_model_run_writes_the_json_markdown_and_plots(tmp_path):
    result = run_bench(tiny_config(tmp_path))
    out = tmp_path / "out"
    saved = json.loads((out / "bench.json").read_text())
    assert saved["failed"] is False and not saved["offline"]["mismatches"]
    env = saved["environment"]
    assert {"versions", "cpu", "threads", "dtype"} <= set(env) and "torch" in env["versions"]
    offline = saved["offline"]
    assert offline["systems"] == ["specdec", "prompt_lookup", "hf", "hf+prompt_lookup"]
    assert list(offline["categories"]) == ["qa", "rag", "writing"]
    row = offline["overall"]["systems"]["prompt_lookup"]
    assert row["drafter"] == "prompt_lookup" and row["k"] == 8
    assert {"tok_s", "vs_specdec", "vs_hf", "acceptance_rate", "mean_accepted_length"} <= set(row)
    assert row["acceptance_per_position"] and row["mean_accepted_length"] >= 1.0
    # Three questions, the first of two turns: four outputs per system.
    assert offline["overall"]["systems"]["specdec"]["tokens"] > 0
    load = saved["load"]
    assert set(load["curves"]) == {"specdec", "prompt_lookup"}
    for points in load["curves"].values():
        assert [p["rate"] for p in points] == [20.0, 400.0]
        for p in points:
            assert p["requests_ok"] == 4 and p["requests_failed"] == 0
            assert 0 < p["ttft_p50_ms"] <= p["ttft_p90_ms"] <= p["ttft_p99_ms"]
            assert p["latency_p50_ms"] <= p["latency_p99_ms"]
    assert "prompt_lookup" in load["break_even"]
    assert load["paying"]["prompt_lookup"].startswith(("pays at", "stops paying at"))
    assert (
        f"prompt_lookup: {load['paying']['prompt_lookup']} (median"
        in (out / "bench.md").read_text()
    )
    assert saved["kernels"]["torch_ms"] > 0
    if cpu_ops.enabled():  # the CPU attention kernels beside the torch path
        rows = saved["attention"]["rows"]
        assert {r["dtype"] for r in rows} == {"bfloat16", "float32"}
        assert all(r["kernel_ms"] > 0 and r["torch_ms"] > 0 and r["speedup"] > 0 for r in rows)
        assert "## CPU attention kernels" in (out / "bench.md").read_text()
    assert saved["recommendation"]["reason"]
    report = (out / "bench.md").read_text()
    assert "## Offline, single stream" in report and "## Under load" in report
    assert "Every drafter's output equals plain decoding" in report
    assert "single stream, greedy" in report and saved["decoding"] == "greedy"
    assert "**Recommendation.**" in report and "Best exact drafter per category: qa" in report
    for png in ("speedup_by_category.png", "latency_vs_rate.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert result["plots"]


def test_open_loop_arrivals_are_seeded_poisson_and_latency_counts_from_arrival(make_llm):
    times = arrival_times(10.0, 2000, seed=3)
    assert times == arrival_times(10.0, 2000, seed=3) and times == sorted(times)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert 0.09 < sum(gaps) / len(gaps) < 0.11  # mean gap 1 / rate
    with pytest.raises(ValueError, match="positive"):
        arrival_times(0.0, 3)
    llm = make_llm()
    report = run_in_process(llm, [([1, 2, 3], 5), ([4, 5, 6, 7], 3)], [0.0, 0.05])
    assert report.errors == []
    assert sorted(r.completion_tokens for r in report.records) == [3, 5]
    assert all(r.latency_s >= r.ttft_s > 0 for r in report.records)
    assert report.duration_s >= 0.05  # the second request waited for its arrival


def test_break_even_is_the_rate_from_which_on_the_drafter_is_no_faster():
    curve = {
        "specdec": [{"rate": r, "latency_p50_ms": m} for r, m in ((1, 100), (2, 120), (4, 200))],
        "pl": [{"rate": r, "latency_p50_ms": m} for r, m in ((1, 70), (2, 125), (4, 210))],
    }
    assert break_even(curve, "pl", "specdec") == 2
    curve["pl"][2]["latency_p50_ms"] = 150  # faster again at the top: one slow point is noise
    assert break_even(curve, "pl", "specdec") is None
    curve["pl"][0]["latency_p50_ms"] = 100  # no better anywhere
    curve["pl"][2]["latency_p50_ms"] = 200
    assert break_even(curve, "pl", "specdec") == 1


def test_the_report_says_at_which_rates_a_drafter_pays():
    rates = (1, 2, 4)

    def curve(base: tuple[int, ...], mine: tuple[int, ...]) -> dict:
        return {
            "specdec": [{"rate": r, "latency_p50_ms": m} for r, m in zip(rates, base)],
            "pl": [{"rate": r, "latency_p50_ms": m} for r, m in zip(rates, mine)],
        }

    base = (100, 120, 200)
    assert paying_summary(curve(base, (90, 110, 190)), "pl", "specdec") == (
        "pays at every rate measured"
    )
    assert paying_summary(curve(base, (100, 130, 210)), "pl", "specdec") == (
        "pays at no rate measured"
    )
    assert paying_summary(curve(base, (70, 125, 210)), "pl", "specdec") == (
        "stops paying at 2.00 req/s"
    )
    # slower at the lowest rate, faster above it (a quick run's noise): not "every rate"
    assert paying_summary(curve(base, (110, 110, 190)), "pl", "specdec") == (
        "pays at 2.00, 4.00 req/s, not at 1.00"
    )


def synthetic(speedups: dict[str, float], mismatched: tuple[str, ...] = ()) -> dict:
    systems = {"specdec": {"tok_s": 10.0, "vs_specdec": 1.0}}
    for name, speedup in speedups.items():
        systems[name] = {
            "tok_s": 10.0 * speedup,
            "vs_specdec": speedup,
            "drafter": name,
            "k": 8,
            "mean_accepted_length": 2.0,
            "acceptance_rate": 0.5,
        }
    figures = {"systems": systems}
    return {
        "overall": figures,
        "categories": {"qa": figures},
        "mismatches": [{"system": n} for n in mismatched],
    }


def test_the_recommendation_follows_the_numbers():
    rec = recommend(synthetic({"prompt_lookup": 1.4, "eagle": 1.2}))
    assert rec.drafter == "prompt_lookup" and rec.k == 8 and "1.40x" in rec.reason
    rec = recommend(synthetic({"prompt_lookup": 1.1, "eagle": 1.3}))
    assert rec.drafter == "eagle"
    rec = recommend(synthetic({"prompt_lookup": 1.0, "eagle": 0.9}))
    assert rec.drafter is None and rec.reason.startswith("Run without speculation")
    rec = recommend(synthetic({"prompt_lookup": 1.4, "eagle": 1.2}, mismatched=("prompt_lookup",)))
    assert rec.drafter == "eagle"  # a drafter that changed the output is never recommended
    load = {
        "curves": {"prompt_lookup": [{"rate": 1.0}, {"rate": 4.0}]},
        "break_even": {"prompt_lookup": 4.0},
    }
    rec = recommend(synthetic({"prompt_lookup": 1.4}), load)
    assert "stops paying at 4.00 requests/s" in rec.reason
    load["break_even"]["prompt_lookup"] = None
    assert "still pays at 4.00" in recommend(synthetic({"prompt_lookup": 1.4}), load).reason


class Broken(EngineSystem):
    """A drafter system whose output differs from plain decoding's in its last token."""

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = EngineSystem.generate(self, prompt, max_tokens)
        return [*tokens[:-1], (tokens[-1] + 1) % 200] if tokens else [7]


def test_a_greedy_mismatch_is_reported_and_fails_the_run(make_llm, tmp_path, monkeypatch):
    plain = EngineSystem(PLAIN, make_llm(), None, None)
    broken = Broken(
        "broken", make_llm(speculative={"drafter": "prompt_lookup"}), "prompt_lookup", 8
    )
    questions = read_questions(write_jsonl(tmp_path / "q.jsonl", RECORDS[1:]))
    offline = run_offline([plain, broken], by_category(questions), 6)
    assert [m["system"] for m in offline["mismatches"]] == ["broken", "broken"]
    assert "OUTPUTS DIFFER FROM PLAIN DECODING: 2" in offline_markdown(offline)
    assert recommend(offline).drafter is None

    import specdec.eval.bench as bench

    def failed_run(config):  # noqa: ANN001, ANN202
        out = Path(config.out)
        return {"failed": True, "plots": [], "environment": {}, "out": out}

    monkeypatch.setattr(bench, "run_bench", failed_run)
    monkeypatch.setattr(bench.report, "markdown", lambda result: "report")
    result = CliRunner().invoke(main, ["bench", "--quick", "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert "output differs from plain decoding" in result.output


def test_a_sampled_run_seeds_each_turn_alike_and_checks_drafters_against_plain(tmp_path):
    """At temperature 1 every engine draws a turn's tokens with the same seed, so a drafter must
    still give plain decoding's output; the seed follows the run's and the prompt."""
    config = tiny_config(tmp_path, modes=("offline", "load"), temperature=1.0, top_p=0.9)
    result = run_bench(config)
    assert result["failed"] is False and not result["offline"]["mismatches"]
    assert result["offline"]["overall"]["systems"]["hf"]["tokens"] > 0  # transformers sampled
    assert all(p["requests_ok"] == 4 for p in result["load"]["curves"]["prompt_lookup"])
    assert result["decoding"].startswith("sampled at temperature 1.0, top_p 0.9")
    assert (
        "single stream, sampled at temperature 1.0" in (tmp_path / "out" / "bench.md").read_text()
    )
    sampling = config.sampling()
    params = sampling.params([5, 6, 7], 4)
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.9, 4)
    assert params.seed == sampling.params([5, 6, 7], 9).seed != sampling.params([5, 6], 4).seed
    assert replace(config, seed=1).sampling().params([5, 6, 7], 4).seed != params.seed
    assert BenchConfig(out=tmp_path).sampling().params([5], 4).temperature == 0  # greedy


def test_bad_options_get_a_clear_error(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "--temperature", "-1"])
    assert result.exit_code != 0 and "temperature" in result.output
    result = runner.invoke(main, ["bench", "--temperature", "1", "--top-p", "0"])
    assert result.exit_code != 0 and "top_p must be a number in" in result.output
    result = runner.invoke(main, ["bench", "--modes", "offline,fast"])
    assert result.exit_code != 0 and "modes must be some of" in result.output
    result = runner.invoke(main, ["bench", "--k", "4,x"])
    assert result.exit_code != 0 and "comma-separated ints" in result.output
    result = runner.invoke(main, ["bench", "--dataset", str(tmp_path / "nope.jsonl")])
    assert result.exit_code != 0 and "no dataset at" in result.output


def test_without_rates_the_load_runs_at_multiples_of_one_streams_measured_rate(tmp_path):
    result = run_bench(tiny_config(tmp_path, modes=("load",), rates=None, quick=True))
    rates = [p["rate"] for p in result["load"]["curves"]["specdec"]]
    assert len(rates) == 2 and rates[0] > 0
    assert rates[1] == pytest.approx(4 * rates[0], rel=1e-3)
    assert "offline" not in result and "recommendation" not in result


def test_wrap_mode_compares_wrap_with_transformers_generate():
    """The wrap mode's table on a tiny model: every system timed or refused, rows compared
    with transformers', resident memory read."""
    from specdec.eval.bench.wrap import markdown, run_wrap

    tokenizer = byte_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model = tiny_model()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    prompts = [[{"role": "user", "content": f"question {i} " * (i + 1)}] for i in range(8)]
    wrap = run_wrap(prompts, 12, rounds=1, model=model, tokenizer=tokenizer)
    assert [row["batch"] for row in wrap["batches"]] == [1, 8]
    for row in wrap["batches"]:
        assert set(row["tokens_per_s"]) | set(row["refused"]) == set(row["systems"])
        assert (
            row["equals_hf"]["wrap"]
            == f"{row['calls'] * row['batch']}/{row['calls'] * row['batch']}"
        )
        assert row["equals_hf"]["wrap+prompt_lookup"] == row["equals_hf"]["wrap"]
    assert {"after wrap", "after wrap at batch 8"} <= set(wrap["memory_mb"])
    assert "| 8 |" in markdown(wrap)


QSELF = "bfloat16+quantized_self k=4"  # a fixed k: no step timing before the run


@pytest.mark.integration
def test_quant_mode_measures_speed_exactness_and_quality(tmp_path, monkeypatch):
    """The quant mode on the default model, three engines and two short prompts: tokens/s
    side by side, quantized_self's output equal to bfloat16's plain decoding, its acceptance,
    and every quantization's agreement with float32 in the report."""
    config = BenchConfig(
        modes=("quant",),
        categories=("qa", "summarization"),
        questions_per_category=1,
        max_new_tokens=12,
        quant_systems=("float32", "bfloat16", QSELF),
        out=tmp_path,
    )
    import specdec.eval.bench.quant

    monkeypatch.setattr(specdec.eval.bench.quant, "QUANTIZATIONS", ("int4", "w8a8"))  # faster
    quant = run_bench(config)["quant"]
    assert {"float32", "bfloat16", QSELF} <= set(quant["speed"]["tokens"])
    assert all(n == 2 * 12 for n in quant["speed"]["tokens"].values())
    assert quant["exact"] == {QSELF: "yes"}
    assert quant["speculation"][QSELF]["verify_steps"] > 0
    assert set(quant["quality"]) == {"int4", "w8a8"}
    assert quant["quality"]["int4"]["weight_rel_change"] == 0  # the GGUF file's own codes
    assert quant["quality"]["w8a8"]["weight_rel_change"] > 0  # int8 re-rounds the 4-bit values
    assert quant["styles"] == ["qa", "summarization"]
    mb, spec = quant["weight_mb"], quant["speculation"][QSELF]
    assert 1.9 < mb["float32"] / mb["bfloat16"] < 2.1  # 4 bytes a weight against 2
    assert mb[QSELF] == mb["bfloat16"] and 0 < spec["draft_mb"] < mb["bfloat16"] / 2
    assert spec["bytes_bound"] == pytest.approx(
        bytes_bound(
            mb[QSELF],
            spec["draft_mb"],
            spec["drafts_per_verification"],
            spec["mean_accepted_length"],
        )
    )
    report = (tmp_path / "bench.md").read_text()
    assert "## Quantized weights and quantized_self" in report and f"| {QSELF} |" in report
    assert "bytes bound it at" in report
    with pytest.raises(ValueError, match="systems must include float32"):
        run_bench(BenchConfig(modes=("quant",), quant_systems=("int4",), out=tmp_path))


def test_the_bytes_bound_of_a_drafter() -> None:
    """A verification's tokens against the weights its drafts and its target step read."""
    assert bytes_bound(268, 98, 8, 6.89) == pytest.approx(1.755, abs=1e-3)  # quantized_self
    assert bytes_bound(100, 0, 0, 1) == 1  # no drafts: plain decoding's own rate
    assert bytes_bound(100, 50, 2, 1) == 0.5  # two drafts a step, every one rejected
