"""Per-rank loading (issue 22): each rank reads only its part of the checkpoint.

`load_shard(path, dtype, device, tp, expert_parallel, weight_format)` returns what
`shard_model(load_model(path, ...), tp, expert_parallel)` returns (the same modules, parameters
and buffers, bit for bit) without ever holding the full model: the skeleton is `shard_model`
applied to the full model on the meta device, and the tensors are read from the safetensors files
through `tp.owned_slices`, the partition `shard_model` applies (stated once, in `tp.py`).
`load_dp_shard(path, dtype, device, dp, expert_parallel, weight_format)` does the same for
data-parallel attention: `enable_dp_attention(load_model(path, ...), dp, expert_parallel)`, read
through `dp.dp_owned_slices` (with expert parallelism only this rank's routed experts and its
share of each shared expert; everything else whole).

What a rank reads, per official tensor:
- replicated: the whole tensor, as the full loader reads it (`WeightLoader` pairs codes with
  scales and dequantises);
- split: only its `Cut`. An FP8 linear the shard keeps in FP8 (`tp.cut_modules_`: a cut of whole
  128x128 scale blocks) is read as its cut codes and the scale blocks covering them, as stored.
  Any other quantised one (FP8 e4m3 with 128x128 UE8M0 block scales; FP4 e2m1 packed two per byte
  with per-32 scales) is read over the whole scale blocks covering the cut, codes and scales
  alike, dequantised (`weights.dequantize`, elementwise) and narrowed to the cut: the values a
  full load then cut holds. A cut on block boundaries reads nothing extra, any other at most one
  partial block per side;
- routed experts under expert parallelism: this rank's experts only (another rank's expert is
  never read).
With `Source("dummy", seed)` (`load_format="dummy"`, the in-memory model source) nothing is read
but config.json: the skeleton is filled with the random values `writer.random_model` would give
the full model, cut to this rank (`distributed/dummy.py`).
Names go through the full loader's mapping: official names as stored; transformers names through
`state_dict_adapter.hf_to_official` (a plain rename is read lazily like an official name; a
stacked transformers tensor is read whole once, split, and cut in memory). The full loader's
checks hold for what a rank owns: a missing, unexpected, doubled or mis-shaped tensor raises
`CheckpointError` (another rank's missing expert is that rank's error).

Reported once per rank (`LoadReport`, logged): the bytes copied out of the files against the
checkpoint's tensor bytes (what the full loader reads), and the host peak: the shard (when
`device` is the CPU) plus the most bytes staged at once for one tensor (what was read for it and
its dequantised values; the codec's fp32 and dtype-conversion temporaries come on top).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsv4.config.engine import WeightFormat
from dsv4.config.model import ModelConfig
from dsv4.distributed.dp import DPGroup, dp_owned_slices, enable_dp_attention
from dsv4.distributed.dummy import FullShapes, randomize_shard_
from dsv4.distributed.tp import Cut, TPGroup, owned_slices, shard_model
from dsv4.kernels.ref.quant import FP4_GROUP, FP8_BLOCK
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import checkpoint_config, empty_model, resolve_device, resolve_dtype
from dsv4.model.state_dict_adapter import hf_to_official, is_hf_name
from dsv4.model.weights import (
    CheckpointError,
    WeightLoader,
    checkpoint_keys,
    dequantize,
    fp8_linear_names,
    internal_to_official,
    official_to_internal,
    shard_files,
)
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)

META = torch.device("meta")
Index = tuple[slice, ...] | None
"""A part of a tensor: one slice per dim, or None for the whole tensor."""


@dataclass(frozen=True)
class LoadReport:
    """What one rank's load read and held: `bytes_read` of the checkpoint's `checkpoint_bytes`;
    `shard_bytes` of parameters and buffers; `host_peak` = the shard if on the CPU + `staged`."""

    rank: int
    bytes_read: int
    checkpoint_bytes: int
    shard_bytes: int
    staged: int
    host_peak: int


@dataclass(frozen=True)
class _Entry:
    """One official tensor: `read(index)` gives its part (from a file when `on_disk`, else a view
    of a tensor in memory); `fp8`: codes in 128x128 blocks (else, with a scale, FP4 per 32)."""

    shape: tuple[int, ...]
    read: Callable[[Index], torch.Tensor]
    fp8: bool
    on_disk: bool


@dataclass(frozen=True)
class Source:
    """Where a rank's weights come from: the checkpoint's files ("auto"), or random values drawn
    for exactly its shard ("dummy": `distributed/dummy.py`, only config.json is read; `seed` as
    `writer.random_model`'s)."""

    load_format: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} is invalid; allowed: 'auto', "
                             "'dummy'")


FILES = Source()


