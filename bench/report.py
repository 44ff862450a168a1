"""The standard benchmark set on the machine at hand, written as one results file per machine class (CPU ISA or GPU
name): what the README's table, the benchmarks page and the plot are drawn from (``bench/render_results.py``).

    python bench/report.py                     # the full set, 1 thread (~25 min on a 2-core AMD EPYC Zen 3)
    python bench/report.py --suites chat       # one suite, merged into this class's newest file
    python bench/report.py --quick --out DIR   # a tiny eager run of every suite (CI's dry run; numbers meaningless)
    python bench/report.py --device cuda       # a GPU's class file (bash bench/run_gpu.sh report)

Suites, every decoder on the same prompts, greedy, batch 1, interleaved prompt by prompt (each prompt decoded by every
decoder in turn, the order rotating) so that a drift of the machine's speed falls on every decoder alike:

- ``forward``: SmolLM2-135M, one forward of T = 1 / 4 / 16 new rows over a 256-token cache, per weight scheme
  (packed fp32 and w8a8 on a CPU, fp32 on a GPU), median of interleaved rounds; the cost of T rows against one.
- ``arith``: the embedded SBD model (``sbd-arith``) on held-out arithmetic problems: HF ``generate`` on its weights
  (the peer), sbd_ext's compiled next-token decoding on the same weights (own NTP), SBD and verify compiled.
- ``smollm2_sbd``: the same rows on ``smollm2-sbd`` (SmolLM2-135M converted to SBD by the recipe's fine-tune).
- ``chat``: the unmodified SmolLM2-135M-Instruct with its gated drafter (``smollm2-drafter``) on the held-out chat
  prompts: HF ``generate`` (the peer), compiled NTP, verify (k=2, lookup 16 and the draft store, no branch), verify
  + branch (the drafter's recommendation) and verify + branch + 3 alternates (compiled; packed fp32 weights on a
  CPU); answers compared with HF ``generate``'s. Where llama-cpp-python is installed (the ``peers`` extra), also
  llama.cpp F32 and Q8_0 on the same weights (``bench/llama_peer.py``) and sbd_ext's compiled NTP in w8a8 (Q8_0's
  precision class); where vLLM's CPU build has its venv (``tools/vllm_env.sh``: ``.venv-vllm``, or
  ``SBD_BENCH_VLLM_PYTHON``), vLLM serving the same checkpoint (fp32, eager, one request at a time).
- On a GPU (or with ``--device-cycle``) ``arith`` and ``chat`` also run their compiled modes with the decoding
  cycle on the device (``cycle="device"``; chat's verify then without lookup): rows "..., device cycle".
- ``arith_drafter``: the SmolLM2 NTP control (``smollm2-ntp``) with its arithmetic drafter: HF ``generate``, compiled
  NTP, compiled verify; accuracy on held-out problems.
- ``profile`` (CPU): where a one-row compiled NTP forward's time goes, per weight scheme (``bench/report_profile.py``).

Every decoding row records tokens/s, tokens per forward and its speed-up both ways: over the peer (``vs_peer``) and
over sbd_ext's own compiled NTP on the same weights (``vs_own_ntp``, what SBD / verify itself buys). The file
(``bench/results/report/<class>.json``) carries the date, commit, CPU model, ISA, threads and torch version.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import sbd_ext
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt
from sbd_ext.integration.server import VLLMServer
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s helpers, also under PYTHONSAFEPATH (the runbook)
import llama_peer  # noqa: E402
from forward_cost import ISA_NAMES, cpu_model_and_isa  # noqa: E402
from report_profile import suite_profile  # noqa: E402
from sbd_forward import block_forward, prefilled_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "report"
SUITES = ("forward", "arith", "smollm2_sbd", "chat", "arith_drafter", "profile")
# size of each suite: (prompts, new tokens) in a full run and in --quick
SIZES = {
    "arith": ((50, 64), (2, 8)),
    "smollm2_sbd": ((8, 96), (2, 8)),
    "chat": ((8, 96), (2, 8)),
    "arith_drafter": ((8, 96), (2, 8)),
    "profile": ((4, 64), (1, 8)),
}
torch._dynamo.config.recompile_limit = 64
# vLLM's CPU build lives in a venv of its own (tools/vllm_env.sh): the chat suite serves the same checkpoint from it
VLLM_PYTHON = Path(os.environ.get("SBD_BENCH_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def machine(device: torch.device) -> dict:
    """The machine class (``cpu-avx2``, ``cpu-avx512``, ``cpu-avx512-zen5``, ``cpu-amx``, ``gpu-<name>``) and what
    names it. A Zen 5 is a class of its own beside the Zen 4 (both AVX-512): its AVX-512 datapath is full width (a
    Zen 4 runs a 512-bit operation as two 256-bit halves) and its memory system differs, so one file cannot stand
    for both."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return {"class": "gpu-" + name.split()[-1].lower(), "name": name, "isa": "CUDA"}
    name, isa = cpu_model_and_isa()
    isa = isa if isa in ISA_NAMES else "other"
    cls = f"cpu-{isa}" + ("-zen5" if isa == "avx512" and "Zen 5" in name else "")
    return {"class": cls, "name": name, "isa": {"amx": "AMX, AVX-512"}.get(isa, ISA_NAMES.get(isa, "no AVX2"))}


