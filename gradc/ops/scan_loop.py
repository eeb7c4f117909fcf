"""A scan's lowerings: on the CPU one loop kernel that runs its step T times; on CUDA
(lower_scan_cuda, at the end) a host loop calling the step's launches.

The step is written by the same statement lowerings as an entry point (codegen/entry.py's
BodyWriter): its leaves are the carries, the slices x_t and the closed-over values, it writes the
new carries and the y_t into arrays the loop hands it, and its intermediates are views of `work`,
a small per-step arena the loop allocates once per call (no reuse inside a step: a step's values
are few). The loop kernel keeps the carry in two buffers that swap each step, copies it into the
carry stacks when the entry reads them (the backward does), and writes each y_t into ys[t]. Code
size and compile time do not depend on T, which may stay symbolic. The loop copies carries with
copy_into (gradc/runtime/copy_into.py); a scalar carry is (1,) in the loop.

The step's lines are written into the loop (s.body_inline): Numba compiles a function a kernel
calls once on its own and again inside every caller, so a step of its own compiled twice or more.
A BPPSA loop, and a backward loop that recomputes carries, run a step from more than one place:
they call it as a function of its own (s.body_kernel), written once per distinct body.

Under carry checkpoints (passes/scan_checkpoint.py) the forward loop copies only every k-th step's
carry, and the backward loop walks the segments of k steps last to first: it runs the forward's
body (a second body function, without the ys) from the segment's checkpoint into a buffer of k + 1
carries, then the segment's backward steps read their carries from that buffer.
"""
from gradc.codegen.statement import dtype_src, shape_src
from gradc.ops.elementwise import X as OPERAND

from .bppsa import bppsa_cpu_lines, bppsa_cuda_lines
from .scan_layout import (CHECKPOINT, FINAL, OSTACK, STACK, YS, forward_attrs, index_of, kind_of,
                          length_operand, operand_leaves, parts, recompute_leaves, vjp_of)


def lower_scan(s):
    """The scan node's statement: its results' buffers, then one call of its loop kernel."""
    attrs = s.attrs
    body, leaves, outputs, K, X, C, M = parts(attrs)
    lines, res = _result_buffers(s)
    present, out_args = list(res), list(res.values())
    scalar_leaves = tuple(j for j, leaf in enumerate(leaves) if body.shape(leaf) == ())
    key = ("scan", repr(body), bool(attrs.get("reverse")), scalar_leaves, attrs.get("checkpoint_every"))
    bppsa = attrs.get("backward") == "bppsa"
    if not bppsa and not attrs.get("recompute_every"):
        # one loop kernel, the step written in (s.body_inline), for every entry point: it takes every result
        # the graph has, and a call's `wants` says which it writes (forward's the final carries,
        # loss_and_grad's the stacks too); an unwanted one is handed an empty array. (A compiled caller, a scan
        # nested in a step or a small graph's hvp block, passes constant flags (typed as literals): Numba compiles
        # the kernel for that pattern, its unwanted lines left out, as a kernel of its own was before.)
        results = _every_result(s)
        skip = tuple(K + m for m in range(M) if index_of(attrs, YS, m) not in results)
        optional = {K + m: _flag(attrs, index_of(attrs, YS, m)) for m in range(M) if K + m not in skip}
        kernel = s.kernel(key + (tuple(results),), "scan", lambda name: _loop_source(
            name, None, attrs, list(results), inline=s.body_inline(body, skip, optional)))
        unwanted = {i: f"np.empty({(0,) * len(s.graph.shape(u))}, {dtype_src(s.graph.dtype(u))})"
                    for i, u in results.items()}
        wants = [_wanted(s, u) if i in res else "False" for i, u in results.items()]
        wants = f"({', '.join(wants)}{',' if len(wants) == 1 else ''})"
        lines.append(s.call(kernel, list(s.args) + [res.get(i, unwanted[i]) for i in results] + [wants]) + s.note)
        return lines
    skip = tuple(K + m for m in range(M) if index_of(attrs, YS, m) not in present)
    body_kernel = s.body_kernel(body, skip, f"one step of a scan: {len(leaves)} leaves -> {len(outputs)} outputs, "
                                            f"intermediates in work")
    key += (tuple(present), skip, body_kernel[0])
    if bppsa:
        key += ("bppsa", repr(attrs["vjp"]))
    forward = None
    if attrs.get("recompute_every"):   # the forward's step again, for the new carries alone
        fbody, _, _, KF, _, _, MF = parts(forward_attrs(attrs))
        forward = s.body_kernel(fbody, tuple(range(KF, KF + MF)),
                                f"one forward step of a scan again, for its {KF} new carr{'y' if KF == 1 else 'ies'} alone")
        key += ("recompute", attrs["recompute_every"], forward[0], repr(attrs["vjp"]))
    kernel = s.kernel(key, "bppsa" if bppsa else "scan",
                      lambda name: _loop_source(name, body_kernel, attrs, present, bppsa, forward))
    lines.append(s.call(kernel, list(s.args) + out_args) + s.note)
    return lines


