"""``cluster.sp_backend = "xfuser"`` (spotlight/workers/sp/xfuser_backend.py) against a stub of
xfuser's distributed module (xfuser cannot be imported without an accelerator): our rendezvous
first, then xfuser's groups over it; torn down and rebuilt on every re-form; the model objects of
a group are xfuser's wrapper class; refused without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spotlight.config import ModelConfig
from spotlight.workers.sp.group import SPGroupMember
from tests.factories import free_ports
from tests.unit.workers.sp.test_group import _guard, _reference, _run, _setup_child, _spec, _velocity, _weights


def _t_xfuser(q, rank, ports):
    _setup_child()
    from spotlight.workers.sp import xfuser_backend
    from tests.unit.workers.sp import xfuser_stub

    def body():
        xfuser_stub.install()
        xfuser_backend.xfuser_problem = lambda device: None  # the stub stands in for a CUDA machine
        m = SPGroupMember(ModelConfig(), f"w{rank}", torch.device("cpu"), backend="xfuser")
        m.form(_spec(["w0", "w1"], ports[0], 1), state_dict=_weights() if rank == 0 else None)
        q.put((f"r{rank}.class", type(m.model).__name__))
        q.put((f"r{rank}.v1", _velocity(m)))
        first = m.model
        m.form(_spec(["w0", "w1"], ports[1], 2))  # a re-form: xfuser's groups are rebuilt
        q.put((f"r{rank}.same_model", m.model is first))  # one model object survives re-forms
        q.put((f"r{rank}.v2", _velocity(m)))
        if rank == 0:
            m.form(_spec(["w0"], ports[2], 3))  # alone: no process group, no xfuser groups
            q.put(("r0.class_sp1", type(m.model).__name__))
        m.leave()
        q.put((f"r{rank}.calls", list(xfuser_stub.CALLS)))

    _guard(q, f"r{rank}", body)


@pytest.mark.procs
def test_xfuser_groups_follow_ours_and_are_rebuilt_on_every_reform():
    ports = free_ports(3)
    out = _run([(_t_xfuser, (r, ports)) for r in range(2)])
    ref = _reference()
    for r in range(2):
        assert out[f"r{r}.class"] == "xFuserQwenImageTransformerWrapper" and out[f"r{r}.same_model"]
        np.testing.assert_allclose(out[f"r{r}.v1"], ref, atol=1e-5, rtol=0)
        np.testing.assert_allclose(out[f"r{r}.v2"], ref, atol=1e-5, rtol=0)
        generation = [
            ("init_distributed_environment", r, 2, 0, True),  # after our rendezvous, local rank 0
            ("initialize_model_parallel", 1, 2, 2),  # no CFG split: Ulysses over both ranks
        ]
        torn_down = [("destroy_model_parallel",), ("destroy_distributed_environment", True)]
        assert out[f"r{r}.calls"] == generation + torn_down + generation + torn_down, out[f"r{r}.calls"]
    assert out["r0.class_sp1"] == "QwenImageTransformer2DModel"


def test_xfuser_is_refused_without_cuda_and_for_families_it_has_no_wrapper_for():
    from spotlight.config import ConfigError, config_from_dict
    from spotlight.workers.sp.xfuser_backend import XfuserAdapter, XfuserUnavailable, xfuser_problem

    assert "needs CUDA" in xfuser_problem(torch.device("cpu"))
    with pytest.raises(XfuserUnavailable, match="needs CUDA"):
        XfuserAdapter("qwen-image", torch.device("cpu"))
    with pytest.raises(ConfigError, match="cluster.sp_backend: 'xfuser' serves qwen-image, tiny"):
        config_from_dict({"model": {"family": "flux", "pretrained_path": "/x"}, "cluster": {"sp_backend": "xfuser"}})


def test_a_local_run_with_xfuser_on_a_machine_without_cuda_is_one_line_before_anything_starts(monkeypatch):
    import types

    from spotlight.cli.up_preflight import Stop, _check_sp_backend
    from spotlight.config import config_from_dict

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = config_from_dict({"cluster": {"sp_backend": "xfuser", "sp_degree": 2}})
    with pytest.raises(Stop) as stop:
        _check_sp_backend(types.SimpleNamespace(cfg=cfg, opts=types.SimpleNamespace(local=True)))
    assert "needs CUDA" in stop.value.line
    _check_sp_backend(types.SimpleNamespace(cfg=cfg, opts=types.SimpleNamespace(local=False)))  # remote agents decide
