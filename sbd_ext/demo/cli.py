"""``sbd-ext`` (and ``python -m sbd_ext.demo``): Set Block Decoding on the embedded model, from the command line.

    sbd-ext generate "Mia has 23 pens. She buys 5 more. She gives 8 to Sam. How many pens does Mia have now?"
    sbd-ext generate --show-steps              # a held-out problem, and which tokens each forward revealed
    sbd-ext generate --mode ntp "..."          # next-token decoding through the same cache, for comparison
    sbd-ext generate --verify --show-steps     # lossless verify mode: NTP's output, corrected tokens marked
    sbd-ext generate --model PATH "..."        # any SBD-trained HF Llama folder (config.mask_token_id set), e.g.
                                               # one from sbd-ext export: its generation_config.json settings and
                                               # prompt format (sbd_demo.json, else its chat template) apply
    sbd-ext eval --out eval/                   # accuracy / NFE table (Markdown) and plot (PNG) on held-out problems
    sbd-ext models                             # the embedded models
    sbd-ext export DIR                         # a transformers checkpoint (model.generate, pipeline, serve: SBD)

Both commands run torch on ONE thread by default (``--threads``): the embedded model is so small (0.8 M
parameters) that intra-op parallelism costs more than it saves, and on a busy machine an OpenMP barrier waiting for
a descheduled thread makes every forward 10-100x slower.

Exit codes: 0 done; 2 a bad argument (argparse's one-line usage error: out-of-range numbers, an unknown model name
or folder); 1 a request the model cannot serve (e.g. a block size outside the model's trained range, a prompt longer
than its positions), also one line on stderr. ``SBD_EXT_TRACEBACK=1`` shows the traceback instead. The prompt is
text: ``<eos>`` or ``<|mask|>`` typed in it are characters, never control tokens, and characters the model's
tokenizer cannot encode are named in a warning (they become its unknown token).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ..decoding.gen_config import sbd_fields
from ..integration import vllm as vllm_integration
from ..quantization import SCHEMES
from ..samplers import DEFAULT_THRESHOLDS, NAMES, get_sampler
from . import evaluate, export, models, tasks
from .argtypes import finite_number, int_in
from .render import paint, render_steps, stream_printer
from .tokenizer import unknown_characters

__all__ = ["main"]


def cmd_generate(args) -> int:

    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    model, tok = models.load(args.model, quantize=args.quantize)
    info = _model_info(args.model, model)
    t_load = time.perf_counter() - t_load

    expected = None
    if args.prompt is None:
        problem = list(tasks.problems("test", args.example + 1, task=info.get("task", "arith")))[-1]
        question = problem.prompt
        expected = problem.answer
        print(f"(no prompt given: held-out problem #{args.example})")
    else:
        question = args.prompt.replace("\\n", "\n")
    tok.split_special_tokens = True  # "<eos>" typed in a prompt is five characters, not the end of the text
    if args.raw:
        prompt = question
    elif info.get("prompt_template") or not getattr(tok, "chat_template", None):
        prompt = evaluate.format_prompt(question, info.get("prompt_template"))
    else:  # a folder with a chat template and no sbd_demo.json: its chat template is its prompt format
        prompt = _chat_prompt(tok, question)
    unknown = unknown_characters(tok, prompt)
    if unknown:
        names = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in unknown)
        print(
            f"sbd-ext: warning: the model's tokenizer has no token for {names}: encoded as {tok.unk_token}",
            file=sys.stderr,
        )
    if expected is None and info.get("task") == "arith":
        expected = tasks.solve(question)

    sampler = args.sampler or info.get("sampler", "eb")
    threshold = args.threshold
    if threshold is None:
        if sampler == info.get("sampler", "eb") and "gamma_low" in info:
            threshold = info["gamma_low"]
        elif get_sampler(sampler).threshold_name == "gamma":
            threshold = 0.1  # the paper's reasoning gamma_low (the library default 0.35 is its chat gamma_low)
        else:
            threshold = DEFAULT_THRESHOLDS[sampler]
    block_size = args.block_size if args.block_size is not None else info.get("block_size", 16)
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    stream = None if args.show_steps else stream_printer(tok, prompt, colour)  # the completion as it becomes final
    # The model's recommendation (its settings, then sbd_demo.json) picks the mode (an NTP model such as the control
    # smollm2-ntp has no trained mask token: SBD on it would be noise) and turns verify mode on for SBD decoding.
    mode = args.mode or info.get("mode", "sbd")
    verify = mode == "sbd" and (args.verify or bool(info.get("verify", False)))
    res = evaluate.decode(
        model,
        tok,
        [prompt],
        mode=mode,
        block_size=block_size,
        sampler=sampler,
        threshold=threshold,
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        batch_size=1,
        return_trace=args.show_steps,
        verify=verify,
        on_final_tokens=stream and (lambda b, ids: stream.put(torch.tensor(ids))),
    )
    completion = res["completions"][0]
    nfe, ntok, secs = res["nfe"][0], res["num_generated"][0], res["seconds"]
    if stream is None:
        print(paint(prompt, 2, enabled=colour), end="")
        print(paint(completion, 1, enabled=colour))
    else:
        stream.end()
    print()
    if args.show_steps:
        print(
            render_steps(
                tok, res["token_ids"][0], res["traces"][0], res["prompt_lengths"][0], colour, res["corrections"][0]
            )
        )
        print()
    how = "NTP (1 token/forward)" if mode == "ntp" else f"SBD k={block_size}, {sampler} sampler {threshold:g}"
    if verify:
        how += f", verified ({len(res['corrections'][0])} corrections)"
    print(
        f"[{how}] NFE {nfe} | {ntok} tokens | {ntok / max(nfe, 1):.2f} tokens/forward | "
        f"{secs:.3f} s ({ntok / max(secs, 1e-9):.0f} tokens/s) | model load {t_load:.2f} s"
    )
    if expected is not None:
        got = tasks.extract_answer(completion)
        ok = got == expected
        print(
            f"answer {got} — expected {expected}: "
            + paint("correct" if ok else "WRONG", 32 if ok else 31, True, colour)
        )
    return 0


def _model_info(name_or_path, model) -> dict:
    """The model's ``sbd_demo.json`` with its ``generation_config``'s ``sbd_*`` settings over it (a folder from
    ``sbd-ext export`` carries its recommended settings there, as transformers reads them)."""
    info = dict(models.demo_info(name_or_path))
    fields = sbd_fields(getattr(model, "generation_config", None), "the model's generation_config.json")
    for field, key in (("block_size", "block_size"), ("sampler", "sampler"), ("verify", "verify"), ("mode", "mode")):
        if field in fields:
            info[key] = fields[field]
    if "threshold" in fields:
        info["gamma_low"] = fields["threshold"]
    elif "sampler" in fields and fields["sampler"] != models.demo_info(name_or_path).get("sampler", "eb"):
        info.pop("gamma_low", None)  # sbd_demo.json's threshold is for its own sampler
    return info


def _chat_prompt(tok, question: str) -> str:
    """``question`` rendered by the tokenizer's chat template as a user turn, as text for the tokenizer: a leading BOS
    that the tokenizer adds itself is dropped; other special tokens of the template stay special tokens (then the
    question must not contain special-token text, which would become control tokens too)."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    bos = tok.bos_token
    if bos and text.startswith(bos) and tok("x")["input_ids"][:1] == [tok.bos_token_id]:
        text = text[len(bos) :]
    specials = [t for t in tok.all_special_tokens if t]
    if any(t in text for t in specials):
        if any(t in question for t in specials):
            raise ValueError(
                "the model's chat template uses special tokens and the prompt contains special-token text; pass "
                "--raw with the full prompt"
            )
        tok.split_special_tokens = False  # the template's markup is control tokens; the question has none
    return text


