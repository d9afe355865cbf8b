"""A client keys directory without the wanted key: the hint says where `spotlight keys add` works."""

from __future__ import annotations

import shutil

import pytest

from spotlight.net.security import KeysError, add_client, init_keys, load_client_keys


def test_an_agents_keys_dir_without_a_status_key_points_at_the_coordinators_dir(tmp_path):
    coord = tmp_path / "coord"
    init_keys(coord)
    secret = add_client(coord, "agent", "spot-0")
    agent = tmp_path / "agent"
    agent.mkdir()
    shutil.copy(coord / "server.key", agent / "server.key")
    shutil.copy(secret, agent / secret.name)
    with pytest.raises(KeysError) as info:
        load_client_keys(agent, role="status")
    msg = str(info.value)
    assert f"spotlight keys add {agent}" not in msg, msg
    assert (
        "spotlight keys add COORDINATOR_KEYS status NAME" in msg
        and "server.key_secret" in msg
        and "does not work on this one" in msg
    ), msg


def test_the_coordinators_keys_dir_gets_the_direct_command(tmp_path):
    coord = tmp_path / "coord"
    init_keys(coord)
    with pytest.raises(KeysError) as info:
        load_client_keys(coord, role="status")
    assert f"spotlight keys add {coord} status NAME" in str(info.value)


def test_a_revoked_keys_secret_leaves_the_directory_so_join_sees_one_key(tmp_path):
    """Was: `keys revoke` left agent.spot-7.key_secret beside agent.spot-8's, and `spotlight-agent
    join --keys DIR` then refused: "holds several client keys of role 'agent'", counting the
    revoked one."""
    from spotlight.net.security import revoke_client

    coord = tmp_path / "coord"
    init_keys(coord)
    old = add_client(coord, "agent", "spot-7")
    new = add_client(coord, "agent", "spot-8")
    assert revoke_client(coord, "agent.spot-7") == old and not old.exists()
    assert load_client_keys(coord, role="agent").principal.id == "agent.spot-8"
    assert new.is_file() and revoke_client(coord, "agent.spot-8") == new
    add_client(coord, "agent", "spot-8")  # the name can be added again: a new pair
    secret_moved = coord / "agent.spot-8.key_secret"
    secret_moved.unlink()  # the secret went to its node: revoking still works
    assert revoke_client(coord, "agent.spot-8") is None


@pytest.mark.parametrize(
    "name, role, says",
    [
        ("agent.local", "reserved", "agent.local is a key of role 'agent', not 'reserved': it joins as a spot agent"),
        ("local", "reserved", "agent.local is a key of role 'agent', not 'reserved'"),
        ("status.watch", "agent", "a status key only reads a run's status (spotlight status); it cannot join"),
        ("reserved.r0", "agent", "it joins as the reserved agent (with --reserved)"),
    ],
)
def test_a_named_key_of_another_role_says_its_role(tmp_path, name, role, says):
    """Was: `spotlight-agent join --key agent.local --reserved` said the directory "holds no client
    secret key of role 'reserved' named 'agent.local'" and told to create one; `--key
    status.watch` without --reserved suggested creating an agent key."""
    coord = tmp_path / "coord"
    init_keys(coord)
    for role_, name_ in (("agent", "local"), ("status", "watch"), ("reserved", "r0")):
        add_client(coord, role_, name_)
    with pytest.raises(KeysError) as info:
        load_client_keys(coord, name=name, role=role)
    assert says in str(info.value), str(info.value)
    assert load_client_keys(coord, name="agent.local", role="agent").principal.id == "agent.local"
