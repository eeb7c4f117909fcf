"""BPPSA (Wang, Bai, Pekhimenko, MLSys 2020): the backward of a scan as a Blelloch scan over the
steps' transposed Jacobians, in the loop of a backward scan marked attrs["backward"] = "bppsa"
(gradc/ops/scan.py use_bppsa), on the CPU (bppsa_cpu_lines) and on CUDA (bppsa_cuda_lines).

The backward scan's first F carries are the adjoints lam_k of the forward's F carries (the others
are the closed values' running sums). Step t maps the adjoint of the carries it wrote to the adjoint
of the carries it read, an affine map per row b of lam = [lam_0 | ... | lam_{F-1}] (each carry's
row flattened, the carries side by side: H values a row): lam -> lam @ M_t[b] + v_t[b], M_t[b] the
transposed Jacobian as a right factor of a row vector and v_t what the step's own outputs add.
  v_t: the step's VJP with lam = 0.
  M_t: W^T scaled by f'(new carry) when the step is f(carry @ W + rest) with one carry (vjp_info's
       "structured": an elementwise op's Jacobian is diagonal, a matmul's the weight), else the
       step's VJP of the H basis vectors (every row at once) with the given adjoints zero.
The maps, in the order the backward runs its steps and padded with identities to P = 2^k, go
through an up-sweep that composes them pairwise, (M1, v1) then (M2, v2) = (M1 M2, v1 M2 + v2):
log2 P levels whose products are independent. The down-sweep starts from the final adjoint at the
root instead of the identity, so it carries vectors: each of its products is a vector times a
matrix (O(H^2)), not a matrix product (O(H^3)), and it ends with V[i] = the adjoint the i-th step
run reads. The loop then runs the step's VJP once per step with that adjoint fed in, not
propagated: the params' running sums, the xs' gradients and the stacks an HVP reads.
"""
from .scan_layout import DERIVATIVE_FROM_OUTPUT, parts, vjp_of


def bppsa_flops(T, rows, H, step_backward, dense):
    """The FLOPs of a BPPSA backward as the generated loop does them (dense: Jacobian rows by H VJP
    calls per step; else the structured f'(pre) * W^T). step_backward: one reverse step's FLOPs."""
    P = 1 << max(T - 1, 0).bit_length()
    compose = rows * (2 * H ** 3 + 2 * H * H + H)             # up-sweep: (M1 M2, v1 M2 + v2)
    push = rows * (2 * H * H + H)                             # down-sweep: lam M + v
    jac = T * H * step_backward if dense else T * rows * H * H
    return (T * step_backward                                 # v_t: the step's VJP with no carry adjoint
            + jac + (P - 1) * (compose + push)
            + T * step_backward)                              # the params' and xs' gradients


def _layout(attrs, a, rows_source, v=""):
    """Lines naming the map's sizes (each name prefixed by v): nR rows, h_k each carry's width in a
    row, o_k its offset, hH their sum, pP the steps {v}T rounded up to a power of two."""
    info = vjp_of(attrs)
    F = info["carries"]
    L = [f"{v}nR = {rows_source}" if info["per_row"] else f"{v}nR = 1"]
    L += [f"{v}h{k} = {a[k]}.size // {v}nR" for k in range(F)]
    L += [f"{v}o{k} = {' + '.join(f'{v}h{j}' for j in range(k)) or '0'}" for k in range(F)]
    L += [f"{v}hH = {' + '.join(f'{v}h{k}' for k in range(F))}", f"{v}pP = 1",
          f"while {v}pP < {v}T:", f"    {v}pP *= 2"]
    return L


