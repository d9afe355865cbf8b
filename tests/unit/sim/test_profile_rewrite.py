"""spotlight.sim.profile.set_iterations_to_target: the profile's convergence input rewritten with
its source, everything else kept byte for byte."""

from __future__ import annotations

import pytest

from spotlight.sim.profile import DEFAULT_PROFILE, ProfileError, load_profile, set_iterations_to_target

VALUES = {"rlboost": (50, "measured: 39 x 1.28"), "verl-omni-spot": (41, "")}


def test_keys_are_set_in_place_and_notes_go_on_top_of_the_table(tmp_path):
    original = DEFAULT_PROFILE.read_text(encoding="utf-8")
    text = set_iterations_to_target(original, VALUES, ["from a test", "second line"], "[m] ")
    lines = text[text.index("[iterations_to_target]") :].splitlines()
    assert "# [m] from a test" in lines and "# [m] second line" in lines
    assert lines.index("# [m] second line") < next(i for i, x in enumerate(lines) if x.startswith("spotlight ="))
    assert "rlboost = 50            # measured: 39 x 1.28" in lines
    assert "verl-omni-spot = 41" in lines
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    its = load_profile(path).iterations_to_target
    assert its == load_profile().iterations_to_target | {"rlboost": 50, "verl-omni-spot": 41}
    # a second rewrite drops the first one's notes
    twice = set_iterations_to_target(text, VALUES, ["only this"], "[m] ")
    assert "from a test" not in twice and twice.count("# [m]") == 1


def test_a_profile_without_the_table_gets_one_at_the_end(tmp_path):
    original = DEFAULT_PROFILE.read_text(encoding="utf-8")
    bare = original[: original.index("[iterations_to_target]")].rstrip("\n")  # no newline at the end either
    text = set_iterations_to_target(bare, VALUES, ["why"], "[m] ")
    assert text.startswith(bare + "\n")
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    assert load_profile(path).iterations_to_target == {"rlboost": 50, "verl-omni-spot": 41}


def test_crlf_files_stay_crlf():
    original = DEFAULT_PROFILE.read_text(encoding="utf-8").replace("\n", "\r\n")
    text = set_iterations_to_target(original, VALUES, ["why"], "[m] ")
    assert "\n" not in text.replace("\r\n", "")


@pytest.mark.parametrize(("values", "match"), [({"rlbost": (3, "")}, "unknown policy"), ({"rlboost": (0, "")}, ">= 1")])
def test_bad_values_are_refused(values, match):
    with pytest.raises(ProfileError, match=match):
        set_iterations_to_target(DEFAULT_PROFILE.read_text(), values, [], "[m] ")
