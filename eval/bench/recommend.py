"""The recommendation: which drafter and k for this workload, with its reason drawn from the
numbers. Only systems whose outputs equalled plain decoding's are candidates."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PAYS = 1.05  # a drafter is recommended only if it is at least this much faster than none


@dataclass(frozen=True, slots=True)
class Recommendation:
    system: str | None  # the benchmark's name for it; None: run without speculation
    drafter: str | None
    k: int | None
    speedup: float  # overall single-stream speedup of the best drafter over none
    reason: str  # one sentence

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _candidates(figures: dict[str, Any], broken: set[str]) -> list[tuple[str, dict[str, Any]]]:
    rows = figures["systems"].items()
    return [(n, r) for n, r in rows if r.get("drafter") and n not in broken]


def best_per_category(offline: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """For each category, the fastest exact drafter and its speedup over none."""
    broken = {m["system"] for m in offline["mismatches"]}
    best = {}
    for category, figures in offline["categories"].items():
        candidates = _candidates(figures, broken)
        if candidates:
            name, row = max(candidates, key=lambda c: c[1]["vs_specdec"])
            best[category] = (name, row["vs_specdec"])
    return best


def recommend(offline: dict[str, Any], load: dict[str, Any] | None = None) -> Recommendation:
    """Pick from ``offline`` (``run_offline``'s result) the drafter with the best overall
    speedup, if it pays (``PAYS``); ``load`` (``run_load_mode``'s result) adds where it stops
    paying under traffic."""
    broken = {m["system"] for m in offline["mismatches"]}
    candidates = _candidates(offline["overall"], broken)
    if not candidates:
        return Recommendation(
            None, None, None, 1.0, "No exact drafter ran: decode without speculation."
        )
    name, row = max(candidates, key=lambda c: c[1]["vs_specdec"])
    speedup, accepted = row["vs_specdec"], row["mean_accepted_length"]
    if speedup < PAYS:
        return Recommendation(
            None,
            None,
            None,
            speedup,
            f"Run without speculation: the best drafter, {row['drafter']} (k={row['k']}), is "
            f"{speedup:.2f}x the engine without one here (mean accepted length {accepted:.2f}), "
            f"below the {PAYS:.2f}x that pays for it.",
        )
    reason = (
        f"Use {row['drafter']} with k={row['k']}: {speedup:.2f}x the engine without speculation "
        f"on this workload, single stream (mean accepted length {accepted:.2f}, "
        f"{row['acceptance_rate']:.0%} of drafts accepted)"
    )
    if load and name in load.get("break_even", {}):
        rates = [point["rate"] for point in load["curves"][name]]
        stop = load["break_even"][name]
        if stop is None:
            reason += f", and it still pays at {max(rates):.2f} requests/s, the most measured"
        elif stop == min(rates):
            reason += (
                f", but not under load: at {stop:.2f} requests/s, the least measured, its median "
                "latency is already no better than without"
            )
        else:
            reason += f"; under load it stops paying at {stop:.2f} requests/s"
    return Recommendation(name, row["drafter"], row["k"], speedup, reason + ".")
