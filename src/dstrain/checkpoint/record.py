"""The record each published checkpoint tag carries (`dstrain_checkpoint.json`), as one typed dataclass: its files
with their sizes and checksums, its save number, the topology it was saved under and the identity of its experiment
(dataclasses both, read back as such), and the schema version that reads it; and the trainer's client state inside
DeepSpeed's files (``ClientState``), the one schema it is written and read by, typed from the trainer to the bytes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from dstrain.config import Recipe, to_dict
from dstrain.strategy.topology import Topology

PARTIAL = ".partial"  # suffix of a tag folder while it is being written
RECORD = "dstrain_checkpoint.json"
SCHEMA = 1  # of dstrain_checkpoint.json and of the client state; a record of another schema is not read


@dataclass(frozen=True)
class Identity:
    """What makes a checkpoint meaningless for another experiment (``identity`` builds it)."""

    model: dict  # config.to_dict of the recipe's model
    seq_len: int
    valid_fraction: float
    data: str | list  # the prepared data's fingerprint (a checkpoint), or the recipe's data.sources (a recipe.yaml)
    seed: int
    optimizer: str  # optim.kind: Muon's state is not AdamW's
    # the lora: section's shape of the adapters (rank, alpha, targets, modules_to_save, use_rslora); None: no adapters,
    # every parameter trains (and a record written before adapters existed)
    adapters: dict | None = None

    def differences(self, other: Identity) -> list[str]:
        """The fields in which ``other`` differs, in declaration order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def identity(recipe: Recipe, data: str | list) -> Identity:
    """What a checkpoint records of its experiment (in dstrain_checkpoint.json), for check_run_dir to compare: the
    model, what it reads (``data``: the data's fingerprint), the seed, and which optimizer's state it holds. The rest
    of the recipe (the optimizer's hyper-parameters, schedule, length, cadence) may change on resume, and the current
    recipe's values apply."""
    return identity_of_recipe_dict(to_dict(recipe), data)


def identity_of_recipe_dict(recipe: dict, data: str | list) -> Identity:
    return Identity(
        model=recipe["model"],
        seq_len=recipe["data"]["seq_len"],
        valid_fraction=recipe["data"]["valid_fraction"],
        data=data,
        seed=recipe["seed"],
        optimizer=recipe["optim"]["kind"],
        adapters=adapter_identity(recipe.get("lora")),
    )


ADAPTER_IDENTITY = ("rank", "alpha", "target_modules", "modules_to_save", "use_rslora")  # lora: fields a resume keeps


def adapter_identity(lora: dict | None) -> dict | None:
    """What of a recipe's lora: section its checkpoints are meaningless without (dropout and init_from may change)."""
    return None if lora is None else {key: lora[key] for key in ADAPTER_IDENTITY}


@dataclass(frozen=True)
class CheckpointRecord:
    step: int  # optimizer steps done when the tag was saved
    save_seq: int  # the save's number in its run folder: keep-last and a resume without `latest` go by it
    files: dict[str, int]  # every file of the tag (path relative to the tag folder) -> its size in bytes
    checksums: dict[str, str]  # path -> hex digest
    hash: str  # the checksums' algorithm (dstrain.checkpoint.integrity.HASH)
    topology: Topology  # the layout of the run that saved it
    identity: Identity | None  # of its experiment; None: saved by a caller that records none (tests, tools)
    schema: int = SCHEMA

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CheckpointRecord:
        """A ValueError for a record that is not one of this schema (a missing field, a wrong type)."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA or not isinstance(raw.get("files"), dict):
            raise ValueError(f"not a checkpoint record of schema {SCHEMA}")
        try:
            identity = raw["identity"]
            record = cls(
                **{
                    **raw,
                    "topology": Topology.from_record(raw["topology"]),
                    "identity": identity and Identity(**identity),
                }
            )
        except (TypeError, KeyError) as e:
            raise ValueError(str(e)) from None
        if not isinstance(record.save_seq, int) or not isinstance(record.checksums, dict):
            raise ValueError("not a checkpoint record")
        return record


def read_record(tag_dir: Path) -> CheckpointRecord | None:
    try:
        return CheckpointRecord.from_json((tag_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ClientState:
    """What the trainer saves beside the engine's state, in DeepSpeed's ``client_state`` of every checkpoint
    (dstrain.checkpoint.store adds the topology and DeepSpeed's universal-checkpoint info on its way to disk)."""

    consumed_samples: int  # samples of the train stream consumed (dstrain.train.step.components.Progress)
    rng: dict  # store.rng_state(): python, numpy and torch generators
    recipe: dict  # config.to_dict of the recipe it was trained under: a resume names what changed since
    data_fingerprint: str  # the prepared data's; a resume on other data is refused
    world_size: int
    strategy: str  # the ds_config's name
    components: dict[str, dict] = field(default_factory=dict)  # the trainer's components' state, by state_key
    schema: int = SCHEMA

    def to_saved(self) -> dict:
        """The keys DeepSpeed saves."""
        return dataclasses.asdict(self)

    @classmethod
    def from_saved(cls, saved: dict) -> ClientState:
        """From what engine.load_checkpoint returns (DeepSpeed's client state holds other keys too)."""
        if saved.get("schema") != SCHEMA:
            raise ValueError(f"the checkpoint's client state is not of schema {SCHEMA}")
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls)})
