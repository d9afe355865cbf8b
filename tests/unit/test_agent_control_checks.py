"""`spotlight-agent revoke` / `add-gpu`: a request naming GPUs the node does not hold (or
already holds, or negative ids) is refused before anything changes."""
from agent.main import control_gpus_error


def test_revoke_of_a_gpu_not_on_the_node_names_the_nodes_gpus():
    err = control_gpus_error("revoke", [7], [0, 1])
    assert err is not None and "[7]" in err and "[0, 1]" in err and "nothing revoked" in err


def test_revoke_of_a_held_gpu_is_accepted():
    assert control_gpus_error("revoke", [1], [0, 1]) is None


def test_add_of_a_gpu_already_present_is_refused():
    err = control_gpus_error("add", [1], [0, 1])
    assert err is not None and "already on this node" in err


def test_add_of_a_new_gpu_is_accepted():
    assert control_gpus_error("add", [2], [0, 1]) is None
    assert control_gpus_error("add", [1], [0]) is None


def test_negative_and_repeated_ids_are_refused():
    assert "0 or more" in control_gpus_error("add", [-1], [0])
    assert "0 or more" in control_gpus_error("revoke", [-1], [0])
    assert "repeated" in control_gpus_error("add", [2, 2], [0])
    assert control_gpus_error("revoke", [], [0]) == "no GPU given"
