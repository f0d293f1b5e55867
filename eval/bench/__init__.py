"""``specdec bench``: which drafter, with which k, makes *this* workload faster, alone and under
load, and by how much.

Modes (``--modes``, comma-separated; default ``offline,load``):

* ``offline`` (:mod:`.offline`): single stream, greedy (or sampled, ``--temperature``, each turn
  seeded alike on every engine), every question of a Spec-Bench-format
  dataset (:mod:`specdec.eval.questions`) on the engine without speculation, with each drafter,
  on ``transformers`` ``generate`` (plain and its assisted generation) and on llama.cpp when
  installed: tokens/s, speedups, acceptance rate, mean accepted length, acceptance per position;
  every drafter's output checked against plain decoding.
* ``load`` (:mod:`.load`): open-loop Poisson arrivals at several rates, with and without each
  drafter (in process) or against a running server (``url``): throughput, TTFT, inter-token and
  end-to-end latency at p50/p90/p99, and the rate where speculation stops paying.
* ``runtime`` (:mod:`.runtime`): the engine without speculation against ``transformers``,
  single stream and a 32-request batch, and the share of memory bandwidth decode reaches.
* ``kernels`` (:mod:`.kernels`): the verification kernel's micro-benchmark.
* ``wrap`` (:mod:`.wrap`): ``specdec.wrap(model).generate`` against the model's own
  ``generate``, plain and assisted, at batch 1 and 8, and the resident memory wrapping adds.
* ``quant`` (:mod:`.quant`): float32, bfloat16, int8, int4, w8a8, w4a8 and bfloat16 with
  ``quantized_self`` drafts on the default model, single stream, with llama.cpp on the same GGUF
  file when installed; ``quantized_self`` acceptance; each quantization's agreement with float32.
* ``embed`` (:mod:`.embed`): ``LLM.embed`` against transformers computing the same vectors.
* ``lora`` (:mod:`.lora`): decoding through LoRA adapters (one, and several mixed in a step)
  against the engine without one and against transformers with PEFT, on the default model.
* ``guided`` (:mod:`.guided`): grammar-guided tasks with and without drafters, and llama.cpp
  following the same grammars on the same GGUF file when installed.

Then a recommendation (:mod:`.recommend`), and in ``out``: ``bench.json`` (every figure and the
environment), ``bench.md`` and PNG plots. Every ratio compares systems run side by side in this
one process. An output that differs from plain decoding fails the run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec.eval.bench import report
from specdec.eval.bench.load import (
    arrival_times,
    break_even,
    paying_summary,
    run_in_process,
    run_over_http,
)
from specdec.eval.bench.offline import run_offline
from specdec.eval.bench.recommend import recommend
from specdec.eval.bench.systems import (
    PLAIN,
    LlamaCpp,
    Sampling,
    available_drafters,
    engine_systems,
    hf_systems,
)
from specdec.eval.questions import DEFAULT_DATASET, by_category, read_questions

MODES = ("offline", "load", "runtime", "kernels", "wrap", "quant", "embed", "lora", "guided")
RATE_MULTIPLIERS = (0.5, 1.0, 2.0, 4.0)  # of one stream's request rate, when no rates are given
QUICK_RATE_MULTIPLIERS = (1.0, 4.0)


@dataclass(slots=True)
class BenchConfig:
    """What ``specdec bench`` runs; the command line's options, one for one."""

    model: Any = None  # None: the embedded default; a path; or an in-memory model (tests)
    tokenizer: Any = None  # with an in-memory model
    dtype: str = "float32"
    dataset: str | os.PathLike = DEFAULT_DATASET
    categories: tuple[str, ...] | None = None  # None: every category in the dataset
    questions_per_category: int | None = None  # None: all (--quick: 1)
    max_new_tokens: int | None = None  # per turn; None: each question's max_tokens, else 128
    max_turns: int | None = None  # play at most this many turns of a question (--quick: 2)
    drafters: tuple[str, ...] | None = None  # None: every drafter available for the model
    ks: tuple[int, ...] = (8,)  # num_speculative_tokens to try for each drafter
    adaptive: bool = True  # the policy may draft fewer than k where drafting does not pay
    temperature: float = 0.0  # 0: greedy; else every system samples (offline and load modes)
    top_p: float = 1.0  # with temperature > 0
    draft_model: str | None = None
    heads: dict[str, str] = field(default_factory=dict)  # kind -> directory
    modes: tuple[str, ...] = ("offline", "load")
    with_hf: bool = True  # transformers generate, plain and assisted
    peers: bool = True  # llama.cpp, when installed (the default model's GGUF only)
    rates: tuple[float, ...] | None = None  # requests/s; None: multiples of one stream's rate
    requests_per_rate: int = 16
    load_max_tokens: int = 64  # new tokens of each request under load
    url: str | None = None  # load a running server instead of the engine in process
    api_key: str | None = None
    kernel_shape: tuple[int, int, int] = (64, 8, 49152)  # B, k, V
    quant_systems: tuple[str, ...] | None = None  # quant mode's engines; None: all of them
    batch_invariant: bool | None = None  # None: the engine's default for the dtype
    out: str | os.PathLike = "eval/results/bench"
    quick: bool = False
    seed: int = 0
    engine_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes must be some of {MODES}, got {self.modes}")
        if any(k < 1 for k in self.ks):
            raise ValueError(f"every k must be at least 1, got {self.ks}")
        self.sampling()  # a bad temperature or top_p: the engine's error
        if self.rates is not None and any(r <= 0 for r in self.rates):
            raise ValueError(f"request rates must be positive, got {self.rates}")
        for name in ("requests_per_rate", "load_max_tokens", "max_new_tokens", "max_turns"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.quick:
            self.questions_per_category = self.questions_per_category or 1
            self.max_new_tokens = self.max_new_tokens or 32
            self.max_turns = self.max_turns or 2
            self.requests_per_rate = min(self.requests_per_rate, 6)
            self.load_max_tokens = min(self.load_max_tokens, 32)

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.seed)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run ``cfg``; write ``bench.json``, ``bench.md`` and the plots under ``cfg.out``; return
    the results (``result["failed"]``: a drafter's output differed from plain decoding's)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = read_questions(cfg.dataset)
    groups = by_category(questions, cfg.questions_per_category)
    if cfg.categories:
        missing = [c for c in cfg.categories if c not in groups]
        if missing:
            raise ValueError(
                f"no questions of categories {missing} in {cfg.dataset}; it has {list(groups)}"
            )
        groups = {c: groups[c] for c in cfg.categories}
    if cfg.max_turns:
        groups = {
            c: [replace(q, turns=q.turns[: cfg.max_turns]) for q in qs] for c, qs in groups.items()
        }
    result: dict[str, Any] = {
        "environment": report.environment(cfg.dtype),
        "dataset": str(cfg.dataset),
        "decoding": cfg.sampling().describe(),
        "modes": list(cfg.modes),
        "notes": [],
    }
    engines: list[Any] = []
    if any(m in cfg.modes for m in ("offline", "load")) and not (
        cfg.url and cfg.modes == ("load",)
    ):
        engines = _engines(cfg, result["notes"])
    if "offline" in cfg.modes:
        systems = list(engines)
        if cfg.with_hf:
            systems += hf_systems(engines[0].llm, cfg.model, cfg.draft_model, cfg.sampling())
        if cfg.peers:
            systems += _peers(cfg, engines[0].llm, result["notes"])
        result["offline"] = run_offline(systems, groups, cfg.max_new_tokens)
        result["offline"]["decoding"] = cfg.sampling().describe()
    if "load" in cfg.modes:
        result["load"] = _load_mode(cfg, engines, groups, result.get("offline"))
    if "offline" in cfg.modes:
        result["recommendation"] = recommend(result["offline"], result.get("load")).to_dict()
    if "runtime" in cfg.modes:
        from specdec.eval.bench.runtime import run_dtype

        result["runtime"] = [run_dtype(cfg.dtype, cfg.quick, cfg.batch_invariant)]
    if "kernels" in cfg.modes:
        from specdec.eval.bench.kernels import run_kernels

        batch, k, vocab = cfg.kernel_shape
        result["kernels"] = run_kernels(batch, k, vocab, repeats=3 if cfg.quick else 20)
        if not torch.cuda.is_available():  # the engine's attention on the CPU
            from specdec.eval.bench.attention import run_attention

            result["attention"] = run_attention(repeats=2 if cfg.quick else 5, quick=cfg.quick)
    every = by_category(questions)  # categories in turn, first turns only
    firsts = [qs[i] for i in range(len(questions)) for qs in every.values() if i < len(qs)]
    if "wrap" in cfg.modes:
        from specdec.eval.bench.wrap import run_wrap

        result["wrap"] = run_wrap(
            [q.conversation() for q in firsts[: 8 if cfg.quick else 16]],
            cfg.max_new_tokens or 64,
            cfg.draft_model,
            rounds=1 if cfg.quick else 2,
        )
    if "quant" in cfg.modes:
        result["quant"] = _quant_mode(cfg, groups, result["notes"])
    if "embed" in cfg.modes:
        from specdec.eval.bench.embed import run_embed

        texts = [q.turns[0] for q in firsts[: 16 if cfg.quick else 64]]
        result["embed"] = run_embed(
            texts, cfg.dtype, 1 if cfg.quick else 2, cfg.model, cfg.tokenizer,
            **cfg.engine_options,
        )  # fmt: skip
    if "lora" in cfg.modes:
        from specdec.eval.bench.lora import run_lora

        conversations = [q.conversation() for q in firsts[: 4 if cfg.quick else 8]]
        result["lora"] = run_lora(
            conversations, cfg.max_new_tokens or 64, out, cfg.dtype, 1 if cfg.quick else 2
        )
    if "guided" in cfg.modes:
        from specdec.eval.bench.guided import read_tasks, run_guided

        tasks = read_tasks()
        result["guided"] = run_guided(
            cfg.dtype, 1 if cfg.quick else 2, tasks[::4] if cfg.quick else tasks,
            peers=cfg.peers, model=cfg.model, tokenizer=cfg.tokenizer,
        )  # fmt: skip
    result["failed"] = any(result.get(m, {}).get("mismatches") for m in ("offline", "guided"))
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    (out / "bench.md").write_text(report.markdown(result), encoding="utf-8")
    result["plots"] = [str(p) for p in report.plot(result, out)]
    return result