def cmd_eval(args) -> int:

    if args.threads:
        torch.set_num_threads(args.threads)
    info = models.demo_info(args.sbd_model)
    g_low, g_high, sampler = info.get("gamma_low"), info.get("gamma_high"), info.get("sampler")
    print(f"evaluating {args.sbd_model} (control: {args.ntp_model}) on {args.n} held-out {args.task} problems")
    t = time.perf_counter()
    result = evaluate.run_eval(
        sbd_model=args.sbd_model,
        ntp_model=None if args.ntp_model in ("", "none") else args.ntp_model,
        n=args.n,
        gammas=args.gammas,
        block_sizes=args.block_sizes,
        samplers=args.samplers,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        task=args.task,
        verify_block_sizes=args.verify_block_sizes,
    )
    result["meta"]["seconds"] = time.perf_counter() - t
    files = evaluate.save_results(result, args.out, g_low, g_high, sampler)
    print()
    print(evaluate.markdown_table(result, g_low, g_high, sampler))
    for kind, f in files.items():
        print(f"wrote {kind}: {f}")
    if "plot" not in files:
        print("(no plot: matplotlib is not installed; `pip install matplotlib` to get it)")
    return 0


def cmd_export(args) -> int:
    dest = export.export(args.model, args.dest, plain=args.plain)
    how = "plain next-token checkpoint" if args.plain else "SBD checkpoint (custom_generate/, sbd_* settings)"
    print(f"{args.model} -> {dest}: {how}")
    print(f"  serve it: transformers serve {dest}{'' if args.plain else ' --trust-remote-code'} --host 127.0.0.1")
    return 0


