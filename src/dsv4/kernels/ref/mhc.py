"""Reference mHC ops (spec §5): the weight split + Sinkhorn projection, and the three per-token
steps.

`hc_split_sinkhorn` splits the RMS-scaled mix into pre/post/comb. `mhc_pre`, `mhc_post` and
`mhc_head` are the executable specs of `kernels/triton/mhc.py` / `mhc_post.py` (same signatures),
`mhc_post_pre` (post, then the next site's pre) that of `kernels/triton/mhc_post_pre.py`:
they compute exactly what `model/hyper_connection.py::HyperConnection.pre` / `.post` and
`HyperHead.forward` compute, op for op, on tokens flattened to [T, n, d] (any leading dims work;
`tests/kernels/test_mhc_triton.py` checks bit-equality in fp32 against the modules).
"""

from __future__ import annotations

import torch


def hc_split_sinkhorn(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
                      iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix: [..., (2+n)*n] fp32 (RMS-scaled) -> pre [..., n], post [..., n], comb [..., n, n].

    comb[j, k] is the weight of input stream j in output stream k; after the final (column) step
    its columns sum to ~1. Orientation matters: consumers contract over the FIRST index.
    """
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = mix[..., 2 * n:].unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def _scaled_mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """r * (fn @ flatten(x)) with r = 1/rms over all n*d values.

    x: [..., n, d] -> [..., rows(fn)] fp32.
    """
    flat = x.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return flat @ fn.float().t()


def _stream_sum(pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Σ_i pre[..., i] * x[..., i, :] in fp32, cast to x's dtype.

    pre: [..., n], x: [..., n, d] -> [..., d].
    """
    return (pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
            iters: int, hc_eps: float,
            norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, n, d] streams -> (h [T, d] in x's dtype, post [T, n] fp32, comb [T, n, n] fp32).

    fn: [(2+n)*n, n*d] fp32; scale: [3]; base: [(2+n)*n]. `HyperConnection.pre` on flattened
    tokens.
    """
    mix = _scaled_mix(x, fn, norm_eps)                                      # [T, (2+n)*n]
    pre, post, comb = hc_split_sinkhorn(mix, scale, base, n, iters, hc_eps)
    return _stream_sum(pre, x), post, comb


def mhc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post[k] * f + Σ_j comb[j, k] * X[j] (fp32 math, x's dtype); `HyperConnection.post`.

    f: [T, d] block output; x: [T, n, d] old streams; post: [T, n]; comb: [T, n, n] -> [T, n, d].
    """
    mixed = torch.einsum("...jk,...jd->...kd", comb, x.float())
    return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(x.dtype)


def mhc_post_pre(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                 hc_eps: float, norm_eps: float,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sub-block's post step, then the next site's pre step on the new streams: (X' [T, n, d],
    h [T, d], post' [T, n], comb' [T, n, n]) = `mhc_post` then `mhc_pre` (fn / scale / base: the
    next site's), op for op."""
    new = mhc_post(f, x, post, comb)
    return (new, *mhc_pre(new, fn, scale, base, n, iters, hc_eps, norm_eps))


def mhc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             hc_eps: float, norm_eps: float) -> torch.Tensor:
    """`HyperHead`: x [T, n, d] -> [T, d] in x's dtype; fn [n, n*d], scale [1], base [n] fp32."""
    mix = _scaled_mix(x, fn, norm_eps)                                      # [T, n]
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return _stream_sum(pre, x)
