"""The ``N/D+K`` tree specs of scripts/tree_sweep.py and scripts/profile_round.py
(``poss.decode.params.tree_spec``); the timing itself needs the real model: run the script."""

import pytest

from helpers.scripts import load_script
from poss.decode.params import TreeParams, tree_spec


@pytest.fixture(scope="module")
def sweep():
    return load_script("tree_sweep")


def test_tree_specs_parse_with_and_without_a_chain():
    assert tree_spec("4/1+4") == TreeParams(num_nodes=4, depth=1, lookup=4)
    assert tree_spec("6/2") == TreeParams(num_nodes=6, depth=2)
    assert tree_spec("1/0+6") == TreeParams(num_nodes=1, depth=0, lookup=6)


@pytest.mark.parametrize("spec", ["4-1", "4/1+", "4/1/2", "0/0", "4/1+-2"])
def test_bad_tree_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        tree_spec(spec)


def test_a_bad_spec_is_a_usage_error_naming_the_flag(sweep, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--trees", "4/1", "four"])
    assert e.value.code == 2 and "--trees" in capsys.readouterr().err
