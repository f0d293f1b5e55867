"""The fuzz corpus against a live server: never a 5xx, every 4xx names what is wrong."""

from __future__ import annotations

from collections import Counter

import httpx

from .fuzz_corpus import corpus, judge
from .test_errors import assert_still_serving


def test_hostile_bodies_get_clear_errors_and_the_server_goes_on(served):
    cases = corpus()
    outcomes: Counter[str] = Counter()
    defects = []
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=served.url, timeout=60) as client:
        for case in cases:
            response = client.post(case.path, content=case.body, headers=headers)
            outcome = judge(case, response.status_code, response.content)
            outcomes[outcome] += 1
            if outcome not in ("ok", "clear 4xx"):
                defects.append(f"{case.name}: {response.status_code} {response.text[:200]}")
    assert defects == [], f"{dict(outcomes)}\n" + "\n".join(defects)
    assert outcomes["clear 4xx"] > 0.7 * len(cases), outcomes  # the corpus is mostly hostile
    assert_still_serving(served)
    served.wait_until_idle()
