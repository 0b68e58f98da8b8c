"""Answers charged ahead (`flowcontrol/answers.py`): a flow's expected answer is charged when its
request is dispatched and settled when it ends, so a flow of long answers does not look cheap
while they run, and over a busy period each flow is charged exactly what it generated."""

from __future__ import annotations

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.answers import AnswerAdvance
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import FlowItem

S = Criticality.STANDARD


def test_nothing_is_charged_ahead_before_a_flow_has_answered() -> None:
    answers = AnswerAdvance()
    assert answers.dispatched("m") == 0
    assert answers.completed("m", 300, running=1) == 300  # charged at the end, as before


def test_the_expected_answer_is_charged_ahead_and_settled_at_the_end() -> None:
    answers = AnswerAdvance()
    answers.completed("m", 300, running=1)
    assert answers.dispatched("m") == 300
    assert answers.completed("m", 300, running=1) == 0  # already paid
    assert answers.dispatched("m") == 300
    assert answers.completed("m", 100, running=1) == -200  # refunded
    assert answers.expected("m") == 260  # the newest answer weighs a fifth


def test_an_error_refunds_the_advance_and_teaches_nothing() -> None:
    answers = AnswerAdvance()
    answers.completed("m", 300, running=1)
    answers.dispatched("m")
    assert answers.completed("m", 0, running=1) == -300
    assert answers.expected("m") == 300


def test_pooled_advances_are_paid_back_exactly_over_a_busy_period() -> None:
    """Requests end in any order and the expectation moves meanwhile; what a flow is charged
    over a busy period (ahead plus settled) is what it generated."""
    answers = AnswerAdvance()
    answers.completed("m", 90, running=1)
    charged, generated, running = 0, 0, 0
    for _ in range(5):
        charged += answers.dispatched("m")
        running += 1
    for output in (10, 400, 7, 250, 33):
        charged += answers.completed("m", output, running)
        generated += output
        running -= 1
    assert charged == generated


def test_a_flow_of_long_answers_is_charged_for_them_while_they_run() -> None:
    """Two flows backlogged; `long` answers 10x longer. Charged at dispatch for their answers,
    the picks follow the charge ratio at once."""
    d: FlowDispatcher[str] = FlowDispatcher(FlowControlConfig(output_token_weight=2))
    for flow, answer in (("short", 30), ("long", 300)):  # one answer each: the expectation
        item = FlowItem(flow, S, flow, 10, 100)
        d.submit(item, 0.0, lambda _i: True)
        d.dispatched(item)
        d.completed(flow, S, answer)
    for i in range(40):
        for flow in ("short", "long"):
            d.submit(FlowItem(f"{flow}{i}", S, flow, 10, 100), 1.0, lambda _i: False)
    sent: list[str] = []
    room = iter(range(20))
    d.pump(1.0, lambda _i: next(room, None) is not None, lambda item: sent.append(item.flow))
    # Charged (prompt 10 + 2 x answer): long 610 a request, short 70; both start at their one
    # answer's charge. Charged only their prompts while their answers ran, `short` took all 20
    # (the swing of `answers.py`: the shares then move only as answers end).
    assert sent.count("long") == 2
    assert sent.count("short") == 18


def test_charge_answers_ahead_false_charges_them_only_at_the_end() -> None:
    d: FlowDispatcher[str] = FlowDispatcher(
        FlowControlConfig(charge_answers_ahead=False, output_token_weight=2)
    )
    for _ in range(2):
        item = FlowItem("r", S, "m", 10, 100)
        d.submit(item, 0.0, lambda _i: True)
        d.dispatched(item)
        d.completed("m", S, 300)
    item = FlowItem("r", S, "m", 10, 100)
    d.submit(item, 0.0, lambda _i: True)
    d.dispatched(item)
    assert d._bands[S].fairness.counter("m") == 3 * 10 + 2 * 2 * 300


def test_a_request_bound_is_charged_before_the_first_answer_and_caps_the_expectation() -> None:
    answers = AnswerAdvance()
    assert answers.dispatched("m", bound=300) == 300  # max_tokens, before any answer
    assert answers.completed("m", 280, running=1) == -20
    assert answers.dispatched("m", bound=16) == 16  # a short bound caps the expectation
    assert answers.dispatched("m") == 280
