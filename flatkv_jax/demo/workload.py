"""The demo's built-in synthetic agentic workload.

Several tenants (one namespace each) share a system prompt per tenant; each session is a
multi-turn conversation in one tenant whose turn ``k + 1`` prompt is turn ``k``'s prompt,
then the tokens the engine generated for it, then new user tokens (a tool result or the
user's reply). So a turn can only be submitted once the previous one finished, and a served
turn's prefix (system prompt, earlier turns) is what the next turn and the tenant's other
sessions hit in the prefix cache. Prompt and decode lengths mix short and long turns; sessions
arrive over time (a step clock), and a turn waits a few "think" steps after the previous one.

Everything is drawn from one ``numpy.random.Generator`` seeded with ``seed``: the same
``(seed, WorkloadConfig)`` gives the same workload on every machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from flatkv_jax.errors import check_nonnegative_int, check_positive_int, fail


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the synthetic workload (the defaults are the demo's).

    Attributes:
      requests: total turns (each turn is one engine request).
      tenants: namespaces; each has its own system prompt.
      vocab: token ids are drawn from ``[1, vocab)`` (0 is left as padding).
      system_tokens: ``(lo, hi)`` inclusive length range of a tenant's system prompt.
      max_turns: turns of the longest session (a session has 1..max_turns turns).
      short_user, long_user: ``(lo, hi)`` new user tokens of a short turn (a reply) and a long
        one (a tool result: several prefill chunks).
      short_decode, long_decode: ``(lo, hi)`` max new tokens of a short and a long answer.
      long_fraction: probability that a turn's user part (independently: its answer) is long.
      arrival_gap: mean steps between two sessions' arrivals (geometric).
      think_steps: ``(lo, hi)`` steps between a turn's end and the next turn's submission.
    """

    requests: int = 40
    tenants: int = 3
    vocab: int = 64
    system_tokens: tuple[int, int] = (40, 72)
    max_turns: int = 4
    short_user: tuple[int, int] = (4, 12)
    long_user: tuple[int, int] = (24, 48)
    short_decode: tuple[int, int] = (4, 12)
    long_decode: tuple[int, int] = (20, 32)
    long_fraction: float = 0.3
    arrival_gap: float = 4.0
    think_steps: tuple[int, int] = (0, 2)

    def __post_init__(self):
        check_positive_int("requests", self.requests)
        check_positive_int("tenants", self.tenants)
        check_positive_int("max_turns", self.max_turns)
        if not isinstance(self.vocab, int) or isinstance(self.vocab, bool) or self.vocab < 2:
            fail(
                "vocab", self.vocab, "token ids need a vocabulary of at least 2", "pass vocab >= 2"
            )
        for name in (
            "system_tokens",
            "short_user",
            "long_user",
            "short_decode",
            "long_decode",
            "think_steps",
        ):
            lo_hi = getattr(self, name)
            if (
                not isinstance(lo_hi, tuple)
                or len(lo_hi) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in lo_hi)
            ):
                fail(name, lo_hi, "it must be a (lo, hi) pair of ints", f"pass {name}=(lo, hi)")
            lo, hi = lo_hi
            floor = 0 if name == "think_steps" else 1
            if lo < floor or hi < lo:
                fail(name, lo_hi, f"it needs {floor} <= lo <= hi", f"pass {name}=(lo, hi) in order")
        if not 0.0 <= self.long_fraction <= 1.0:
            fail("long_fraction", self.long_fraction, "it is a probability", "pass 0 <= p <= 1")
        if not self.arrival_gap >= 0.0:
            fail("arrival_gap", self.arrival_gap, "it must be >= 0", "pass a mean gap in steps")

    @property
    def max_session_tokens(self) -> int:
        """The longest a session's last request can get (prompt + generated), in tokens."""
        per_turn = max(self.short_user[1], self.long_user[1]) + max(
            self.short_decode[1], self.long_decode[1]
        )
        return self.system_tokens[1] + self.max_turns * per_turn


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of a session (one engine request).

    Attributes:
      user: the new tokens this turn appends (after the system prompt for the first turn,
        after the previous turn's prompt and answer otherwise).
      max_new_tokens: the answer's length (the engine stops there).
      think_steps: steps after the previous turn finished before this one is submitted
        (0 for a session's first turn: it arrives at the session's arrival step).
    """

    user: tuple[int, ...]
    max_new_tokens: int
    think_steps: int


@dataclasses.dataclass(frozen=True)
class Session:
    """A multi-turn conversation in one tenant.

    Attributes:
      index: position in :attr:`Workload.sessions`.
      namespace: the tenant (its system prompt and prefix-cache namespace).
      arrival_step: the step clock value at which the first turn is submitted.
      turns: at least one.
    """

    index: int
    namespace: int
    arrival_step: int
    turns: tuple[Turn, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """The generated workload.

    Attributes:
      config: what it was drawn from.
      seed: the generator seed.
      system_prompts: per namespace, the tenant's system prompt.
      sessions: sorted by arrival step.
    """

    config: WorkloadConfig
    seed: int
    system_prompts: tuple[tuple[int, ...], ...]
    sessions: tuple[Session, ...]

    @property
    def requests(self) -> int:
        """Total turns (engine requests)."""
        return sum(len(s.turns) for s in self.sessions)

    def first_prompt(self, session: Session) -> tuple[int, ...]:
        """Turn 0's prompt: the tenant's system prompt, then the user tokens."""
        return self.system_prompts[session.namespace] + session.turns[0].user

    @staticmethod
    def next_prompt(
        previous_prompt: Sequence[int], previous_answer: Sequence[int], turn: Turn
    ) -> tuple[int, ...]:
        """Turn ``k + 1``'s prompt: turn ``k``'s prompt, its answer, the new user tokens."""
        return tuple(previous_prompt) + tuple(previous_answer) + turn.user


def _draw(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def make_workload(seed: int, config: WorkloadConfig | None = None) -> Workload:
    """Draws the workload for ``seed``.

    Sessions are drawn (tenant uniformly, 1..max_turns turns) until their turns add up to
    ``config.requests``; the last session is cut short if needed.

    Args:
      seed: any int >= 0 (the demo's ``--seed``).
      config: the shape; default :class:`WorkloadConfig()`.

    Returns:
      The workload.
    """
    check_nonnegative_int("seed", seed)
    cfg = WorkloadConfig() if config is None else config
    if not isinstance(cfg, WorkloadConfig):
        fail(
            "config", cfg, "it must be a WorkloadConfig", "pass WorkloadConfig(...)", exc=TypeError
        )
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(1, cfg.vocab, n))

    system_prompts = tuple(tokens(_draw(rng, cfg.system_tokens)) for _ in range(cfg.tenants))
    sessions: list[Session] = []
    left, clock = cfg.requests, 0
    while left:
        n_turns = min(left, int(rng.integers(1, cfg.max_turns + 1)))
        turns = []
        for k in range(n_turns):
            long_user = rng.random() < cfg.long_fraction
            long_answer = rng.random() < cfg.long_fraction
            turns.append(
                Turn(
                    user=tokens(_draw(rng, cfg.long_user if long_user else cfg.short_user)),
                    max_new_tokens=_draw(rng, cfg.long_decode if long_answer else cfg.short_decode),
                    think_steps=0 if k == 0 else _draw(rng, cfg.think_steps),
                )
            )
        sessions.append(
            Session(
                index=len(sessions),
                namespace=int(rng.integers(cfg.tenants)),
                arrival_step=clock,
                turns=tuple(turns),
            )
        )
        left -= n_turns
        # Geometric gaps: a Poisson-like arrival process on the step clock.
        if cfg.arrival_gap > 0:
            clock += int(rng.geometric(1.0 / (1.0 + cfg.arrival_gap))) - 1
    return Workload(config=cfg, seed=seed, system_prompts=system_prompts, sessions=tuple(sessions))
