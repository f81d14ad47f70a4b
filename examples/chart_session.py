"""A code-interpreter session that draws: a cell's matplotlib figure comes back as a PNG result.

An agent's data-analysis loop sends cells to a warm interpreter and shows the user what they return.
Charts come back the way E2B's code interpreter returns them: ``execution.results[i].png`` (base64),
next to the cell's text value; ``display(obj)`` and objects with ``_repr_html_`` work too.

Needs matplotlib in the image:

    forkd image build --name charts --package python3-matplotlib --package python3-pandas
    forkd snapshot create --tag charts --image charts --warm numpy --warm pandas --warm matplotlib.pyplot
    FORKD_TEMPLATE=charts .venv/bin/python examples/chart_session.py --out chart.png
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

from forkd import Sandbox

CELLS = [
    "import numpy as np, pandas as pd\n"
    "sales = pd.DataFrame({'month': range(1, 13), 'units': np.random.default_rng(7).integers(50, 150, 12)})\n"
    "sales.units.sum()",
    "import matplotlib.pyplot as plt\n"
    "fig, ax = plt.subplots(figsize=(6, 3))\n"
    "ax.bar(sales.month, sales.units)\n"
    "ax.set_title('units per month')\n"
    "plt.show()",
    "sales.describe().loc[['mean', 'max']]",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("chart.png"), help="where to save the chart")
    out = parser.parse_args().out
    with Sandbox.create(timeout=600) as sandbox:
        for number, cell in enumerate(CELLS, 1):
            execution = sandbox.run_code(cell, timeout=300)
            if execution.error:
                print(f"[{number}] error {execution.error.name}: {execution.error.value}")
                continue
            for result in execution.results:
                if result.png:
                    out.write_bytes(base64.b64decode(result.png))
                    print(f"[{number}] chart: {out} ({out.stat().st_size} bytes, formats {result.formats()})")
                elif result.html:
                    print(f"[{number}] table as html ({len(result.html)} characters) and text:\n{result.text}")
                else:
                    print(f"[{number}] -> {result.text}")


if __name__ == "__main__":
    main()