def load_shard(model_dir: str | Path, dtype: str | torch.dtype, device: str | torch.device,
               tp: TPGroup, expert_parallel: bool = False, weight_format: WeightFormat = "bf16",
               source: Source = FILES) -> DeepSeekV4ForCausalLM:
    """Rank `tp.rank`'s shard, read directly (module docstring); equal to
    `shard_model(load_model(model_dir, dtype, device, weight_format=...), tp, expert_parallel)`
    (`source` "dummy": to `shard_model(random_model(...))`). Needs no process group. Raises as
    `load_model` and `shard_model` do."""
    return load_shard_with_report(model_dir, dtype, device, tp, expert_parallel, weight_format,
                                  source)[0]


def load_shard_with_report(model_dir: str | Path, dtype: str | torch.dtype,
                           device: str | torch.device, tp: TPGroup, expert_parallel: bool = False,
                           weight_format: WeightFormat = "bf16", source: Source = FILES,
                           ) -> tuple[DeepSeekV4ForCausalLM, LoadReport]:
    """`load_shard`, and what it read and held (logged once)."""
    return _load_layout(model_dir, dtype, device, weight_format, tp, source,
                        "expert parallel" if expert_parallel else "tensor parallel",
                        lambda full: owned_slices(full, tp, expert_parallel),
                        lambda full: shard_model(full, tp, expert_parallel))


def load_dp_shard(model_dir: str | Path, dtype: str | torch.dtype, device: str | torch.device,
                  dp: DPGroup, expert_parallel: bool = False,
                  weight_format: WeightFormat = "bf16",
                  source: Source = FILES) -> DeepSeekV4ForCausalLM:
    """Rank `dp.rank`'s model under data-parallel attention, read directly: equal to
    `enable_dp_attention(load_model(model_dir, dtype, device, weight_format=...), dp,
    expert_parallel)`; with `expert_parallel` another rank's routed experts are never read (the
    rest is held whole on every rank). Needs no process group."""
    return load_dp_shard_with_report(model_dir, dtype, device, dp, expert_parallel,
                                     weight_format, source)[0]


def load_dp_shard_with_report(model_dir: str | Path, dtype: str | torch.dtype,
                              device: str | torch.device, dp: DPGroup,
                              expert_parallel: bool = False, weight_format: WeightFormat = "bf16",
                              source: Source = FILES,
                              ) -> tuple[DeepSeekV4ForCausalLM, LoadReport]:
    """`load_dp_shard`, and what it read and held (logged once)."""
    return _load_layout(model_dir, dtype, device, weight_format, dp, source,
                        "DP attention, experts by id" if expert_parallel else
                        "DP attention, experts replicated",
                        lambda full: dp_owned_slices(full, dp, expert_parallel),
                        lambda full: enable_dp_attention(full, dp, expert_parallel))


def owned_cuts(model_dir: str | Path, dtype: str | torch.dtype, group: TPGroup,
               expert_parallel: bool, weight_format: WeightFormat,
               data_parallel: bool = False, source: Source = FILES) -> dict[str, Cut]:
    """Rank `group.rank`'s cuts of the checkpoint's model (`owned_slices`, or `dp_owned_slices`
    with `data_parallel`), from its config alone (a meta model): what `load_shard` /
    `load_dp_shard` read, and what a weight update gives the rank (`tp.take_owned`)."""
    full = _full_meta(Path(model_dir), resolve_dtype(dtype), weight_format, source)
    if data_parallel:
        return dp_owned_slices(full, group, expert_parallel)
    return owned_slices(full, group, expert_parallel)


def _full_meta(path: Path, dtype: torch.dtype, weight_format: WeightFormat,
               source: Source) -> DeepSeekV4ForCausalLM:
    """The full model on the meta device, as the checkpoint (or, "dummy", its config) gives it."""
    if source.load_format == "dummy":
        return empty_model(ModelConfig.from_hf(path), dtype, META, weight_format).eval()
    return empty_model(checkpoint_config(path), dtype, META, weight_format,
                       fp8_linear_names(checkpoint_keys(shard_files(path)))).eval()