def _every_result(s):
    """{result index: its node} for every result of the scan the graph has (some entry computes it), in order."""
    g, results = s.graph, {}
    for u in g.users(s.n):
        if g.op(u) == "scan_out":
            results.setdefault(g.attrs(u)["index"], u)
    return dict(sorted(results.items()))


def _wanted(s, u):
    """Whether this call wants result u: True, or in a scan nested in a step, the step's flags for the
    outputs that alone need u (the nested scan runs whenever the step's carries need it, and its ys only
    when those outputs are wanted)."""
    flags, here = s.guard_of(u), s.guard_of(s.n)
    if not flags or flags == here:
        return "True"
    return next(iter(flags)) if len(flags) == 1 else f"({' or '.join(sorted(flags))})"


def _flag(attrs, index):
    """The loop kernel's name for whether a call wants result `index`."""
    kind, i = kind_of(attrs, index)
    return f"want_{kind}{i}"


def _result_buffers(s):
    """The lines giving the scan's results their buffers, and {result index: its variable} for those
    the entry computes (in result order)."""
    results = _every_result(s)
    lines, res = [], {}
    for index in results:
        alloc = s.alloc_for(results[index])
        if alloc is not None:
            lines.append(alloc)
            res[index] = s.var(results[index])
    return lines, res


def _loop_source(name, body, attrs, present, bppsa=False, forward=None, inline=None):
    """body: (kernel, work sizes, dims) of the step; forward: the same of the forward's step on a
    backward scan that recomputes its carries; inline: (dim lines, lines, work sizes, dims) of the
    step written into the loop instead (body is then None): `present` is then every result the graph
    has, and the kernel's last argument `wants` says which of them a call writes."""
    body_kernel, sizes, dims = body if inline is None else (None,) + inline[2:]
    body, leaves, outputs, K, X, C, M = parts(attrs)
    work = sizes.source()
    held = operand_leaves(attrs)   # leaf j's operand is the argument a{j}
    res = {index: f"r{i}" for i, index in enumerate(present)}
    lines = [f"def {name}({', '.join([f'a{j}' for j in held] + list(res.values()) + (['wants'] if inline else []))}):"]
    if inline and present:
        lines.append(f"    {', '.join(_flag(attrs, i) for i in present)}{',' if len(present) == 1 else ''} = wants")

    def wanted(index, line):   # a line that writes result `index`, under its flag where calls choose
        return [f"if {_flag(attrs, index)}:", "    " + line] if inline else [line]
    # the body's dims, read off the operands (a slice's dims are its sequence's, one axis later)
    seen, seen_dims = set(), set()
    for j in held:
        for axis, d in enumerate(body.shape(leaves[j])):
            if isinstance(d, str) and d not in seen:
                seen.add(d)
                seen_dims.add(dims.get(d, 'd_' + d))
                lines.append(f"    {dims.get(d, 'd_' + d)} = a{j}.shape[{axis + (1 if K <= j < K + X else 0)}]")
    lines.append(f"    T = a{held[length_operand(attrs)]}.shape[0]")
    lines.append(f"    work = np.empty(max({work}, 1), FLOAT)")
    for k in range(K):
        lines.append(f"    cur{k} = a{k}.copy()")
        lines.append(f"    nxt{k} = np.empty_like(a{k})")
    for m in range(M):
        if bppsa or (index_of(attrs, YS, m) not in res and not inline):   # an output the step must be handed
            lines.append(f"    yb{m} = np.empty({shape_src(body.shape(outputs[K + m]), dims)}, FLOAT)")
    loop = ["t = T - 1 - i" if attrs.get("reverse") else "t = i"]
    if bppsa:   # the carry adjoint each step gets is the scan's, not the previous step's output
        lines += bppsa_cpu_lines(body_kernel, attrs)
        loop += [f"copy_into(cur{k}.reshape(nR, h{k}), Vv[i, :, o{k}:o{k} + h{k}])" for k in range(vjp_of(attrs)["carries"])]
    every = attrs.get("checkpoint_every")
    for k in range(K):
        if index_of(attrs, STACK, k) in res:
            loop += wanted(index_of(attrs, STACK, k), f"copy_into({res[index_of(attrs, STACK, k)]}[t], cur{k})")
        if every and index_of(attrs, CHECKPOINT, k) in res:   # where the backward starts its segments from
            at = f"i % {every} == 0"
            loop += [f"if {_flag(attrs, index_of(attrs, CHECKPOINT, k)) + ' and ' if inline else ''}{at}:",
                     f"    copy_into({res[index_of(attrs, CHECKPOINT, k)]}[i // {every}], cur{k})"]
    read = {j: f"a{j}[t]" for j in range(K, K + X)}
    if forward:   # the carries of the segment, from the buffer the recomputation filled
        for (what, k), j in recompute_leaves(attrs).items():
            if what in (STACK + "_in", OSTACK + "_in"):
                read[j] = f"sg{k}[f - f0{' + 1' if what == OSTACK + '_in' else ''}]"
    call = [f"cur{k}" for k in range(K)] + [read[j] for j in range(K, K + X)] + [f"a{K + X + j}" for j in range(C)]
    call += [f"nxt{k}" for k in range(K)]
    call += [f"{res[index_of(attrs, YS, m)]}[t]" if index_of(attrs, YS, m) in res else f"yb{m}" for m in range(M)]
    if inline:   # the step's leaves and outputs bound to the names its lines read and write
        step_dims, step, _, _ = inline
        skip = {K + m for m in range(M) if index_of(attrs, YS, m) not in res}
        loop.append(f"# one step: {len(leaves)} leaves -> {len(outputs)} outputs, intermediates in work")
        loop += [f"l{j} = {arg}" for j, arg in enumerate(call[:len(leaves)])]
        loop += [f"o{k} = nxt{k}" for k in range(K)]
        for m in range(M):
            if K + m not in skip:
                loop += wanted(index_of(attrs, YS, m), f"o{K + m} = {res[index_of(attrs, YS, m)]}[t]")
        loop += [line for line in step_dims if line.split(" = ")[0] not in seen_dims]
        loop += step
    else:
        loop.append(f"{body_kernel}({', '.join(call + ['work'])})")
    for k in range(K):
        if index_of(attrs, OSTACK, k) in res:
            loop += wanted(index_of(attrs, OSTACK, k), f"copy_into({res[index_of(attrs, OSTACK, k)]}[t], nxt{k})")
        loop.append(f"cur{k}, nxt{k} = nxt{k}, cur{k}")
    if forward:
        lines += _segment_lines(attrs, *forward, loop)
    else:
        lines.append("    for i in range(T):")
        lines += ["        " + line for line in loop]
    for k in range(K):
        if index_of(attrs, FINAL, k) in res:
            lines += ["    " + line for line in wanted(index_of(attrs, FINAL, k),
                                                       f"copy_into({res[index_of(attrs, FINAL, k)]}, cur{k})")]
    doc = (f"{'BPPSA (Blelloch scan of the carry adjoints, then the steps) ' if bppsa else ''}"
           f"{'reverse ' if attrs.get('reverse') else ''}scan: {body_kernel or 'the step written below,'} once per step over axis 0 of "
           f"{X} sequence(s), {K} carr{'y' if K == 1 else 'ies'}; writes " + ("those its call wants of " if inline else "") +
           ", ".join(f"{kind_of(attrs, i)[0]}{kind_of(attrs, i)[1]}" for i in present))
    if every and any(kind_of(attrs, i)[0] == CHECKPOINT for i in present):
        doc += f" (the carry every {every}th step reads)"
    if forward:
        doc += (f"; recomputes the forward's carries ({forward[0]}) from a checkpoint every "
                f"{attrs['recompute_every']} steps, segment by segment")
    return "\n".join(lines), doc


