"""Host-side input checks of the oracle: every error message names the value, rule and fix."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_cases import full_plan

from flatkv_jax.oracle import (
    RadixOracle,
    TraceConfig,
    admit_batch,
    extend_batch,
    handle_batch,
    random_trace,
    run_trace,
)

PLAN = full_plan()


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (
            lambda: admit_batch("plan", []),
            TypeError,
            "plan='str' is invalid: it must be a CachePlan",
        ),
        (lambda: admit_batch(PLAN, "abc"), TypeError, "rows must be a sequence"),
        (lambda: admit_batch(PLAN, [None] * 5), ValueError, "at most 4 rows fit a batch of size 4"),
        (
            lambda: admit_batch(PLAN, [], size=0),
            ValueError,
            "the batch size must be a positive int",
        ),
        (
            lambda: admit_batch(PLAN, [(0, [1])]),
            TypeError,
            "an admit row is (namespace, prompt_tokens, first_chunk)",
        ),
        (
            lambda: admit_batch(PLAN, [(0, [[1, 2]], 1)]),
            TypeError,
            "tokens must be a 1-D sequence of ints",
        ),
        (
            lambda: admit_batch(PLAN, [(0, [1.5], 1)]),
            TypeError,
            "tokens must be a 1-D sequence of ints",
        ),
        (
            lambda: admit_batch(PLAN, [(0, list(range(49)), 1)]),
            ValueError,
            "at most 48 tokens fit this batch",
        ),
        (
            lambda: admit_batch(PLAN, [(0, [-1], 1)]),
            ValueError,
            "token ids must lie in [0, 2**31 - 1]",
        ),
        (
            lambda: admit_batch(PLAN, [(True, [1], 1)]),
            TypeError,
            "rows[0].namespace=True is invalid: it must be an int",
        ),
        (lambda: admit_batch(PLAN, [(0, [1], 2**31)]), ValueError, "it must fit int32"),
        (
            lambda: extend_batch(PLAN, [((0, 0), [1], 3)]),
            TypeError,
            "an extend row is (handle, tokens)",
        ),
        (
            lambda: extend_batch(PLAN, [(0, [1])]),
            TypeError,
            "a handle is a (slot, generation) pair",
        ),
        (
            lambda: extend_batch(PLAN, [((0, 0), list(range(PLAN.limits.step_tokens + 1)))]),
            ValueError,
            f"at most {PLAN.limits.step_tokens} tokens fit this batch",
        ),
        (
            lambda: handle_batch(PLAN, [((0, "g"), 1)]),
            TypeError,
            "rows[0].handle.generation='g' is invalid",
        ),
        (
            lambda: RadixOracle(None),
            TypeError,
            "plan='NoneType' is invalid: it must be a CachePlan",
        ),
        (
            lambda: RadixOracle(PLAN, fifo_depth=0),
            ValueError,
            "fifo_depth=0 is invalid: it must be positive",
        ),
        (
            lambda: RadixOracle(PLAN, tail_first=1),
            TypeError,
            "tail_first=1 is invalid: it must be a bool",
        ),
        (
            lambda: RadixOracle(PLAN, prefix_reuse="y"),
            TypeError,
            "prefix_reuse='y' is invalid: it must be a bool",
        ),
        (lambda: TraceConfig(vocab=0), ValueError, "vocab=0 is invalid: it must be positive"),
        (
            lambda: TraceConfig(p_bad=2.0),
            ValueError,
            "p_bad=2.0 is invalid: a probability in [0, 1]",
        ),
        (lambda: random_trace(PLAN, -1), ValueError, "seed=-1 is invalid: it must be >= 0"),
        (
            lambda: random_trace(PLAN, 0, config={}),
            TypeError,
            "config='dict' is invalid: it must be a TraceConfig",
        ),
        (lambda: random_trace(1, 0), TypeError, "plan='int' is invalid"),
        (
            lambda: run_trace(random_trace(PLAN, 0)),
            TypeError,
            "run_trace needs at least one backend",
        ),
    ],
)
def test_bad_input_raises_with_a_readable_message(call, exc, msg):
    with pytest.raises(exc) as e:
        call()
    assert msg in str(e.value)
    if "is invalid" in str(e.value):
        assert "Fix:" in str(e.value)


def test_builders_pad_and_mask():
    b = admit_batch(PLAN, [None, (3, [5, 6, 7], 2)])
    assert b.valid.tolist() == [False, True, False, False]
    assert b.tokens.shape == (4, 48) and b.tokens[1, :4].tolist() == [5, 6, 7, 0]
    assert (b.prompt_len[1], b.first_chunk[1], b.namespace[1]) == (3, 2, 3)
    e = extend_batch(PLAN, [((2, 7), [1, 2])], size=2)
    assert e.count.tolist() == [2, 0] and (e.slot[0], e.generation[0]) == (2, 7)
    h = handle_batch(PLAN, [(1, 0), ((1, 0), 5), None])
    assert h.valid.tolist() == [True, True, False, False] and h.arg.tolist() == [0, 5, 0, 0]
    assert all(a.dtype == np.int32 for a in (b.tokens, e.slot, h.arg))
