"""Where the shipped model and scenario configs are, and how a model is named.

The YAML files live in the repository's `configs/` folder; `setup.py` installs the same
folder as the package data `dynatrain_megatron/shipped_configs/`, so `--model llama3-70b`
works from an installed package as well as from a source checkout. Every command that
takes a model name resolves it here.
"""
from __future__ import annotations

from pathlib import Path

from .vps.errors import ModelSpecError
from .vps.model_spec import ModelSpec

_PACKAGE = Path(__file__).resolve().parent
_INSTALLED = _PACKAGE / "shipped_configs"  # setup.py: package_dir maps configs/ here
_CHECKOUT = _PACKAGE.parent / "configs"  # a source checkout (PYTHONPATH, editable)


def configs_dir() -> Path:
    """The folder holding `models/` and `scenarios/`: the installed package data when
    there is one, else the source checkout's `configs/`."""
    return _INSTALLED if (_INSTALLED / "models").is_dir() else _CHECKOUT


def model_names() -> list[str]:
    """Names of the shipped model configs (`configs/models/NAME.yaml`)."""
    return sorted(p.stem for p in (configs_dir() / "models").glob("*.yaml"))


def model_config_path(name_or_path: str | Path) -> Path:
    """The YAML file of a model: `name_or_path` itself when it is a file or ends in
    .yaml/.yml, else the shipped config of that name. ModelSpecError names the known
    models when there is no such config."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    cand = configs_dir() / "models" / f"{name_or_path}.yaml"
    if not cand.is_file():
        raise ModelSpecError(f"unknown model {str(name_or_path)!r}: no file {cand}; "
                             f"known: {model_names()}")
    return cand


def load_model(name_or_path: str | Path) -> ModelSpec:
    """The `ModelSpec` of a model name or YAML path (`model_config_path`)."""
    return ModelSpec.from_yaml(model_config_path(name_or_path))


__all__ = ["configs_dir", "model_names", "model_config_path", "load_model"]
