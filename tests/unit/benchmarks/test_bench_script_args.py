"""``benchmarks/version_bytes.py`` and ``benchmarks/table2_configs.py`` parse their arguments:
``--help`` prints help and an unknown argument is refused before anything runs (``--help`` ran
the version-bytes benchmark; ``--bogus`` rewrote the tracked ``results/table2_configs.json``
with ``--bogus`` in its provenance). In-process: ``main(argv)``, its work stubbed to fail."""

from __future__ import annotations

import pathlib

import pytest

from tests.factories import load_benchmark

TABLE2 = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "table2_configs.json"


def _ran(*args, **kwargs):
    raise AssertionError("the benchmark ran")


@pytest.mark.parametrize("name", ["version_bytes", "table2_configs"])
def test_help_prints_help_and_an_unknown_argument_is_refused(name, monkeypatch, capsys):
    mod = load_benchmark(name)
    for work in ("measured", "arithmetic", "provenance", "provenance_line"):  # what each computes or writes
        if hasattr(mod, work):
            monkeypatch.setattr(mod, work, _ran)
    monkeypatch.setattr("spotlight.config.load_config", _ran)
    before = TABLE2.read_bytes() if TABLE2.exists() else None
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    out = capsys.readouterr()
    assert exc.value.code == 0 and out.out.startswith("usage:") and "|---" not in out.out, out
    assert mod.__doc__.splitlines()[0] in out.out
    with pytest.raises(SystemExit) as exc:
        mod.main(["--bogus"])
    out = capsys.readouterr()
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in out.err and out.out == "", out
    assert (TABLE2.read_bytes() if TABLE2.exists() else None) == before
