"""``sbd-ext generate`` streams the completion as its tokens become final (unless --show-steps)."""

from sbd_ext.demo import cli


def test_generate_streams_the_completion(monkeypatch, capsys):
    puts = []
    make = cli.stream_printer

    def counting(tok, prompt, colour):
        printer = make(tok, prompt, colour)
        put = printer.put
        printer.put = lambda ids: (puts.append(ids.tolist()), put(ids))
        return printer

    monkeypatch.setattr(cli, "stream_printer", counting)
    argv = ["generate", "--max-new-tokens", "48", "--block-size", "8", "--color", "never"]
    assert cli.main(argv) == 0
    streamed = capsys.readouterr().out
    n_puts = len(puts)
    assert n_puts >= 2  # several runs of final tokens, not one print at the end
    assert cli.main([*argv, "--show-steps"]) == 0  # not streamed: printed once decoded
    shown = capsys.readouterr().out
    assert len(puts) == n_puts
    assert streamed.split("\n\n")[0] == shown.split("\n\n")[0]  # the same prompt + completion