def bppsa_cpu_lines(body_kernel, attrs):
    """The lines of the CPU loop kernel (gradc/ops/scan_loop.py) that leave in Vv[i] the carry adjoint
    the i-th step run reads; operands a{j}, the step body_kernel(leaves..., outputs..., work)."""
    body, leaves, outputs, K, X, C, M = parts(attrs)
    info = vjp_of(attrs)
    F = info["carries"]
    zero, st = set(info["zero"]), info["structured"]
    L = _layout(attrs, [f"a{k}" for k in range(K)], "a0.shape[0]")
    L += ["Mm = np.zeros((pP, nR, hH, hH), FLOAT)",
          "Vv = np.zeros((pP, nR, hH), FLOAT)",
          "for i in range(T, pP):",
          "    for b in range(nR):",
          "        for p in range(hH):",
          "            Mm[i, b, p, p] = 1.0"]
    for k in range(F):
        L += [f"lz{k} = np.zeros_like(a{k})", f"eb{k} = np.zeros_like(a{k})", f"ebv{k} = eb{k}.reshape(nR, h{k})"]
    L += [f"jo{k} = np.empty_like(a{k})" for k in range(K)]
    L += [f"z{j} = np.zeros_like(a{j}[0])" for j in sorted(zero)]
    outs = [f"jo{k}" for k in range(K)] + [f"yb{m}" for m in range(M)]
    rest = [f"a{k}" for k in range(F, K)]
    real = [f"lz{k}" for k in range(F)] + rest + [f"a{j}[t]" for j in range(K, K + X)] + \
        [f"a{j}" for j in range(K + X, len(leaves))]
    basis = [f"eb{k}" for k in range(F)] + rest + [f"z{j}" if j in zero else f"a{j}[t]" for j in range(K, K + X)] + \
        [f"a{j}" for j in range(K + X, len(leaves))]
    order = "T - 1 - t" if attrs.get("reverse") else "t"   # i: the order the steps run in
    L += ["for t in range(T):",
          f"    i = {order}",
          f"    {body_kernel}({', '.join(real + outs + ['work'])})"]
    L += [f"    copy_into(Vv[i, :, o{k}:o{k} + h{k}], jo{k}.reshape(nR, h{k}))" for k in range(F)]
    if st:   # f'(new carry) from the carry itself; no body call, so the steps run on every thread
        L += ["for t in prange(T):",
              f"    i = {order}",
              f"    yv = np.ascontiguousarray(a{st['cn']}[t]).reshape(nR, hH)",
              "    for b in range(nR):",
              "        for p in range(hH):",
              "            y = yv[b, p]",
              f"            dv = {DERIVATIVE_FROM_OUTPUT[st['f']]}",
              "            for q in range(hH):",
              f"                Mm[i, b, p, q] = dv * a{st['W']}[q, p]"]
    else:   # row o_k + p of M_t: the step's VJP of the basis vector p of carry k (one work buffer: in order)
        L += ["for t in range(T):", f"    i = {order}"]
        for k in range(F):
            L += [f"    for p in range(h{k}):",
                  f"        ebv{k}[:, p] = 1.0",
                  f"        {body_kernel}({', '.join(basis + outs + ['work'])})"]
            L += [f"        copy_into(Mm[i, :, o{k} + p, o{j}:o{j} + h{j}], jo{j}.reshape(nR, h{j}))" for j in range(F)]
            L += [f"        ebv{k}[:, p] = 0.0"]
    # the sweeps: the products of one level are independent, one (pair, row) an iteration on Numba's threads
    L += ["d = 1",                                     # up-sweep
          "while d < pP:",
          "    for j in prange((pP // (2 * d)) * nR):",
          "        b = j % nR",
          "        l = (j // nR) * 2 * d + d - 1",
          "        r = l + d",
          "        copy_into(Vv[r, b], Vv[l, b] @ Mm[r, b] + Vv[r, b])",
          "        copy_into(Mm[r, b], Mm[l, b] @ Mm[r, b])",
          "    d *= 2"]
    L += [f"copy_into(Vv[pP - 1, :, o{k}:o{k} + h{k}], np.ascontiguousarray(a{k}).reshape(nR, h{k}))" for k in range(F)]
    L += ["d = pP // 2",                               # down-sweep: the final adjoints at the root
          "while d >= 1:",
          "    for j in prange((pP // (2 * d)) * nR):",
          "        b = j % nR",
          "        l = (j // nR) * 2 * d + d - 1",
          "        r = l + d",
          "        tv = Vv[l, b].copy()",
          "        copy_into(Vv[l, b], Vv[r, b])",
          "        copy_into(Vv[r, b], Vv[r, b] @ Mm[l, b] + tv)",
          "    d //= 2"]
    return ["    " + line for line in L]


