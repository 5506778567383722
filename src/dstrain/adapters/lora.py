"""LoRA applied to the built GPT from outside model/gpt.py: an adapter beside each targeted projection, the base frozen.

dstrain.adapters.config says which projections; docs/adapters.md how to use it.

Where the adapters live: each attention or MLP module that has targets gets a ModuleDict ``lora`` of one
``LoraAdapter`` per target, its weights ``<module>.lora.<target>.lora_A.weight`` (rank x in) and ``.lora_B.weight``
(out x rank). The projections themselves are untouched, so every base parameter keeps its name (init_from, the
checkpoints, consolidation and the Hugging Face export read the base as before), and a layout that replaces a
projection (AutoTP swaps nn.Linear for its own layers inside deepspeed.initialize) replaces only the base: the
adapter is added to whatever module sits at the target's name, by a forward hook that the parent module's
pre-hook (re)attaches before each forward.

Why hand-written rather than PEFT's LoraLayer: PEFT wraps each nn.Linear in a module of its own, which renames the
base (``q_proj.base_layer.weight``), is not known to AutoTP's partitioning, and draws its weights from the global
RNG, which would differ between a pipeline stage and the whole model. The math is PEFT's (tests/test_lora_*.py
hold our logits to PEFT's on the exported folder).

Under AutoTP the adapters stay whole on every tensor-parallel rank: a column-parallel target (q/k/v/gate/up) adds
this rank's rows of B (A x), its r-wide intermediate's gradient summed over the group (as the layer sums its input's)
and B's gradient too (each rank fills its own rows); a row-parallel target (o/down) sums A's partial product over
the group before B, and A's gradient (each rank fills its own columns).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.adapters.config import LoraConfig, target_names
from dstrain.model.config import GPTConfig
from dstrain.model.gpt import Block, Embedding, Head

ADAPTER_KEY = ".lora."  # in the name of every adapter parameter (and of nothing else)


class AdapterLinear(nn.Linear):
    """A bias-free nn.Linear that draws its own weight, inside its constructor (ZeRO-3 partitions on return), from a
    CPU generator of its own: the same numbers under every layout. seed given: uniform in +-1/sqrt(in), the bound of
    PEFT's lora_A (kaiming-uniform, a = sqrt(5)); None: zero (PEFT's lora_B)."""

    def __init__(self, fan_in: int, fan_out: int, seed: int | None) -> None:
        self.seed = seed
        super().__init__(fan_in, fan_out, bias=False)

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        with torch.no_grad():
            if self.seed is None:
                self.weight.zero_()
                return
            generator = torch.Generator(device="cpu").manual_seed(self.seed)
            # torch.rand, not uniform_ on a torch.empty: under a bf16 zero.Init DeepSpeed 0.19.8 recasts what
            # torch.empty/zeros/ones/full/tensor make to bf16 even when given dtype=float32, and bf16's uniform_
            # hands back values at the bound with the wrong sign (seen: 0.1249 drawn as -0.125). It leaves torch.rand
            # alone. tests/test_lora_strategies.py::test_deepspeed_recasts_explicit_fp32_under_zero_init notices a fix.
            unit = torch.rand(self.weight.shape, generator=generator, dtype=torch.float32, device="cpu")
            self.weight.copy_((2 * unit - 1) / math.sqrt(self.in_features))


class LoraAdapter(nn.Module):
    """scale x B A dropout(x) for one projection of ``fan_in`` -> ``fan_out`` features."""

    def __init__(self, fan_in: int, fan_out: int, lora: LoraConfig, seed: int) -> None:
        super().__init__()
        self.lora_A = AdapterLinear(fan_in, lora.rank, seed)
        self.lora_B = AdapterLinear(lora.rank, fan_out, None)
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        self.scale = lora.scale
        self.tp_kind: str | None = None  # "column" or "row" once AutoTP replaced the target (its forward hook)

    def forward(self, x: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """The adapter's addition to ``target``'s output for its input x (AutoTP's layers: this rank's part)."""
        x = self.dropout(x)
        sizes, index = getattr(target, "_partition_sizes", None), getattr(target, "tp_index", 0)
        group = getattr(target, "mp_group", None)
        if sizes is None or group is None or len(sizes) == 1:
            return self.lora_B(self.lora_A(x)) * self.scale
        start, size = sum(sizes[:index]), sizes[index]
        if type(target).__name__.startswith("LinearAllreduce"):  # row-parallel: x holds this rank's input columns
            self.tp_kind = "row"
            partial = F.linear(x, self.lora_A.weight.narrow(1, start, size))
            return self.lora_B(SumOverGroup.apply(partial, group)) * self.scale
        self.tp_kind = "column"  # column-parallel: x is whole, the output holds this rank's rows
        inner = SumGradOverGroup.apply(self.lora_A(x), group)
        return F.linear(inner, self.lora_B.weight.narrow(0, start, size)) * self.scale


class SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the tensor-parallel group; backward: the gradient as is (each rank needs it whole)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class SumGradOverGroup(torch.autograd.Function):
    """Forward: as is; backward: the gradient summed over the tensor-parallel group (each rank had a part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def add_adapter_output(target: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    adapter: LoraAdapter = target.__dict__["_lora_adapter"]
    return output + adapter(args[0], target).to(output.dtype)


def attach_hooks(parent: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a module holding adapters: each target (whatever module is there now) adds its adapter."""
    adapters: nn.ModuleDict = parent.lora  # type: ignore[assignment]
    for name, adapter in adapters.items():
        target = parent._modules[name]
        assert target is not None
        if target.__dict__.get("_lora_adapter") is not adapter:
            target.__dict__["_lora_adapter"] = adapter  # not a submodule: the adapter has one home, parent.lora
            target.register_forward_hook(add_adapter_output)


def sum_grads_over_tp(adapter: LoraAdapter) -> None:
    """Under AutoTP each rank fills only its rows of B (column targets) or columns of A (row targets)."""

    def summed(kind: str):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if adapter.tp_kind != kind:
                return grad
            from deepspeed.utils import groups

            grad = grad.clone()
            torch.distributed.all_reduce(grad, group=groups.get_tensor_model_parallel_group())
            return grad

        return hook

    adapter.lora_B.weight.register_hook(summed("column"))
    adapter.lora_A.weight.register_hook(summed("row"))


def numbered_blocks(model: nn.Module) -> list[tuple[int, Block]]:
    """(index in the whole model, block) of every block this rank holds: the plain GPT's, or a pipeline stage's."""
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):  # layer 0 is the embedding, then the blocks
        return [(model._local_start + i - 1, f) for i, f in enumerate(model.forward_funcs) if isinstance(f, Block)]
    return list(enumerate(model.blocks))  # type: ignore[arg-type]


def adapter_seed(seed: int, block: int, target: str) -> int:
    """The generator seed of one adapter's A: the recipe's seed, the block and the target, nothing of the layout."""
    return zlib.crc32(f"{seed}:{block}:{target}".encode())


def inject(model: nn.Module, config: GPTConfig, lora: LoraConfig, seed: int, tensor_parallel: bool = False) -> int:
    """Adds the adapters to every block ``model`` holds and freezes all but them (and lora.modules_to_save); the
    number of adapters added. Inside zero.Init under ZeRO-3 (the caller's context): each is partitioned as built."""
    targets = target_names(lora, config)
    count = 0
    for index, block in numbered_blocks(model):
        for parent in (block.self_attn, block.mlp):
            names = [name for name in targets if isinstance(getattr(parent, name, None), nn.Linear)]
            if not names:
                continue
            adapters = nn.ModuleDict()
            for name in names:
                linear: nn.Linear = getattr(parent, name)
                adapter = LoraAdapter(linear.in_features, linear.out_features, lora, adapter_seed(seed, index, name))
                if tensor_parallel:
                    sum_grads_over_tp(adapter)
                adapters[name] = adapter
            parent.lora = adapters
            parent.register_forward_pre_hook(attach_hooks)
            count += len(names)
    freeze_base(model, lora)
    return count


def freeze_base(model: nn.Module, lora: LoraConfig) -> None:
    """requires_grad only on the adapters and the modules lora.modules_to_save names."""
    saved: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, Embedding) and "embed_tokens" in lora.modules_to_save:
            saved.append(module.tok.weight)
        if isinstance(module, Head) and "lm_head" in lora.modules_to_save:
            saved.append(module.weight)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    for tensor in saved:
        tensor.requires_grad_(True)


SAVED_PARAMETERS = {"embed_tokens": "embed.tok.weight", "lm_head": "lm_head.weight"}  # modules_to_save, GPT's names


def saved_module_names(lora: LoraConfig) -> set[str]:
    """The plain GPT's names of the parameters lora.modules_to_save trains."""
    return {SAVED_PARAMETERS[name] for name in lora.modules_to_save}


def is_adapter(name: str) -> bool:
    """Whether a parameter name (plain or a pipeline stage's) is an adapter's."""
    return ADAPTER_KEY in name or name.startswith("lora.")


def canonical_names(model: nn.Module, config: GPTConfig) -> dict[str, str]:
    """This rank's parameter names -> the plain GPT's (a pipeline stage's layers renamed by model/pipe.py's
    layer_prefixes)."""
    names = [name for name, _ in model.named_parameters()]
    if not hasattr(model, "forward_funcs"):
        return {name: name for name in names}
    from dstrain.model.pipe import layer_prefixes

    prefixes = layer_prefixes(config)
    plain = {}
    for name in names:
        index, _, rest = name.partition(".")
        if index.isdigit() and prefixes[int(index)] is not None:
            ours, own = prefixes[int(index)]  # type: ignore[misc]
            plain[name] = ours + rest[len(own) :]
        elif name.startswith("tied_modules.embed."):
            plain[name] = "embed." + name[len("tied_modules.embed.") :]
    return plain


def merged_state_dict(state: dict[str, torch.Tensor], config: GPTConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The plain GPT's state dict with each adapter folded into its projection, W + scale x B A, in fp32 (what PEFT's
    merge_and_unload computes); the adapter tensors left out. Done on a consolidated checkpoint, never in an engine.
    A QLoRA run's NF4 projections are dequantized first: the merged model is the one the run computed."""
    if lora.quantize_base is not None:
        from dstrain.adapters.qlora import dequantized_state_dict

        state = dequantized_state_dict(state, config)
    merged = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for name, a in state.items():
        if not name.endswith(".lora_A.weight"):
            continue
        b = state[name.replace(".lora_A.", ".lora_B.")]
        parent, _, rest = name.partition(ADAPTER_KEY)
        base = f"{parent}.{rest.split('.')[0]}.weight"
        merged[base] = (merged[base].float() + lora.scale * (b.float() @ a.float())).to(merged[base].dtype)
    if config.tied:
        merged["lm_head.weight"] = merged["embed.tok.weight"]
    return merged
