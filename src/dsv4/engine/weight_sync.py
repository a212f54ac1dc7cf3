"""New weights into a live model, in place: the engine side of RL weight sync.

`update_weights(model, named)` copies tensors named as in `model.state_dict()` of a plain float
model (`layers.0.attn.wq_a.weight`, stacked experts `layers.2.ffn.experts.w1` [E, I, d],
`layers.0.ffn.gate.tid2eid`, ...) into the model's parameters and buffers. Invariants:

- In place: every write is a `copy_` into the existing storage, so tensor addresses (and the CUDA
  graphs captured over them) stay valid. Values are cast to each target's dtype.
- Atomic: every tensor is validated (known name, exact shape, floating and finite for float
  targets, integer for integer targets, expert ids in range for `tid2eid`) and, for experts kept
  in checkpoint encoding, encoded, before the first write. A bad update raises ValueError naming
  the tensor and changes nothing.
- Partial: `named` may be any non-empty subset of the names; the rest keep their values.
- Experts in checkpoint encoding (`QuantExperts`, weight_format "checkpoint") take the same float
  stacks `...experts.w1/w2/w3` and re-quantise them into their codes and scales with the codecs of
  `kernels/ref/quant.py` (round to nearest: exact for weights that were decoded from that format).
  Their code buffers (`w13`, `w13_scale`, ...) are not accepted by name.
- FP8 linears in checkpoint encoding (`QuantLinear`) likewise take a float `....weight` [out, in]
  and re-quantise it into their codes and 128x128 block scales (`quant.quant_fp8_block`, the
  checkpoint writer's codec); their `scale` is not accepted by name.

`read_checkpoint_dir(path, model)` reads an official-layout checkpoint directory (what
`dsv4.checkpoint.writer` and `dsv4 train export` write) into such a dict of float32 CPU tensors,
after checking that its architecture is the model's. It materialises the whole model in float32 on
the CPU (sized for the models RL runs here).

Test: `pytest tests/engine/test_weight_sync.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError

from dsv4.config.model import ModelConfig
from dsv4.kernels.ref import quant
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import load_model
from dsv4.model.quant_experts import QuantExperts
from dsv4.model.quant_linear import QuantLinear

_FLOAT_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")
_STORAGE_FIELDS = ("weight_quant",)
"""ModelConfig fields that describe how a checkpoint stores its weights, not the architecture."""

Write = Callable[[], object]
T = TypeVar("T")


def update_weights(model: DeepSeekV4ForCausalLM, named: Mapping[str, torch.Tensor]) -> int:
    """Copy `named` into `model` in place (see the module docstring); returns how many tensors
    were updated. Raises ValueError, with nothing written, if any tensor is invalid."""
    if not named:
        raise ValueError("named is empty; allowed: at least one tensor to update")
    targets = _targets(model)
    quant_experts = {name: m for name, m in model.named_modules() if isinstance(m, QuantExperts)}
    quant_linears = {f"{name}.weight": m for name, m in model.named_modules()
                     if isinstance(m, QuantLinear)}
    writes: list[Write] = []
    for name, tensor in named.items():
        m = _FLOAT_EXPERTS.match(name)
        if m is not None and m.group(1) in quant_experts:
            writes.append(_plan_quant(name, tensor, quant_experts[m.group(1)], m.group(2)))
        elif name in quant_linears:
            writes.append(_plan_quant_linear(name, tensor, quant_linears[name]))
        elif name in targets:
            writes.append(_plan_copy(name, tensor, targets[name], model.config))
        else:
            raise ValueError(f"tensor {name!r} is not a parameter or buffer of the model; allowed: "
                             f"names of model.state_dict(), e.g. {sorted(targets)[:3]}")
    check_finite({n: t for n, t in named.items() if t.is_floating_point()})
    with torch.no_grad():
        for write in writes:
            write()
    return len(named)


def _targets(model: DeepSeekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """Writable tensors by name: persistent parameters and buffers, except checkpoint-encoded
    experts and FP8 linears (written through their float stacks and weights)."""
    quant_prefixes = {name for name, m in model.named_modules()
                      if isinstance(m, QuantExperts | QuantLinear)}
    return {name: t for name, t in model.state_dict(keep_vars=True).items()
            if name.rsplit(".", 1)[0] not in quant_prefixes}


def _plan_copy(name: str, src: torch.Tensor, dest: torch.Tensor, config: ModelConfig) -> Write:
    _check_shape(name, src, tuple(dest.shape))
    if dest.is_floating_point():
        _check_float(name, src)
    elif src.is_floating_point() or src.dtype == torch.bool:
        raise ValueError(f"tensor {name!r} is {src.dtype}; allowed: an integer tensor "
                         f"(the model holds {dest.dtype})")
    elif name.endswith("tid2eid") and src.numel() and not (
            0 <= int(src.min()) and int(src.max()) < config.n_routed_experts):
        num = config.n_routed_experts
        raise ValueError(f"tensor {name!r} holds expert ids outside [0, {num}); "
                         f"allowed: 0..{num - 1}")
    return lambda: dest.copy_(src)     # copy_ casts to dest's dtype and device


def _plan_quant(name: str, src: torch.Tensor, module: QuantExperts, which: str) -> Write:
    """Encode a float expert stack [E, out, in] for `module` now; the write copies the codes in."""
    num_experts = module.w13.shape[0]
    shape = ((num_experts, module.d, module.inter) if which == "w2"
             else (num_experts, module.inter, module.d))
    _check_shape(name, src, shape)
    _check_float(name, src)
    codes, scales = _encode(src.detach(), module.fmt)
    return functools.partial(_load_codes, module, which, codes, scales)


def _plan_quant_linear(name: str, src: torch.Tensor, module: QuantLinear) -> Write:
    """Encode a float [out, in] weight for an FP8 linear now; the write copies codes and scales."""
    _check_shape(name, src, (module.out_features, module.in_features))
    _check_float(name, src)
    codes, scales = quant.quant_fp8_block(src.detach().to(module.weight.device))

    def write() -> None:
        module.load(codes, scale=False)
        module.load(scales, scale=True)
    return write


def _load_codes(module: QuantExperts, which: str, codes: torch.Tensor,
                scales: torch.Tensor) -> None:
    # NOTE: the float shape checked before encoding fixes the codec's output shapes, which are the
    # module's layout (`quant_experts._shapes`): `load` cannot refuse them.
    for e in range(codes.shape[0]):
        module.load(which, e, codes[e], scale=False)
        module.load(which, e, scales[e], scale=True)


def _encode(stack: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a float stack [E, out, in] in expert format `fmt`, stacked per expert."""
    E, n_out, n_in = stack.shape
    if fmt == "fp4":   # groups run along rows: the stack encodes as one [E*out, in] matrix
        codes, scales = quant.quant_fp4_group(stack.reshape(E * n_out, n_in))
        return codes.view(E, n_out, -1), scales.view(E, n_out, -1)
    pairs = [quant.quant_fp8_block(stack[e]) for e in range(E)]   # 128x128 blocks per expert
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


