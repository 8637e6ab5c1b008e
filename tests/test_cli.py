"""The `dynatrain` command: every subcommand registered once, import failures loud, and
models found by name through `configs.py` (installed package data or the checkout)."""
from __future__ import annotations

import sys

import pytest

from dynatrain_megatron import cli, configs
from dynatrain_megatron.vps.errors import ModelSpecError


def test_every_subcommand_is_registered():
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    assert set(sub.choices) == {"layout", "lost", "plan", "request", "join", "launch", "megatron-lm", "suggest",
                                "bench-switch"}


def test_a_subcommand_that_cannot_be_imported_fails_loudly(tmp_path, monkeypatch):
    (tmp_path / "broken_subcommand.py").write_text("import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_module_anywhere"):
        cli.build_parser(cli.SUBCOMMANDS + ("broken_subcommand",))
    sys.modules.pop("broken_subcommand", None)


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert cli.main(["layout", "--model", "no-such-model", "--layout", "tp1", "--world",
                     "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynatrain layout: error: unknown model 'no-such-model'")
    assert "tiny-gpt" in err and "\n" not in err


def test_model_names_resolve_from_one_place(tmp_path, monkeypatch):
    assert configs.model_config_path("tiny-gpt").name == "tiny-gpt.yaml"
    assert configs.load_model("tiny-gpt").name == "tiny-gpt"
    yaml_path = tmp_path / "mine.yaml"
    assert configs.model_config_path(yaml_path) == yaml_path  # a path is taken as is
    assert configs.model_config_path(str(yaml_path)) == yaml_path
    with pytest.raises(ModelSpecError, match="known: .*'llama3-70b'"):
        configs.model_config_path("llama-9000")
    # an installed package (package data next to the module) wins over the checkout
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "only-installed.yaml").write_text("name: x\n")
    monkeypatch.setattr(configs, "_INSTALLED", tmp_path)
    assert configs.configs_dir() == tmp_path
    assert configs.model_names() == ["only-installed"]
    assert configs.model_config_path("only-installed") == \
        tmp_path / "models" / "only-installed.yaml"