def paired(decoders: dict, prompts: list, passes: int = 1) -> dict:
    """Each prompt decoded by every decoder in turn (the order rotating), ``passes`` times, after one untimed call
    each (compilation). ``decoders[name](prompt) -> (answer token ids, forwards or None)``."""
    names = list(decoders)
    for name in names:
        decoders[name](prompts[0])
    secs, nfe, answers = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {n: [] for n in names}
    for _ in range(passes):
        for i, p in enumerate(prompts):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                a, f = decoders[name](p)
                if p.device.type == "cuda":
                    torch.cuda.synchronize(p.device)
                secs[name] += time.perf_counter() - t0
                nfe[name] += f if f is not None else len(a)
                answers[name].append(a)
    return {n: {"seconds": secs[n], "forwards": nfe[n], "answers": answers[n]} for n in names}


def _cut(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def hf_decoder(model, max_new: int, eos: int, pad: int):
    def run(p):
        out = model.generate(
            p,
            attention_mask=torch.ones_like(p),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        return _cut(out[0, p.shape[1] :].tolist(), eos), None

    return run


def sbd_decoder(model, max_new: int, eos: int, **kw):
    def run(p):
        out = sbd_ext.generate(model, p, max_new_tokens=max_new, eos_token_id=eos, **kw)
        return _cut(out.sequences[0, p.shape[1] :].tolist(), eos), int(out.nfe.sum())

    return run


def vllm_decoder(server: VLLMServer, max_new: int, eos: int):
    """Greedy decoding through vLLM's server (its OpenAI completions API, the prompt as token ids)."""

    def run(p):
        choice = server.complete(p[0].tolist(), max_new, stop_token_ids=[eos], return_token_ids=True)["choices"][0]
        out = list(choice["token_ids"])
        if choice.get("finish_reason") == "stop" and (not out or out[-1] != eos):
            out.append(eos)  # vLLM leaves the stop token out of the text it returns
        return _cut(out, eos), None

    return run


def device_cycle_rows(decoders: dict, model, max_new: int, eos: int, compiled: bool, modes: dict) -> None:
    """On a GPU, each of ``modes`` (label -> settings) also with the decoding cycle on the device
    (``cycle="device"``, issue 64): rows "LABEL, compiled, device cycle"."""
    for label, kw in modes.items():
        decoders[f"{label}, compiled, device cycle"] = sbd_decoder(
            model, max_new, eos, compile=compiled, cycle="device", **kw
        )


def rows_of(runs: dict, peer: str, own_ntp: str, roles: dict, judge) -> list[dict]:
    """One row per decoder: tokens/s, tokens per forward, both speed-ups, and ``judge(answers)`` (a dict). The own
    NTP is the fastest of ``own_ntp`` and its device-cycle row where there is one (sbd_ext's best NTP)."""
    best = f"{own_ntp}, device cycle"
    if best in runs and runs[best]["seconds"] < runs[own_ntp]["seconds"]:
        own_ntp = best
    out = []
    for name, r in runs.items():
        toks = sum(len(a) for a in r["answers"])
        out.append(
            {
                "decoder": name,
                "role": roles.get(name, "ours"),
                "tokens": toks,
                "seconds": round(r["seconds"], 3),
                "tokens_per_s": round(toks / r["seconds"], 2),
                "tokens_per_forward": round(toks / max(r["forwards"], 1), 3),
                "vs_peer": round(runs[peer]["seconds"] / r["seconds"], 3),
                "vs_own_ntp": round(runs[own_ntp]["seconds"] / r["seconds"], 3),
            }
            | judge(r["answers"])
        )
    return out


def accuracy_judge(tok, probs: list):
    """``judge`` of :func:`rows_of` for arithmetic: the answers' accuracy on ``probs``."""

    def judge(answers):
        texts = [tok.decode(a, skip_special_tokens=True) for a in answers]
        return {"accuracy": round(tasks.accuracy(texts, probs), 4)}

    return judge


def suite_forward(device: torch.device, quick: bool) -> dict:
    rows_t = (1, 4) if quick else (1, 4, 16)
    rounds = 2 if quick else 15
    schemes = ["fp32"] if device.type == "cuda" else ["packed", "bf16", "w8a8"]
    out = []
    for scheme in schemes:
        model, _ = checkpoint.load_smollm2(dtype=torch.float32, attn_implementation="sbd", device=device)
        if scheme != "fp32":
            sbd_ext.quantize(model, scheme)
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, model.config.vocab_size, (1, 256), generator=gen).to(device)
        cache = prefilled_cache(model, prefix, spare=max(rows_t) + 1)
        runs = {
            t: block_forward(model, cache, torch.randint(0, 1000, (1, t), generator=gen).to(device)) for t in rows_t
        }
        times = {t: [] for t in rows_t}
        for t in rows_t:
            runs[t]()
        for _ in range(rounds):
            for t in rows_t:
                t0 = time.perf_counter()
                runs[t]()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[t].append((time.perf_counter() - t0) * 1e3)
        one = statistics.median(times[1])
        for t in rows_t:
            med = statistics.median(times[t])
            out.append(
                {
                    "scheme": scheme,
                    "rows": t,
                    "cache": 256,
                    "median_ms": round(med, 3),
                    "vs_one_row": round(med / one, 3),
                }
            )
        del model, cache
    return {"what": f"SmolLM2-135M, one eager forward over a 256-token cache, median of {rounds} rounds", "rows": out}


def suite_arith(
    device: torch.device,
    n: int,
    max_new: int,
    compiled: bool = True,
    name: str = models.DEFAULT_MODEL,
    device_cycle: bool = False,
) -> dict:
    model, tok = models.load(name, device=device)
    hf, _ = models.load(name, device=device, attn_implementation="sdpa")
    info = models.demo_info(name)
    weights = "fp32"
    if device.type == "cpu" and sum(p.numel() for p in model.parameters()) > 10**7:  # SmolLM2: its fastest layout
        model, weights = sbd_ext.quantize(model, "packed"), "packed fp32"
    probs = list(tasks.problems("test", n))
    prompts = [
        tok(format_prompt(p.prompt, info.get("prompt_template")), return_tensors="pt").input_ids.to(device)
        for p in probs
    ]
    eos, sbd_kw = tok.eos_token_id, dict(block_size=info["block_size"], sampler=info["sampler"])
    decoders = {
        "HF generate": hf_decoder(hf, max_new, eos, tok.pad_token_id),
        "NTP, compiled": sbd_decoder(model, max_new, eos, mode="ntp", verify=False, compile=compiled),
        "SBD, compiled": sbd_decoder(
            model, max_new, eos, threshold=info["gamma_low"], verify=False, compile=compiled, **sbd_kw
        ),
        "verify, compiled": sbd_decoder(
            model, max_new, eos, threshold=info["gamma_low"], verify=True, compile=compiled, **sbd_kw
        ),
    }
    if device_cycle:
        modes = {"NTP": dict(mode="ntp", verify=False)}
        modes["SBD"] = dict(threshold=info["gamma_low"], verify=False, **sbd_kw)
        modes["verify"] = dict(threshold=info["gamma_low"], verify=True, **sbd_kw)
        device_cycle_rows(decoders, model, max_new, eos, compiled, modes)
    runs = paired(decoders, prompts)

    about = {
        models.DEFAULT_MODEL: "embedded sbd-arith (0.8 M parameters)",
        "smollm2-sbd": "smollm2-sbd (SmolLM2-135M-Instruct converted to SBD by the recipe's LoRA fine-tune)",
    }.get(name, name)
    return {
        "what": f"{about}, {n} held-out arithmetic problems, up to {max_new} new tokens, {weights} weights; SBD "
        f"k={info['block_size']}, entropy bound {info['gamma_low']}",
        "rows": rows_of(runs, "HF generate", "NTP, compiled", {"HF generate": "peer"}, accuracy_judge(tok, probs)),
    }


def _chat_prompts(tok, n: int, device) -> list[torch.Tensor]:
    return [torch.tensor([checkpoint.chat_prompt(tok, p["text"])], device=device) for p in eval_prompts()[:n]]


def suite_chat(device: torch.device, n: int, max_new: int, compiled: bool = True, device_cycle: bool = False) -> dict:
    base, tok = checkpoint.load_smollm2(attn_implementation="sdpa", device=device)
    packed = device.type == "cpu"  # the CPU's fastest fp32 layout
    model, _ = models.load("smollm2-drafter", device=device, quantize="packed" if packed else None)
    weights = "packed fp32" if packed else "fp32"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = _chat_prompts(tok, n, device)
    decoders = {
        "HF generate": hf_decoder(base, max_new, eos, tok.pad_token_id),
        "NTP, compiled": sbd_decoder(model, max_new, eos, mode="ntp", verify=False, compile=compiled),
        # verify without the branch (k=2, lookup 16 and the draft store), then the drafter's recommendation (+ branch)
        "verify, compiled": sbd_decoder(model, max_new, eos, verify=True, branch=False, compile=compiled),
        "verify + branch, compiled": sbd_decoder(model, max_new, eos, verify=True, branch=True, compile=compiled),
        "verify + branch + alternates 3, compiled": sbd_decoder(
            model, max_new, eos, verify=True, branch=True, alternates=3, compile=compiled
        ),
    }
    if device_cycle:  # the device cycle verifies without lookup / branch
        modes = {"NTP": dict(mode="ntp", verify=False), "verify k=2": dict(verify=True, lookup=0, branch=False)}
        device_cycle_rows(decoders, model, max_new, eos, compiled, modes)
    roles = {"HF generate": "peer"}
    extra = {}
    if device.type == "cpu" and llama_peer.available():  # the peers extra: llama.cpp on the same weights
        extra["llama_cpp_build"] = llama_peer.system_info()  # the ISA features the peer was built with
        # sbd_ext at llama.cpp BF16's and Q8_0's precisions: bf16 weights (verify too: exact for the bf16 model);
        # int8 weights and inputs (NTP runs the base alone)
        bf16, _ = models.load("smollm2-drafter", device=device, quantize="bf16")
        decoders["NTP, compiled, bf16"] = sbd_decoder(bf16, max_new, eos, mode="ntp", verify=False, compile=compiled)
        decoders["verify, compiled, bf16"] = sbd_decoder(
            bf16, max_new, eos, verify=True, branch=False, compile=compiled
        )
        # where the bf16 weights run on AMX-BF16 tiles a verify forward's extra rows cost ~nothing: the wider modes
        decoders["verify + branch + alternates 3, compiled, bf16"] = sbd_decoder(
            bf16, max_new, eos, verify=True, branch=True, alternates=3, compile=compiled
        )
        w8a8, _ = models.load("smollm2-drafter", device=device, quantize="w8a8")
        decoders["NTP, compiled, w8a8"] = sbd_decoder(w8a8, max_new, eos, mode="ntp", verify=False, compile=compiled)
        # w8a8 without the branch (what the docs tell w8a8 users: its extra rows cost more than they save there)
        decoders["verify, compiled, w8a8"] = sbd_decoder(
            w8a8, max_new, eos, verify=True, branch=False, compile=compiled
        )
        for kind, label in (("f32", "llama.cpp F32"), ("bf16", "llama.cpp BF16"), ("q8_0", "llama.cpp Q8_0")):
            llm = llama_peer.llama(kind, torch.get_num_threads())
            decoders[label] = lambda p, llm=llm: (llama_peer.greedy(llm, p[0].tolist(), eos, max_new), None)
            roles[label] = "peer"
    server = None
    if device.type == "cpu" and VLLM_PYTHON.exists():  # the peers extra: vLLM's CPU build on the same checkpoint
        server = VLLMServer(checkpoint.ensure_checkpoint(), threads=torch.get_num_threads(), python=VLLM_PYTHON)
        server.start()
        decoders["vLLM (CPU build)"] = vllm_decoder(server, max_new, eos)
        roles["vLLM (CPU build)"] = "peer"
    try:
        runs = paired(decoders, prompts)
    finally:
        if server is not None:
            server.stop()
    ref = runs["HF generate"]["answers"]

    def judge(answers):
        return {"equal_to_peer": f"{sum(a == r for a, r in zip(answers, ref, strict=True))}/{len(ref)}"}

    rows = rows_of(runs, "HF generate", "NTP, compiled", roles, judge)
    # verify is exact for a rounded model (bf16 weights; w8a8 weights and inputs): its answers are its own NTP's
    for scheme in ("bf16", "w8a8"):
        if f"verify, compiled, {scheme}" not in runs:
            continue
        own = runs[f"NTP, compiled, {scheme}"]
        for row in rows:
            if row["decoder"].startswith("verify") and row["decoder"].endswith(f", compiled, {scheme}"):
                same = sum(a == b for a, b in zip(runs[row["decoder"]]["answers"], own["answers"], strict=True))
                row["equal_to_own_precision_ntp"] = f"{same}/{len(ref)}"
                row["vs_own_precision_ntp"] = round(own["seconds"] / runs[row["decoder"]]["seconds"], 3)
    return {
        "what": f"SmolLM2-135M-Instruct, unmodified, + its gated drafter (smollm2-drafter: verify k=2, lookup 16 with "
        f"its draft store; its recommendation adds the branch), {n} held-out chat prompts x {max_new} new tokens, "
        f"{weights} weights",
        "rows": rows,
        **extra,
    }


def suite_arith_drafter(device: torch.device, n: int, max_new: int, compiled: bool = True) -> dict:
    model, tok = models.load(
        "smollm2-arith-drafter", device=device, quantize="packed" if device.type == "cpu" else None
    )
    hf, _ = models.load("smollm2-ntp", device=device, attn_implementation="sdpa")
    probs = list(tasks.problems("test", n))
    prompts = [torch.tensor([tok(p.prompt, add_special_tokens=False)["input_ids"]], device=device) for p in probs]
    eos = tok.eos_token_id
    decoders = {
        "HF generate": hf_decoder(hf, max_new, eos, tok.pad_token_id),
        "NTP, compiled": sbd_decoder(model, max_new, eos, mode="ntp", verify=False, compile=compiled),
        "verify, compiled": sbd_decoder(model, max_new, eos, verify=True, compile=compiled),
    }
    runs = paired(decoders, prompts)

    return {
        "what": f"SmolLM2-135M NTP control on arithmetic (smollm2-ntp) + its drafter (smollm2-arith-drafter, k=8), "
        f"{n} held-out problems, up to {max_new} new tokens",
        "rows": rows_of(runs, "HF generate", "NTP, compiled", {"HF generate": "peer"}, accuracy_judge(tok, probs)),
    }


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        )
        return sha.stdout.strip() + ("+" if dirty.stdout.strip() else "") or "?"
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", nargs="+", choices=SUITES, help="default: every suite (on a GPU: not forward, profile)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a dry run: the numbers mean nothing)")
    ap.add_argument("--out", default=str(OUT), help="the folder of the per-class results files")
    ap.add_argument(
        "--device-cycle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also the rows with cycle='device' in arith and chat (default: on a GPU)",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    mach = machine(device)
    path = Path(a.out) / f"{mach['class']}.json"
    rec = json.loads(path.read_text()) if path.is_file() else {"suites": {}}
    if rec.get("quick", a.quick) != a.quick:
        rec = {"suites": {}}  # a dry run never mixes with a real one
    dcyc = device.type == "cuda" if a.device_cycle is None else a.device_cycle
    runners = {
        "forward": lambda: suite_forward(device, a.quick),
        # --quick decodes eagerly (the rows keep their names: a dry run checks the pipeline, not the speed)
        "arith": lambda: suite_arith(device, *SIZES["arith"][a.quick], not a.quick, device_cycle=dcyc),
        "smollm2_sbd": lambda: suite_arith(device, *SIZES["smollm2_sbd"][a.quick], not a.quick, name="smollm2-sbd"),
        "chat": lambda: suite_chat(device, *SIZES["chat"][a.quick], not a.quick, device_cycle=dcyc),
        "arith_drafter": lambda: suite_arith_drafter(device, *SIZES["arith_drafter"][a.quick], not a.quick),
        "profile": lambda: suite_profile(device, *SIZES["profile"][a.quick], not a.quick),
    }
    suites = a.suites or [s for s in SUITES if not (device.type == "cuda" and s in ("forward", "profile"))]
    if device.type == "cuda" and {"forward", "profile"} & set(suites):
        ap.error("--suites forward / profile: the CPU's forward; on a GPU the roofline stage measures it")
    failed = []
    for name in suites:
        t0 = time.time()
        try:
            res = runners[name]()
        except Exception as e:  # one suite's failure (a model not installed) leaves the others' results
            failed.append(name)
            print(f"report: suite {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        res["seconds"] = round(time.time() - t0, 1)
        res |= {"date": datetime.date.today().isoformat(), "commit": commit()}
        rec["suites"][name] = res
        print(json.dumps({name: res["rows"]}, indent=None)[:2000], flush=True)
    rec |= {
        "class": mach["class"],
        "machine": mach["name"],
        "isa": mach["isa"],
        "threads": a.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "quick": a.quick,
        "date": datetime.date.today().isoformat(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {path}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
