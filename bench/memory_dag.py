"""Retention planning on graphs with skips: the chain DP against the Checkmate-style MILP.

Two models whose values skip layers: a residual MLP (skips of one block) and a U-Net-like MLP
(the encoder's values feed the decoder's mirror layers, skips of every length). For budgets
below keeping everything, each planner's plan is compiled and its true peak (liveness) and
recomputed FLOPs are read back, with the planning time. gradc keeps whichever plan fits with
less recompute; "-" means that planner found no plan within the budget.

    python bench/memory_dag.py
"""
import json
import os
import tempfile
import time

WIDTH, BATCH = 64, 64


def residual(blocks=8):
    import gradc as gc
    m = gc.Model("residual_mlp")
    x = m.input("x", ("B", WIDTH))
    t = m.input("t", ("B", 1))
    h = x
    for i in range(blocks):
        h = h + gc.tanh(gc.tanh(h @ m.param(f"A{i}", (WIDTH, WIDTH))) @ m.param(f"B{i}", (WIDTH, WIDTH)))
    m.minimize(gc.mse(h @ m.param("Wo", (WIDTH, 1)), t))
    return m


def unet(depth=6):
    import gradc as gc
    m = gc.Model("unet_mlp")
    x = m.input("x", ("B", WIDTH))
    t = m.input("t", ("B", 1))
    h, skips = x, []
    for i in range(depth):
        h = gc.tanh(h @ m.param(f"E{i}", (WIDTH, WIDTH)))
        skips.append(h)
    for i in reversed(range(depth)):
        h = gc.tanh(h @ m.param(f"D{i}", (WIDTH, WIDTH)) + skips[i] @ m.param(f"S{i}", (WIDTH, WIDTH)))
    m.minimize(gc.mse(h @ m.param("Wo", (WIDTH, 1)), t))
    return m


def main():
    import gradc as gc
    from gradc.compiler import compile_model
    print(f"width {WIDTH}, batch {BATCH}, float32; MILP time limit 20 s per plan")
    print("| model | budget | chosen | DP peak KiB | DP extra MFLOP | MILP peak KiB | MILP extra MFLOP | MILP status, gap "
          "| plan s |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for make in (residual, unet):
            model = make()
            full = compile_model(model, out=os.path.join(out, "full"), order=1, bind={"B": BATCH}, warm_cache=False)
            store_all = full.MEMORY_PLAN["peak_bytes"]
            for share in (0.8, 0.6, 0.45):
                budget = int(share * store_all)
                t = time.perf_counter()
                try:
                    compile_model(model, out=os.path.join(out, "b"), order=1, bind={"B": BATCH}, warm_cache=False,
                                  memory_budget=budget)
                except gc.GradcError as e:
                    print(f"| {model.name} | {share:.0%} | refused: {str(e).split(': ', 1)[1][:60]} | | | | | | "
                          f"{time.perf_counter() - t:.1f} |")
                    continue
                seconds = time.perf_counter() - t
                with open(os.path.join(out, "b", f"{model.name}.memplan.json")) as f:
                    plan = json.load(f)
                r = plan["retention"]
                found = {c["method"].split()[0]: c for c in r["candidates"]}
                milp = r if r.get("coarse_nodes") else r.get("milp", {})
                cell = lambda c, k, scale: f"{c[k] / scale:.1f}" if c else "-"
                dp, mp = found.get("dp-chain"), found.get("checkmate-milp")
                status = f"{milp.get('status', 'no plan')}, {100 * milp['gap']:.1f}%" if milp.get("gap") is not None \
                    else (milp.get("solves") or [{}])[-1].get("status", "-")
                print(f"| {model.name} | {share:.0%} of {store_all / 1024:.0f} KiB | {plan['method'].split()[0]} | "
                      f"{cell(dp, 'peak_bytes', 1024)} | {cell(dp, 'extra_flops', 1e6)} | {cell(mp, 'peak_bytes', 1024)} | "
                      f"{cell(mp, 'extra_flops', 1e6)} | {status} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
