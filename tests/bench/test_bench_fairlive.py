"""`bench flow --live`'s measurement: the live requests counted as the virtual run counts them."""

from __future__ import annotations

import pytest

from poolkeeper.bench.fleet.fairshare import issue35_case, jain
from poolkeeper.bench.live.fairlive import _Done, _Run, measure


def test_live_requests_are_measured_like_the_virtual_run() -> None:
    run = _Run(t0=0.0, case=issue35_case())  # 25 s: the window is [8.33, 25)
    run.done = [
        _Done("alpha", 200, 9.0, 10.0, 0.1, prompt_tokens=40, output_tokens=30),
        _Done("alpha", 200, 1.0, 2.0, 0.1, prompt_tokens=40, output_tokens=30),  # before
        _Done("beta", 200, 9.0, 11.0, 0.2, prompt_tokens=40, output_tokens=30),
        # Spans the window's end: its prompt (first token at 24.2) and 0.8 s of its 1.8 s of
        # decoding count (tokens as served, `fairshare.served_in`).
        _Done("beta", 200, 24.0, 26.0, 0.2, prompt_tokens=40, output_tokens=30),
        _Done("alpha", 429, 12.0, 12.0, reason="rejected-saturated"),
        _Done("probe", 200, 8.3, 9.5, 0.05, prompt_tokens=40, output_tokens=30),
    ]
    m = measure(run)
    beta = 70 + 40 + 30 * 0.8 / 1.8
    assert m["beta_to_alpha"] == pytest.approx(beta / 70)
    assert m["jain"] == pytest.approx(jain([70, beta]))
    assert m["completed"] == {"alpha": 2, "beta": 2}
    assert m["refused"] == {"429 rejected-saturated": 1}
    assert m["standard_refused"] == 1
    assert m["probe"] == {"status": "ok", "ttft_s": 0.05}
