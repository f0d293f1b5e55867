"""What the benchmark reports say about their own runs, on made-up figures."""

from specdec.eval import bench_runtime, bench_spec
from specdec.eval.prompts import STYLES


def runtime_result(cpu_kernels: bool) -> dict:
    single = {"specdec_tok_s": 30.0, "hf_generate_tok_s": 20.0, "speedup_vs_hf_generate": 1.5}
    single |= {"bandwidth_fraction": 0.5, "stream_read_gb_s": 10.0}
    batched = {"num_requests": 32, "useful_tokens": 2208, "specdec_tok_s": 90.0}
    batched |= {"speedup_vs_hf_static": 2.0, "speedup_vs_hf_continuous": 1.2}
    batched |= {"prompt_tokens_min": 53, "prompt_tokens_median": 133.5, "prompt_tokens_max": 2038}
    return {
        "dtype": "float32",
        "cpu_kernels": cpu_kernels,
        "single_stream": single,
        "batched": batched,
    }


def test_the_runtime_report_gives_the_prompt_lengths_of_the_mix():
    report = bench_runtime.markdown([runtime_result(cpu_kernels=True)])
    assert "32-req tok/s" in report
    assert "The 32 requests: prompts of 53 to 2038 tokens (median 133.5), 2208 output" in report
    assert "no CPU kernels" not in report
    assert "float32 (no CPU kernels)" in bench_runtime.markdown([runtime_result(cpu_kernels=False)])


def spec_result(prompts_per_style: int, cpu_kernels: bool) -> dict:
    names = ("specdec", "specdec+prompt_lookup", "hf", "hf+prompt_lookup")
    row: dict = {
        f"{n}_{k}": 1.0 for n in names for k in ("tok_s", "vs_specdec", "tokens", "seconds")
    }
    row |= {"prompt_lookup_ceiling_tokens_per_step": 2.0, "reference_3gram_tokens_per_step": 1.5}
    row |= {"specdec+prompt_lookup_mean_accepted_length": 1.5, "num_prompts": 5}
    row |= {"specdec+prompt_lookup_identical_outputs": 5}
    row |= {"specdec+prompt_lookup_acceptance_per_position": [0.5, 0.25]}
    concurrent = {"num_requests": 32, "specdec_tok_s": 1.0, "prompt_lookup_tok_s": 1.0}
    concurrent |= {"prompt_lookup_vs_specdec": 1.0, "prompt_lookup_identical_outputs": 32}
    return {
        "dtype": "float32",
        "prompts_per_style": prompts_per_style,
        "cpu_kernels": cpu_kernels,
        "single_stream": dict.fromkeys(STYLES, row),
        "concurrent": concurrent,
    }


def test_the_spec_report_says_how_many_prompts_of_each_style_it_ran():
    report = bench_spec.markdown(spec_result(5, cpu_kernels=True))
    assert report.startswith("dtype float32, the first 5 prompts of each style")
    assert all(f"| {style} |" in report for style in STYLES)
    assert "chat, prompt_lookup: acceptance per position 0.50 0.25" in report
    assert "32 concurrent requests: prompt_lookup 1.0 tok/s vs 1.0 without (1.00x)" in report
    report = bench_spec.markdown(spec_result(0, cpu_kernels=False))
    assert report.startswith(
        "dtype float32, WITHOUT the fused CPU kernels (torch fallback), all prompts of each"
    )
