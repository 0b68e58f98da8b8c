"""`AnswerAdvance`: a band's flows are charged for their answers when a request is dispatched,
not only when it ends (issue 35: fair shares that hold while answers are long).

The fairness policy's counter of a flow (`vtc.py`) measures the service the flow received.
The EPP learns a request's output tokens only when it ends, so charged at the end a flow whose
answers are long looks cheap for as long as they run: fair order sends it more, its answers
then end together and its counter jumps past the others', which are then served alone until
they catch up. On the grid's 2 servers x 8 slots, open loop, answers of 300 against 30 tokens
(`bench flow --grid`), the counters swung by a dozen long answers and the long-answer flow got
0.70-0.74 of the other's tokens on seeds 1-3 where its charge ratio gives 0.78, while a charge
ratio of 3 instead of 2 measured the same: the swing, not the charge, set the share.

So a request is charged at dispatch with its flow's expected answer (the mean of the flow's
recent answers, exponentially weighted, at most the request's max_tokens; before the flow's
first answer its max_tokens, else nothing: on 2 servers x 256 slots an answer of 300 tokens
takes 5 s, and charged only its prompts until then the long-answer flow took most of the
first 512 slots, which the other flow then caught up for well into the measured window:
share 0.59-0.61 against the ratio's 0.73), and at its end with
what it generated less the advance charged for it (negative: a refund). The advances of a
flow's requests in service are pooled: an ending request takes back the pool's average, and
the last one in service takes back the rest, so over any busy period a flow is charged exactly
what it generated, as before. The VTC paper's scheduler charges each output token as the
engine generates it; the advance is the EPP's stand-in, since it sees an answer only when it
ends. Measured: docs/flowcontrol.md, "Fair sharing on any fleet".
"""

from __future__ import annotations

ANSWER_WEIGHT = 0.2  # weight of the newest answer in a flow's expected answer
_MAX_FLOWS = 1024  # expected answers remembered before pruning to the flows in service


class AnswerAdvance:
    """Expected answers and the advances charged for the requests in service, per flow."""

    __slots__ = ("_advance", "_expected", "ahead")

    def __init__(self, *, ahead: bool = True) -> None:
        self.ahead = ahead  # False: answers charged only at the end (`chargeAnswersAhead`)
        self._expected: dict[str, float] = {}
        self._advance: dict[str, int] = {}  # flow -> tokens charged ahead for its running ones

    def expected(self, flow: str, bound: int = 0) -> int:
        """The output tokens charged ahead for a request of `flow` dispatched now: the flow's
        expected answer, at most the request's `bound` (its max_tokens; 0: none), or before
        the flow's first answer that bound."""
        known = self._expected.get(flow)
        if known is None:
            return bound
        return round(known) if bound <= 0 else min(round(known), bound)

    def dispatched(self, flow: str, bound: int = 0) -> int:
        """A request of `flow` goes: the tokens to charge it ahead (0 before any answer
        without a bound)."""
        tokens = self.expected(flow, bound) if self.ahead else 0
        if tokens:
            self._advance[flow] = self._advance.get(flow, 0) + tokens
        return tokens

    def completed(self, flow: str, output_tokens: int, running: int) -> int:
        """A request of `flow` ended having generated `output_tokens`, one of `running` of
        the flow's requests in service (counting it): the tokens to charge now (negative: a
        refund of what was charged ahead beyond the answer)."""
        pooled = self._advance.pop(flow, 0)
        back = pooled if running <= 1 else pooled // running
        if pooled - back > 0:
            self._advance[flow] = pooled - back
        if output_tokens > 0:  # an error or a cancellation says nothing of the flow's answers
            if len(self._expected) >= _MAX_FLOWS and flow not in self._expected:
                self._expected = {f: e for f, e in self._expected.items() if f in self._advance}
            old = self._expected.get(flow)
            self._expected[flow] = (
                float(output_tokens) if old is None else old + ANSWER_WEIGHT * (output_tokens - old)
            )
        return output_tokens - back
