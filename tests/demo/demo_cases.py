"""Shared by the demo tests."""

#: Top-level keys of `flatkv demo --json`.
JSON_KEYS = {
    "model",
    "seed",
    "options",
    "plan",
    "workload",
    "requests",
    "steps",
    "wall_s",
    "warmup_s",
    "check_s",
    "prefill",
    "decode",
    "prefix",
    "occupancy",
    "pages_zeroed",
    "retractions",
    "compilations",
    "compilations_after_warmup",
    "drafts",
    "parity",
    "devices",
    "ranks",
    "routing",
    "ok",
}
