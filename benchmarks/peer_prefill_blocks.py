"""Where vLLM's manager frees a prefill's out-of-window blocks (run with the peer's python).

The peer harness (``../shared/peers/vllm_kv_bench.py``) times vLLM's admission as
``get_computed_blocks + allocate_slots(prompt)`` and a decode step as the
``allocate_slots(req, 1)`` loop. On the DeepSeek-V4 layout a prefill allocates a block for
every prompt token in the sliding-window and compressor-state groups (4- and 8-token blocks),
and most of them leave the window at once. This script admits single prompts into a fresh
manager built exactly as the harness builds it (dsv4 config, prefix caching on), and prints,
per prompt: the admission's microseconds and the blocks it took per group, then the
request's first decode ``allocate_slots(req, 1)``: its microseconds and the blocks it freed
(``remove_skipped_blocks``). So it shows which of the harness's columns pays for dropping a
prefill's window blocks: vLLM's ``admit`` or its ``decode``. ``benchmarks/vs_vllm.py
--reclaim-prefill decode`` puts ours in the same column.

Run (after ``bash ../shared/peers/setup_vllm_peer.sh /tmp/vllmpeer``)::

    /tmp/vllmpeer/bin/python benchmarks/peer_prefill_blocks.py --prompts 3000 3000 2500
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_PEER = ROOT.parent / "shared" / "peers" / "vllm_kv_bench.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[3000, 3000, 2500])
    ap.add_argument("--num-blocks", type=int, default=40000)
    ap.add_argument("--peer", type=pathlib.Path, default=DEFAULT_PEER)
    args = ap.parse_args()
    # This folder's kernels.py would shadow the `kernels` package vLLM imports.
    here = pathlib.Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != here]
    sys.path.insert(0, str(args.peer.parent))
    argv, sys.argv = sys.argv, [sys.argv[0]]  # the peer module reads no arguments at import
    try:
        import vllm_kv_bench as peer
    finally:
        sys.argv = argv
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    kv_cfg, sched_bs, hash_bs = peer.build_kv_cache_config("dsv4", args.num_blocks, 0)
    kv = KVCacheManager(
        kv_cache_config=kv_cfg,
        max_model_len=max(args.prompts) + 512,
        scheduler_block_size=sched_bs,
        hash_block_size=hash_bs,
        max_in_flight_tokens=16384,
        enable_caching=True,
        use_eagle=False,
        num_hash_lookahead_tokens=0,
        num_prefill_lookahead=0,
        log_stats=False,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        metrics_collector=None,
        watermark=0.0,
    )
    managers = kv.coordinator.single_type_managers
    print(
        "groups:",
        ", ".join(f"{type(m).__name__}(block {m.block_size})" for m in managers),
    )
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, 0)
    pool = kv.block_pool
    rng = random.Random(0)
    for n, length in enumerate(args.prompts):
        prompt = [rng.randrange(150_000) for _ in range(length)]
        req = Request(
            request_id=f"r{n}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=8),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=hasher,
        )
        free0 = pool.get_num_free_blocks()
        t = time.perf_counter()
        blocks, hit, junction = kv.get_computed_blocks(req)
        req.shared_prefix_boundary = junction
        new = kv.allocate_slots(
            req,
            req.num_tokens - hit,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=0,
            num_external_computed_tokens=0,
            delay_cache_blocks=False,
            num_encoder_tokens=0,
            full_sequence_must_fit=True,
            reserved_blocks=0,
            has_scheduled_reqs=False,
        )
        admit_us = (time.perf_counter() - t) * 1e6
        taken = free0 - pool.get_num_free_blocks()
        per_group = [len(b) for b in new.blocks]
        req.num_computed_tokens = req.num_tokens
        kv.new_step_starts()
        free1 = pool.get_num_free_blocks()
        t = time.perf_counter()
        kv.allocate_slots(req, 1, num_lookahead_tokens=0)
        decode_us = (time.perf_counter() - t) * 1e6
        held = [sum(1 for b in m.req_to_blocks[req.request_id] if not b.is_null) for m in managers]
        print(
            f"prompt {length} (hit {hit}): admit {admit_us:.0f} us, took {taken} blocks "
            f"{per_group}; first decode step {decode_us:.0f} us, freed "
            f"{pool.get_num_free_blocks() - free1} blocks, holds {held}"
        )


if __name__ == "__main__":
    main()
