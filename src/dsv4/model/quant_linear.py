"""Dense linears kept in their checkpoint encoding: FP8 e4m3 + 128x128 UE8M0 block scales.

DeepSeek-V4 checkpoints store the attention projections (wq_a, wq_b, wkv, wo_a, wo_b, the
indexer's wq_b), the shared experts' w1 / w2 / w3 and the MTP blocks' e_proj / h_proj in FP8
(`checkpoint/writer.py` writes the same set, `FP8_LINEAR`); norms, the gate, the indexer's
weights_proj, the compressors, embeddings and the LM head stay float. With
`weight_format="checkpoint"` each linear the checkpoint stores in FP8 becomes a `QuantLinear`
(`model/loader.py::empty_model`): its `weight` (float8_e4m3fn [out, in]) and `scale` (uint8
exponent codes [ceil(out/128), ceil(in/128)]) buffers hold the checkpoint's bytes as they are (one
byte per weight, half of bf16), under the checkpoint's own names.

Forward: the serving path passes its kernel backend's ops (`linear(module, x, ctx.ops)`), whose
`quant_linear` op decodes the codes in registers (`kernels/triton/fp8_linear.py`; the `ref` op
dequantises the matrix first). Elsewhere (the full-sequence path, tests) the reference dequantises
the weight to x's dtype on the fly on every call and runs F.linear: exact values, so outputs equal
those of the model whose linears were dequantised at load, and gradients reach x (the codes are not
trainable; a model holding them cannot be exported).

Composition: the serving path's fused projection groups (`model/fused_projections.py`) fuse
FP8 members among themselves (codes and block scales stacked, one `quant_linear` call: wq_a | wkv,
wq_b | the indexer's wq_b, w1 | w3, where every member but the last holds whole 128-row scale
blocks) and never mix them with float ones; the grouped `wo_a` is one call (`groups=`); tensor
parallelism cuts codes and scales together on 128 boundaries (`narrow_`) and dequantises only a
linear whose cut is not block-aligned (`distributed/tp.py::cut_modules_`). Each module holds the
kernel's split-K arrival counters (`counters`, not in the state dict; zero between calls), so a
decode call needs no memset; a module's calls run one at a time on one stream, whichever stream
that is (multi-stream).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from dsv4.kernels.ref import quant
from dsv4.kernels.ref.fp8_linear import fp8_linear
from dsv4.kernels.registry import KernelOps

# module names (as in the official checkpoint, less `.weight`) of the linears stored in FP8
FP8_LINEAR = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b"
                        r"|ffn\.shared_experts\.w[123]|e_proj|h_proj)$")


def is_fp8_linear(module_name: str) -> bool:
    """Whether the checkpoint writer stores linear `module_name` in FP8 (`FP8_LINEAR`)."""
    return bool(FP8_LINEAR.search(module_name))


class QuantLinear(nn.Module):
    """A bias-free linear [out, in] as FP8 codes (`weight`) and UE8M0 block scales (`scale`)."""

    weight: torch.Tensor
    scale: torch.Tensor
    counters: torch.Tensor
    bias: None = None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        b = quant.FP8_BLOCK
        self.register_buffer("weight", torch.zeros(out_features, in_features,
                                                   dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.zeros(math.ceil(out_features / b),
                                                  math.ceil(in_features / b), dtype=torch.uint8))
        # one word per output tile of the narrowest tile the kernel plans (16 rows)
        self.register_buffer("counters", torch.zeros(math.ceil(out_features / 16),
                                                     dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor, ops: KernelOps | None = None, *,
                up: torch.Tensor | None = None, limit: float = 0.0) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype: `ops.quant_linear`, or the reference. `up`
        (the shared expert's w2): x is the gate and the input `swiglu(x, up, limit)`, computed
        by the op (its SwiGLU mode)."""
        fn = fp8_linear if ops is None else ops.quant_linear
        return fn(x, self.weight, self.scale, counters=self.counters, up=up, limit=limit)

    def grouped(self, x: torch.Tensor, ops: KernelOps | None = None) -> torch.Tensor:
        """Block-diagonal product of the output projection's groups (attention `wo_a`): x
        [..., g, in] -> [..., g, out / g], group i through rows [i out/g, (i+1) out/g). One call
        of the op (`groups=g`) when the groups are whole scale blocks; otherwise (small test
        geometries) one call per group on all rows, keeping its own: g times the work, but no
        dequantised copy and no host sync (this runs inside CUDA-graph capture)."""
        g = x.shape[-2]
        rows = self.out_features // g
        fn = fp8_linear if ops is None else ops.quant_linear
        if rows % quant.FP8_BLOCK:
            return torch.stack([fn(x[..., i, :], self.weight, self.scale,
                                   counters=self.counters)[..., i * rows:(i + 1) * rows]
                                for i in range(g)], -2)
        return fn(x, self.weight, self.scale, groups=g, counters=self.counters)

    def block_aligned(self, dim: int, start: int, size: int) -> bool:
        """Whether rows (`dim` 0) or columns (1) [start, start + size) are whole scale blocks
        (the last one may be the matrix's own partial block): a cut `narrow_` keeps exactly."""
        b, full = quant.FP8_BLOCK, self.weight.shape[dim]
        return start % b == 0 and (size % b == 0 or start + size == full)

    @torch.no_grad()
    def narrow_(self, dim: int, start: int, size: int) -> None:
        """Keep only rows (`dim` 0) or columns (1) [start, start + size), codes and their scale
        blocks alike (a tensor-parallel cut), in place: the decoded weight is exactly the full
        one's cut. Raises ValueError for a cut that is not `block_aligned` or out of range."""
        if dim not in (0, 1) or size <= 0 or start < 0 or start + size > self.weight.shape[dim]:
            raise ValueError(f"cut dim={dim} [{start}, {start + size}) is outside the FP8 "
                             f"linear's {tuple(self.weight.shape)}")
        if not self.block_aligned(dim, start, size):
            raise ValueError(f"cut dim={dim} [{start}, {start + size}) of an FP8 linear must be "
                             f"whole {quant.FP8_BLOCK}-wide scale blocks; allowed: starts and "
                             f"sizes that are multiples of {quant.FP8_BLOCK}")
        b = quant.FP8_BLOCK
        self.weight = self.weight.narrow(dim, start, size).clone()
        self.scale = self.scale.narrow(dim, start // b, math.ceil(size / b)).clone()
        self.out_features, self.in_features = self.weight.shape
        self.counters = torch.zeros(math.ceil(self.out_features / 16), dtype=torch.int32,
                                    device=self.weight.device)

    def reset_buffers(self) -> None:
        """Zero the split-K counters (e.g. after `to_empty`: the loader fills only the codes and
        scales)."""
        self.counters.zero_()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in] the codes and scales encode (exact in bf16 / fp32)."""
        return quant.dequant_fp8_block(self.weight, self.scale, dtype)

    def load(self, tensor: torch.Tensor, scale: bool) -> None:
        """Copy the checkpoint's codes (or scales) in; shape and one-byte encoding must fit."""
        dest = self.scale if scale else self.weight
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{'scale' if scale else 'codes'}: shape {tuple(tensor.shape)}, "
                             f"the FP8 linear expects {tuple(dest.shape)}")
        if tensor.element_size() != 1:
            raise ValueError(f"{tensor.dtype} is not an FP8 / UE8M0 encoding "
                             "(one byte per element)")
        with torch.no_grad():
            dest.copy_(tensor.to(dest.device).view(dest.dtype))

    def quantize_from(self, weight: torch.Tensor) -> None:
        """Encode a float [out, in] weight with the checkpoint writer's codec
        (`quant.quant_fp8_block`: exact for a weight decoded from FP8)."""
        codes, scale = quant.quant_fp8_block(weight.to(self.weight.device))
        self.load(codes, scale=False)
        self.load(scale, scale=True)

    @torch.no_grad()
    def randomize_(self, generator: torch.Generator) -> None:
        """Random weights in the encoding itself (`load_format="dummy"`), on the buffers' device:
        every finite e4m3 code equally likely (NaN codes never drawn), and one scale, the power
        of two that brings the decoded rms nearest 1 / sqrt(in), as `model/random_init.py::
        init_tensor` draws float linears."""
        device = self.weight.device
        magnitude = torch.randint(0, 0x7F, self.weight.shape, generator=generator, device=device,
                                  dtype=torch.int32)
        sign = torch.randint(0, 2, self.weight.shape, generator=generator, device=device,
                             dtype=torch.int32) << 7
        self.weight.view(torch.uint8).copy_((magnitude | sign).to(torch.uint8))
        values = quant.decode_e4m3(torch.arange(0x7F, dtype=torch.uint8))
        code_rms = float(values.square().mean().sqrt())
        exponent = round(math.log2(1.0 / (code_rms * math.sqrt(self.in_features))))
        self.scale.fill_(quant.E8M0_BIAS + exponent)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128"


