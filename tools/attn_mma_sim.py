#!/usr/bin/env python3
"""Emulates the tensor-core attention kernels of kernels/cuda/attn_mma.cuh on the CPU.

The kernels' correctness rests on the fragment layouts of mma.sync m16n8k16, ldmatrix
(.trans) and movmatrix as the PTX ISA defines them, and on the lane and address
arithmetic that feeds them. This script emulates those instructions warp-wide with numpy
and runs the kernels' algorithm step for step with the same index expressions (decode:
am_load_q, am_tile, am_run and the warps' merge; prefill: amp_load_q, amp_tile), then
compares against a float64 attention. It checks the index logic where no GPU is at hand;
it does not run the CUDA code: tests/gpu/test_ops_cuda does that on a device.

Usage: tools/attn_mma_sim.py  (needs numpy; exits 1 when a case is off by more than 1e-6)
"""
import sys

import numpy as np

PAD = 16         # AM_PAD: bytes past each staged row
LO = 4096.0      # kAmLo


def ldmatrix(smem, addrs, trans):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: smem a uint16 array, addrs the 32
    lanes' byte addresses (lanes 8m..8m+7 give matrix m's rows); returns r[4][lane][2]."""
    r = np.zeros((4, 32, 2), dtype=np.uint16)
    for m in range(4):
        mat = np.array([smem[addrs[8 * m + i] // 2:addrs[8 * m + i] // 2 + 8] for i in range(8)])
        if trans:
            mat = mat.T
        for lane in range(32):
            r[m, lane] = mat[lane // 4, 2 * (lane % 4):2 * (lane % 4) + 2]
    return r


def movtrans(reg):
    """movmatrix.sync.aligned.m8n8.trans.b16 of reg[lane][2]."""
    mat = np.zeros((8, 8), dtype=np.uint16)
    for lane in range(32):
        mat[lane // 4, 2 * (lane % 4):2 * (lane % 4) + 2] = reg[lane]
    mat = mat.T
    return np.array([mat[lane // 4, 2 * (lane % 4):2 * (lane % 4) + 2] for lane in range(32)])


def halves(u):
    return u.view(np.float16).astype(np.float64)


def mma(c, a, b0, b1):
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: c[lane][4] += A B with A from
    a[4][lane][2], B from b0, b1 [lane][2] (the PTX ISA's fragment layouts)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(8):
            row = g + (8 if i in (2, 3, 6, 7) else 0)
            col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
            A[row, col] = halves(a[i // 2, lane])[i & 1]
        for i in range(4):
            B[2 * t + (i & 1) + (8 if i >= 2 else 0), g] = halves((b0, b1)[i // 2][lane])[i & 1]
    D = A @ B
    out = c.copy()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            out[lane, i] = np.float32(c[lane, i] + D[g + (8 if i >= 2 else 0), 2 * t + (i & 1)])
    return out


def split(x0, x1, scale):
    """am_split: f16 hi and (x - hi) * scale as f16, both as uint16 pairs."""
    hi = np.array([np.float16(x0), np.float16(x1)])
    lo = np.array([np.float16((np.float32(x0) - np.float32(hi[0])) * scale),
                   np.float16((np.float32(x1) - np.float32(hi[1])) * scale)])
    return hi.view(np.uint16), lo.view(np.uint16)


def stage(K, V, p, n, last, hd):
    """n rows from position p (rows past last: row last again) as the kernels stage them."""
    row = hd * 2 + PAD
    ks = np.zeros(n * row // 2, dtype=np.uint16)
    vs = np.zeros_like(ks)
    for r in range(n):
        src = min(p + r, last)
        ks[r * row // 2:r * row // 2 + hd] = K[src].view(np.uint16)
        vs[r * row // 2:r * row // 2 + hd] = V[src].view(np.uint16)
    return ks, vs


def decode_block(q, K, V, ng, hd, c0, c1, nw):
    """attn_mma_kernel's block: q [ng][hd] pre-scaled; returns the merged (M, L, A)."""
    kc_n, row = hd // 16, hd * 2 + PAD
    sq = np.zeros((kc_n, 32, 4, 2), dtype=np.uint16)
    for kc in range(kc_n):
        for ln in range(32):
            head, t = ln // 4, ln % 4
            for half in range(2):
                d = kc * 16 + 2 * t + 8 * half
                x = (q[head, d], q[head, d + 1]) if head < ng else (0.0, 0.0)
                sq[kc, ln, half], sq[kc, ln, 2 + half] = split(x[0], x[1], LO)
    warps = []
    for warp in range(nw):
        oh, ol = np.zeros((kc_n, 32, 4)), np.zeros((kc_n, 32, 4))
        m, l = np.full((32, 2), -np.inf), np.zeros((32, 2))
        first, step = c0 + warp * 16, nw * 16
        n_tiles = (c1 - first + step - 1) // step if first < c1 else 0
        for i in range(n_tiles):
            p = first + i * step
            ks, vs = stage(K, V, p, 16, c1 - 1, hd)
            sa = np.zeros((4, 32, 4))
            kb = [((ln & 7) + 8 * ((ln >> 3) & 1)) * row + 16 * (ln >> 4) for ln in range(32)]
            for kc in range(kc_n):
                ka = ldmatrix(ks, [x + kc * 32 for x in kb], False)
                sa[kc & 1] = mma(sa[kc & 1], ka, sq[kc, :, 0], sq[kc, :, 1])
                sa[2 + (kc & 1)] = mma(sa[2 + (kc & 1)], ka, sq[kc, :, 2], sq[kc, :, 3])
            s = (sa[0] + sa[1]) + (sa[2] + sa[3]) / LO
            for ln in range(32):
                if p + (ln >> 2) >= c1:
                    s[ln, 0:2] = -np.inf
                if p + (ln >> 2) + 8 >= c1:
                    s[ln, 2:4] = -np.inf
            mx = np.stack([np.maximum(s[:, 0], s[:, 2]), np.maximum(s[:, 1], s[:, 3])], 1)
            for o in (4, 8, 16):
                mx = np.maximum(mx, mx[np.arange(32) ^ o])
            mn = np.maximum(m, mx)
            cr = np.exp2(m - mn)
            e = np.exp2(s - mn[:, [0, 1, 0, 1]])
            l = l * cr + np.stack([e[:, 0] + e[:, 2], e[:, 1] + e[:, 3]], 1)
            m = mn
            oh *= cr[None, :, [0, 1, 0, 1]]
            ol *= cr[None, :, [0, 1, 0, 1]]
            h01, l01, h23, l23 = (np.zeros((32, 2), dtype=np.uint16) for _ in range(4))
            for ln in range(32):
                h01[ln], l01[ln] = split(e[ln, 0], e[ln, 1], LO)
                h23[ln], l23[ln] = split(e[ln, 2], e[ln, 3], LO)
            bh0, bh1, bl0, bl1 = movtrans(h01), movtrans(h23), movtrans(l01), movtrans(l23)
            vb = [((ln & 7) + 8 * (ln >> 4)) * row + 16 * ((ln >> 3) & 1) for ln in range(32)]
            for mt in range(kc_n):
                va = ldmatrix(vs, [x + mt * 32 for x in vb], True)
                oh[mt] = mma(oh[mt], va, bh0, bh1)
                ol[mt] = mma(ol[mt], va, bl0, bl1)
        for o in (4, 8, 16):
            l = l + l[np.arange(32) ^ o]
        acc, sm, sl = np.zeros((8, hd)), np.zeros(8), np.zeros(8)
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for mt in range(kc_n):
                for i in range(4):
                    acc[2 * t + (i & 1), 16 * mt + g + 8 * (i >> 1)] = oh[mt, ln, i] + ol[mt, ln, i] / LO
            if g == 0:
                sm[2 * t:2 * t + 2], sl[2 * t:2 * t + 2] = m[ln], l[ln]
        warps.append((sm, sl, acc))
    M = np.max([w[0] for w in warps], 0)
    L, A = np.zeros(8), np.zeros((8, hd))
    for sm, sl, acc in warps:
        wt = np.where(sm == -np.inf, 0.0, np.exp2(np.where(sm == -np.inf, 0.0, sm - M)))
        L += wt * sl
        A += wt[:, None] * acc
    return M[:ng], L[:ng], A[:ng]