def _load_layout(model_dir: str | Path, dtype: str | torch.dtype, device: str | torch.device,
                 weight_format: WeightFormat, group: TPGroup, source: Source, layout: str,
                 cuts_of: Callable[[DeepSeekV4ForCausalLM], dict[str, Cut]],
                 build: Callable[[DeepSeekV4ForCausalLM], DeepSeekV4ForCausalLM],
                 ) -> tuple[DeepSeekV4ForCausalLM, LoadReport]:
    """One rank's model read directly: the full model on the meta device, this rank's `cuts_of`
    it (before `build` cuts it), the skeleton `build` makes of it, filled from the files (or with
    its random values: `source` "dummy")."""
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    full = _full_meta(path, torch_dtype, weight_format, source)
    cuts, shapes = cuts_of(full), FullShapes.of(full)
    shard = build(full)
    shard.to_empty(device=dev)
    shard.reset_buffers()
    if source.load_format == "dummy":
        randomize_shard_(shard, shapes, cuts, source.seed)
        shard_bytes = sum(_nbytes(t) for t in chain(shard.parameters(), shard.buffers()))
        logger.info("rank %d/%d: random weights for %s (%s, weights=%s, seed %d); shard %.1f MB",
                    group.rank, group.size, path, layout, weight_format, source.seed,
                    shard_bytes / 1e6)
        return shard, LoadReport(group.rank, 0, 0, shard_bytes, 0,
                                 shard_bytes if dev.type == "cpu" else 0)
    files = shard_files(path)
    reader = _ShardReader(shard, cuts)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        reader.read_all(handles)
    shard_bytes = sum(_nbytes(t) for t in chain(shard.parameters(), shard.buffers()))
    report = LoadReport(group.rank, reader.bytes_read, sum(_data_bytes(f) for f in files),
                        shard_bytes, reader.staged,
                        (shard_bytes if dev.type == "cpu" else 0) + reader.staged)
    logger.info("rank %d/%d loaded %s (%s, weights=%s): read %.1f of %.1f MB (%.0f%%); shard "
                "%.1f MB; host peak %.1f MB", group.rank, group.size, path, layout, weight_format,
                report.bytes_read / 1e6, report.checkpoint_bytes / 1e6,
                100 * report.bytes_read / max(report.checkpoint_bytes, 1), shard_bytes / 1e6,
                report.host_peak / 1e6)
    return shard, report


