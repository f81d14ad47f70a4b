"""Branch and fan out: get a sandbox into an interesting state, BRANCH it, try 3 variants from there.

An agent halfway through a task (data loaded, a model fitted, files written) branches its sandbox
and explores alternatives from that exact state in parallel, without redoing the work and without
disturbing the original, which keeps running.

    forkd quickstart && .venv/bin/python examples/branch_fanout.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from forkd import Controller, Sandbox

SETUP = """
import numpy as np
rng = np.random.default_rng(0)
x = rng.uniform(-3, 3, 400)
y = 0.5 * x**3 - x + rng.normal(0, 1, x.size)
open('/root/stage.txt', 'w').write('data loaded\\n')
print('expensive setup done')
"""
VARIANTS = {1: "linear", 3: "cubic", 7: "degree 7"}


def try_variant(tag: str, degree: int) -> tuple[int, float]:
    """A child of the branch: the data and file are already there; fit one polynomial degree."""
    with Sandbox.create(template=tag, timeout=300) as child:
        assert child.files.read("/root/stage.txt") == "data loaded\n"
        error = child.eval(f"float(np.mean((np.polyval(np.polyfit(x, y, {degree}), x) - y) ** 2))")
        return degree, error


def main() -> None:
    with Sandbox.create() as source:
        source.run_code(SETUP)
        branch = source.branch(mode="diff")
        print(f"branched {source.sandbox_id} as {branch['tag']} (paused {branch.get('pause_ms', '?')} ms)")
        with ThreadPoolExecutor(len(VARIANTS)) as pool:
            fits = list(pool.map(lambda degree: try_variant(branch["tag"], degree), VARIANTS))
        for degree, error in sorted(fits):
            print(f"{VARIANTS[degree]:>9}: mean squared error {error:.3f}")
        print("source still has its state:", source.eval("len(x)"))
        best = min(fits, key=lambda fit: fit[1])[0]
        print("best:", VARIANTS[best])
    with Controller() as api:  # the branch's children are gone: its snapshot can go too
        api.remove_snapshot(branch["tag"])


if __name__ == "__main__":
    main()
