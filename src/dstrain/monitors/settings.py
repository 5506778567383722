"""Which monitors a run writes, and where: DeepSpeed's own ``tensorboard``, ``csv_monitor`` and ``wandb`` blocks of
the ds_config (DeepSpeed's schema, checked by strategy.ds_schema), and W&B's environment variables.

dstrain writes these monitors itself, from rank 0, at the optimizer step (dstrain.monitors); DeepSpeed is handed the
ds_config without the three blocks (dstrain.strategy.resolved.OWN_SECTIONS), so its own sample-stepped events are not
sent. Nothing here imports torch, wandb or tensorboard: the checks run before any work.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dstrain.errors import DstrainError, InputError

# The ds_config blocks dstrain's monitors read (and DeepSpeed is not given).
MONITOR_BLOCKS = ("tensorboard", "csv_monitor", "wandb")
# The package each monitor needs, and the pin of requirements.txt.
INSTALLS = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb==0.31.0"}
# WANDB_MODE's values (W&B's own): "dryrun" is offline and "run" online, as W&B reads them.
WandbMode = Literal["online", "offline", "disabled"]
WANDB_MODES: dict[str, WandbMode] = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}
DEFAULT_PROJECT = "dstrain"


@dataclass(frozen=True)
class WandbSettings:
    """A W&B run's place: the ds_config's wandb block where it names them, else W&B's environment variables."""

    project: str  # wandb.project, else WANDB_PROJECT, else "dstrain"
    entity: str | None  # wandb.team, else WANDB_ENTITY, else the account's default entity
    group: str | None  # wandb.group, else WANDB_RUN_GROUP
    mode: WandbMode  # from WANDB_MODE (W&B's default: online)
    dir: Path  # W&B's own files (its wandb/ folder): WANDB_DIR, else the run folder


@dataclass(frozen=True)
class MonitorSettings:
    tensorboard: Path | None  # the event files' folder: tensorboard.output_path / tensorboard.job_name
    csv: Path | None  # the CSV files' folder: csv_monitor.output_path / csv_monitor.job_name
    wandb: WandbSettings | None

    @property
    def any(self) -> bool:
        return bool(self.tensorboard or self.csv or self.wandb)


def _enabled(config: Mapping, block: str) -> bool:
    section = config.get(block)
    return isinstance(section, Mapping) and bool(section.get("enabled"))


def _folder(config: Mapping, block: str, run_dir: Path) -> Path | None:
    if not _enabled(config, block):
        return None
    section = config[block]
    output = section.get("output_path")  # "" is DeepSpeed's own default: the working directory
    return Path(run_dir if output is None else output) / section.get("job_name", "")


def wandb_enabled(config: Mapping, env: Mapping[str, str]) -> bool:
    """The wandb block enables W&B; without a block, WANDB_PROJECT does (as for W&B's other integrations); an
    explicit ``"enabled": false`` or WANDB_MODE=disabled keeps it off."""
    if WANDB_MODES.get(env.get("WANDB_MODE", "online").lower()) == "disabled":
        return False
    return _enabled(config, "wandb") if "wandb" in config else bool(env.get("WANDB_PROJECT"))


# The W&B variable each name of the wandb block falls back to.
WANDB_VARIABLES = {"project": "WANDB_PROJECT", "team": "WANDB_ENTITY", "group": "WANDB_RUN_GROUP"}


def _named(block: Mapping, key: str, env: Mapping[str, str]) -> str | None:
    """The wandb block's name where it gives one (check_monitors refuses an empty one), else W&B's variable (an
    empty variable is unset, as W&B reads it)."""
    value = block.get(key)
    return value if value is not None else env.get(WANDB_VARIABLES[key]) or None


def monitor_settings(config: Mapping, run_dir: Path, env: Mapping[str, str] = os.environ) -> MonitorSettings:
    """The monitors a resolved ds_config enables (strategy.resolve filled the folders' "auto")."""
    wandb = None
    if wandb_enabled(config, env):
        block = config.get("wandb") or {}
        wandb = WandbSettings(
            project=_named(block, "project", env) or DEFAULT_PROJECT,
            entity=_named(block, "team", env),
            group=_named(block, "group", env),
            mode=WANDB_MODES.get(env.get("WANDB_MODE", "online").lower(), "online"),
            dir=Path(env["WANDB_DIR"]) if env.get("WANDB_DIR") else run_dir,
        )
    return MonitorSettings(_folder(config, "tensorboard", run_dir), _folder(config, "csv_monitor", run_dir), wandb)


def check_monitors(config: Mapping, run_dir: Path, env: Mapping[str, str] = os.environ) -> None:
    """One line before any work: a monitor whose package is not installed, an unknown WANDB_MODE, a W&B folder
    that cannot be written. (An unknown key in a monitor block: strategy.ds_schema, DeepSpeed's own models.)"""
    mode = env.get("WANDB_MODE")
    if mode is not None and mode.lower() not in WANDB_MODES:
        raise DstrainError(f"WANDB_MODE={mode} is not a W&B mode; use one of online, offline, disabled")
    for key, variable in WANDB_VARIABLES.items():
        if (config.get("wandb") or {}).get(key) == "":
            raise InputError(f'wandb.{key} is ""; name one, or remove the key to use {variable}')
    settings = monitor_settings(config, run_dir, env)
    needed = [block for block in INSTALLS if getattr(settings, block) is not None]
    for package in needed:
        if importlib.util.find_spec(package) is None:
            fix = f"but {package} is not installed; pip install {INSTALLS[package]}"
            if _enabled(config, package):  # the ds_config's block: the check phase names its file
                raise InputError(f"{package} is enabled {fix}")
            raise DstrainError(f"WANDB_PROJECT enables W&B {fix}")
    if settings.wandb is not None and env.get("WANDB_DIR"):
        _check_writable(Path(env["WANDB_DIR"]), settings.wandb.mode)
    if settings.wandb is not None and settings.wandb.mode == "online" and not _has_wandb_key(env):
        raise DstrainError(
            "W&B is online (WANDB_MODE) but finds no API key (WANDB_API_KEY, or ~/.netrc from `wandb login`); "
            "run `wandb login` once, set WANDB_API_KEY, or WANDB_MODE=offline"
        )


def _has_wandb_key(env: Mapping[str, str]) -> bool:
    """W&B's own sources of a key, read without wandb (it would ask on a terminal, or fail after the launch)."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(env.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _check_writable(folder: Path, mode: str) -> None:
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise DstrainError(
            f"WANDB_DIR={folder} is not a writable folder; W&B ({mode}) keeps the run's files there: "
            f"set WANDB_DIR=<a writable folder>, or unset it to keep them in the run folder"
        )