def _quant_mode(
    cfg: BenchConfig, groups: dict[str, list[Any]], notes: list[str]
) -> dict[str, Any] | None:
    """The quant mode on the first turns of ``questions_per_category`` questions per category
    (2 when not given): it runs a dozen engines of the default model, in turns."""
    if cfg.model is not None:
        notes.append("quant mode skipped: it measures the default model's own GGUF weights.")
        return None
    from specdec.eval.bench.quant import run_quant

    per_category = cfg.questions_per_category or 2
    chosen = [(c, q) for c, qs in groups.items() for q in qs[:per_category]]
    return run_quant(
        [q.conversation() for _, q in chosen],
        [c for c, _ in chosen],
        cfg.max_new_tokens or 128,
        list(cfg.quant_systems) if cfg.quant_systems else None,
    )


def _engines(cfg: BenchConfig, notes: list[str]) -> list[Any]:
    drafters = (
        list(cfg.drafters)
        if cfg.drafters is not None
        else available_drafters(cfg.model, cfg.draft_model, cfg.heads)
    )
    options = dict(cfg.engine_options)
    if cfg.tokenizer is not None:
        options["tokenizer"] = cfg.tokenizer
    if cfg.batch_invariant is not None:
        options["batch_invariant"] = cfg.batch_invariant
    if cfg.drafters is None and "draft_model" not in drafters:
        notes.append("draft_model skipped: give --draft-model to compare a draft model.")
    return engine_systems(
        cfg.model,
        cfg.dtype,
        drafters,
        list(cfg.ks),
        cfg.draft_model,
        cfg.heads,
        cfg.adaptive,
        cfg.sampling(),
        **options,
    )