def _segment_lines(attrs, fkernel, fsizes, _dims, loop):
    """The backward loop of a scan that recomputes its forward's carries: for each segment of
    `every` forward steps, last first, the forward body from the segment's checkpoint into sg_k
    (sg_k[f - f0] the carry forward step f reads, sg_k[f - f0 + 1] the one it writes), then the
    segment's backward steps (`loop`, run index i) in reverse order of f."""
    rc, every = recompute_leaves(attrs), attrs["recompute_every"]
    fbody, _, fouts, KF, XF, CF, MF = parts(forward_attrs(attrs))
    L = [f"every = {every}",
         "n_checkpoints = (T + every - 1) // every",
         f"work_f = np.empty(max({fsizes.source()}, 1), FLOAT)"]
    for k in range(KF):
        L.append(f"sg{k} = np.empty((every + 1,) + a{rc[(STACK + '_in', k)]}.shape[1:], FLOAT)")
    for m in range(MF):   # the forward's ys are not recomputed: its body leaves these untouched
        L.append(f"fy{m} = np.empty({(0,) * len(fbody.shape(fouts[KF + m]))}, FLOAT)")
    ft = "T - 1 - f" if not attrs.get("reverse") else "f"   # the forward runs the other way round
    fcall = [f"sg{k}[f - f0]" for k in range(KF)] + [f"a{rc[('x', j)]}[t]" for j in range(XF)]
    fcall += [f"a{rc[('closed', j)]}" for j in range(CF)] + [f"sg{k}[f - f0 + 1]" for k in range(KF)]
    fcall += [f"fy{m}" for m in range(MF)] + ["work_f"]
    L += ["for c in range(n_checkpoints - 1, -1, -1):",
          "    f0 = c * every",
          "    f1 = min(T, f0 + every)"]
    L += [f"    copy_into(sg{k}[0], a{rc[(STACK + '_in', k)]}[c])" for k in range(KF)]
    L += ["    for f in range(f0, f1):",
          f"        t = {ft}",
          f"        {fkernel}({', '.join(fcall)})",
          "    for f in range(f1 - 1, f0 - 1, -1):",
          "        i = T - 1 - f"]
    L += ["        " + line for line in loop]
    return ["    " + line for line in L]