def bppsa_cuda_lines(s, step, at, copy):
    """The host lines of the CUDA scan (gradc/ops/scan_loop.py lower_scan_cuda) that leave in
    {v}V[i] the carry adjoint the i-th step run reads, as the CPU's do, with the level products
    as kernels over every (pair, row, element) of a level; and the lines of each step that feed
    it in. step: the step's host function, its work, scal and stream (a list of names); at(j): the
    slice of sequence leaf j at step t; copy(src, dst, rank): a copy kernel's launch."""
    attrs, a, v = s.attrs, s.args, f"s{s.n}_"
    body, leaves, outputs, K, X, C, M = parts(attrs)
    info = vjp_of(attrs)
    F = info["carries"]
    zero, st = set(info["zero"]), info["structured"]
    name = lambda x: v + x
    launch = lambda kernel, args: s.call(kernel, args)
    fill = lambda array, value: launch(s.kernels.fill(), [array, value])

    def zeros(var, like):
        return [f"{var} = temp_array_like({like})", fill(f"{var}.reshape({var}.size)", "0.0")]

    L = _layout(attrs, a, f"{a[0]}.shape[0]", v)
    mm, vv = name("M"), name("V")
    L += [f"{mm} = temp_array(({name('pP')}, {name('nR')}, {name('hH')}, {name('hH')}), FLOAT)",
          f"{vv} = temp_array(({name('pP')}, {name('nR')}, {name('hH')}), FLOAT)",
          f"{name('S')} = temp_array((max({name('pP')} // 2, 1), {name('nR')}, {name('hH')} + 1, {name('hH')}), FLOAT)",
          f"{name('SV')} = temp_array((max({name('pP')} // 2, 1), {name('nR')}, {name('hH')}), FLOAT)",
          f"if {name('pP')} > {name('T')}:   # the padding: identity maps",
          "    " + launch(s.kernel(("bppsa_identity",), "bppsa_identity_maps", _identity_source), [f"{mm}[{name('T')}:]"]),
          "    " + fill(f"{vv}[{name('T')}:].reshape(({name('pP')} - {name('T')}) * {name('nR')} * {name('hH')})", "0.0")]
    for k in range(F):
        L += zeros(name(f"lz{k}"), a[k]) + zeros(name(f"eb{k}"), a[k])
    L += [f"{name(f'jo{k}')} = temp_array_like({a[k]})" for k in range(K)]
    L += [line for j in sorted(zero) for line in zeros(name(f"z{j}"), f"{a[j]}[0:1]" if body.shape(leaves[j]) == () else f"{a[j]}[0]")]
    outs = [name(f"jo{k}") for k in range(K)] + [name(f"y{m}") for m in range(M)]
    rest = list(a[F:K])
    closed = list(a[K + X:])
    real = [name(f"lz{k}") for k in range(F)] + rest + [at(j) for j in range(K, K + X)] + closed
    basis = [name(f"eb{k}") for k in range(F)] + rest + [name(f"z{j}") if j in zero else at(j) for j in range(K, K + X)]
    basis += closed
    T, nR = name("T"), name("nR")
    order = f"{T} - 1 - t" if attrs.get("reverse") else "t"
    row = lambda k: f"{name(f'o{k}')}:{name(f'o{k}')} + {name(f'h{k}')}"
    rows_of = lambda var, k: f"{var}.reshape({nR}, {name(f'h{k}')})"
    L += [f"for t in range({T}):   # v_t: the step's VJP with no carry adjoint",
          f"    i = {order}",
          f"    {step[0]}({', '.join(real + outs + step[1:])})"]
    L += ["    " + copy(rows_of(name(f"jo{k}"), k), f"{vv}[i, :, {row(k)}]", 2) for k in range(F)]
    if st:   # f'(new carry) * W^T, every (step, row, p, q) a thread
        maps = s.kernel(("bppsa_structured", st["f"], bool(attrs.get("reverse"))), f"bppsa_{st['f'] or 'linear'}_jacobians",
                        lambda kname: _structured_source(kname, st["f"], bool(attrs.get("reverse"))))
        L.append(launch(maps, [f"{a[st['cn']]}.reshape({T}, {nR}, {name('hH')})", a[st["W"]], f"{mm}[:{T}]"]))
    else:   # row o_k + p of M_t: the step's VJP of the basis vector p of carry k
        L += [f"for t in range({T}):   # M_t by rows: the step's VJP of each basis vector", f"    i = {order}"]
        for k in range(F):
            column = f"{rows_of(name(f'eb{k}'), k)}[:, p]"
            L += [f"    for p in range({name(f'h{k}')}):", "        " + fill(column, "1.0"),
                  f"        {step[0]}({', '.join(basis + outs + step[1:])})"]
            L += ["        " + copy(rows_of(name(f"jo{j}"), j), f"{mm}[i, :, {name(f'o{k}')} + p, {row(j)}]", 2)
                  for j in range(F)]
            L.append("        " + fill(column, "0.0"))
    compose = s.kernel(("bppsa_compose",), "bppsa_compose_pairs", _compose_source)
    store = s.kernel(("bppsa_store",), "bppsa_store_pairs", _store_source)
    push = s.kernel(("bppsa_push",), "bppsa_push_adjoints", _push_source)
    place = s.kernel(("bppsa_place",), "bppsa_place_adjoints", _place_source)
    pairs = f"{name('pP')} // (2 * d)"
    L += ["d = 1   # up-sweep: each level's products into S, then into the right map of each pair",
          f"while d < {name('pP')}:",
          "    " + launch(compose, [mm, vv, "d", f"{name('S')}[:{pairs}]"]),
          "    " + launch(store, [f"{name('S')}[:{pairs}]", "d", mm, vv]),
          "    d *= 2"]
    L += [copy(rows_of(a[k], k), f"{vv}[{name('pP')} - 1, :, {row(k)}]", 2) for k in range(F)]
    L += [f"d = {name('pP')} // 2   # down-sweep from the final adjoints: vector times matrix",
          "while d >= 1:",
          "    " + launch(push, [mm, vv, "d", f"{name('SV')}[:{pairs}]"]),
          "    " + launch(place, [f"{name('SV')}[:{pairs}]", "d", vv]),
          "    d //= 2"]
    feed = [copy(f"{vv}[i, :, {row(k)}]", rows_of(name(f"cur{k}"), k), 2) for k in range(F)]
    return L, feed


