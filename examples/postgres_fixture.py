"""Fork-per-test PostgreSQL: every test gets its own database server, already running and seeded.

The parent VM starts PostgreSQL and loads the schema and seed rows once, then is saved. Each test
forks a child: the server is already up (no initdb, no start, no seeding), the test sees the seeded
rows, and whatever it writes vanishes with its child. Siblings never see each other's writes.

Make the snapshot once (Debian's postgresql in the image; the warmup starts it and seeds it):

    forkd image build --name pg --package postgresql
    forkd snapshot create --tag pg --image pg --warmup-cmd "$(.venv/bin/python examples/postgres_fixture.py --print-warmup)"
    FORKD_TEMPLATE=pg .venv/bin/python examples/postgres_fixture.py
"""

from __future__ import annotations

import argparse
import json
import shlex
from concurrent.futures import ThreadPoolExecutor

from forkd import Sandbox

PG_BIN = "/usr/lib/postgresql/15/bin"
PG_DATA = "/var/lib/postgresql/15/main"
PG_CONF = "/etc/postgresql/15/main/postgresql.conf"
SEED_SQL = (
    "CREATE TABLE accounts (id int PRIMARY KEY, owner text NOT NULL, balance int NOT NULL);"
    "INSERT INTO accounts VALUES (1, 'ada', 100), (2, 'grace', 250), (3, 'linus', 75);"
)
#: The snapshot's warmup: start the server, seed it, report ready (the server keeps running in the snapshot).
WARMUP = (
    "set -e; install -d -o postgres -g postgres /run/postgresql; "
    f"runuser -u postgres -- {PG_BIN}/pg_ctl -D {PG_DATA} -o '-c config_file={PG_CONF}' -l /tmp/postgres.log -w start"
    " >/dev/null; "
    f"runuser -u postgres -- psql -q -v ON_ERROR_STOP=1 -c \"{SEED_SQL}\"; "
    "echo '{\"ready\": true}'"
)


def psql(sandbox: Sandbox, sql: str) -> list[list[str]]:
    """Rows of ``sql`` as run by the postgres superuser in the sandbox (unaligned, '|'-separated)."""
    result = sandbox.commands.run(f"psql -qAtX -F '|' -v ON_ERROR_STOP=1 -c {shlex.quote(sql)}", user="postgres",
                                  cwd="/tmp", timeout=600)
    return [line.split("|") for line in result.stdout.splitlines() if line]


def test_transfer(sandbox: Sandbox) -> dict[str, object]:
    """A test that writes: moves money, then checks the totals it sees."""
    psql(sandbox, "UPDATE accounts SET balance = balance - 50 WHERE id = 2; "
                  "UPDATE accounts SET balance = balance + 50 WHERE id = 3;")
    return {"balances": psql(sandbox, "SELECT owner, balance FROM accounts ORDER BY id")}


def test_new_account(sandbox: Sandbox) -> dict[str, object]:
    """A test that inserts a row and counts what it sees."""
    psql(sandbox, "INSERT INTO accounts VALUES (4, 'margaret', 10)")
    return {"count": int(psql(sandbox, "SELECT count(*) FROM accounts")[0][0])}


def test_sees_seed_only(sandbox: Sandbox) -> dict[str, object]:
    """A test that only reads: siblings' writes must not show up."""
    return {"owners": [row[0] for row in psql(sandbox, "SELECT owner FROM accounts ORDER BY id")]}


TESTS = (test_transfer, test_new_account, test_sees_seed_only)


def run_in_own_child(test) -> tuple[str, dict[str, object]]:  # type: ignore[no-untyped-def]
    with Sandbox.create(timeout=300) as sandbox:
        return test.__name__, test(sandbox)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-warmup", action="store_true", help="print the snapshot's warmup command")
    if parser.parse_args().print_warmup:
        print(WARMUP)
        return
    with ThreadPoolExecutor(len(TESTS)) as pool:
        for name, outcome in pool.map(run_in_own_child, TESTS):
            print(f"{name}: {json.dumps(outcome)}")


if __name__ == "__main__":
    main()