def prefill_warp(Q, K, V, hd, lim, c0, end, tile):
    """amp_tile over one warp's 16 rows (Q [16][hd] pre-scaled, zeros where lim is 0), K/V
    tiles of `tile` positions; returns (M, L, O) per row."""
    kc_n, row, nt_n = hd // 16, hd * 2 + PAD, tile // 8
    qa = np.zeros((kc_n, 2, 4, 32, 2), dtype=np.uint16)  # [chunk][hi/lo][register][lane]
    for kc in range(kc_n):
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for i in range(4):
                r, d = g + 8 * (i & 1), kc * 16 + 2 * t + 8 * (i >> 1)
                qa[kc, 0, i, ln], qa[kc, 1, i, ln] = split(Q[r, d], Q[r, d + 1], LO)
    o, m, l = np.zeros((hd // 8, 32, 4)), np.full((32, 2), -np.inf), np.zeros((32, 2))
    lim_l = np.array([[lim[ln >> 2], lim[(ln >> 2) + 8]] for ln in range(32)])
    n_tiles = (end - c0 + tile - 1) // tile if end > c0 else 0
    for it in range(n_tiles):
        t0 = c0 + it * tile
        if t0 >= max(lim):
            continue
        ks, vs = stage(K, V, t0, tile, end - 1, hd)
        sh, sl = np.zeros((nt_n, 32, 4)), np.zeros((nt_n, 32, 4))
        kb = [((ln & 7) + 8 * (ln >> 4)) * row + 16 * ((ln >> 3) & 1) for ln in range(32)]
        for kc in range(kc_n):
            for np_ in range(nt_n // 2):
                b = ldmatrix(ks, [x + np_ * 16 * row + kc * 32 for x in kb], False)
                for acc, hl in ((sh, 0), (sl, 1)):
                    acc[2 * np_] = mma(acc[2 * np_], qa[kc, hl], b[0], b[1])
                    acc[2 * np_ + 1] = mma(acc[2 * np_ + 1], qa[kc, hl], b[2], b[3])
        s = sh + sl / LO
        for nt in range(nt_n):
            for ln in range(32):
                for i in range(4):
                    if t0 + nt * 8 + 2 * (ln & 3) + (i & 1) >= lim_l[ln, i >> 1]:
                        s[nt, ln, i] = -np.inf
        mx = np.stack([s[:, :, 0:2].max((0, 2)), s[:, :, 2:4].max((0, 2))], 1)
        for sh_ in (1, 2):
            mx = np.maximum(mx, mx[np.arange(32) ^ sh_])
        mn = np.maximum(m, mx)
        cr = np.where(mn == -np.inf, 1.0, np.exp2(np.where(mn == -np.inf, 0.0, m - mn)))
        m, l = mn, l * cr
        w = np.where(np.isinf(m[None, :, [0, 0, 1, 1]]), 0.0,
                     np.exp2(s - np.where(np.isinf(m), 0.0, m)[None, :, [0, 0, 1, 1]]))
        l += np.stack([w[:, :, 0:2].sum((0, 2)), w[:, :, 2:4].sum((0, 2))], 1)
        o *= cr[None, :, [0, 0, 1, 1]]
        vb = [((ln & 7) + 8 * ((ln >> 3) & 1)) * row + 16 * (ln >> 4) for ln in range(32)]
        for kk in range(nt_n // 2):
            ah, al = np.zeros((4, 32, 2), dtype=np.uint16), np.zeros((4, 32, 2), dtype=np.uint16)
            for ln in range(32):
                for r in range(4):
                    ww = w[2 * kk + (r >> 1), ln, 2 * (r & 1):2 * (r & 1) + 2]
                    ah[r, ln], al[r, ln] = split(ww[0], ww[1], 1.0)
            for ndp in range(hd // 16):
                b = ldmatrix(vs, [x + kk * 16 * row + ndp * 32 for x in vb], True)
                for a in (ah, al):
                    o[2 * ndp] = mma(o[2 * ndp], a, b[0], b[1])
                    o[2 * ndp + 1] = mma(o[2 * ndp + 1], a, b[2], b[3])
    for sh_ in (1, 2):
        l = l + l[np.arange(32) ^ sh_]
    out, M, L = np.zeros((16, hd)), np.zeros(16), np.zeros(16)
    for ln in range(32):
        g, t = ln >> 2, ln & 3
        for e in range(2):
            for nd in range(hd // 8):
                out[g + 8 * e, nd * 8 + 2 * t:nd * 8 + 2 * t + 2] = o[nd, ln, 2 * e:2 * e + 2]
            M[g + 8 * e], L[g + 8 * e] = m[ln, e], l[ln, e]
    return M, L, out


def reference(q, K, V, c0, c1):
    s = q.astype(np.float64) @ K[c0:c1].astype(np.float64).T  # log2 units
    p = np.exp2(s - s.max(1, keepdims=True))
    return (p @ V[c0:c1].astype(np.float64)) / p.sum(1, keepdims=True)


def main():
    rng = np.random.default_rng(1)
    worst = 0.0

    def draw(n, hd, rows):
        K = rng.uniform(-1, 1, (n, hd)).astype(np.float16)
        V = rng.uniform(-1, 1, (n, hd)).astype(np.float16)
        q = (rng.uniform(-6, 6, (rows, hd)) / np.sqrt(hd) * 1.4426950408889634).astype(np.float32)
        return K, V, q

    # decode: (heads in the block, hd, positions, split [c0, c1), warps)
    for ng, hd, n, c0, c1, nw in [(8, 256, 40, 0, 40, 4), (3, 64, 77, 10, 77, 4),
                                  (8, 128, 300, 64, 200, 2), (5, 128, 33, 0, 33, 1),
                                  (2, 16, 50, 0, 50, 4), (8, 32, 20, 3, 19, 2)]:
        K, V, q = draw(n, hd, ng)
        _, L, A = decode_block(q, K, V, ng, hd, c0, c1, nw)
        err = np.abs(A / L[:, None] - reference(q, K, V, c0, c1)).max()
        print(f"decode ng {ng} hd {hd} positions [{c0}, {c1}) warps {nw}: max err {err:.3g}")
        worst = max(worst, err)
    # prefill: one warp's 16 rows (token r // ng, head r % ng) after pos0 cached positions
    for hd, ng, pos0, n_tok, tile in [(64, 8, 5, 2, 32), (128, 8, 37, 2, 32), (32, 4, 0, 4, 32),
                                      (256, 8, 70, 2, 32), (64, 3, 10, 6, 32), (16, 1, 3, 16, 32),
                                      (256, 8, 40, 2, 16), (256, 4, 9, 4, 16)]:
        c1 = pos0 + n_tok
        K, V, q = draw(c1 + 3, hd, 16)
        lim = [min(pos0 + r // ng + 1, c1) if r // ng < n_tok else 0 for r in range(16)]
        q[[r for r in range(16) if lim[r] == 0]] = 0.0
        _, L, O = prefill_warp(q, K, V, hd, lim, 0, c1, tile)
        err = max(np.abs(O[r] / L[r] - reference(q[r:r + 1], K, V, 0, lim[r])[0]).max()
                  for r in range(16) if lim[r])
        print(f"prefill hd {hd} ng {ng} after {pos0}, {n_tok} tokens, tiles of {tile}: "
              f"max err {err:.3g}")
        worst = max(worst, err)
    print(f"worst {worst:.3g} (bound 1e-6)")
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