def _peers(cfg: BenchConfig, llm: Any, notes: list[str]) -> list[Any]:
    if cfg.model is not None:
        notes.append("llama.cpp skipped: it runs only the default model's GGUF file here.")
        return []
    try:
        return [LlamaCpp(llm.tokenizer.eos_token_id, cfg.sampling())]
    except ImportError:
        notes.append(
            "llama.cpp skipped: llama-cpp-python is not installed (pip install .[llamacpp])."
        )
        return []


def _load_mode(
    cfg: BenchConfig,
    engines: list[Any],
    groups: dict[str, list[Any]],
    offline: dict[str, Any] | None,
) -> dict[str, Any]:
    questions = [q for qs in groups.values() for q in qs]
    picked = [questions[i % len(questions)] for i in range(cfg.requests_per_rate)]
    load: dict[str, Any] = {"requests_per_rate": cfg.requests_per_rate, "curves": {}, "notes": []}
    if cfg.url:
        rates = list(cfg.rates or (0.5, 1.0, 2.0, 4.0))
        requests = [(q.conversation(), cfg.load_max_tokens) for q in picked]
        load["curves"]["server"] = [
            {
                "rate": rate,
                **run_over_http(
                    cfg.url, requests, arrival_times(rate, len(requests), cfg.seed), cfg.api_key
                ).summary(),
            }
            for rate in tqdm(rates, desc="load (server)")
        ]
        load["notes"].append(
            f"Against the server at {cfg.url}, running whatever drafter it was started with."
        )
        return load
    chat = engines[0].llm
    requests = [(chat.apply_chat_template(q.conversation()), cfg.load_max_tokens) for q in picked]
    systems = _load_systems(cfg, engines, offline)
    rates = list(cfg.rates) if cfg.rates else _default_rates(cfg, chat, requests)
    for system in systems:  # warm up, untimed
        run_in_process(system.llm, requests[:2], [0.0, 0.0], cfg.sampling())
    curves: dict[str, list[dict[str, float]]] = {s.name: [] for s in systems}
    bar = tqdm(total=len(rates) * len(systems), desc="load", unit="run")
    for i, rate in enumerate(rates):
        arrivals = arrival_times(rate, len(requests), cfg.seed + i)
        for system in systems if i % 2 == 0 else list(reversed(systems)):
            system.llm.reset_prefix_cache()
            summary = run_in_process(system.llm, requests, arrivals, cfg.sampling()).summary()
            curves[system.name].append({"rate": round(rate, 4), **summary})
            bar.update()
    bar.close()
    load["curves"] = curves
    load["break_even"] = {s.name: break_even(curves, s.name, PLAIN) for s in systems if s.drafter}
    load["paying"] = {s.name: paying_summary(curves, s.name, PLAIN) for s in systems if s.drafter}
    return load


def _load_systems(
    cfg: BenchConfig, engines: list[Any], offline: dict[str, Any] | None
) -> list[Any]:
    """Every engine; with ``--quick``, plain decoding and the best exact drafter offline."""
    if not cfg.quick or offline is None:
        return engines
    overall = offline["overall"]["systems"]
    drafters = [e for e in engines if e.drafter]
    best = recommend(offline).system or max(
        (e.name for e in drafters), key=lambda n: overall[n]["vs_specdec"], default=None
    )
    return [e for e in engines if e.name in (PLAIN, best)]


def _default_rates(
    cfg: BenchConfig, llm: Any, requests: list[tuple[list[int], int]]
) -> list[float]:
    """Multiples of the request rate one stream serves, measured here: the load's requests run
    one at a time on the engine without speculation (prompt processing included)."""
    from specdec import SamplingParams

    start = time.perf_counter()
    for prompt, max_tokens in requests:
        llm.reset_prefix_cache()
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
    one_stream = len(requests) / (time.perf_counter() - start)
    multipliers = QUICK_RATE_MULTIPLIERS if cfg.quick else RATE_MULTIPLIERS
    return [round(one_stream * m, 4) for m in multipliers]
