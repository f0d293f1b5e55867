"""The priority scheduling policy (vLLM's): waiting requests line up by priority, then arrival;
under KV pressure the running request last in that order is preempted; outputs never change."""

import pytest

from specdec import LLM, SamplingParams
from specdec.engine_config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
PROMPTS = [list(range(10, 22)), list(range(30, 42)), list(range(50, 62)), list(range(70, 82))]


def start_order(outputs) -> list[int]:  # noqa: ANN001
    """The prompts' indices in the order their first tokens came."""
    return sorted(range(len(outputs)), key=lambda i: outputs[i].metrics.first_token_time)


@pytest.mark.parametrize(
    ("priority", "order"),
    [([3, 1, 2, 0], [3, 1, 2, 0]), ([1, 0, 1, 0], [1, 3, 0, 2]), ([-5, 7, 0, 0], [0, 2, 3, 1])],
)
def test_one_at_a_time_requests_run_by_priority_then_arrival(make_llm, priority, order):
    llm = make_llm(max_num_seqs=1, scheduling_policy="priority")
    outputs = llm.generate(PROMPTS, GREEDY, priority=priority)
    assert start_order(outputs) == order
    fcfs = make_llm(max_num_seqs=1)
    plain = fcfs.generate(PROMPTS, GREEDY)
    assert start_order(plain) == [0, 1, 2, 3]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]


def staggered(llm: LLM, priorities: list[int]) -> list[tuple[list[int], int]]:
    """Add one request a step (so they are admitted in arrival order, whatever their priority);
    each one's tokens and preemptions."""
    engine, ids = llm.engine, []
    tokens: dict[int, list[int]] = {}
    preemptions: dict[int, int] = {}
    while len(ids) < len(priorities) or engine.has_unfinished():
        if len(ids) < len(priorities):
            ids.append(engine.add_request(PROMPTS[len(ids)], GREEDY, priorities[len(ids)]))
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            preemptions[delta.request_id] = delta.metrics.num_preemptions
    return [(tokens[i], preemptions[i]) for i in ids]


def test_memory_pressure_preempts_the_lowest_priority_and_changes_no_output(make_llm):
    """Admitted in arrival order, the last being the most urgent: first come first served
    preempts it (the newest); the priority policy preempts the least urgent (the oldest), and
    the most urgent never."""
    ample = staggered(make_llm(block_size=4), [0, 0, 0])
    fcfs = staggered(make_llm(block_size=4, num_kv_blocks=16), [0, 0, 0])
    by_priority = make_llm(block_size=4, num_kv_blocks=16, scheduling_policy="priority")
    ranked = staggered(by_priority, [2, 1, 0])
    assert fcfs[2][1] > 0 and fcfs[0][1] == 0
    assert ranked[0][1] > 0 and ranked[2][1] == 0
    for outputs in (fcfs, ranked):
        assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in ample]


def test_a_preempted_request_waits_behind_more_urgent_ones(make_llm):
    """Preempted, the least urgent request goes back in line by its priority: a more urgent
    one that arrived later starts before it runs again."""
    llm = make_llm(block_size=4, num_kv_blocks=16, max_num_seqs=2, scheduling_policy="priority")
    engine = llm.engine
    low = engine.add_request(PROMPTS[0], GREEDY, priority=5)
    engine.add_request(PROMPTS[1], GREEDY, priority=1)
    resumed: dict[int, int] = {}  # request -> the step its first token after preemption came
    step, urgent = 0, -1
    while engine.has_unfinished():
        step += 1
        if step == 3:
            urgent = engine.add_request(PROMPTS[2], GREEDY, priority=0)
        for delta in engine.step():
            if delta.metrics.num_preemptions and delta.request_id not in resumed:
                resumed[delta.request_id] = step
            if delta.request_id == urgent and urgent not in resumed:
                resumed[urgent] = step
    assert low in resumed and resumed[urgent] < resumed[low]


def test_priorities_are_checked(make_llm):
    fcfs = make_llm()
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.generate(PROMPTS[:2], GREEDY, priority=[0, 1])
    by_priority = make_llm(scheduling_policy="priority")
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        by_priority.generate(PROMPTS[:2], GREEDY, priority=[1])
    for bad in (1.5, True, "1"):
        with pytest.raises(ValueError, match="priority must be an integer"):
            by_priority.generate(PROMPTS[:1], GREEDY, priority=[bad])
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(scheduling_policy="shortest")