class _ShardReader:
    """Reads the parts of the checkpoint that `cuts` (from `owned_slices`) give this rank into
    `shard` through a `WeightLoader` (which fills, checks shapes and reports what is missing)."""

    def __init__(self, shard: DeepSeekV4ForCausalLM, cuts: dict[str, Cut]) -> None:
        self.loader, self.cuts = WeightLoader(shard), cuts
        self.num_experts = shard.config.n_routed_experts
        self.bytes_read = 0
        self.staged = 0             # the most bytes held for one tensor (`_read_one`)
        self._held = 0              # bytes held for the tensor being read

    def read_all(self, handles: list[Any]) -> None:
        entries, stacked = _file_entries(handles)
        self._read_entries(entries, entries)
        for handle, key in stacked:             # transformers' stacked experts: whole, then split
            whole = handle.get_tensor(key)
            self.bytes_read += _nbytes(whole)
            parts = {name: _memory_entry(t) for name, t in hf_to_official(key, whole)}
            self._read_entries(parts, {**entries, **parts}, base=_nbytes(whole))
        self.loader.finish()

    def _read_entries(self, todo: dict[str, _Entry], known: dict[str, _Entry],
                      base: int = 0) -> None:
        """Read each tensor of `todo` (a scale together with its weight; `known` holds both)."""
        for name, entry in todo.items():
            if name.endswith(".scale") and _weight_of(name) in known:
                continue
            staged = self._read_one(name, entry, known.get(_scale_of(name)))
            self.staged = max(self.staged, base + staged)

    def _read_one(self, name: str, entry: _Entry, scale: _Entry | None) -> int:
        """Load this rank's part of official tensor `name`; returns the bytes it staged."""
        self._held = 0
        target = official_to_internal(name)
        cut = self.cuts.get(target.name)
        if target.expert is not None and cut is not None:
            if cut.dim == 0:                    # expert parallel: whole experts by id
                if not 0 <= target.expert < self.num_experts:
                    raise CheckpointError(f"unexpected tensor `{name}`: "
                                          f"expert {target.expert} >= {self.num_experts}")
                local = target.expert - cut.start
                if not 0 <= local < cut.size:
                    return 0                    # another rank's expert
                name = internal_to_official(target.name, cut.size)[local][0]
                cut = None
            else:                               # the stacked tensor's dim d is the expert's d-1
                cut = Cut(cut.dim - 1, cut.start, cut.size)
        if cut is None:
            got = [(name, self._read(entry, None))]
            if scale is not None:
                got.append((_scale_of(name), self._read(scale, None)))
                self._held += self._dequantized_bytes(target.name, target.expert)
        elif scale is None:
            rows = _index(len(entry.shape), cut.dim, cut.start, cut.start + cut.size)
            got = [(name, self._read(entry, rows))]
        elif target.name.rpartition(".")[0] in self.loader.quant_linears:
            got = self._coded_cut(name, entry, scale, cut)
        else:
            got = [(name, self._dequantized_cut(name, entry, scale, cut))]
        for part_name, t in got:
            self.loader.add(part_name, t)
        return self._held

    def _dequantized_cut(self, name: str, entry: _Entry, scale: _Entry, cut: Cut) -> torch.Tensor:
        """`cut` of a quantised weight: the scale blocks covering it, dequantised, narrowed."""
        if len(entry.shape) != 2:
            raise CheckpointError(f"tensor `{name}`: a quantised weight must be 2-D, got shape "
                                  f"{entry.shape}")
        block, pack = ((FP8_BLOCK, FP8_BLOCK), 1) if entry.fp8 else ((1, FP4_GROUP), 2)
        step = block[cut.dim]
        per_code = pack if cut.dim == 1 else 1     # FP4: two columns per stored byte
        full = entry.shape[cut.dim] * per_code
        lo = cut.start // step * step
        hi = min(math.ceil((cut.start + cut.size) / step) * step, full)
        codes = self._read(entry, _index(2, cut.dim, lo // per_code, hi // per_code))
        scales = self._read(scale, _index(2, cut.dim, lo // step, math.ceil(hi / step)))
        dtype = self.loader.params[official_to_internal(name).name].dtype
        try:
            values = dequantize(codes, scales, dtype)
        except ValueError as err:
            raise CheckpointError(f"tensor `{name}`: {err}") from err
        self._held += _nbytes(values)
        return values.narrow(cut.dim, cut.start - lo, cut.size)

    def _coded_cut(self, name: str, entry: _Entry, scale: _Entry,
                   cut: Cut) -> list[tuple[str, torch.Tensor]]:
        """`cut` of an FP8 linear the shard keeps in FP8 (`tp.cut_modules_`: whole 128-wide
        scale blocks): its codes and the scale blocks covering them, as stored."""
        if not entry.fp8 or len(entry.shape) != 2:
            raise CheckpointError(f"tensor `{name}`: an FP8 linear's codes must be 2-D e4m3, got "
                                  f"shape {entry.shape}")
        lo, hi = cut.start, cut.start + cut.size
        codes = self._read(entry, _index(2, cut.dim, lo, hi))
        scales = self._read(scale, _index(2, cut.dim, lo // FP8_BLOCK,
                                          math.ceil(hi / FP8_BLOCK)))
        return [(name, codes), (_scale_of(name), scales)]

    def _dequantized_bytes(self, param: str, expert: int | None) -> int:
        """Bytes the loader dequantises a whole weight of `param` to (0: codes kept as stored)."""
        dest = self.loader.params.get(param)
        if dest is None:
            return 0
        return _nbytes(dest) // (dest.shape[0] if expert is not None else 1)

    def _read(self, entry: _Entry, index: Index) -> torch.Tensor:
        """Part `index` of `entry`, counted as read and staged when it comes from a file."""
        t = entry.read(index)
        if entry.on_disk:
            self.bytes_read += _nbytes(t)
            self._held += _nbytes(t)
        return t


def _file_entries(handles: list[Any]) -> tuple[dict[str, _Entry], list[tuple[Any, str]]]:
    """Official name -> lazy entry for every tensor of the files, and the (handle, key) of each
    transformers tensor that `hf_to_official` splits (those are read whole)."""
    entries: dict[str, _Entry] = {}
    stacked: list[tuple[Any, str]] = []
    for handle in handles:
        for key in handle.keys():
            part = handle.get_slice(key)
            shape = tuple(part.get_shape())
            name = key
            if is_hf_name(key):
                probe = torch.empty(shape, device=META)
                pairs = list(hf_to_official(key, probe))
                if len(pairs) != 1 or pairs[0][1] is not probe:
                    stacked.append((handle, key))
                    continue
                name = pairs[0][0]
            if name in entries:
                raise CheckpointError(f"tensor `{name}` appears twice in the checkpoint")
            entries[name] = _Entry(shape, _file_reader(handle, key),
                                   part.get_dtype() == "F8_E4M3", on_disk=True)
    return entries, stacked


def _file_reader(handle: Any, key: str) -> Callable[[Index], torch.Tensor]:
    def read(index: Index) -> torch.Tensor:
        return handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
    return read


def _memory_entry(t: torch.Tensor) -> _Entry:
    return _Entry(tuple(t.shape), lambda index: t if index is None else t[index],
                  t.dtype == torch.float8_e4m3fn, on_disk=False)


def _index(ndim: int, dim: int, lo: int, hi: int) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) if d == dim else slice(None) for d in range(ndim))


def _scale_of(weight: str) -> str:
    return weight.removesuffix(".weight") + ".scale"


def _weight_of(scale: str) -> str:
    return scale.removesuffix(".scale") + ".weight"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _data_bytes(file: Path) -> int:
    """Tensor bytes of a safetensors file (all of it but the 8-byte length and the header)."""
    with file.open("rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return file.stat().st_size - 8 - header