# the buffer name of a float linear's decode split-K counters (`model/decode_gemv.py` adds them)
GEMV_COUNTERS = "gemv_counters"


def linear(module: nn.Module, x: torch.Tensor, ops: KernelOps | None) -> torch.Tensor:
    """`module(x)`; a `QuantLinear` gets the serving path's `ops` (None: the reference), and so
    does a float linear the engine gave split-K counters (`GEMV_COUNTERS`: the `linear` op)."""
    if isinstance(module, QuantLinear):
        return module(x, ops)
    counters = getattr(module, GEMV_COUNTERS, None)
    if ops is None or counters is None:
        return module(x)
    weight = module.weight
    assert isinstance(weight, torch.Tensor) and isinstance(counters, torch.Tensor)
    return ops.linear(x, weight, counters=counters)


@torch.no_grad()
def quantize_linears_(model: nn.Module, names: set[str] | None = None) -> list[str]:
    """Replace the bias-free `nn.Linear`s of `model` named in `names` (default: those the
    checkpoint writer stores in FP8, `FP8_LINEAR`) by `QuantLinear`s, in place; returns the names
    replaced. On the meta device the new buffers are empty; otherwise the weights are encoded
    (`QuantLinear.quantize_from`: lossless for weights decoded from FP8)."""
    replaced: list[str] = []
    for name, module in list(model.named_modules()):
        if not (isinstance(module, nn.Linear) and module.bias is None):
            continue
        if not (is_fp8_linear(name) if names is None else name in names):
            continue
        q = QuantLinear(module.in_features, module.out_features).to(module.weight.device)
        if module.weight.device.type != "meta":
            q.quantize_from(module.weight.detach())
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, q)
        replaced.append(name)
    return replaced


@torch.no_grad()
def dequantize_linears_(model: nn.Module, dtype: torch.dtype,
                        names: set[str] | None = None) -> list[str]:
    """Replace the `QuantLinear`s of `model` named in `names` (default: every one) by bias-free
    `nn.Linear`s of `dtype` holding their dequantised weights (exact), in place (on the meta
    device: empty ones); returns the names. What tensor parallelism does to a linear whose cut is
    not whole scale blocks (`distributed/tp.py::cut_modules_`)."""
    replaced: list[str] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantLinear) or (names is not None and name not in names):
            continue
        device = module.weight.device
        dense = nn.Linear(module.in_features, module.out_features, bias=False, device=device,
                          dtype=dtype)
        if device.type != "meta":
            dense.weight.copy_(module.dequantized(dtype))
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, dense)
        replaced.append(name)
    return replaced
