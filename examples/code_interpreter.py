"""A code-interpreter loop, E2B style: each cell a model would write runs in one persistent sandbox.

The "model" here is a fixed list of cells so the example runs offline; in an agent, each cell comes
from the LLM and the printed output, value or error goes back into its context. State (variables,
imports, files) persists from cell to cell; an error does not end the session.

    forkd quickstart && .venv/bin/python examples/code_interpreter.py
"""

from forkd import Sandbox

CELLS = [
    "import numpy as np\nrng = np.random.default_rng(7)\nsamples = rng.normal(10, 2, size=10_000)\nprint('drew', samples.size)",
    "round(float(samples.mean()), 1), round(float(samples.std()), 1)",
    "samples.median()",  # a mistake the model will see and fix
    "float(np.median(samples)) > 9",
    "open('/tmp/report.txt', 'w').write(f'mean={samples.mean():.2f}\\n')",
]


def main() -> None:
    with Sandbox.create() as sandbox:
        for number, cell in enumerate(CELLS, 1):
            execution = sandbox.run_code(cell, on_stdout=lambda message: print("  stdout:", message.line, end=""))
            if execution.error is not None:
                print(f"[{number}] error {execution.error.name}: {execution.error.value}")
            else:
                print(f"[{number}] -> {execution.text}")
        print("report:", sandbox.files.read("/tmp/report.txt"), end="")


if __name__ == "__main__":
    main()