def _check_shape(name: str, src: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(src.shape) != expected:
        raise ValueError(f"tensor {name!r} has shape {list(src.shape)}; allowed: the model's "
                         f"shape {list(expected)}")


def _check_float(name: str, src: torch.Tensor) -> None:
    if not src.is_floating_point():
        raise ValueError(f"tensor {name!r} is {src.dtype}; allowed: a floating tensor")


FINITE_CHUNK = 1 << 28
"""Elements per `isfinite` pass: its bool temporary stays at 256 MB for any tensor (a whole
4.3 GB expert stack would need 2.1 GB more beside a colocated engine)."""


def check_finite(floats: Mapping[str, torch.Tensor], chunk: int = FINITE_CHUNK) -> None:
    """ValueError naming the first tensor with an inf or nan; one host sync per device. Each
    tensor is checked `chunk` elements at a time (bounded temporary memory)."""
    by_device: dict[torch.device, list[str]] = {}
    for name, t in floats.items():
        by_device.setdefault(t.device, []).append(name)
    for names in by_device.values():
        ok = torch.stack([_all_finite(floats[n], chunk) for n in names]).tolist()
        bad = [n for n, good in zip(names, ok, strict=True) if not good]
        if bad:
            raise ValueError(f"tensor {bad[0]!r} contains non-finite values (inf or nan); "
                             "allowed: finite values")


def _all_finite(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """A 0-d bool on t's device: every element finite, checked in slices of t's first dimension
    of about `chunk` elements (at least one row; views, so no copy of a strided t)."""
    if t.dim() == 0 or t.numel() <= chunk:
        return torch.isfinite(t).all()
    rows = max(1, chunk // max(1, t[0].numel()))
    return torch.stack([torch.isfinite(part).all() for part in t.split(rows)]).all()


# ---- checkpoint directories -------------------------------------------------------------------


def read_checkpoint_dir(path: str | Path, model: DeepSeekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path` as `update_weights` takes them (float32, CPU).

    Raises ValueError when the directory is missing, its config describes another architecture
    (naming the differing fields), or a tensor is missing, mis-shaped or unreadable (corrupt or
    truncated safetensors).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model_path={str(path)!r} is not a checkpoint directory; allowed: a "
                         "directory with config.json and *.safetensors")
    _check_architecture(_guarded(path, lambda: ModelConfig.from_hf(path)), model.config, path)
    loaded = _guarded(path, lambda: load_model(path, dtype="float32", device="cpu",
                                               progress=False))
    # the loader may drop MTP (a transformers-layout checkpoint without mtp.* tensors)
    _check_architecture(loaded.config, model.config, path)
    return dict(loaded.state_dict())


def _guarded(path: Path, read: Callable[[], T]) -> T:
    """`read()`, with any error reading the checkpoint turned into a ValueError naming `path`."""
    try:
        return read()
    except (ValueError, OSError, RuntimeError, KeyError, SafetensorError) as e:
        raise ValueError(f"checkpoint {str(path)!r} cannot be read: {type(e).__name__}: {e}") from e


def _check_architecture(found: ModelConfig, expected: ModelConfig, path: Path) -> None:
    """Raise ValueError naming every architecture field where `found` differs from `expected`."""
    diffs = [f"{f.name}={getattr(found, f.name)!r} (served: {getattr(expected, f.name)!r})"
             for f in dataclasses.fields(ModelConfig)
             if f.name not in _STORAGE_FIELDS
             and getattr(found, f.name) != getattr(expected, f.name)]
    if diffs:
        raise ValueError(f"checkpoint {str(path)!r} has another architecture: {'; '.join(diffs)}; "
                         "allowed: the served model's config")
