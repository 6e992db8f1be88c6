"""`--config FILE` of the long commands (commands/common.py): values typed and checked as their flags',
flags override the file, required flags satisfied by it, and one-line errors naming the file and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from expertcast.commands import evaluate, simulate, sweep
from expertcast.commands.common import config_record
from expertcast.utils.errors import UsageError
from expertcast.utils.provenance import sha256_file


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_dest_names_and_dashed_spellings_read_as_the_command_line(tmp_path):
    cfg = _yaml(tmp_path, "model: qwen3_moe-tiny\nbenchmark: arith\npolicy: lru\nout: o\n"
                          "max-new-tokens: 8\nbatch_size: 2\nlink_gbps: 1.5\noverwrite: true\n")
    got = vars(evaluate.build_parser().parse_args(["--config", cfg]))
    flags = vars(evaluate.build_parser().parse_args(
        ["--model", "qwen3_moe-tiny", "--benchmark", "arith", "--policy", "lru", "--out", "o",
         "--max-new-tokens", "8", "--batch-size", "2", "--link-gbps", "1.5", "--overwrite"]))
    assert got.pop("config") == cfg and flags.pop("config") is None
    assert got == flags


def test_config_record_names_the_file_and_its_hash(tmp_path):
    cfg = _yaml(tmp_path, "policies: lru\n")
    args = simulate.build_parser().parse_args(["--config", cfg, "--synthetic", "zipf"])
    assert config_record(args) == {"path": str(Path(cfg).resolve()), "sha256": sha256_file(cfg)}
    assert config_record(simulate.build_parser().parse_args([])) is None


@pytest.mark.parametrize("text, expected", [
    ("polices: lru\n", "unknown key 'polices'; valid keys: "),
    ("limit: 0\n", "key 'limit': expected a positive integer, got 0"),
    ("limit: many\n", "key 'limit': expected a positive integer, got 'many'"),
    ("pool: everywhere\n", "key 'pool': invalid choice: 'everywhere'"),
    ("overwrite: 1\n", "key 'overwrite': expected true or false, got 1"),
    ("chat_template: yes\n", "key 'chat_template': expected a string or a number, got bool True (quote yes/no"),
    ("model: [a, b]\n", "key 'model': expected a string or a number, got list"),
    ("limit: 2\nlimit-x: 3\n", "unknown key 'limit-x'"),
    ("max_new_tokens: 2\nmax-new-tokens: 3\n", "key 'max-new-tokens' sets max_new_tokens a second time"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("- lru\n- lfu\n", "expected a mapping of flag names to values, got list"),
    ("", "expected a mapping of flag names to values, got an empty document"),
    ("limit: 2\npool: [per-layer\n", "YAML syntax error at line 3"),
])
def test_bad_config_is_a_one_line_usage_error(text, expected, tmp_path):
    cfg = _yaml(tmp_path, text)
    with pytest.raises(UsageError) as err:
        sweep.build_parser().parse_args(["--config", cfg, "--model", "m", "--policies", "lru", "--out", "o"])
    msg = str(err.value)
    assert msg.startswith(f"--config {cfg}: ") and expected in msg and "\n" not in msg


def test_missing_config_file_exits_2_with_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert simulate.main(["--config", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"expertcast simulate: error: --config {missing}: cannot read it") and "\n" not in err


def test_required_flags_from_the_file_and_still_required_without_it(tmp_path, capsys):
    cfg = _yaml(tmp_path, "model: m\npolicies: lru\n")
    parser = sweep.build_parser()
    assert parser.parse_args(["--config", cfg, "--out", "o"]).policies == "lru"
    with pytest.raises(SystemExit):  # --out is in neither: argparse's own required check
        parser.parse_args(["--config", cfg])
    assert "the following arguments are required: --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the parser is left as built: the file's values are not kept
        parser.parse_args(["--out", "o"])
    assert "--model, --policies" in capsys.readouterr().err


def test_an_abbreviated_config_flag_is_refused_not_ignored(tmp_path, capsys):
    cfg = _yaml(tmp_path, "synthetic: zipf\n")
    with pytest.raises(SystemExit):
        simulate.build_parser().parse_args(["--conf", cfg])
    assert "spell --config in full" in capsys.readouterr().err
    assert simulate.build_parser().parse_args([f"--config={cfg}"]).synthetic == "zipf"


def test_other_commands_config_flags_are_their_own_files():
    from expertcast.commands import build_default

    recipe = str(Path(__file__).resolve().parents[2] / "configs/tiny_default/default.yaml")
    assert build_default.build_parser().parse_args(["--config", recipe]).config == recipe  # not read as flags


def test_capacity_flags_become_typed_budgets():
    """``--capacity`` / ``--slots`` / ``--budget-gb`` each give Budgets (never dicts); ``--budget-gb`` is exclusive
    of the other two; a single-capacity command takes one value."""
    import argparse

    from expertcast.commands.common import add_capacity_args, capacities_from_args
    from expertcast.inference.cache.expert_cache import Budget

    p = argparse.ArgumentParser()
    add_capacity_args(p, multiple=True, budget_gb=True)
    caps = capacities_from_args(p.parse_args(["--capacity", "0.25,0.5", "--slots", "8"]), multiple=True)
    assert caps == [Budget.fraction(0.25), Budget.fraction(0.5), Budget.slots(8)]
    assert [c.row() for c in caps] == [{"capacity": 0.25}, {"capacity": 0.5}, {"slots": 8}]
    assert capacities_from_args(p.parse_args(["--budget-gb", "1.5,2"]), multiple=True) == \
        [Budget.bytes(1_500_000_000), Budget.bytes(2_000_000_000)]
    for argv, match in ((["--slots", "8", "--budget-gb", "1"], "give --budget-gb (bytes of experts) or --slots"),
                        (["--budget-gb", "-1"], "--budget-gb: -1; a byte budget must be a positive number of GB"),
                        (["--budget-gb", "x"], "--budget-gb: 'x' is not a number of gigabytes")):
        with pytest.raises(UsageError, match=re.escape(match)):
            capacities_from_args(p.parse_args(argv), multiple=True)
    with pytest.raises(UsageError, match="takes one capacity"):
        capacities_from_args(p.parse_args(["--budget-gb", "1,2"]), multiple=False)
    plain = argparse.ArgumentParser()
    add_capacity_args(plain, multiple=False)
    assert not hasattr(plain.parse_args([]), "budget_gb")  # only the commands that take bytes