def _decode(extents, names):
    """Lines unravelling the thread's flat index j over names (the first outermost, the last fastest)
    with the given extents."""
    lines, stride = [], None
    for at, (var, extent) in enumerate(reversed(list(zip(names, extents)))):
        value = "j" if stride is None else f"j // {stride}"
        lines.append(f"    {var} = {value}" if at == len(names) - 1 else f"    {var} = {value} % {extent}")
        stride = extent if stride is None else f"({stride} * {extent})"
    return lines


def _head(name, args, out):
    return [f"def {name}({', '.join(args)}):", "    j = cuda.grid(1)", f"    if j >= {out}.size:", "        return"]


def _structured_source(name, f, reverse):
    lines = _head(name, ["ys", "w", "out"], "out")
    lines += ["    T, nR, H = out.shape[0], out.shape[1], out.shape[2]"]
    lines += _decode(["T", "nR", "H", "H"], ["i", "b", "p", "q"])
    lines += [f"    t = {'T - 1 - i' if reverse else 'i'}", "    y = ys[t, b, p]",
              f"    out[i, b, p, q] = ({DERIVATIVE_FROM_OUTPUT[f]}) * w[q, p]"]
    return "\n".join(lines), f"out[i, b] = diag({f or 'identity'}'(ys[t, b])) W^T: step t's transposed Jacobian", ("flat", -1)


def _identity_source(name):
    lines = _head(name, ["out"], "out") + ["    nR, H = out.shape[1], out.shape[2]"]
    lines += _decode(["out.shape[0]", "nR", "H", "H"], ["i", "b", "p", "q"])
    lines += ["    out[i, b, p, q] = 1.0 if p == q else 0.0"]
    return "\n".join(lines), "out[i, b] = the identity (the maps padding T up to a power of two)", ("flat", -1)


def _pair_lines():
    return ["    l = pair * 2 * d + d - 1", "    r = l + d"]


def _compose_source(name):
    lines = _head(name, ["m", "v", "d", "out"], "out") + ["    nR, H = out.shape[1], out.shape[3]"]
    lines += _decode(["out.shape[0]", "nR", "(H + 1)", "H"], ["pair", "b", "p", "q"]) + _pair_lines()
    lines += ["    if p < H:",
              "        acc = 0.0",
              "        for k in range(H):",
              "            acc += m[l, b, p, k] * m[r, b, k, q]",
              "    else:",
              "        acc = v[r, b, q]",
              "        for k in range(H):",
              "            acc += v[l, b, k] * m[r, b, k, q]",
              "    out[pair, b, p, q] = acc"]
    return "\n".join(lines), "out[pair, b] = [M_l M_r; v_l M_r + v_r]: the level's pair (l, r) composed", ("flat", -1)


def _store_source(name):
    lines = _head(name, ["s", "d", "m", "v"], "s") + ["    nR, H = s.shape[1], s.shape[3]"]
    lines += _decode(["s.shape[0]", "nR", "(H + 1)", "H"], ["pair", "b", "p", "q"]) + _pair_lines()
    lines += ["    if p < H:", "        m[r, b, p, q] = s[pair, b, p, q]", "    else:", "        v[r, b, q] = s[pair, b, p, q]"]
    return "\n".join(lines), "(m, v)[r] = the composed pair s[pair] (r: the pair's right map)", ("flat", 0)


def _push_source(name):
    lines = _head(name, ["m", "v", "d", "out"], "out") + ["    nR, H = out.shape[1], out.shape[2]"]
    lines += _decode(["out.shape[0]", "nR", "H"], ["pair", "b", "q"]) + _pair_lines()
    lines += ["    acc = v[l, b, q]", "    for k in range(H):", "        acc += v[r, b, k] * m[l, b, k, q]",
              "    out[pair, b, q] = acc"]
    return "\n".join(lines), "out[pair, b] = lam_r M_l + v_l: the adjoint past the pair's left maps", ("flat", -1)


def _place_source(name):
    lines = _head(name, ["s", "d", "v"], "s") + ["    nR, H = s.shape[1], s.shape[2]"]
    lines += _decode(["s.shape[0]", "nR", "H"], ["pair", "b", "q"]) + _pair_lines()
    lines += ["    v[l, b, q] = v[r, b, q]", "    v[r, b, q] = s[pair, b, q]"]
    return "\n".join(lines), "v[l] = v[r] (the adjoint entering the pair), v[r] = s[pair]", ("flat", 0)