def lower_scan_cuda(s):
    """The scan node's statement on CUDA: the loop runs on the host, calling the step's host function
    (s.body_kernel: its kernels' launches) once per step; carries are device arrays that swap, copied
    into the stacks and the final carries by a copy kernel. A BPPSA backward (gradc/ops/bppsa.py)
    first leaves every step's carry adjoint in a device array, and each step starts from its own.
    Carry checkpoints are CPU only (compiler.check_scans refuses them on CUDA)."""
    n, attrs = s.n, s.attrs
    body, leaves, outputs, K, X, C, M = parts(attrs)
    if attrs.get("recompute_every") or attrs.get("checkpoint_every"):
        raise NotImplementedError("cuda codegen: carry checkpoints of gc.scan are built for the CPU only")
    bppsa = attrs.get("backward") == "bppsa"
    lines, res = _result_buffers(s)
    skip = tuple(K + m for m in range(M) if index_of(attrs, YS, m) not in res)
    step, sizes, dims, scalars = s.body_kernel(body, skip, f"one step of a scan: {len(leaves)} leaves -> "
                                                           f"{len(outputs)} outputs, launched from the host")
    # sizes and shapes name the body's dims by the variables the entry already has for them (d_<dim>)
    a = s.args
    v = f"s{n}_"   # this scan's locals in the entry function
    copy = lambda src, dst, rank: s.call(s.kernels.elementwise(OPERAND[0], [tuple(range(rank))], rank, "copy"), [src, dst])
    lines.append(f"{v}work = temp_array(max({sizes.source()}, 1), FLOAT)")
    lines.append(f"{v}scal = temp_array({max(scalars, 1)}, FLOAT)")
    for k in range(K):
        rank = len(body.shape(leaves[k]))
        lines += [f"{v}cur{k} = temp_array_like({a[k]})", f"{v}nxt{k} = temp_array_like({a[k]})",
                  copy(a[k], f"{v}cur{k}", rank)]
    for m in range(M):
        if bppsa or index_of(attrs, YS, m) not in res:
            lines.append(f"{v}y{m} = temp_array({shape_src(body.shape(outputs[K + m]), dims)}, FLOAT)")
    lines.append(f"{v}T = {a[K]}.shape[0]")
    at = lambda arr, leaf: f"{arr}[t:t + 1]" if body.shape(leaf) == () else f"{arr}[t]"
    loop = [f"t = {v}T - 1 - i" if attrs.get("reverse") else "t = i"]
    if bppsa:   # the carry adjoint each step gets is the scan's, not the previous step's output
        prelude, feed = bppsa_cuda_lines(s, [step, f"{v}work", f"{v}scal", "stream"],
                                         lambda j: at(a[j], leaves[j]), copy)
        lines += prelude
        loop += feed
    for k in range(K):
        if index_of(attrs, STACK, k) in res:
            loop.append(copy(f"{v}cur{k}", f"{res[index_of(attrs, STACK, k)]}[t]", len(body.shape(leaves[k]))))
    call = [f"{v}cur{k}" for k in range(K)] + [at(a[K + j], leaves[K + j]) for j in range(X)] + list(a[K + X:])
    call += [f"{v}nxt{k}" for k in range(K)]
    call += [f"{res[index_of(attrs, YS, m)]}[t]" if index_of(attrs, YS, m) in res else f"{v}y{m}" for m in range(M)]
    loop.append(f"{step}({', '.join(call + [f'{v}work', f'{v}scal', 'stream'])})")
    for k in range(K):
        if index_of(attrs, OSTACK, k) in res:
            loop.append(copy(f"{v}nxt{k}", f"{res[index_of(attrs, OSTACK, k)]}[t]", len(body.shape(leaves[k]))))
        loop.append(f"{v}cur{k}, {v}nxt{k} = {v}nxt{k}, {v}cur{k}")
    lines.append(f"for i in range({v}T):{s.note}")
    lines += ["    " + line for line in loop]
    for k in range(K):
        if index_of(attrs, FINAL, k) in res:
            lines.append(copy(f"{v}cur{k}", res[index_of(attrs, FINAL, k)], len(body.shape(leaves[k]))))
    return lines