def cmd_serve(args) -> int:
    """vLLM's OpenAI server for an exported checkpoint with SBD as its speculative proposer."""
    folder = os.path.abspath(args.checkpoint)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"{args.checkpoint} is not a checkpoint folder (no config.json): make one with sbd-ext export")
    if not vllm_integration.vllm_installed():
        raise ValueError("vLLM is not installed here: make its venv with `bash tools/vllm_env.sh` (vLLM's CPU build)")
    rest = list(args.vllm_args)
    if args.compile_draft:  # read by the proposer in vLLM's worker process, which inherits this environment
        os.environ[vllm_integration.COMPILE_ENV] = "1"
    spec = json.dumps(vllm_integration.speculative_config(args.num_speculative_tokens))
    argv = ["serve", folder, "--host", args.host, "--port", str(args.port), "--dtype", "float32"]
    return vllm_integration.vllm_cli([*argv, "--speculative-config", spec, *rest]) or 0


def cmd_models(args) -> int:
    for name in models.available():
        p = models.path(name)
        size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
        print(f"{name:<12} {size / 1e6:5.1f} MB  {p}")
    return 0


# Held-out problems are generated in order (a test problem is found by filtering the seed stream, ~2 ms each), so
# example i costs i generations: the range stops where that would take longer than decoding (~20 s).
MAX_EXAMPLE = 9999
# eval builds its problems before decoding and keeps every output: a bound keeps a typo (--n 100000000) from hanging
# while memory grows; 100k problems is 100x the README's evaluation.
MAX_EVAL_N = 100_000
# torch.set_num_threads(100000) segfaults inside torch; more threads than 4x the cores only slows the tiny model.
MAX_THREADS = 4 * (os.cpu_count() or 1)
_INT64 = (-(2**63), 2**63 - 1)


def _check_models(parser: argparse.ArgumentParser, args) -> None:
    """Unknown model names / folders are usage errors, found before anything is loaded."""
    for dest in ("model", "sbd_model", "ntp_model"):
        name = getattr(args, dest, None)
        if name is None or (dest == "ntp_model" and name in ("", "none")):
            continue
        try:
            models.path(name)
        except FileNotFoundError as e:
            parser.error(f"argument --{dest.replace('_', '-')}: {e}")


