"""A decoded token's banded attention over a paged KV cache in one compiled pass (numba): what
``paged_attention`` runs for a decoding step on the CPU in float32 and float64.

Shape legend: H query heads · K key/value heads · g = H / K query heads per kv head · D head
dim · F rotary pairs · P cache blocks · b tokens per block · S the request's keys.

Why compiled. The torch step (``paged_attention._torch_decoding_step``) computes a token's
logits in batched products of g query rows over b-key blocks, a softmax over the table, and
a second pass of products over the values, with each band's query and a window's keys turned
by torch ops first: about 100 torch calls a layer, 0.6-1.1 ms of fixed cost, and two sweeps
of the cache's memory. Through 30 layers' caches it took 1.32-1.75x the time of vLLM's own
decoding kernel, this pass 0.99-1.49x in the same three runs (``benchmarks/vllm_decoding.py``),
and vLLM serving the plugin decodes at 0.93-1.08x stock (docs/serving/index.md, "Speed"). It
reads each block's keys, then its values (vLLM's cache lays them out one after the other),
once, keeps the softmax online (FlashAttention's running maximum and sum, Dao et al. 2022,
sec. 3.1; one pass over the keys, as flash-decoding does), and makes every band's query and
turned key itself from the encoding's rotation tables: one call a layer, no logit table, no
copies.

The bands. A decoded token's keys [0, S) fall into segments, each scored by one band's query
(``starts``, ``stops``, ``bands``) and read either as the cache holds them (rotated as the
far band reads them: ``paged_attention.rotate_for_cache``) or turned on the fly from there to
the band's own rotation by per-key tables (a window of a few hundred keys: ``turned_at``,
``t_cos``, ``t_sin``). Segments are disjoint: each key's logit comes from the one band that
covers it, as in ``bands_fused``'s exact merge.

Numerics. Sums are reassociated (``fastmath``'s 'reassoc' and 'contract') so that LLVM
vectorises the dot products and the value sums: their rounding differs from a sequential sum
as a BLAS kernel's does. ``exp`` is Cephes' ``expf`` written so that it vectorises (within
3e-7 relative of float64's down to float32's smallest normal) for float32, numpy's ``exp``
for float64; the float64 pass agrees with ``banded_attention`` to 1e-10, the float32 one to
2e-5 (tests/serve/test_paged_attention.py, test_paged_kernels.py).

Holds: attend, rotate_rows, write_rows.
"""

from __future__ import annotations

import numba
import numpy as np

# No 'nnan' or 'ninf': the running maximum starts at -inf.
_FAST = {"reassoc", "contract", "nsz", "arcp"}
_LOG2E = 1.4426950408889634
# Cephes' expf (cephes/single/expf.c): x = n ln 2 + r, ln 2 in two parts (Cody and Waite), so
# that r = x - n ln 2 is exact to float32's rounding; exp(r) = 1 + r + r^2 P(r) on
# |r| <= ln 2 / 2.
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
      5.0000001201e-1)  # fmt: skip


@numba.njit(fastmath=_FAST, nogil=True, cache=True)
def _exp_shifted(x, r0, r1, top, bits):
    """x[r0:r1] = exp(x[r0:r1] - top) in place (arguments <= 0); returns their sum. float32:
    exp(n ln 2 + r) = 2^n exp(r) (``_P``), the power of two written as exponent bits into
    ``bits`` (int32 scratch of x's length, read back as float32): two loops that LLVM
    vectorises (numpy's ``exp`` is a call per element in numba: 8x the time here)."""
    total = 0.0
    if x.itemsize == 8:
        for r in range(r0, r1):
            x[r] = np.exp(x[r] - top)
            total += x[r]
        return total
    scale = bits.view(np.float32)
    for r in range(r0, r1):
        v = max(x[r] - top, np.float32(-87.0))  # below: 2^-126 at most, and the maximum's 1
        n = np.floor(v * np.float32(_LOG2E) + np.float32(0.5))
        v = v - n * np.float32(_LN2_HI) - n * np.float32(_LN2_LO)
        p = np.float32(_P[0])
        p = p * v + np.float32(_P[1])
        p = p * v + np.float32(_P[2])
        p = p * v + np.float32(_P[3])
        p = p * v + np.float32(_P[4])
        p = p * v + np.float32(_P[5])
        x[r] = p * v * v + v + np.float32(1.0)
        bits[r] = (np.int32(n) + 127) << 23
    for r in range(r0, r1):
        x[r] *= scale[r]
        total += x[r]
    return total


