"""E2B's code-interpreter SDK on forkd's ``code-interpreter-v1`` template (``forkd template code-interpreter``):
``Sandbox.create()`` names no template, and the libraries E2B's template ships are there and already
imported. Pointed at forkd only through E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY. Prints ``ok NAME``
/ ``FAIL NAME: why`` per check and exits non-zero if any failed.
"""

from __future__ import annotations

import sys

from e2b_code_interpreter import Sandbox

from checks import check, failures

WARM = ("numpy", "pandas", "matplotlib", "scipy", "sklearn", "seaborn", "requests")


def main() -> int:
    sbx = Sandbox.create(timeout=600)  # no template: the SDK asks for code-interpreter-v1
    try:
        def warm_imports() -> None:
            # Before any import in this context: what the snapshot's warm interpreter left loaded.
            loaded = sbx.run_code(f"import sys; sorted(m for m in {list(WARM)!r} if m in sys.modules)")
            assert loaded.error is None, loaded.error
            assert loaded.text == repr(sorted(WARM)), loaded.text

        def libraries() -> None:
            cell = ("import bs4, openpyxl, PIL, sympy, plotly, xlrd, aiohttp, scipy.stats, sklearn.linear_model\n"
                    "import pandas as pd, seaborn as sns\n"
                    "model = sklearn.linear_model.LinearRegression().fit([[0], [1], [2]], [1, 3, 5])\n"
                    "(round(float(model.coef_[0]), 3), int(pd.DataFrame({'a': [1, 2]})['a'].sum()))")
            answer = sbx.run_code(cell)
            assert answer.error is None, answer.error
            assert answer.text == "(2.0, 3)", answer.text

        def chart() -> None:
            answer = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
            assert answer.error is None, answer.error
            assert any(r.png for r in answer.results), answer.results
            assert any(r.chart is not None for r in answer.results), answer.results

        check("warm_imports", warm_imports)
        check("libraries", libraries)
        check("chart", chart)
    finally:
        sbx.kill()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
