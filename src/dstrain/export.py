"""Hugging Face interchange: `dstrain export` writes a run's checkpoint as a transformers model folder, and
a recipe's `init_from` starts training from one.

    dstrain export runs/tiny --out hf/tiny                  # newest complete checkpoint
    dstrain export runs/tiny --tag global_step200 --out hf/tiny-200

The folder holds config.json, model.safetensors and the run's tokenizer. The weights are the fp32 master
weights wherever the checkpoint holds them apart from the module's (bf16 runs: ZeRO's or BF16_Optimizer's
partitions), else the module's own (fp32 runs); `--dtype bf16` writes them rounded to bf16; llama-flavour models
become LlamaForCausalLM, gpt2-flavour ones GPT2LMHeadModel (dstrain.model.hf), so
`AutoModelForCausalLM.from_pretrained(folder)` computes what our GPT computed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
from pathlib import Path

import torch

from dstrain.errors import DstrainError

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds recipe.yaml and checkpoints/)")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step200 (default: the newest complete)")
    parser.add_argument("--out", required=True, help="new folder for the Hugging Face model (must not hold files)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="weights written: fp32 (the masters, default) or bf16 (half the size)")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DstrainError(f"--out {out} already exists and is not empty; choose a new folder")
    recipe, tag_dir = load_run(args.run_dir, args.tag)
    tokenizer = load_run_tokenizer(recipe)
    model = to_hf_model(recipe.model, consolidated_state_dict(tag_dir, recipe.model), tokenizer)
    model.to(torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)  # replaces an empty folder, never a full one
    print(f"{out}: {type(model).__name__} from {tag_dir} ({args.dtype} safetensors of the {weights_kind(tag_dir)} "
          f"weights, tokenizer)")
    return 0


# --- a run's checkpoint as one plain state dict --------------------------------------------------------


def load_run(run_dir: str | os.PathLike, tag: str | None):
    """(recipe, tag folder) of a run directory; tag None = the newest complete checkpoint."""
    from dstrain.config import load_recipe
    from dstrain.train import checkpoint

    run_dir = Path(run_dir)
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise DstrainError(f"{recipe_file}: no such file; pass a run directory written by dstrain.train")
    recipe = load_recipe(recipe_file)
    checkpoints = run_dir / "checkpoints"
    tag = tag or checkpoint.newest_complete(checkpoints)
    if tag is None:
        raise DstrainError(f"{checkpoints}: no complete checkpoint; train the run first or pass --tag")
    if not checkpoint.is_complete(checkpoints / tag):
        raise DstrainError(f"--tag {tag}: no complete checkpoint {checkpoints / tag}; omit --tag for the newest")
    return recipe, checkpoints / tag


def weights_kind(tag_dir: Path) -> str:
    """ "fp32 master" for a bf16 run, whose checkpoint keeps them apart from its bf16 module weights (ZeRO and fp16
    runs read through zero_to_fp32 get their masters too), else "module"."""
    from dstrain.train.topology import saved

    topology = saved(tag_dir)
    return "fp32 master" if topology and topology.precision == "bf16" else "module"


def consolidated_state_dict(tag_dir: Path, model_config) -> dict[str, torch.Tensor]:
    """fp32 weights of GPT(model_config), from a checkpoint of any strategy: the fp32 masters of a bf16 run (its
    module weights are a rounding of them), otherwise the module's own, widened to fp32."""
    from dstrain.train.topology import fp32_masters

    if weights_kind(tag_dir) == "fp32 master":
        return fp32_masters(tag_dir, model_config)
    return {name: tensor.float().contiguous() for name, tensor in module_state_dict(tag_dir).items()}


