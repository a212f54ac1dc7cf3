"""Routed experts kept in their checkpoint encoding (`weight_format="checkpoint"`, spec §8, §12).

The default (`"bf16"`) dequantises the FP4 experts at load into stacked float parameters
(`moe.Experts`). With `"checkpoint"` every MoE layer's experts become a `QuantExperts`: the e2m1
codes and UE8M0 scales stay in GPU memory as loaded (4.25 bits per weight instead of 16) and the
kernel backend's `routed_experts_quant` op dequantises in registers (`kernels/triton/moe.py`; the
`ref` op dequantises the whole stack first). w1 and w3 are stored concatenated as `w13` ([W1; W3]
along the output dim, the kernel's layout, `ref.moe.pack_w13`). FP8 experts ("fp8", 128x128
blocks) are supported by the module and kernels for experiments (`quantize_experts_`); official V4
checkpoints store experts in FP4.

Serving only: these buffers are not trainable and a model holding them cannot be exported.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.kernels.ref import quant
from dsv4.kernels.ref.moe import dequant_experts, routed_experts_quant
from dsv4.model.forward_context import ForwardContext
from dsv4.model.forward_mode import ForwardMode
from dsv4.model.moe import NO_COMBINE, Combine, Experts

EXPERT_FORMATS = ("fp4", "fp8")


def _shapes(fmt: str, E: int, inter: int,
            d: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Buffer shapes and dtypes of one layer's stacked experts in `fmt` (kernels/triton/moe.py)."""
    if fmt == "fp4":
        g = quant.FP4_GROUP
        return {"w13": ((E, 2 * inter, d // 2), torch.uint8),
                "w13_scale": ((E, 2 * inter, d // g), torch.uint8),
                "w2": ((E, d, inter // 2), torch.uint8),
                "w2_scale": ((E, d, inter // g), torch.uint8)}
    b = quant.FP8_BLOCK
    return {"w13": ((E, 2 * inter, d), torch.float8_e4m3fn),
            "w13_scale": ((E, 2 * math.ceil(inter / b), math.ceil(d / b)), torch.uint8),
            "w2": ((E, d, inter), torch.float8_e4m3fn),
            "w2_scale": ((E, math.ceil(d / b), math.ceil(inter / b)), torch.uint8)}


class QuantExperts(nn.Module):
    """A layer's routed experts as checkpoint codes: w13 / w2 codes + UE8M0 scales, format `fmt`."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    start = 0
    """The global id of the first expert held (an expert-parallel shard's, `tp.LocalQuantExperts`,
    is its cut's start)."""

    def __init__(self, num_experts: int, inter: int, d: int, limit: float,
                 fmt: str = "fp4") -> None:
        super().__init__()
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"expert format {fmt!r} is invalid; "
                             f"allowed: {list(EXPERT_FORMATS)}")
        self.fmt, self.limit, self.inter, self.d = fmt, limit, inter, d
        for name, (shape, dtype) in _shapes(fmt, num_experts, inter, d).items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    @classmethod
    def from_config(cls, config: ModelConfig, fmt: str = "fp4") -> QuantExperts:
        return cls(config.n_routed_experts, config.moe_inter_dim, config.hidden_size,
                   config.swiglu_limit, fmt)

    def forward(self, u: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                ctx: ForwardContext | None = None, *, mode: ForwardMode | None = None,
                combine: Combine = NO_COMBINE) -> torch.Tensor:
        """`Experts.forward`'s contract: u [N, d] -> [N, d] in `combine.out_dtype`, the shared
        addend included (serving only: no "dense" form)."""
        if ctx is None and (mode is None or mode.experts != "sparse"):
            raise ValueError(f"checkpoint-format experts run the sparse form only; "
                             f"got mode={mode}")
        fn = routed_experts_quant if ctx is None else ctx.ops.routed_experts_quant
        return fn(u, self.w13, self.w13_scale, self.w2, self.w2_scale, indices, weights, self.limit,
                  self.fmt, **combine.kwargs())

    def _rows(self, which: str, scale: bool) -> tuple[torch.Tensor, slice]:
        """The buffer holding expert matrix `which` (w1 / w2 / w3) and its row range in it."""
        if which == "w2":
            return (self.w2_scale if scale else self.w2), slice(None)
        split = (math.ceil(self.inter / quant.FP8_BLOCK) if (scale and self.fmt == "fp8")
                 else self.inter)
        rows = slice(0, split) if which == "w1" else slice(split, None)
        return (self.w13_scale if scale else self.w13), rows

    def load(self, which: str, expert: int, tensor: torch.Tensor, scale: bool) -> None:
        """Copy one expert's codes (or scales) of `which` in; shape and encoding must fit `fmt`."""
        buf, rows = self._rows(which, scale)
        dest = buf[expert, rows]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{which} {'scale' if scale else 'codes'}: shape "
                             f"{tuple(tensor.shape)}, {self.fmt} experts expect "
                             f"{tuple(dest.shape)}")
        if tensor.element_size() != 1:
            raise ValueError(f"{which}: {tensor.dtype} is not a {self.fmt} encoding "
                             "(one byte per element)")
        with torch.no_grad():
            dest.copy_(tensor.view(dest.dtype))

    def quantize_from(self, which: str, expert: int, weight: torch.Tensor) -> None:
        """Encode a float [out, in] expert matrix in `fmt` (exact if it was decoded from `fmt`)."""
        fn = quant.quant_fp4_group if self.fmt == "fp4" else quant.quant_fp8_block
        codes, scale = fn(weight)
        self.load(which, expert, codes, scale=False)
        self.load(which, expert, scale, scale=True)

    @torch.no_grad()
    def randomize_(self, generator: Callable[[int], torch.Generator]) -> None:
        """Random weights in the checkpoint encoding itself (`load_format="dummy"`): every e2m1
        code equally likely, and one UE8M0 scale per matrix, the power of two that brings the
        decoded rms nearest 1 / sqrt(fan_in), as `model/random_init.py::init_tensor` draws float
        linears. Expert e's codes come from `generator(start + e)` alone (`start`: the global id
        of the first expert held), so an expert-parallel shard draws exactly its experts' codes
        of the whole layer's. FP4 only: random e4m3 bytes would include NaN codes."""
        if self.fmt != "fp4":
            raise ValueError(f"random {self.fmt} experts are not supported; allowed: fp4")
        code_rms = math.sqrt(sum(v * v for v in quant.E2M1_MAGNITUDES) / len(quant.E2M1_MAGNITUDES))
        for e in range(self.w13.shape[0]):
            g = generator(self.start + e)
            for codes, scale, fan_in in ((self.w13[e], self.w13_scale[e], self.d),
                                         (self.w2[e], self.w2_scale[e], self.inter)):
                codes.copy_(torch.randint(0, 256, codes.shape, generator=g, device=codes.device,
                                          dtype=torch.int32).to(codes.dtype))
                exponent = round(math.log2(1.0 / (code_rms * math.sqrt(fan_in))))
                scale.fill_(quant.E8M0_BIAS + exponent)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) as the dense stacked tensors `Experts` holds."""
        w1, w3, w2 = dequant_experts(self.w13, self.w13_scale, self.w2, self.w2_scale, self.fmt,
                                     dtype)
        return w1, w2, w3


@torch.no_grad()
def quantize_experts_(model: nn.Module, fmt: str = "fp4") -> nn.Module:
    """Replace every `Experts` of `model` (decoder and MTP layers) by a `QuantExperts`, in place.

    The new module holds the weights encoded in `fmt` (round to the nearest code; lossless for
    weights dequantised from that format).
    """
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if not isinstance(experts, Experts):
            continue
        E, inter, d = experts.w1.shape
        q = QuantExperts(E, inter, d, experts.limit, fmt).to(experts.w1.device)
        for e in range(E):
            for which in ("w1", "w2", "w3"):
                q.quantize_from(which, e, getattr(experts, which)[e])
        module.experts = q
    return model

