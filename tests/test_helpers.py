"""The shared test helpers (tests/factories.py, tests/fakes.py) do what their docstrings say."""

from __future__ import annotations

import pytest

from spotlight import protocol as P
from spotlight.net.security import load_client_keys
from tests.factories import (
    cond_tensors,
    example_config,
    free_ports,
    make_conditioning,
    make_keys,
    make_leases,
    write_config,
)
from tests.fakes import FakeClock


def test_fake_clock_moves_only_when_told():
    c = FakeClock(100.0, step=7.0)
    assert (c(), c(), c.now) == (100.0, 107.0, 114.0)
    still = FakeClock(5.0)
    assert still() == still() == 5.0
    assert still.advance(2.5) == 7.5 and still.sleep(0.5) == 8.0
    with pytest.raises(AssertionError):
        still.advance(-1.0)


def test_config_factories_load_the_example_with_overrides(tmp_path):
    cfg = example_config("jpeg-toy", {"run.iterations": 3})
    assert cfg.run.iterations == 3
    assert example_config(None).run.iterations != 3  # the embedded default
    path = write_config(tmp_path / "c.toml", "jpeg-toy", {"run.iterations": 3})
    assert path.is_file()
    from spotlight.config import load_config

    assert load_config(path) == cfg


def test_keys_conditioning_leases_and_ports(tmp_path):
    keys = make_keys(tmp_path / "keys", agents=["a", "b"], status=["s"])
    assert load_client_keys(keys, name="b").principal and load_client_keys(keys, role="status")
    cond = make_conditioning(3, seed=1)
    assert cond.embeds.shape == (3, 5, 16) and cond.mask.sum(1).tolist() == [5, 3, 5]
    assert make_conditioning(3, seed=1).embeds.equal(cond.embeds)  # seeded
    assert cond_tensors(cond, [1])["cond.mask"].tolist() == [[1, 1, 1, 0, 0]]
    leases = make_leases("explore", [7, 8], params={"x": 1})
    assert [(i.request_id, i.lease_id, i.prompt_index, i.seed, i.weight_version) for i in leases.items] == [
        ("r0", 10, 0, 7, 3),
        ("r1", 11, 1, 8, 3),
    ]
    assert P.decode(P.encode(leases))[1] == leases
    ports = free_ports(3)
    assert len(set(ports)) == 3
