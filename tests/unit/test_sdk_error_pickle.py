"""The SDK's exceptions cross process boundaries as themselves (a cluster's work function raises them
in a Ray worker; the driver catches them by class)."""

from __future__ import annotations

import pickle

from forkd.sdk.models import CommandExitException, CommandResult
from forkd.sdk.errors import DaemonUnreachable, ForkdError, NotFoundException, error_for


def test_every_sdk_exception_survives_a_pickle() -> None:
    for error in (ForkdError(500, "internal", "boom"), NotFoundException(404, "sandbox_not_found", "no sb-1"),
                  error_for(409, "sandbox_ended", "it ended"), DaemonUnreachable("http://n1:7070", "refused")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error)
        assert (again.status, again.code, again.message, str(again)) == (error.status, error.code, error.message,
                                                                         str(error))


def test_an_exception_keeps_its_own_fields() -> None:
    error = CommandExitException(CommandResult(stdout="out", stderr="bad input", exit_code=2))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is CommandExitException and (again.exit_code, again.stdout, again.stderr) == (2, "out",
                                                                                                    "bad input")
    assert str(again) == str(error) == "command exited with code 2: bad input"