def build_parser() -> argparse.ArgumentParser:

    positive = int_in(1)
    nonneg = finite_number(0.0)

    ap = argparse.ArgumentParser(prog="sbd-ext", description="Set Block Decoding demo on the embedded model.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt and print the completion with its NFE and timing")
    g.add_argument("prompt", nargs="?", help="the question (default: a held-out problem); '\\n' becomes a newline")
    g.add_argument("--model", default="sbd-arith", help="embedded model name or a local HF model folder")
    g.add_argument("--mode", choices=("sbd", "ntp"), default=None, help="default: the model's recommendation, else sbd")
    g.add_argument("--block-size", type=positive, default=None, help="SBD block size k (default: the model's, 16)")
    g.add_argument("--sampler", choices=NAMES, default=None, help="default: the model's (sbd_demo.json)")
    g.add_argument(
        "--threshold", type=nonneg, default=None, help="gamma (eb/entropy) or tau (confidence); default: gamma_low"
    )
    g.add_argument("--temperature", type=nonneg, default=0.0, help="0: greedy")
    g.add_argument("--seed", type=int_in(*_INT64), default=0)
    g.add_argument("--max-new-tokens", type=positive, default=160)
    g.add_argument("--show-steps", action="store_true", help="show which tokens each forward revealed")
    g.add_argument(
        "--verify",
        action="store_true",
        help="lossless verify mode: every SBD token is checked against the model's own next-token choice; the "
        "output equals --mode ntp's, in fewer forwards",
    )
    g.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's prompt template")
    g.add_argument(
        "--example",
        type=int_in(0, MAX_EXAMPLE),
        default=0,
        help=f"which held-out problem (0-{MAX_EXAMPLE}) when no prompt is given",
    )
    g.add_argument(
        "--quantize",
        choices=SCHEMES,
        default=None,
        help="weight format for the decoding forward (sbd_ext.quantize; CPU, fp32 activations): packed (fp32 in "
        "row_linear's panel layout, the same values), bf16 (those panels rounded to bf16), int8, w8a8; default: "
        "fp32 as loaded",
    )
    threads = int_in(0, MAX_THREADS)
    g.add_argument(
        "--threads",
        type=threads,
        default=1,
        help=f"torch threads (0: torch's default, at most {MAX_THREADS}); see below",
    )
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="accuracy and NFE on held-out problems: Markdown table + PNG plot")
    e.add_argument("--sbd-model", default="sbd-arith")
    e.add_argument("--ntp-model", default="ntp-arith", help="the NTP control ('none' to skip)")
    e.add_argument("--n", type=int_in(1, MAX_EVAL_N), default=500, help=f"held-out problems (at most {MAX_EVAL_N})")
    e.add_argument("--gammas", type=nonneg, nargs="+", default=list(evaluate.DEFAULT_GAMMAS))
    e.add_argument("--block-sizes", type=positive, nargs="+", default=list(evaluate.DEFAULT_BLOCK_SIZES))
    e.add_argument("--samplers", nargs="+", default=list(evaluate.DEFAULT_SAMPLERS), choices=NAMES)
    e.add_argument(
        "--verify-block-sizes",
        type=positive,
        nargs="*",
        default=list(evaluate.DEFAULT_VERIFY_BLOCK_SIZES),
        help="block sizes evaluated in verify mode (eb sampler, every gamma); none to skip",
    )
    e.add_argument("--batch-size", type=positive, default=50)
    e.add_argument("--max-new-tokens", type=positive, default=160)
    e.add_argument("--task", default="arith", choices=("arith", "sort"))
    e.add_argument("--out", default="sbd_eval", help="folder for results.json, table.md, accuracy_vs_tpf.png")
    e.add_argument(
        "--threads", type=threads, default=1, help=f"torch threads (0: torch's default, at most {MAX_THREADS})"
    )
    e.set_defaults(func=cmd_eval)

    m = sub.add_parser("models", help="list the embedded models")
    m.set_defaults(func=cmd_models)

    x = sub.add_parser(
        "export",
        help="save a model as a transformers checkpoint whose generate() decodes with SBD (model.generate, "
        "pipeline, transformers serve --trust-remote-code)",
    )
    x.add_argument("dest", help="an empty folder for the checkpoint")
    x.add_argument("--model", default=models.DEFAULT_MODEL, help="embedded model name or folder (default: %(default)s)")
    x.add_argument(
        "--plain", action="store_true", help="no custom_generate/ and no SBD settings: served as any NTP model"
    )
    x.set_defaults(func=cmd_export)

    v = sub.add_parser(
        "serve",
        help="vLLM's OpenAI server (its CPU build: tools/vllm_env.sh) for an exported checkpoint, SBD as its "
        "speculative proposer; arguments after -- go to vllm serve",
    )
    v.add_argument("checkpoint", help="a folder from sbd-ext export (the drafter in its sbd_drafter/, or an SBD model)")
    v.add_argument(
        "-k", "--num-speculative-tokens", type=positive, default=4, help="the SBD block size k (default: %(default)s)"
    )
    v.add_argument(
        "--compile-draft",
        action="store_true",
        help="compile the draft forward of one-request steps (SBD_EXT_VLLM_COMPILE=1): faster drafts, a few minutes "
        "of compiling at start the first time",
    )
    v.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    v.add_argument("--port", type=int_in(1, 65535), default=8000, help="default: %(default)s")
    v.set_defaults(func=cmd_serve, vllm_args=[])  # main() takes what follows -- as vllm serve options
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    vllm_args = []
    if argv[:1] == ["serve"] and "--" in argv:  # sbd-ext serve DIR [options] -- <vllm serve options>
        cut = argv.index("--")
        argv, vllm_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if vllm_args:
        args.vllm_args = vllm_args
    _check_models(parser, args)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        # What a user can cause once the arguments parse (a block size the model was not trained for, a prompt
        # longer than its positions, a model folder that does not load, an output folder that cannot be written):
        # one line, no traceback.
        if os.environ.get("SBD_EXT_TRACEBACK"):
            raise
        one_line = " ".join(line.strip() for line in str(e).splitlines())
        print(f"sbd-ext {args.command}: error: {one_line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
