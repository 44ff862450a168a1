"""The roofline SBD rests on, measured (issue 64): a forward of T new rows over a KV cache of C tokens on a
Llama-3.1-8B-shaped model (random bf16 weights, nothing downloaded), its time against T = 1, and the rest of an SBD
cycle at the same shapes (entropy + sampling over the 128,256-token vocabulary, the in-place mask replacement).

    python3 bench/roofline.py [--rows 1,2,4,8,16,32,64] [--caches 1024,4096,16384,32768] [--json FILE]
    python3 bench/roofline.py --tiny --device cpu        # the dry run: a tiny model, every step, eager

Each forward is sbd_ext's attention over an SBDCache whose first C rows hold random K/V (a prefill's cost is not
what is measured), the T rows a set block (nothing committed, so the cache is the same for every repeat). On CUDA the
forward is captured as a CUDA graph and replayed (what the compiled decoding step does; "graph": false where
capture failed and eager launches were timed instead), timed with CUDA events: median of ``--repeats`` replays.
Rows: {cache, rows, forward_ms, x_t1 (forward time / T=1's at that cache), cycle_ms (entropy_sample + mask_replace
over the T rows), weights_gb_per_s (the weight and cache bytes the forward streams, over its time)}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import sbd_ext
from sbd_ext.cache import SBDCache

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = LLAMA_8B | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)  # fmt: skip


def build(shape: dict, device: str, dtype: torch.dtype):
    """The model with random weights made on ``device`` in ``dtype`` (8B: ~16 GB, no host copy)."""
    config = LlamaConfig(**shape)
    config._attn_implementation = "sbd"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def filled_cache(model, cache_len: int, spare: int, dtype, device) -> SBDCache:
    cache = SBDCache(model.config, 1, cache_len + spare, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t[:, :, :cache_len].normal_(generator=gen)
    cache.seq_lens = [cache_len]
    return cache


def forward_fn(model, cache: SBDCache, rows: int, device: str):
    """A function running one forward of ``rows`` set-block rows after the cache's rows (the cache unchanged), and
    whether it is a CUDA graph replay."""
    start = cache.seq_lens[0]
    ids = torch.randint(0, model.config.vocab_size, (1, rows), device=device)
    pos = torch.arange(start, start + rows, device=device)[None]
    meta = torch.tensor([[start], [0], [rows]], dtype=torch.int32, device=device)
    cache.check_plan([0], [rows])

    def run():
        with torch.no_grad(), cache.static_forwards():
            plan = cache.device_plan(meta[0], meta[1], meta[2])
            return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, sbd_plan=plan,
                         logits_to_keep=rows).logits  # fmt: skip

    if device != "cuda":
        return run, False
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return (lambda: (graph.replay(), out)[1]), True
    except Exception as e:  # noqa: BLE001  (a forward that cannot be captured is timed eagerly)
        print(f"roofline: CUDA graph capture failed at T={rows}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return run, False


def timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls (after two warm-ups)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cycle_fn(logits: torch.Tensor, mask_id: int):
    """The SBD cycle's work after a forward of T rows: entropy + token per row, then the EB reveal in place."""
    T = logits.shape[-2]
    flat = logits.reshape(T, -1)
    tokens = torch.full((1, T), mask_id, dtype=torch.int64, device=logits.device)

    def run():
        ent, mp, tok = sbd_ext.entropy_sample(flat)
        sbd_ext.mask_replace(tokens.fill_(mask_id), tok.view(1, T), ent.view(1, T), mp.view(1, T), mask_id)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--caches", default="1024,4096,16384,32768")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the dry run: a 2-layer model, small caches")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    caches = [int(c) for c in a.caches.split(",")]
    if a.tiny:
        caches, a.repeats = [64, 256], 3
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    t0 = time.time()
    model = build(TINY if a.tiny else LLAMA_8B, a.device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"roofline: model built in {time.time() - t0:.1f} s, {weight_bytes / 1e9:.2f} GB of weights", flush=True)
    cfg = model.config
    kv_row_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    kv_row_bytes *= torch.finfo(dtype).bits // 8
    out = []
    for C in caches:
        cache = filled_cache(model, C, max(rows), dtype, a.device)
        base = None
        for T in rows:
            fwd, graph = forward_fn(model, cache, T, a.device)
            ms = timed(fwd, a.device, a.repeats)
            cyc = timed(cycle_fn(fwd(), cfg.vocab_size - 1), a.device, a.repeats)
            base = ms if T == rows[0] else base
            streamed = weight_bytes + C * kv_row_bytes
            row = dict(cache=C, rows=T, forward_ms=round(ms, 4), x_t1=round(ms / base, 4), cycle_ms=round(cyc, 4),
                       graph=graph, gb_per_s=round(streamed / (ms / 1e3) / 1e9, 1))  # fmt: skip
            out.append(row)
            print(json.dumps(row), flush=True)
            del fwd
        del cache
        if a.device == "cuda":
            torch.cuda.empty_cache()
    result = dict(
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine(),
        model="tiny" if a.tiny else "Llama-3.1-8B shapes, random bf16 weights",
        torch=torch.__version__,
        sbd_ext=sbd_ext.build_info(),
        rows=out,
    )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
