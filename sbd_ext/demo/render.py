"""What ``sbd-ext generate`` prints: the completion streamed as its tokens become final, and ``--show-steps``'s
view of which tokens each forward revealed (ANSI colours per forward, corrections marked)."""

from __future__ import annotations

__all__ = ["paint", "render_steps", "stream_printer"]

COLOURS = [31, 32, 33, 34, 35, 36, 91, 92, 93, 94, 95, 96]  # ANSI foreground colours, cycled per forward


def paint(text: str, colour: int | None, bold: bool = False, enabled: bool = True) -> str:
    if not enabled or colour is None:
        return text
    return f"\033[{'1;' if bold else ''}{colour}m{text}\033[0m"


def visible(s: str) -> str:
    return s.replace("\n", "↵")


def render_steps(
    tok, token_ids: list[int], trace: list, prompt_len: int, colour: bool, corrections: list[int] = ()
) -> str:
    """One line per forward: the completion so far, masked / future positions as ``·``, the newly revealed tokens
    highlighted (colour in a terminal, ``^`` markers underneath otherwise; ``!`` for a token verify mode corrected,
    ``corrections`` being indices into ``token_ids``); then the completion with every token coloured by the forward
    that revealed it, corrected tokens underlined."""
    corrected = set(corrections)
    pieces = [visible(tok.decode([t])) for t in token_ids]
    when = [None] * len(pieces)
    lines = []
    for step, (f, positions, _tokens) in enumerate(trace):
        rel = [p - prompt_len for p in positions if 0 <= p - prompt_len < len(pieces)]
        for j in rel:
            when[j] = step
        upto = max((j for j in range(len(pieces)) if when[j] is not None), default=-1)
        text, marks = [], []
        for j in range(upto + 1):
            piece = pieces[j] if when[j] is not None else "·"
            new = j in rel
            text.append(paint(piece, COLOURS[step % len(COLOURS)], bold=True, enabled=colour and new))
            marks.append(("!" if new and j in corrected else "^" if new else " ") * len(piece))
        lines.append(f"forward {f + 1:3d} +{len(rel):2d} | " + "".join(text))
        if not colour:
            lines.append(" " * 17 + "| " + "".join(marks).rstrip())
    if colour:
        coloured = "".join(
            paint(p, COLOURS[w % len(COLOURS)] if w is not None else None, enabled=True)
            if j not in corrected
            else f"\033[4;{COLOURS[w % len(COLOURS)]}m{p}\033[0m"
            for j, (p, w) in enumerate(zip(pieces, when, strict=True))
        )
        lines.append("by forward:           " + coloured)
        if corrected:
            lines.append("(underlined: corrected by verification)")
    return "\n".join(lines)


def stream_printer(tok, prompt: str, colour: bool):
    """Print the prompt now, and return a streamer that prints the completion's text as its tokens become final."""
    from transformers import TextStreamer

    print(paint(prompt, 2, enabled=colour) + ("\033[1m" if colour else ""), end="", flush=True)

    class _Printer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            print(text + ("\033[0m" if stream_end and colour else ""), end="\n" if stream_end else "", flush=True)

    return _Printer(tok, skip_special_tokens=True)