def module_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The module's weights in the checkpoint, in the model's dtype (fp32 masters for ZeRO, read by zero_to_fp32)."""
    from dstrain.train.topology import ZERO12_MODEL_FILE, _load

    if any(tag_dir.glob("layer_*-model_states.pt")) or any(tag_dir.glob("mp_rank_01_model_states.pt")):
        # Pipeline layer files / AutoTP shards: the model-parallel converter of dstrain.model consolidates them.
        from dstrain.model.convert import read_checkpoint

        return read_checkpoint(tag_dir)[1]
    if any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):  # ZeRO-1/2/3 partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # DeepSpeed's own consolidation (it loads its files with weights_only=False itself); its progress
        # prints would land in `dstrain generate`'s output.
        with contextlib.redirect_stdout(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    return _load(tag_dir / ZERO12_MODEL_FILE)["module"]  # ZeRO-0 and BF16_Optimizer: the whole model


def tokenizer_dir(recipe) -> Path:
    from dstrain.data.tokenizer import TOKENIZER_DIR

    return Path(recipe.data.tokenizer or Path(recipe.data.sources[0].path) / TOKENIZER_DIR)


def load_run_tokenizer(recipe):
    from dstrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tokenizer_dir(recipe)), flag="the run's tokenizer")


def to_hf_model(config, state: dict[str, torch.Tensor], tokenizer=None):
    """A transformers model (eval mode, fp32) holding our weights; the tokenizer gives its BOS/EOS ids."""
    import transformers

    from dstrain.model.hf import to_hf

    bos, eos = (tokenizer.bos_token_id, tokenizer.eos_token_id) if tokenizer is not None else (None, None)
    hf_config, hf_state = to_hf(config, state, bos_token_id=bos, eos_token_id=eos)
    model = getattr(transformers, hf_config.architectures[0])(hf_config)
    model.load_state_dict(hf_state, strict=True)
    return model.eval()


# --- import: a recipe's init_from ------------------------------------------------------------------


def load_init_from(model: torch.nn.Module, recipe, recipe_file: str | os.PathLike, zero3: bool) -> None:
    """Copy the weights of the Hugging Face folder ``recipe.init_from`` into the freshly built ``model``.

    Under ZeRO-3 the model was built inside deepspeed.zero.Init, so each parameter is gathered, filled on
    rank 0 and re-partitioned from there (one parameter at a time: no rank ever holds the whole model)."""
    from dstrain.model.gpt import GPT
    from dstrain.model.hf import architecture_diff, from_hf

    config, state = from_hf(recipe.init_from)
    differ = [f"model.{k}={ours!r} vs {theirs!r}" for k, ours, theirs in architecture_diff(recipe.model, config)]
    if differ:
        raise DstrainError(f"{recipe_file}: init_from {recipe.init_from} has another architecture ({'; '.join(differ)}); "
                           f"set those model fields to the Hugging Face values")
    if not isinstance(model, GPT):  # a PipelineModule: this rank's stage only
        from dstrain.model.convert import load_into_pipeline

        load_into_pipeline(model, state, recipe.model)
        return
    if not zero3:
        model.load_state_dict(state, strict=True)
        return
    import deepspeed

    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    param.copy_(state[name])


# --- a model to evaluate or sample from: a run's checkpoint or a Hugging Face folder ---------------


def load_model_source(path: str | os.PathLike, tag: str | None = None):
    """(GPTConfig, fp32 state dict, the run's recipe or None) of a run directory or a Hugging Face model folder."""
    from dstrain.model.hf import from_hf

    path = Path(path)
    if (path / "config.json").is_file():
        if tag:
            raise DstrainError(f"--tag {tag}: {path} is a Hugging Face model folder, which has no checkpoints")
        config, state = from_hf(path)
        return config, {k: v.float() for k, v in state.items()}, None
    if (path / "recipe.yaml").is_file():
        recipe, tag_dir = load_run(path, tag)
        return recipe.model, consolidated_state_dict(tag_dir, recipe.model), recipe
    raise DstrainError(f"{path}: neither a run directory (recipe.yaml) nor a Hugging Face model folder (config.json)")