@numba.njit(fastmath=_FAST, nogil=True, cache=True)
def _scores(q, kb, r0, r1, logits, row, zero):
    """logits[h, r] = q[h] . kb[row + r] for r in [r0, r1), every head h of q (g, D); four
    rows at a time, each query element loaded once for them. ``zero``: the dtype's (a literal
    0.0 would sum in float64)."""
    D = q.shape[1]
    for h in range(q.shape[0]):
        r = r0
        while r + 4 <= r1:
            k0, k1, k2, k3 = kb[row + r], kb[row + r + 1], kb[row + r + 2], kb[row + r + 3]
            a0, a1, a2, a3 = zero, zero, zero, zero
            for d in range(D):
                x = q[h, d]
                a0 += x * k0[d]
                a1 += x * k1[d]
                a2 += x * k2[d]
                a3 += x * k3[d]
            logits[h, r], logits[h, r + 1], logits[h, r + 2], logits[h, r + 3] = a0, a1, a2, a3
            r += 4
        for rest in range(r, r1):
            a = zero
            for d in range(D):
                a += q[h, d] * kb[row + rest, d]
            logits[h, rest] = a


@numba.njit(fastmath=_FAST, nogil=True, cache=True)
def _add_values(weights, vb, r0, r1, acc, row):
    """acc[h] += sum_r weights[h, r] vb[row + r] over r in [r0, r1); four rows at a time, so
    that each accumulator element is loaded and stored once for them."""
    D = acc.shape[1]
    for h in range(acc.shape[0]):
        r = r0
        while r + 4 <= r1:
            v0, v1, v2, v3 = vb[row + r], vb[row + r + 1], vb[row + r + 2], vb[row + r + 3]
            p0, p1, p2, p3 = weights[h, r], weights[h, r + 1], weights[h, r + 2], weights[h, r + 3]
            for d in range(D):
                acc[h, d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
            r += 4
        for rest in range(r, r1):
            p = weights[h, rest]
            for d in range(D):
                acc[h, d] += p * vb[row + rest, d]


@numba.njit(fastmath=_FAST, nogil=True, cache=True)
def _rotate_row(x, cos, sin, interleaved, out):
    """out = R x for one row x (D,): pairs (x[i], x[F + i]) ("half") or (x[2 i], x[2 i + 1])
    (``interleaved``) turned by cos[i], sin[i], i < F, as ``rotary.rotate`` turns them; the
    dims past the 2 F pairs copied."""
    F = cos.shape[0]
    for i in range(F):
        a, c = (2 * i, 2 * i + 1) if interleaved else (i, F + i)
        out[a] = x[a] * cos[i] - x[c] * sin[i]
        out[c] = x[c] * cos[i] + x[a] * sin[i]
    for d in range(2 * F, x.shape[0]):
        out[d] = x[d]


@numba.njit(fastmath=_FAST, nogil=True, cache=True)
def _band_queries(q, factors, q_cos, q_sin, interleaved, queries):
    """queries[band, h] = factors[band, h] R_band q[h] (module docstring's query per band)."""
    for band in range(queries.shape[0]):
        for h in range(q.shape[0]):
            th = h if q_cos.shape[1] > 1 else 0
            _rotate_row(q[h], q_cos[band, th], q_sin[band, th], interleaved, queries[band, h])
            f = factors[band, h if factors.shape[1] > 1 else 0]
            for d in range(q.shape[1]):
                queries[band, h, d] *= f


@numba.njit(fastmath=_FAST, nogil=True, cache=True)
def attend(q, factors, q_cos, q_sin, keys, key_row, values, value_row, b, blocks, starts, stops,
           bands, turned_at, t_cos, t_sin, interleaved, out):  # fmt: skip
    """One decoded token's attention (module docstring), written into ``out`` (H, D), whose
    dtype is the accumulation's.

    The query: q (H, D) unrotated; each band's is ``factors[band]`` (n_bands, H|1) times q
    rotated by ``q_cos``, ``q_sin`` (n_bands, H|1, F) (``interleaved``: the pairing).

    The cache: keys and values (P, K, R, D), C-contiguous (numba reads strided arrays without
    vectorising: 3.6x the time), a block's b keys in rows [key_row, key_row + b) of ``keys``
    and its values in rows [value_row, value_row + b) of ``values`` (vLLM's CPU cache: one
    array, R = 2 b, rows 0 and b); blocks (n,) int, the request's block ids in token order.

    The segments ``starts``, ``stops``, ``bands``, ``turned_at`` (n_segments,) int64: keys
    [starts[s], stops[s]) scored with band bands[s]'s query, as the cache holds them
    (turned_at[s] < 0) or turned by ``t_cos``, ``t_sin`` (K|1, N_t, F) rows turned_at[s] +
    j - starts[s] for key j. A head that no segment reaches is left 0."""
    H, D = q.shape
    K = keys.shape[1]
    g = H // K
    queries = np.empty((factors.shape[0], H, D), dtype=out.dtype)
    _band_queries(q, factors, q_cos, q_sin, interleaved, queries)
    logits = np.empty((g, b), dtype=out.dtype)
    turned = np.empty((b, D), dtype=keys.dtype)
    bits = np.empty(b, dtype=np.int32)
    best = np.empty(g, dtype=out.dtype)
    total = np.empty(g, dtype=out.dtype)
    zero = np.zeros(1, dtype=out.dtype)[0]
    for k in range(K):
        acc = out[k * g : (k + 1) * g]
        acc[:] = 0
        best[:] = -np.inf
        total[:] = 0
        tk = k if t_cos.shape[0] > 1 else 0
        for s in range(starts.shape[0]):
            qs = queries[bands[s], k * g : (k + 1) * g]
            j = starts[s]
            while j < stops[s]:
                i = j // b
                r0, r1 = j - i * b, min(b, stops[s] - i * b)
                block = keys[blocks[i], k]
                if turned_at[s] < 0:
                    _scores(qs, block, r0, r1, logits, key_row, zero)
                else:
                    for r in range(r0, r1):
                        row = turned_at[s] + i * b + r - starts[s]
                        _rotate_row(block[key_row + r], t_cos[tk, row], t_sin[tk, row],
                                    interleaved, turned[r])  # fmt: skip
                    _scores(qs, turned, r0, r1, logits, 0, zero)
                for h in range(g):
                    top = best[h]
                    for r in range(r0, r1):
                        top = max(top, logits[h, r])
                    if top > best[h]:  # FlashAttention's rescaling of what was summed so far
                        shrink = np.exp(best[h] - top)
                        total[h] *= shrink
                        for d in range(D):
                            acc[h, d] *= shrink
                        best[h] = top
                    total[h] += _exp_shifted(logits[h], r0, r1, top, bits)
                _add_values(logits, values[blocks[i], k], r0, r1, acc, value_row)
                j = i * b + r1
        for h in range(g):
            if total[h] > 0:
                for d in range(D):
                    acc[h, d] /= total[h]


@numba.njit(fastmath=_FAST, nogil=True, cache=True)
def rotate_rows(x, cos, sin, interleaved, out):
    """out[n, h] = R x[n, h] for rows x (N, heads, D) by ``cos``, ``sin`` (heads|1, N, F): the
    plugin's rotary for a new token's keys (``paged_attention.rotate_for_cache``)."""
    for n in range(x.shape[0]):
        for h in range(x.shape[1]):
            th = h if cos.shape[0] > 1 else 0
            _rotate_row(x[n, h], cos[th, n], sin[th, n], interleaved, out[n, h])


@numba.njit(nogil=True, cache=True)
def write_rows(keys, key_row, values, value_row, b, slots, key, value):
    """Token n's key (N, K, D) and value at its slot s = slots[n] of the cache (``attend``'s
    keys, key_row, values, value_row, b): block s // b, row s % b; slots < 0 (padding) are
    skipped."""
    for n in range(slots.shape[0]):
        s = slots[n]
        if s < 0:
            continue
        block, row = s // b, s % b
        for k in range(key.shape[1]):
            keys[block, k, key_row + row, :] = key[n, k]
            values[block, k, value_row + row, :] = value[n, k]
