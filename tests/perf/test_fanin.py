"""server/bench/fanin.py, the reader's fan-in benchmark: it runs (a small version) and reports each mode."""

from __future__ import annotations

from server.bench.fanin import main


def test_fanin_bench_runs_both_modes_and_delivers_everything(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--logs", "64", "--writes-per-s", "200", "--seconds", "0.5", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    off, on = (line for line in out.splitlines() if line.startswith("pause "))
    assert off.startswith("pause off (0.0 ms)") and on.startswith("pause on  (1.3 ms)")
    for line in (off, on):
        delivered = line.split("delivered ", 1)[1].split(" ", 1)[0]
        got, sent = delivered.split("/")
        assert got == sent and int(sent) > 0
