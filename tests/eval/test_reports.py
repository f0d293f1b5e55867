"""What the runtime report says about its own runs, on made-up figures."""

from specdec.eval.bench import runtime as bench_runtime


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
