"""E2B code, unchanged but for the import: forkd's Sandbox is a drop-in for E2B's.

Run against the quickstart snapshot: `forkd quickstart`, then `.venv/bin/python examples/e2b_compat.py`
(FORKD_TEMPLATE picks another snapshot).
"""

from forkd import Sandbox  # was: from e2b_code_interpreter import Sandbox

sbx = Sandbox.create()
result = sbx.commands.run("echo hello from $(hostname)")
print(result.stdout, end="")

sbx.files.write("/tmp/data.csv", "x,y\n1,2\n3,4\n")
print(sbx.files.read("/tmp/data.csv"), end="")

execution = sbx.run_code("import csv\nrows = list(csv.DictReader(open('/tmp/data.csv')))\nsum(int(r['y']) for r in rows)")
print("sum of y:", execution.text)

execution = sbx.run_code("rows[0]")  # state is kept between calls
print("first row:", execution.text)

try:
    sbx.commands.run("exit 3")
except Exception as exc:  # CommandExitException, as in E2B
    print("exit code:", exc.exit_code)

sbx.kill()
